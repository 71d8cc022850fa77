/* LLM decode on the CPU: weight-only quantized GEMV and a whole decoder stack for a batch of
 * decode tokens over the paged KV cache, in one call (kiln/llm/model.py, decode_native).
 *
 * Weight formats (fmt), [N, K] with groups of 32 along K; each output row n is one record of
 * kiln_qrow_bytes(fmt, K) bytes, so a row streams from one place:
 *   0  float32                      K floats
 *   1  int8, symmetric per group    K/32 FP16 scales, then K int8: w = s * q, q in -127..127
 *   2  int4, asymmetric per group   K/32 FP16 scales, K/32 FP16 minimums, then K/2 bytes:
 *      w = s * q + min, q in 0..15; byte j of a group holds element j (low nibble) and element
 *      j + 16 (high nibble).
 * These are GGUF's Q8_0 and Q4_1 (FP16 scales too), so such weights load without loss.
 *
 * Decode is bound by the bytes of weights streamed per token: the GEMV prefetches a few rows
 * ahead, unpacks each group once into registers and applies it to up to 4 rows of x. The stack
 * runs RMSNorm, QKV, RoPE, the KV write, paged attention, O + residual, RMSNorm, gate|up,
 * SiLU * up, down + residual for every layer, with no Python between the ops. */
#include <stdint.h>

#include "kernels.h"

/* FP16 scales need F16C besides AVX2 + FMA (every AVX2 CPU kiln has met has it) */
#undef TGT
#define TGT __attribute__((target("avx2,fma,f16c")))

int kiln_llm_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
        && __builtin_cpu_supports("f16c");
}

/* The int GEMVs' instruction set: 1 AVX2, 2 AVX-512 (F + BW + VL), chosen on first use where
 * the CPU has it; kiln_llm_set_isa picks one (tests run both) and returns the one in force. */
static int isa;

static int isa_best(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") ? 2 : 1;
}

int kiln_llm_set_isa(int want)
{
    int best = isa_best();
    isa = want <= 0 || want > best ? best : want;
    return isa;
}

#define G 32
#define PF_AHEAD 2048 /* bytes of weight rows prefetched ahead of the row being read */

long kiln_qrow_bytes(int fmt, long K)
{
    return fmt == 0 ? 4 * K : fmt == 1 ? 2 * (K / G) + K : 4 * (K / G) + K / 2;
}

/* the dot of one unpacked group (4 vectors) with 32 floats of x */
TGT static inline __m256 dot32(__m256 w0, __m256 w1, __m256 w2, __m256 w3, const float *x)
{
    __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
    t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), t);
    t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), t);
    return _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), t);
}

/* The rows r < R (R <= 4, a constant where inlined) of y for one output row record. Each is
 * always_inline and called with a literal R, so the accumulators live in registers (a loop over
 * a runtime R kept them on the stack: a store-to-load chain per group, 3x slower). */
#define INL TGT static inline __attribute__((always_inline))

INL void row_f32(const long R, long K, const float *x, long ldx, const float *w, float *out)
{
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        for (long r = 0; r < R; r++) {
            acc[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + k + 8), acc[r][1]);
        }
    }
    for (long r = 0; r < R; r++) {
        float s = hsum256(_mm256_add_ps(acc[r][0], acc[r][1]));
        for (long j = k; j < K; j++)
            s += w[j] * x[r * ldx + j];
        out[r] = s;
    }
}

INL void row_i8(const long R, long K, const float *x, long ldx, const uint8_t *row, float *out)
{
    long ng = K / G;
    const uint16_t *sh = (const uint16_t *)row;
    const int8_t *w = (const int8_t *)(row + 2 * ng);
    __m256 acc[4];
    for (int r = 0; r < 4; r++)
        acc[r] = _mm256_setzero_ps();
    for (long g = 0; g < ng; g++) {
        const int8_t *q = w + g * G;
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)q)));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(q + 8))));
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(q + 16))));
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(q + 24))));
        __m256 d = _mm256_set1_ps(_cvtsh_ss(sh[g]));
        for (long r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(d, dot32(w0, w1, w2, w3, x + r * ldx + g * G), acc[r]);
    }
    for (long r = 0; r < R; r++)
        out[r] = hsum256(acc[r]);
}

/* the order in which row_i4 unpacks the 32 elements of a group */
static const int I4_PERM[32] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                16, 20, 24, 28, 17, 21, 25, 29, 18, 22, 26, 30, 19, 23, 27, 31};

/* x: rows of K floats with each group permuted by I4_PERM; xs[r * ng + g]: the sum of group g
 * of row r (the minimum's term) */
INL void row_i4(const long R, long K, const float *x, long ldx, const uint8_t *row,
                const float *xs, float *out)
{
    long ng = K / G, g = 0;
    const uint16_t *sh = (const uint16_t *)row, *mh = sh + ng;
    const uint8_t *w = row + 4 * ng;
    __m256 acc[4], macc[4];
    for (int r = 0; r < 4; r++)
        acc[r] = macc[r] = _mm256_setzero_ps();
    /* the 16 bytes of a group broadcast to both halves; lane l of vector v takes the nibble
     * of dword l % 4 at the shift below, so the elements come in the order of I4_PERM (x was
     * permuted to match): no byte shuffles */
    const __m256i nib = _mm256_set1_epi32(0x0F);
    const __m256i s0 = _mm256_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8);
    const __m256i s1 = _mm256_setr_epi32(16, 16, 16, 16, 24, 24, 24, 24);
    const __m256i s2 = _mm256_setr_epi32(4, 4, 4, 4, 12, 12, 12, 12);
    const __m256i s3 = _mm256_setr_epi32(20, 20, 20, 20, 28, 28, 28, 28);
    for (; g < ng; g++) {
        __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(w + g * 16)));
        __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, s0), nib));
        __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, s1), nib));
        __m256 w2 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, s2), nib));
        __m256 w3 = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(b, s3), nib));
        __m256 d = _mm256_set1_ps(_cvtsh_ss(sh[g]));
        for (long r = 0; r < R; r++)
            acc[r] = _mm256_fmadd_ps(d, dot32(w0, w1, w2, w3, x + r * ldx + g * G), acc[r]);
    }
    /* the minimum's term: sum_g min[g] * xs[r, g], 8 groups at a time */
    for (g = 0; g + 8 <= ng; g += 8) {
        __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mh + g)));
        for (long r = 0; r < R; r++)
            macc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(xs + r * ng + g), macc[r]);
    }
    for (long r = 0; r < R; r++) {
        float t = hsum256(_mm256_add_ps(acc[r], macc[r]));
        for (long j = g; j < ng; j++)
            t += _cvtsh_ss(mh[j]) * xs[r * ng + j];
        out[r] = t;
    }
}

/* AVX-512: a whole group in two vectors of 16. int4 takes each weight from a table of the
 * group's 16 values d * q + m (exactly GGUF's dequantized weights), indexed by the nibble
 * itself (vpermps reads an index's low 4 bits: no mask, no conversion); int8 multiplies the
 * converted codes by d. Then one FMA per 16 weights and row of x, in natural order (x is not
 * permuted). At batch 1, 4 row records at a time share each load of x (8 accumulators in
 * flight, one 4-wide store); with more rows of x, one record against up to 4 rows, two groups
 * in flight. */
#define TGT512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define INL512 TGT512 static inline __attribute__((always_inline))

/* the 16 FP16 values at h[0..n) (n <= 16) as floats in f[0..16) */
INL512 void halves(const uint16_t *h, long n, float *f)
{
    __m256i v = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), h);
    _mm512_storeu_ps(f, _mm512_cvtph_ps(v));
}

/* group g of a row (w: its codes) as 32 floats in w0, w1; d, m: its scale and minimum */
INL512 void unpack512(const int fmt, const uint8_t *w, long g, float d_, float m_, __m512 *w0,
                      __m512 *w1)
{
    __m512 d = _mm512_set1_ps(d_);
    if (fmt == 1) {
        const int8_t *q = (const int8_t *)w + g * G;
        *w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
        *w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
    } else {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        /* d * q is exact in float32 (an FP16 d times q < 16), so this is d * q + m as GGUF
         * dequantizes it, fused or not */
        __m512 tab = _mm512_fmadd_ps(d, iota, _mm512_set1_ps(m_));
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + g * 16)));
        *w0 = _mm512_permutexvar_ps(b, tab);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), tab);
    }
}

/* group g (index j among the 16 whose scales are in ds/ms) into accumulators a, a + 1 */
INL512 void group512(const long R, const int fmt, const float *x, long ldx, const uint8_t *w,
                     long g, float d_, float m_, __m512 acc[4][4], const int a)
{
    __m512 w0, w1;
    unpack512(fmt, w, g, d_, m_, &w0, &w1);
    for (long r = 0; r < R; r++) {
        const float *xr = x + r * ldx + g * G;
        acc[r][a] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r][a]);
        acc[r][a + 1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r][a + 1]);
    }
}

/* the sums of a, b, c, d, in that order */
INL512 __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d)
{
#define HALF(v) _mm256_add_ps(_mm512_castps512_ps256(v), \
    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
#define QUARTER(v) _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
    __m128 qa = QUARTER(HALF(a)), qb = QUARTER(HALF(b)), qc = QUARTER(HALF(c));
    __m128 qd = QUARTER(HALF(d));
#undef HALF
#undef QUARTER
    return _mm_hadd_ps(_mm_hadd_ps(qa, qb), _mm_hadd_ps(qc, qd));
}

/* one row of x against 4 consecutive row records (a decode at batch 1): each group of x is
 * loaded once for the 4 rows, 8 accumulators in flight, one 4-wide store */
INL512 void cols4_q512(const int fmt, long K, const float *x, const uint8_t *row, long rb,
                       float *out)
{
    long ng = K / G;
    const long codes = (fmt == 1 ? 2 : 4) * ng;
    __m512 acc[4][2];
    for (int c = 0; c < 4; c++)
        acc[c][0] = acc[c][1] = _mm512_setzero_ps();
    float ds[4][16], ms[4][16] = {{0}};
    for (long g0 = 0; g0 < ng; g0 += 16) {
        long n = ng - g0 < 16 ? ng - g0 : 16;
        for (int c = 0; c < 4; c++) {
            const uint16_t *sh = (const uint16_t *)(row + c * rb);
            halves(sh + g0, n, ds[c]);
            if (fmt == 2)
                halves(sh + ng + g0, n, ms[c]);
        }
        for (long j = 0; j < n; j++) {
            long g = g0 + j;
            __m512 x0 = _mm512_loadu_ps(x + g * G), x1 = _mm512_loadu_ps(x + g * G + 16);
            for (int c = 0; c < 4; c++) {
                __m512 w0, w1;
                unpack512(fmt, row + c * rb + codes, g, ds[c][j], ms[c][j], &w0, &w1);
                acc[c][0] = _mm512_fmadd_ps(w0, x0, acc[c][0]);
                acc[c][1] = _mm512_fmadd_ps(w1, x1, acc[c][1]);
            }
        }
    }
    _mm_storeu_ps(out, hsum4_512(_mm512_add_ps(acc[0][0], acc[0][1]),
                                 _mm512_add_ps(acc[1][0], acc[1][1]),
                                 _mm512_add_ps(acc[2][0], acc[2][1]),
                                 _mm512_add_ps(acc[3][0], acc[3][1])));
}

TGT512 static void cols4_512(int fmt, long K, const float *x, const uint8_t *row, long rb,
                             float *out)
{
    if (fmt == 1)
        cols4_q512(1, K, x, row, rb, out);
    else
        cols4_q512(2, K, x, row, rb, out);
}

INL512 void row_q512(const long R, const int fmt, long K, const float *x, long ldx,
                     const uint8_t *row, float *out)
{
    long ng = K / G;
    const uint16_t *sh = (const uint16_t *)row, *mh = sh + ng;
    const uint8_t *w = row + (fmt == 1 ? 2 : 4) * ng;
    __m512 acc[4][4];
    for (int r = 0; r < 4; r++)
        for (int a = 0; a < 4; a++)
            acc[r][a] = _mm512_setzero_ps();
    float ds[16], ms[16] = {0};
    for (long g0 = 0; g0 < ng; g0 += 16) {
        long n = ng - g0 < 16 ? ng - g0 : 16, j = 0;
        halves(sh + g0, n, ds);
        if (fmt == 2)
            halves(mh + g0, n, ms);
        for (; j + 2 <= n; j += 2) { /* literal accumulator indices: they stay in registers */
            group512(R, fmt, x, ldx, w, g0 + j, ds[j], ms[j], acc, 0);
            group512(R, fmt, x, ldx, w, g0 + j + 1, ds[j + 1], ms[j + 1], acc, 2);
        }
        if (j < n)
            group512(R, fmt, x, ldx, w, g0 + j, ds[j], ms[j], acc, 0);
    }
    for (long r = 0; r < R; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                                    _mm512_add_ps(acc[r][2], acc[r][3])));
}

TGT512 static void rows512(int fmt, long R, long K, const float *x, long ldx,
                           const uint8_t *row, float *out)
{
#define ROWS(n)                                                                            \
    if (fmt == 1)                                                                          \
        row_q512(n, 1, K, x, ldx, row, out);                                               \
    else                                                                                   \
        row_q512(n, 2, K, x, ldx, row, out);
    switch (R) {
    case 1: ROWS(1) break;
    case 2: ROWS(2) break;
    case 3: ROWS(3) break;
    default: ROWS(4) break;
    }
#undef ROWS
}

TGT static void rows(int fmt, long R, long K, const float *x, long ldx, const uint8_t *row,
                     const float *xs, float *out)
{
#define ROWS(n)                                                                            \
    if (fmt == 0)                                                                          \
        row_f32(n, K, x, ldx, (const float *)row, out);                                    \
    else if (fmt == 1)                                                                     \
        row_i8(n, K, x, ldx, row, out);                                                    \
    else                                                                                   \
        row_i4(n, K, x, ldx, row, xs, out);
    switch (R) {
    case 1: ROWS(1) break;
    case 2: ROWS(2) break;
    case 3: ROWS(3) break;
    default: ROWS(4) break;
    }
#undef ROWS
}

/* y[M, N] (+)= x[M, K] @ w^T (+ bias): rows of x four at a time, outputs split over threads.
 * w: N row records of kiln_qrow_bytes(fmt, K); K a multiple of 32 for the int formats. */
TGT void kiln_qgemv(int fmt, long M, long N, long K, const float *x, long ldx, const void *w,
                    const float *bias, float *y, long ldy, int accumulate, int nt)
{
    long ng = K / G, rb = kiln_qrow_bytes(fmt, K);
    float *xs = NULL, *xp = NULL;
    if (!isa)
        kiln_llm_set_isa(0);
    int wide = fmt != 0 && isa == 2;
    if (fmt == 2 && !wide) {
        xs = malloc(sizeof(float) * (M * ng + M * K + 1));
        xp = xs + M * ng;
        for (long r = 0; r < M; r++)
            for (long g = 0; g < ng; g++) {
                const float *p = x + r * ldx + g * G;
                float *o = xp + r * K + g * G;
                for (int j = 0; j < G; j++)
                    o[j] = p[I4_PERM[j]];
                __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                         _mm256_add_ps(_mm256_loadu_ps(p + 16),
                                                       _mm256_loadu_ps(p + 24)));
                xs[r * ng + g] = hsum256(t);
            }
        x = xp;
        ldx = K;
    }
    const uint8_t *base = w;
    long n4 = 0;
    if (wide && M == 1) { /* batch 1: 4 row records at a time */
        n4 = N / 4 * 4;
#pragma omp parallel for schedule(static) num_threads(nt)
        for (long n = 0; n < n4; n += 4) {
            const uint8_t *row = base + n * rb;
            for (long off = 0; off < 4 * rb; off += 64)
                _mm_prefetch((const char *)row + PF_AHEAD + off, _MM_HINT_T0);
            float out[4];
            cols4_512(fmt, K, x, row, rb, out);
            for (int c = 0; c < 4; c++) {
                float v = out[c] + (bias ? bias[n + c] : 0.0f);
                y[n + c] = accumulate ? y[n + c] + v : v;
            }
        }
    }
#pragma omp parallel for schedule(static) num_threads(nt)
    for (long n = n4; n < N; n++) {
        const uint8_t *row = base + n * rb;
        for (long off = 0; off < rb; off += 64) /* this row's share of the stream, ahead */
            _mm_prefetch((const char *)row + PF_AHEAD + off, _MM_HINT_T0);
        for (long r0 = 0; r0 < M; r0 += 4) {
            long R = M - r0 < 4 ? M - r0 : 4;
            float out[4];
            if (wide)
                rows512(fmt, R, K, x + r0 * ldx, ldx, row, out);
            else
                rows(fmt, R, K, x + r0 * ldx, ldx, row, xs ? xs + r0 * ng : NULL, out);
            for (long r = 0; r < R; r++) {
                float v = out[r] + (bias ? bias[n] : 0.0f);
                float *dst = y + (r0 + r) * ldy + n;
                *dst = accumulate ? *dst + v : v;
            }
        }
    }
    free(xs);
}

/* w as float32 [N, K] (long prefills run their GEMMs on the dequantized weight) */
TGT void kiln_qdequant(int fmt, long N, long K, const void *w, float *out, int nt)
{
    long ng = K / G, rb = kiln_qrow_bytes(fmt, K);
    const uint8_t *base = w;
    #pragma omp parallel for schedule(static) num_threads(nt)
    for (long n = 0; n < N; n++) {
        const uint8_t *row = base + n * rb;
        const uint16_t *sh = (const uint16_t *)row;
        for (long g = 0; g < ng; g++) {
            float d = _cvtsh_ss(sh[g]), *o = out + n * K + g * G;
            if (fmt == 1) {
                const int8_t *q = (const int8_t *)(row + 2 * ng) + g * G;
                for (int j = 0; j < G; j++)
                    o[j] = d * q[j];
            } else {
                const uint8_t *q = row + 4 * ng + g * 16;
                float m = _cvtsh_ss(sh[ng + g]);
                for (int j = 0; j < 16; j++) {
                    o[j] = d * (q[j] & 15) + m;
                    o[j + 16] = d * (q[j] >> 4) + m;
                }
            }
        }
    }
}

static void rmsnorm(long M, long H, const float *x, const float *w, float eps, float *y)
{
    for (long r = 0; r < M; r++) {
        const float *xr = x + r * H;
        double ss = 0;
        for (long i = 0; i < H; i++)
            ss += (double)xr[i] * xr[i];
        float inv = 1.0f / sqrtf((float)(ss / H) + eps);
        for (long i = 0; i < H; i++)
            y[r * H + i] = xr[i] * inv * w[i];
    }
}

/* rotate-half RoPE on `heads` heads of head_dim hd, in place */
static void rope(float *v, long heads, long hd, const float *cos, const float *sin)
{
    long h2 = hd / 2;
    for (long h = 0; h < heads; h++) {
        float *p = v + h * hd;
        for (long i = 0; i < h2; i++) {
            float a = p[i], b = p[i + h2];
            p[i] = a * cos[i] - b * sin[i];
            p[i + h2] = b * cos[i + h2] + a * sin[i + h2];
        }
    }
}

TGT static inline float dotf(const float *a, const float *b, long n)
{
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum256(acc);
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* One query row per (token, head) against the token's blocks; `scores` has max_ctx floats per
 * (token, head). kc, vc: one layer's [blocks * block_size, kv_heads, hd]. */
static void paged_attention(long M, long nh, long nkv, long hd, const float *q, long ldq,
                            const float *kc, const float *vc, long bs, const long *tables,
                            long max_blocks, const int *ctx, float *scores, long max_ctx,
                            float *out, int nt)
{
    float scale = 1.0f / sqrtf((float)hd);
    long group = nh / nkv;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (long mh = 0; mh < M * nh; mh++) {
        long m = mh / nh, h = mh % nh, kvh = h / group, c = ctx[m];
        const float *qr = q + m * ldq + h * hd;
        const long *tab = tables + m * max_blocks;
        float *sc = scores + mh * max_ctx, mx = -INFINITY, sum = 0;
        for (long j = 0; j < c; j++) {
            long slot = tab[j / bs] * bs + j % bs;
            sc[j] = dotf(qr, kc + (slot * nkv + kvh) * hd, hd) * scale;
            if (sc[j] > mx)
                mx = sc[j];
        }
        for (long j = 0; j < c; j++) {
            sc[j] = expf(sc[j] - mx);
            sum += sc[j];
        }
        float *o = out + m * nh * hd + h * hd, inv = 1.0f / sum;
        for (long i = 0; i < hd; i++)
            o[i] = 0;
        for (long j = 0; j < c; j++) {
            long slot = tab[j / bs] * bs + j % bs;
            const float *v = vc + (slot * nkv + kvh) * hd;
            float p = sc[j] * inv;
            for (long i = 0; i < hd; i++)
                o[i] += p * v[i];
        }
    }
}

/* Per-layer weights: LLM_PTRS pointers per layer, in this order (kiln/llm/model.py). */
enum { P_LN1, P_LN2, P_QKV, P_QKV_B, P_O, P_GU, P_DOWN, LLM_PTRS };

long kiln_llm_ptrs_per_layer(void) { return LLM_PTRS; }

/* The decoder stack for M decode tokens. cfg: M, layers, hidden, heads, kv_heads, head_dim,
 * intermediate, fmt, num_blocks, block_size, max_blocks, max_ctx. x [M, hidden]: the
 * embeddings in, the last hidden state (before the final norm) out. rope_cos/sin: [M, hd] rows
 * for the tokens' positions. cache: [layers, 2, num_blocks * block_size, kv_heads, hd].
 * scratch: kiln_llm_scratch_floats(cfg) floats. */
long kiln_llm_scratch_floats(const long *cfg)
{
    long M = cfg[0], H = cfg[2], nh = cfg[3], nkv = cfg[4], hd = cfg[5], I = cfg[6];
    return M * H + M * (nh + 2 * nkv) * hd + M * nh * hd + M * 3 * I + M * nh * cfg[11];
}

void kiln_llm_decode(const long *cfg, void *const *ptrs, float *x, const float *rope_cos,
                     const float *rope_sin, float *cache, const long *slots, const long *tables,
                     const int *ctx, float eps, float *scratch, int nt)
{
    long M = cfg[0], L = cfg[1], H = cfg[2], nh = cfg[3], nkv = cfg[4], hd = cfg[5], I = cfg[6];
    int fmt = (int)cfg[7];
    long nb = cfg[8], bs = cfg[9], max_blocks = cfg[10], max_ctx = cfg[11];
    long nq = (nh + 2 * nkv) * hd, layer_floats = nb * bs * nkv * hd;
    float *y = scratch, *qkv = y + M * H, *att = qkv + M * nq, *gu = att + M * nh * hd;
    float *act = gu + M * 2 * I, *scores = act + M * I;
    for (long l = 0; l < L; l++) {
        void *const *p = ptrs + l * LLM_PTRS;
        float *kc = cache + (2 * l) * layer_floats, *vc = kc + layer_floats;
        rmsnorm(M, H, x, p[P_LN1], eps, y);
        kiln_qgemv(fmt, M, nq, H, y, H, p[P_QKV], p[P_QKV_B], qkv, nq, 0, nt);
        for (long m = 0; m < M; m++) {
            float *q = qkv + m * nq, *k = q + nh * hd, *v = k + nkv * hd;
            rope(q, nh, hd, rope_cos + m * hd, rope_sin + m * hd);
            rope(k, nkv, hd, rope_cos + m * hd, rope_sin + m * hd);
            memcpy(kc + slots[m] * nkv * hd, k, sizeof(float) * nkv * hd);
            memcpy(vc + slots[m] * nkv * hd, v, sizeof(float) * nkv * hd);
        }
        paged_attention(M, nh, nkv, hd, qkv, nq, kc, vc, bs, tables, max_blocks, ctx, scores,
                        max_ctx, att, nt);
        kiln_qgemv(fmt, M, H, nh * hd, att, nh * hd, p[P_O], NULL, x, H, 1, nt);
        rmsnorm(M, H, x, p[P_LN2], eps, y);
        kiln_qgemv(fmt, M, 2 * I, H, y, H, p[P_GU], NULL, gu, 2 * I, 0, nt);
        for (long m = 0; m < M; m++)
            for (long i = 0; i < I; i++) {
                float g = gu[m * 2 * I + i];
                act[m * I + i] = g / (1.0f + expf(-g)) * gu[m * 2 * I + I + i];
            }
        kiln_qgemv(fmt, M, H, I, act, I, p[P_DOWN], NULL, x, H, 1, nt);
    }
}
