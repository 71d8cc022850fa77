/* u8 x s8 integer GEMM with a float epilogue: C[m, n] = act(float(sum_k A[m, k] B[k, n] -
 * a_zero * colsum[n]) * (a_scale * w_scale[n]) (+ bias[n]) (+ R[m, n])), the int32 sums exact
 * (no int16 pair saturation), the float steps those of onnxruntime's MatMulInteger -> Cast ->
 * Mul (-> Add); or that product requantized to 8 bits and back (QLinearMatMul's steps).
 * A is uint8 activation codes [M, K] (row stride lda), B int8 weight codes [K, N] with zero
 * point 0, packed once by kiln_qgemm_pack for one path:
 *
 * - VNNI (AVX512-VNNI, vpdpbusd): panels of 32 columns; per group of 4 k, 32 x 4 bytes (column
 *   c's 4 codes together), so one instruction adds 4 u8 x s8 products into 16 int32 sums;
 * - AVX2 (vpmaddwd on int16): panels of 16 columns; per pair of k, 16 x 2 int16 (the codes
 *   sign-extended), A's pair zero-extended into one int32 broadcast: each vpmaddwd adds 2
 *   products per column in int32, exactly (vpmaddubsw would saturate their int16 sum);
 * - scalar: B transposed, [N, K] int8 (the epilogue is AVX2's, as kiln's library needs it).
 *
 * kiln_qgemm_best_path picks the fastest path the CPU has; any path can be forced (tests run
 * each one the CPU can). The row blocks x column panels are items of kiln's team (team.c).
 * kiln_qgemm_f32 quantizes float32 rows first (quant.c), by a fixed or their own range. */
/* no fused multiply-adds in the epilogue: onnxruntime rounds the product, then adds the bias */
#pragma GCC optimize("fp-contract=off")
#include "kernels.h"
#include <stdint.h>

enum { QP_SCALAR = 1, QP_AVX2 = 2, QP_VNNI = 3 };
#define QACT_REQUANT 100 /* the epilogue requantizes (QLinearMatMul) instead of bias/act */
#define QACT_INT32 101 /* the epilogue stores the int32 sums (MatMulInteger), C an int32 [M, N] */
#define QMR 4 /* rows of a register tile (scalar, AVX2) */
#define QMRV 8 /* rows of VNNI's: 16 accumulators */
#define QSERIAL_WORK (1L << 18) /* multiply-adds below which one thread does it all */

int kiln_qgemm_best_path(void)
{
    static int best = 0;
    if (!best) {
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            best = QP_VNNI;
        else if (__builtin_cpu_supports("avx2"))
            best = QP_AVX2;
        else
            best = QP_SCALAR;
    }
    return best;
}

static long panel_cols(int path) { return path == QP_VNNI ? 32 : path == QP_AVX2 ? 16 : 1; }
static long kgroup(int path) { return path == QP_VNNI ? 4 : path == QP_AVX2 ? 2 : 1; }
static long elem_bytes(int path) { return path == QP_AVX2 ? 2 : 1; }

/* Bytes of B packed for ``path`` (0 for a path this build or CPU cannot run). */
long kiln_qgemm_packed_size(int path, long K, long N)
{
    if (path < QP_SCALAR || path > kiln_qgemm_best_path())
        return 0;
    long pc = panel_cols(path), g = kgroup(path);
    return (N + pc - 1) / pc * pc * ((K + g - 1) / g * g) * elem_bytes(path);
}

/* B [K, N] int8 (row stride N) into ``out`` (kiln_qgemm_packed_size bytes), zeros padding. */
void kiln_qgemm_pack(int path, long K, long N, const int8_t *B, void *out)
{
    long pc = panel_cols(path), g = kgroup(path);
    long kp = (K + g - 1) / g * g, np = (N + pc - 1) / pc;
    if (path == QP_SCALAR) {
        int8_t *o = out;
        for (long n = 0; n < N; n++)
            for (long k = 0; k < K; k++)
                o[n * K + k] = B[k * N + n];
        return;
    }
    memset(out, 0, (size_t)(np * pc * kp * elem_bytes(path)));
    for (long p = 0; p < np; p++)
        for (long k = 0; k < K; k++)
            for (long c = 0; c < pc && p * pc + c < N; c++) {
                long at = p * pc * kp + (k / g) * pc * g + c * g + k % g;
                int8_t v = B[k * N + p * pc + c];
                if (path == QP_AVX2)
                    ((int16_t *)out)[at] = v;
                else
                    ((int8_t *)out)[at] = v;
            }
}

struct qjob {
    int path;
    long M, N, K, lda, ldc, rb;
    const uint8_t *A;
    int a_zero;
    const void *B;
    const int32_t *colsum;
    float a_scale;
    const float *w_scale;
    long w_scale_n; /* 1: one scale for every column */
    const float *bias;
    const float *R; /* residual [M, N] (row stride ldr) or none */
    long ldr;
    int act; /* kernels.h's ACT_* after the residual, or QACT_REQUANT */
    float alpha, beta; /* the activation's parameters */
    float y_scale, y_zero, lo, hi; /* QACT_REQUANT's */
    float *C;
    const int32_t *row_add; /* an int32 per row added to the sums (qconv.c's terms) or none */
};

/* The epilogue of 8 columns n0 .. n0 + 7 (``valid`` of them inside N) of row m: masked loads
 * and stores at the right edge, the same float steps at every column. */
TGT static inline __attribute__((always_inline)) void store8(const struct qjob *j, long m, long n0, long valid, __m256i acc)
{
    __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid > 8 ? 8 : (int)valid),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256i cs = _mm256_maskload_epi32(j->colsum + n0, mask);
    __m256i t = _mm256_sub_epi32(acc, _mm256_mullo_epi32(_mm256_set1_epi32(j->a_zero), cs));
    if (j->row_add)
        t = _mm256_add_epi32(t, _mm256_set1_epi32(j->row_add[m]));
    if (j->act == QACT_INT32) {
        int *c = (int *)j->C + m * j->ldc + n0;
        if (valid >= 8)
            _mm256_storeu_si256((__m256i *)c, t);
        else
            _mm256_maskstore_epi32(c, mask, t);
        return;
    }
    __m256 s = j->w_scale_n == 1 ? _mm256_set1_ps(j->a_scale * j->w_scale[0]) :
        _mm256_mul_ps(_mm256_set1_ps(j->a_scale), _mm256_maskload_ps(j->w_scale + n0, mask));
    __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(t), s);
    if (j->act == QACT_REQUANT) {
        __m256 vz = _mm256_set1_ps(j->y_zero);
        __m256 q = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, vz), _mm256_set1_ps(j->lo)),
                          _mm256_set1_ps(j->hi));
        y = _mm256_mul_ps(_mm256_sub_ps(q, vz), _mm256_set1_ps(j->y_scale));
    } else {
        if (j->bias)
            y = _mm256_add_ps(y, _mm256_maskload_ps(j->bias + n0, mask));
        if (j->R)
            y = _mm256_add_ps(y, _mm256_maskload_ps(j->R + m * j->ldr + n0, mask));
        if (j->act)
            y = act256(y, j->act, j->alpha, j->beta);
    }
    float *c = j->C + m * j->ldc + n0;
    if (valid >= 8)
        _mm256_storeu_ps(c, y);
    else
        _mm256_maskstore_ps(c, mask, y);
}

/* A's codes k0 .. k0 + len - 1 of one row (len <= 4) as one little-endian word, zeros past K. */
static inline uint32_t a_word(const uint8_t *a, long k0, long K, int len)
{
    uint32_t w = 0;
    if (k0 + len <= K) {
        if (len == 4)
            memcpy(&w, a + k0, 4);
        else
            w = (uint32_t)a[k0] | ((uint32_t)a[k0 + 1] << 16);
        return w;
    }
    for (int i = 0; i < len && k0 + i < K; i++)
        w |= (uint32_t)a[k0 + i] << (len == 4 ? 8 * i : 16 * i);
    return w;
}

TGT static void scalar_items(void *ctx, long i0, long i1)
{
    const struct qjob *j = ctx;
    const int8_t *B = j->B;
    for (long i = i0; i < i1; i++) {
        long n0 = (i / j->rb) * 8, m0 = (i % j->rb) * QMR;
        for (long m = m0; m < m0 + QMR && m < j->M; m++) {
            const uint8_t *a = j->A + m * j->lda;
            int32_t acc[8] = {0};
            for (long c = 0; c < 8 && n0 + c < j->N; c++)
                for (long k = 0; k < j->K; k++)
                    acc[c] += (int32_t)a[k] * (int32_t)B[(n0 + c) * j->K + k];
            store8(j, m, n0, j->N - n0, _mm256_loadu_si256((const __m256i *)acc));
        }
    }
}

TGT static void avx2_items(void *ctx, long i0, long i1)
{
    const struct qjob *j = ctx;
    long kp = (j->K + 1) / 2;
    for (long i = i0; i < i1; i++) {
        long p = i / j->rb, m0 = (i % j->rb) * QMR;
        const int16_t *b = (const int16_t *)j->B + p * 16 * kp * 2;
        const uint8_t *a[QMR];
        for (int r = 0; r < QMR; r++)
            a[r] = j->A + (m0 + r < j->M ? m0 + r : m0) * j->lda;
        __m256i acc[QMR][2];
        for (int r = 0; r < QMR; r++)
            acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        for (long g = 0; g < kp; g++) {
            __m256i b0 = _mm256_loadu_si256((const __m256i *)(b + g * 32));
            __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + g * 32 + 16));
            for (int r = 0; r < QMR; r++) {
                __m256i av = _mm256_set1_epi32((int)a_word(a[r], 2 * g, j->K, 2));
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(av, b0));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(av, b1));
            }
        }
        for (int r = 0; r < QMR && m0 + r < j->M; r++)
            for (int h = 0; h < 2; h++) {
                long n0 = p * 16 + h * 8;
                if (n0 < j->N)
                    store8(j, m0 + r, n0, j->N - n0, acc[r][h]);
            }
    }
}

#define TGTV __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

/* One tile: rows m0 .. m0 + R - 1 (those past M read row m0 and are not stored) x panel p. */
TGTV static inline __attribute__((always_inline)) void vnni_tile(const struct qjob *j, long m0,
                                                               long p, const int R)
{
    long kp = (j->K + 3) / 4, kfull = j->K / 4;
    const int8_t *b = (const int8_t *)j->B + p * 32 * kp * 4;
    const uint8_t *a[QMRV];
    for (int r = 0; r < R; r++)
        a[r] = j->A + (m0 + r < j->M ? m0 + r : m0) * j->lda;
    __m512i acc[QMRV][2];
    for (int r = 0; r < R; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (long g = 0; g < kp; g++) {
        __m512i b0 = _mm512_loadu_si512(b + g * 128);
        __m512i b1 = _mm512_loadu_si512(b + g * 128 + 64);
        for (int r = 0; r < R; r++) {
            uint32_t w;
            if (g < kfull)
                memcpy(&w, a[r] + 4 * g, 4);
            else
                w = a_word(a[r], 4 * g, j->K, 4);
            __m512i av = _mm512_set1_epi32((int)w);
            acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], av, b0);
            acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], av, b1);
        }
    }
    for (int r = 0; r < R && m0 + r < j->M; r++)
        for (int h = 0; h < 4; h++) {
            long n0 = p * 32 + h * 8;
            if (n0 >= j->N)
                break;
            __m512i v = acc[r][h / 2];
            __m256i q = (h & 1) ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v);
            store8(j, m0 + r, n0, j->N - n0, q);
        }
}

/* Items of QMRV-row blocks x 32-column panels; a block of at most 4 rows takes the 4-row
 * tile (a GEMV-like layer does not compute 8 rows for one). */
TGTV static void vnni_items(void *ctx, long i0, long i1)
{
    const struct qjob *j = ctx;
    for (long i = i0; i < i1; i++) {
        long p = i / j->rb, m0 = (i % j->rb) * QMRV;
        if (j->M - m0 <= 4)
            vnni_tile(j, m0, p, 4);
        else
            vnni_tile(j, m0, p, QMRV);
    }
}

/* C [M, N] (row stride ldc) = act(float(A B - a_zero colsum) * (a_scale w_scale) + bias + R)
 * from A's codes and B packed for ``path`` (0: the best); w_scale has w_scale_n values (1 or
 * N), bias N or none, R [M, N] (row stride ldr) or none; ep = {alpha, beta} of ``act``, and
 * for act QACT_REQUANT {., ., y_scale, y_zero, lo, hi}: (clamp(round(float(...) * w_scale) +
 * y_zero, lo, hi) - y_zero) * y_scale (w_scale the whole multipliers: a_scale, bias and R
 * unused); for act QACT_INT32, C is int32 and gets the sums A B - a_zero colsum themselves.
 * Returns -1 for a path this CPU cannot run. */
int kiln_qgemm(int path, long M, long N, long K, const uint8_t *A, long lda, int a_zero,
               const void *B, const int32_t *colsum, float a_scale, const float *w_scale,
               long w_scale_n, const float *bias, const float *R, long ldr, int act,
               const float *ep, float *C, long ldc, int nthreads)
{
    return kiln_qgemm_rows(path, M, N, K, A, lda, a_zero, B, colsum, NULL, a_scale, w_scale,
                           w_scale_n, bias, R, ldr, act, ep, C, ldc, nthreads);
}

/* kiln_qgemm with row_add[m] (int32, M of them, or NULL) added to row m's sums before the
 * epilogue. */
int kiln_qgemm_rows(int path, long M, long N, long K, const uint8_t *A, long lda, int a_zero,
                    const void *B, const int32_t *colsum, const int32_t *row_add,
                    float a_scale, const float *w_scale, long w_scale_n, const float *bias,
                    const float *R, long ldr, int act, const float *ep, float *C, long ldc,
                    int nthreads)
{
    if (path == 0)
        path = kiln_qgemm_best_path();
    if (path < QP_SCALAR || path > kiln_qgemm_best_path())
        return -1;
    long pc = path == QP_SCALAR ? 8 : panel_cols(path);
    long mr = path == QP_VNNI ? QMRV : QMR, rb = (M + mr - 1) / mr;
    struct qjob j = {path, M, N, K, lda, ldc, rb, A, a_zero, B, colsum, a_scale, w_scale,
                     w_scale_n, bias, R, ldr, act, ep[0], ep[1],
                     act == QACT_REQUANT ? ep[2] : 0.0f, act == QACT_REQUANT ? ep[3] : 0.0f,
                     act == QACT_REQUANT ? ep[4] : 0.0f, act == QACT_REQUANT ? ep[5] : 0.0f, C,
                     row_add};
    if (act == QACT_REQUANT)
        j.a_scale = 1.0f;
    kiln_range_fn fn = path == QP_VNNI ? vnni_items : path == QP_AVX2 ? avx2_items :
        scalar_items;
    long items = rb * ((N + pc - 1) / pc);
    if (nthreads < 2 || items < 2 || M * N * K < QSERIAL_WORK)
        fn(&j, 0, items);
    else
        kiln_parallel(items, fn, &j, nthreads);
    return 0;
}

/* kiln_qgemm of float32 rows X [M, K] (row stride ldx) quantized to uint8 first
 * (kiln_quantize_rows, quant.c): by x_scale and x_zero, or, where x_scale is 0, by X's own
 * range (DynamicQuantizeLinear). Returns -1 for a path this CPU cannot run or no memory. */
int kiln_qgemm_f32(int path, long M, long N, long K, const float *X, long ldx, float x_scale,
                   int x_zero, const void *B, const int32_t *colsum, const float *w_scale,
                   long w_scale_n, const float *bias, const float *R, long ldr, int act,
                   const float *ep, float *C, long ldc, int nthreads)
{
    return kiln_qgemm_f32_off(path, M, N, K, X, ldx, x_scale, x_zero, B, colsum, 0, w_scale,
                              w_scale_n, bias, R, ldr, act, ep, C, ldc, nthreads);
}

/* kiln_qgemm_f32 of a weight whose integers are B's plus one offset ``col_off`` (uint8 codes
 * minus a zero point beyond int8: B = codes - 128, col_off = 128 - zero): the products gain
 * col_off times each row's sum of (code - x_zero), added to the row's sums. */
int kiln_qgemm_f32_off(int path, long M, long N, long K, const float *X, long ldx,
                       float x_scale, int x_zero, const void *B, const int32_t *colsum,
                       int col_off, const float *w_scale, long w_scale_n, const float *bias,
                       const float *R, long ldr, int act, const float *ep, float *C, long ldc,
                       int nthreads)
{
    uint8_t *codes = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64 + 64));
    int32_t *rows = col_off ? malloc((size_t)(M + 1) * sizeof(int32_t)) : NULL;
    if (!codes || (col_off && !rows)) {
        free(codes);
        free(rows);
        return -1;
    }
    float scale = x_scale, zero = (float)x_zero;
    kiln_quantize_rows(M, K, X, ldx, codes, &scale, &zero, x_scale == 0.0f, nthreads);
    for (long m = 0; col_off && m < M; m++) {
        long sum = 0;
        for (long k = 0; k < K; k++)
            sum += codes[m * K + k];
        rows[m] = (int32_t)(col_off * (sum - K * (long)zero));
    }
    int rc = kiln_qgemm_rows(path, M, N, K, codes, K, (int)zero, B, colsum, rows, scale,
                             w_scale, w_scale_n, bias, R, ldr, act, ep, C, ldc, nthreads);
    free(codes);
    free(rows);
    return rc;
}

/* ---------------------------------------------------------------- kiln_qbmm_qdq
 * QDQ's DQ -> MatMul -> Q of two activations (attention's Q K^T and P V in a QDQ model), as
 * onnxruntime runs it (one QLinearMatMul): both operands' 8-bit codes (QuantizeLinear's float32
 * steps: divide, round half to even, add the zero point, saturate), exact int32 sums of (a -
 * a_zero)(b - b_zero), requantized by mult = a_scale * b_scale / y_scale (round half to even,
 * saturate) and dequantized by y_scale: the float32 values the DQ after the Q gives.
 *
 * Per batch item: A's codes as uint8 rows u = code + (128 if signed), zero a_zero + the same; B's
 * as int8 b' = code + (128 if signed) - 128, stored column by column [N][Kp] (a column's K codes
 * together), then packed for the path as kiln_qgemm_pack lays out a weight. With d = 128 -
 * (128 if signed) - b_zero, code_b - b_zero = b' + d, so the sums are sum u b' - a_zero' *
 * colsum(b') + d * (rowsum(u) - K a_zero'): qgemm's colsum and row_add terms. The batch items
 * (2 batch dims, any strides, 0 for a broadcast one) are the team's items; one item splits its
 * tiles over the team instead. */

struct qbmm {
    int path;
    long b0, b1, M, N, K;
    const float *A, *B;
    float *C;
    long sa[4], sb[4], sc[3]; /* element strides: A b0 b1 m k; B b0 b1 k n; C b0 b1 m */
    float a_s, a_z, a_lo, a_hi, b_s, b_z, b_lo, b_hi, mult, y_s, y_z, y_lo, y_hi;
};

/* code + off (off 128 for signed codes) of QuantizeLinear(x, s, z) saturated to [lo, hi] */
static inline int qcode(float x, float s, float z, float lo, float hi, int off)
{
    float q = nearbyintf(x / s) + z;
    q = q < lo ? lo : q > hi ? hi : q;
    return (int)q + off;
}

/* n codes + off of x (stride sx) into y (bytes, ``flip`` xor-ed into each: 0x80 makes the
 * uint8 u into the int8 u - 128); returns their sum (of the stored bytes' values, as uint8
 * or int8). */
TGT static long quant_run(const float *x, long sx, long n, float s, float z, float lo, float hi,
                          int off, int flip, uint8_t *y)
{
    long i = 0, sum = 0;
    if (sx == 1) {
        const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
        const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
        const __m256i voff = _mm256_set1_epi32(off);
        __m256i acc = _mm256_setzero_si256();
        for (; i + 8 <= n; i += 8) {
            __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, vz), vlo), vhi);
            __m256i w = _mm256_add_epi32(_mm256_cvtps_epi32(q), voff); /* 0..255 */
            acc = _mm256_add_epi32(acc, w);
            __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(w),
                                         _mm256_extracti128_si256(w, 1));
            p = _mm_packus_epi16(p, p);
            p = _mm_xor_si128(p, _mm_set1_epi8((char)flip));
            _mm_storel_epi64((__m128i *)(y + i), p);
        }
        int32_t t[8];
        _mm256_storeu_si256((__m256i *)t, acc);
        for (int k = 0; k < 8; k++)
            sum += t[k];
        if (flip)
            sum -= 128L * i;
    }
    for (; i < n; i++) {
        int u = qcode(x[i * sx], s, z, lo, hi, off);
        y[i] = (uint8_t)(u ^ flip);
        sum += flip ? u - 128 : u;
    }
    return sum;
}

/* B's codes column-major bt [N][ldt] (zeros past K) into the packed panels of ``path`` */
static void qbmm_pack(int path, long K, long N, const int8_t *bt, long ldt, void *out)
{
    long pc = panel_cols(path), g = kgroup(path);
    long kp = (K + g - 1) / g * g, np = (N + pc - 1) / pc;
    if (path == QP_VNNI) {
        int8_t *o = out;
        for (long p = 0; p < np; p++)
            for (long q = 0; q < kp / 4; q++) {
                int8_t *dst = o + p * 32 * kp + q * 128;
                for (long c = 0; c < 32; c++) {
                    long n = p * 32 + c;
                    if (n < N)
                        memcpy(dst + 4 * c, bt + n * ldt + 4 * q, 4);
                    else
                        memset(dst + 4 * c, 0, 4);
                }
            }
    } else {
        int16_t *o = out;
        for (long p = 0; p < np; p++)
            for (long q = 0; q < kp / 2; q++) {
                int16_t *dst = o + p * 16 * kp + q * 32;
                for (long c = 0; c < 16; c++) {
                    long n = p * 16 + c;
                    dst[2 * c] = n < N ? bt[n * ldt + 2 * q] : 0;
                    dst[2 * c + 1] = n < N ? bt[n * ldt + 2 * q + 1] : 0;
                }
            }
    }
}

struct qbmm_scratch {
    uint8_t *a;   /* [M, K] */
    int8_t *bt;   /* [N, ldt] */
    void *packed;
    int32_t *colsum, *row_add;
    long ldt;
};

static int scratch_get(const struct qbmm *q, struct qbmm_scratch *s)
{
    long g = q->path == QP_SCALAR ? 1 : 4;
    s->ldt = (q->K + g - 1) / g * g;
    long packed = q->path == QP_SCALAR ? 0 : kiln_qgemm_packed_size(q->path, q->K, q->N);
    s->a = malloc((size_t)(q->M * q->K + 64));
    s->bt = calloc((size_t)(q->N * s->ldt + 64), 1);
    s->packed = packed ? aligned_alloc(64, (size_t)((packed + 63) / 64 * 64)) : NULL;
    s->colsum = malloc((size_t)(q->N + 8) * sizeof(int32_t));
    s->row_add = malloc((size_t)(q->M + 8) * sizeof(int32_t));
    return s->a && s->bt && (s->packed || !packed) && s->colsum && s->row_add ? 0 : -1;
}

static void scratch_free(struct qbmm_scratch *s)
{
    free(s->a);
    free(s->bt);
    free(s->packed);
    free(s->colsum);
    free(s->row_add);
}

/* batch item i's codes, sums and packed B into s; fills j (the qgemm job of its tiles) */
static void qbmm_prepare(const struct qbmm *q, long i, struct qbmm_scratch *s, struct qjob *j)
{
    long i0 = i / q->b1, i1 = i % q->b1, K = q->K;
    const float *A = q->A + i0 * q->sa[0] + i1 * q->sa[1];
    const float *B = q->B + i0 * q->sb[0] + i1 * q->sb[1];
    int aoff = q->a_lo < 0 ? 128 : 0, boff = q->b_lo < 0 ? 128 : 0;
    int a_zero = (int)q->a_z + aoff, d = 128 - boff - (int)q->b_z;
    for (long m = 0; m < q->M; m++) {
        long sum = quant_run(A + m * q->sa[2], q->sa[3], K, q->a_s, q->a_z, q->a_lo, q->a_hi,
                             aoff, 0, s->a + m * K);
        s->row_add[m] = (int32_t)(d * (sum - K * a_zero));
    }
    for (long n = 0; n < q->N; n++)
        s->colsum[n] = (int32_t)quant_run(B + n * q->sb[3], q->sb[2], K, q->b_s, q->b_z,
                                          q->b_lo, q->b_hi, boff, 0x80,
                                          (uint8_t *)s->bt + n * s->ldt);
    const void *Bp = s->bt;
    if (q->path != QP_SCALAR) {
        qbmm_pack(q->path, K, q->N, s->bt, s->ldt, s->packed);
        Bp = s->packed;
    }
    long mr = q->path == QP_VNNI ? QMRV : QMR;
    struct qjob t = {q->path, q->M, q->N, K, K, q->sc[2], (q->M + mr - 1) / mr, s->a, a_zero, Bp,
                     s->colsum, 1.0f, &q->mult, 1, NULL, NULL, 0, QACT_REQUANT, 0.0f, 0.0f,
                     q->y_s, q->y_z, q->y_lo, q->y_hi,
                     q->C + i0 * q->sc[0] + i1 * q->sc[1], s->row_add};
    *j = t;
}

static kiln_range_fn qbmm_tiles(int path)
{
    return path == QP_VNNI ? vnni_items : path == QP_AVX2 ? avx2_items : scalar_items;
}

static long qbmm_tile_count(const struct qjob *j)
{
    long pc = j->path == QP_SCALAR ? 8 : panel_cols(j->path);
    return j->rb * ((j->N + pc - 1) / pc);
}

static void qbmm_items(void *ctx, long i0, long i1)
{
    const struct qbmm *q = ctx;
    struct qbmm_scratch s;
    if (scratch_get(q, &s) == 0)
        for (long i = i0; i < i1; i++) {
            struct qjob j;
            qbmm_prepare(q, i, &s, &j);
            qbmm_tiles(q->path)(&j, 0, qbmm_tile_count(&j));
        }
    scratch_free(&s);  /* (out of memory: kiln_qbmm_qdq checked one item's scratch first) */
}

/* dims = {b0, b1, M, N, K}; sa = A's element strides {b0, b1, m, k}, sb = B's {b0, b1, k, n},
 * sc = C's {b0, b1, m} (C's columns contiguous); qp = {a_scale, a_zero, a_lo, a_hi, b_scale,
 * b_zero, b_lo, b_hi, mult, y_scale, y_zero, y_lo, y_hi} (lo < 0: int8 codes, else uint8; mult
 * = a_scale * b_scale / y_scale as the caller rounds it). path 0: the best. Returns -1 for a
 * path this CPU cannot run or no memory. */
int kiln_qbmm_qdq(int path, const long *dims, const float *A, const long *sa, const float *B,
                  const long *sb, float *C, const long *sc, const float *qp, int nthreads)
{
    if (path == 0)
        path = kiln_qgemm_best_path();
    if (path < QP_SCALAR || path > kiln_qgemm_best_path())
        return -1;
    struct qbmm q = {path, dims[0], dims[1], dims[2], dims[3], dims[4], A, B, C,
                     {sa[0], sa[1], sa[2], sa[3]}, {sb[0], sb[1], sb[2], sb[3]},
                     {sc[0], sc[1], sc[2]}, qp[0], qp[1], qp[2], qp[3], qp[4], qp[5], qp[6],
                     qp[7], qp[8], qp[9], qp[10], qp[11], qp[12]};
    long items = q.b0 * q.b1;
    if (items <= 0 || q.M <= 0 || q.N <= 0)
        return 0;
    struct qbmm_scratch s;
    if (scratch_get(&q, &s) != 0) {
        scratch_free(&s);
        return -1;
    }
    long work = items * q.M * q.N * (q.K > 0 ? q.K : 1);
    if (nthreads < 2 || work < QSERIAL_WORK) {
        for (long i = 0; i < items; i++) {
            struct qjob j;
            qbmm_prepare(&q, i, &s, &j);
            qbmm_tiles(path)(&j, 0, qbmm_tile_count(&j));
        }
    } else if (items >= 2) {
        kiln_parallel(items, qbmm_items, &q, nthreads);
    } else {
        struct qjob j;
        qbmm_prepare(&q, 0, &s, &j);
        kiln_parallel(qbmm_tile_count(&j), qbmm_tiles(path), &j, nthreads);
    }
    scratch_free(&s);
    return 0;
}
