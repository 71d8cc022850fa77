/* kiln's CPU single-precision GEMM for inference: C = act(A @ B + bias + R).
 *
 * B is a constant (a layer's weight), packed once into 24-column panels; A is read in place.
 * The 4 x 24 register tile (12 ymm accumulators, three B registers, one broadcast register)
 * keeps both FMA pipes busy on AVX2 + FMA with a load to FMA ratio of 7:12, and a batch of
 * 128 rows is whole tiles. K is blocked so a panel's k block stays near the core while a block
 * of A rows stays in L2. Threads (OpenMP; loaded after torch, this library shares
 * torch's libgomp and so its thread pool) split the panels, or the rows where panels are few.
 *
 * The code is compiled for AVX2 + FMA by function attribute; kiln_sgemm_supported() says
 * whether this CPU has them, and callers must not call anything else when it says no. */
#include <immintrin.h>
#include <stddef.h>
#include <math.h>
#include <string.h>
#include <omp.h>

#define MR 4 /* rows of the register tile */
#define NV 3 /* 8-float vectors across it */
#define NR (8 * NV) /* columns of the tile and of a packed panel */
#ifndef KC
#define KC 768
#endif
#ifndef PF
#define PF 8 /* B rows prefetched ahead */
#endif
#ifndef MC
#define MC 192
#endif

#define TGT __attribute__((target("avx2,fma")))

int kiln_sgemm_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* The register tile's rows and columns and the K block, for tests that aim at their edges. */
void kiln_sgemm_tile(int *mr, int *nr, int *kc)
{
    *mr = MR;
    *nr = NR;
    *kc = KC;
}

long kiln_sgemm_packed_size(long K, long N)
{
    return ((N + NR - 1) / NR) * K * NR;
}

/* Element (k, n) of B is B[k * sk + n * sn]. The packed layout is [k block][panel][k][16]:
 * k blocks of KC rows; panel p holds columns 16p..16p+15, zero past N. The panels a thread walks
 * in one k block are thus one sequential stream. */
void kiln_sgemm_pack(long K, long N, const float *B, long sk, long sn, float *out)
{
    long panels = (N + NR - 1) / NR;
    for (long k0 = 0; k0 < K; k0 += KC) {
        long kc = K - k0 < KC ? K - k0 : KC;
        for (long p = 0; p < panels; p++) {
            float *dst = out + k0 * panels * NR + p * kc * NR;
            long n0 = p * NR, nn = N - n0 < NR ? N - n0 : NR;
            for (long k = 0; k < kc; k++) {
                const float *src = B + (k0 + k) * sk + n0 * sn;
                long j = 0;
                for (; j < nn; j++) dst[k * NR + j] = src[j * sn];
                for (; j < NR; j++) dst[k * NR + j] = 0.0f;
            }
        }
    }
}

TGT static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Activations, applied to the tile in registers (codes as in kiln/native/__init__.py). */
enum { ACT_NONE, ACT_RELU, ACT_GELU, ACT_GELU_TANH, ACT_SIGMOID, ACT_SILU, ACT_TANH, ACT_CLIP,
       ACT_LEAKY_RELU, ACT_HARD_SWISH };

/* e^x: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two for exactness), e^r by a degree-7
 * polynomial (the Cephes expf coefficients), 2^n by building the exponent bits; about 1 ulp.
 * x is clamped to [-87, 88] so the result is a normal float; NaN stays NaN (the clamps and the
 * activations' max/min take v as their second operand, which they return when either is NaN). */
TGT static inline __m256 exp256(__m256 x)
{
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* 1 / (1 + e^(-x)), exact division. */
TGT static inline __m256 sigmoid256(__m256 x)
{
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* x * Phi(x) = x/2 (1 + erf(x / sqrt 2)), erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7):
 * erf(z) = 1 - q(t) e^(-z^2) for z >= 0, t = 1 / (1 + 0.3275911 z). 1 + erf(z) is formed as
 * 2 - q e^(-z^2) for x >= 0 and as q e^(-z^2) for x < 0, so large negative x keeps its accuracy. */
TGT static inline __m256 gelu256(__m256 x)
{
    __m256 z = _mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x),
                             _mm256_set1_ps(0.70710678118654752f));
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(z, _mm256_set1_ps(0.3275911f), one));
    __m256 q = _mm256_set1_ps(1.061405429f);
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(-1.453152027f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(1.421413741f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(-0.284496736f));
    q = _mm256_fmadd_ps(q, t, _mm256_set1_ps(0.254829592f));
    q = _mm256_mul_ps(_mm256_mul_ps(q, t), exp256(_mm256_sub_ps(_mm256_setzero_ps(),
                                                                _mm256_mul_ps(z, z))));
    __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256 onep = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(2.0f), q), q, neg);
    return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), onep);
}

TGT static inline __m256 act256(__m256 v, int act, float alpha, float beta)
{
    __m256 zero = _mm256_setzero_ps();
    switch (act) {
    case ACT_RELU: return _mm256_max_ps(zero, v);
    case ACT_GELU: return gelu256(v);
    case ACT_GELU_TANH: {  /* x/2 (1 + tanh u) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3) */
        __m256 u = _mm256_mul_ps(v, _mm256_fmadd_ps(_mm256_mul_ps(v, v),
                                                    _mm256_set1_ps(0.044715f * 1.5957691216f),
                                                    _mm256_set1_ps(1.5957691216f)));
        return _mm256_mul_ps(v, sigmoid256(u));
    }
    case ACT_SIGMOID: return sigmoid256(v);
    case ACT_SILU: return _mm256_mul_ps(v, sigmoid256(v));
    case ACT_TANH:  /* 2 sigmoid(2x) - 1 */
        return _mm256_fmsub_ps(_mm256_set1_ps(2.0f), sigmoid256(_mm256_add_ps(v, v)),
                               _mm256_set1_ps(1.0f));
    case ACT_CLIP:
        return _mm256_min_ps(_mm256_set1_ps(beta), _mm256_max_ps(_mm256_set1_ps(alpha), v));
    case ACT_LEAKY_RELU:
        return _mm256_blendv_ps(v, _mm256_mul_ps(v, _mm256_set1_ps(alpha)),
                                _mm256_cmp_ps(v, zero, _CMP_LT_OQ));
    case ACT_HARD_SWISH: {  /* x min(max(x / 6 + 1/2, 0), 1) */
        __m256 g = _mm256_fmadd_ps(v, _mm256_set1_ps(1.0f / 6.0f), _mm256_set1_ps(0.5f));
        g = _mm256_min_ps(_mm256_set1_ps(1.0f), _mm256_max_ps(zero, g));
        return _mm256_mul_ps(v, g);
    }
    default: return v;
    }
}

/* One tile of mr <= MR rows and nr <= NR columns over k in [0, kc): the MR x NV accumulators
 * live in named registers for the whole k loop (gcc spills an array of them to the stack). Rows
 * past mr re-read the last row and are not stored. first: add bias and R (else C); last: apply
 * the activation. */
TGT static void tile(long kc, const float *A, long lda, const float *Bp, float *C, long ldc,
                     int mr, int nr, int first, int last, const float *bias, const float *R,
                     long ldr, int act, float alpha, float beta)
{
    const float *a[MR];
    for (int r = 0; r < MR; r++) a[r] = A + (r < mr ? r : mr - 1) * lda;
    for (int r = 0; r < mr; r++) {
        const float *pr = first ? (R ? R + r * ldr : NULL) : C + r * ldc;
        if (pr) { _mm_prefetch((const char *)pr, _MM_HINT_T0);
                  _mm_prefetch((const char *)(pr + NR - 1), _MM_HINT_T0); }
    }
    __m256 acc[MR][NV];
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3];
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00,
           c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
#pragma GCC unroll 4
    for (long k = 0; k < kc; k++) {
        _mm_prefetch((const char *)(Bp + (k + PF) * NR), _MM_HINT_T0);
        const float *bk = Bp + k * NR;
        __m256 w0 = _mm256_load_ps(bk), w1 = _mm256_load_ps(bk + 8), w2 = _mm256_load_ps(bk + 16);
        __m256 x;
        x = _mm256_broadcast_ss(a0 + k); c00 = _mm256_fmadd_ps(x, w0, c00);
        c01 = _mm256_fmadd_ps(x, w1, c01); c02 = _mm256_fmadd_ps(x, w2, c02);
        x = _mm256_broadcast_ss(a1 + k); c10 = _mm256_fmadd_ps(x, w0, c10);
        c11 = _mm256_fmadd_ps(x, w1, c11); c12 = _mm256_fmadd_ps(x, w2, c12);
        x = _mm256_broadcast_ss(a2 + k); c20 = _mm256_fmadd_ps(x, w0, c20);
        c21 = _mm256_fmadd_ps(x, w1, c21); c22 = _mm256_fmadd_ps(x, w2, c22);
        x = _mm256_broadcast_ss(a3 + k); c30 = _mm256_fmadd_ps(x, w0, c30);
        c31 = _mm256_fmadd_ps(x, w1, c31); c32 = _mm256_fmadd_ps(x, w2, c32);
    }
    acc[0][0] = c00; acc[0][1] = c01; acc[0][2] = c02; acc[1][0] = c10; acc[1][1] = c11;
    acc[1][2] = c12; acc[2][0] = c20; acc[2][1] = c21; acc[2][2] = c22; acc[3][0] = c30;
    acc[3][1] = c31; acc[3][2] = c32;
    int full = nr == NR;
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i m[NV];
    __m256 bv[NV];
    for (int v = 0; v < NV; v++) {
        m[v] = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr - 8 * v), idx);
        bv[v] = _mm256_setzero_ps();
    }
#define LD(p, v) (full ? _mm256_loadu_ps(p) : _mm256_maskload_ps((p), m[v]))
    if (first && bias)
        for (int v = 0; v < NV; v++) bv[v] = LD(bias + 8 * v, v);
    for (int r = 0; r < mr; r++) {
        float *cr = C + r * ldc;
        const float *rr = R ? R + r * ldr : NULL;
        for (int v = 0; v < NV; v++) {
            __m256 y = acc[r][v];
            if (first) {
                y = _mm256_add_ps(y, bv[v]);
                if (rr) y = _mm256_add_ps(y, LD(rr + 8 * v, v));
            } else {
                y = _mm256_add_ps(y, LD(cr + 8 * v, v));
            }
            if (last && act) y = act256(y, act, alpha, beta);
            if (full) _mm256_storeu_ps(cr + 8 * v, y);
            else _mm256_maskstore_ps(cr + 8 * v, m[v], y);
        }
    }
#undef LD
}

/* Rows [m0, m1) and panels [p0, p1) of the product: k blocks outermost, then blocks of MC rows
 * of A (which stay in L2 while every panel passes over them), then the panels, then the row
 * tiles (which reuse the panel's k block from L1/L2). */
TGT static void block(long m0, long m1, long p0, long p1, long N, long K, const float *A,
                      long lda, const float *Bp, const float *bias, const float *R, long ldr,
                      float *C, long ldc, int act, float alpha, float beta)
{
    long panels = (N + NR - 1) / NR;
    for (long k0 = 0; k0 < K; k0 += KC) {
        long kc = K - k0 < KC ? K - k0 : KC;
        int first = k0 == 0, last = k0 + kc == K;
        for (long i0 = m0; i0 < m1; i0 += MC) {
            long i1 = i0 + MC < m1 ? i0 + MC : m1;
            for (long p = p0; p < p1; p++) {
                long n0 = p * NR;
                int nr = N - n0 < NR ? (int)(N - n0) : NR;
                const float *bp = Bp + k0 * panels * NR + p * kc * NR;
                const float *bb = bias ? bias + n0 : NULL;
                for (long i = i0; i < i1; i += MR) {
                    int mr = i1 - i < MR ? (int)(i1 - i) : MR;
                    tile(kc, A + i * lda + k0, lda, bp, C + i * ldc + n0, ldc, mr, nr, first,
                         last, bb, R ? R + i * ldr + n0 : NULL, ldr, act, alpha, beta);
                }
            }
        }
    }
}


/* C[M, N] (row stride ldc) = act(A[M, K] (row stride lda) @ B + bias[N] + R[M, N] (row stride
 * ldr)), B packed by kiln_sgemm_pack, K >= 1; bias and R may be NULL; act: an ACT_ code, alpha and beta
 * its parameters (Clip's bounds, LeakyRelu's slope). */
void kiln_sgemm(long M, long N, long K, const float *A, long lda, const float *Bp,
                const float *bias, const float *R, long ldr, float *C, long ldc, int act,
                float alpha, float beta, int nthreads)
{
    long panels = (N + NR - 1) / NR;
    if (nthreads < 1) nthreads = 1;
    if (M <= 0 || N <= 0 || K <= 0)  /* callers pass K >= 1 (there is no product to take) */
        return;
    /* Split the panels where each thread gets at least two, else the rows (in tiles of 6). */
    int by_rows = panels < 2L * nthreads && M >= 2L * MR * nthreads;
    if (nthreads == 1 || (M * N * K) < 64L * 64 * 64) {
        block(0, M, 0, panels, N, K, A, lda, Bp, bias, R, ldr, C, ldc, act, alpha, beta);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (by_rows) {
            long tiles_m = (M + MR - 1) / MR;
            long a = tiles_m * t / nt * MR, b = tiles_m * (t + 1) / nt * MR;
            if (b > M) b = M;
            if (a < b)
                block(a, b, 0, panels, N, K, A, lda, Bp, bias, R, ldr, C, ldc, act, alpha, beta);
        } else {
            long a = panels * t / nt, b = panels * (t + 1) / nt;
            if (a < b)
                block(0, M, a, b, N, K, A, lda, Bp, bias, R, ldr, C, ldc, act, alpha, beta);
        }
    }
}

/* Rows [m0, m1) of Y (row stride ldy, N columns) normalized in place: (y - mean) / sqrt(var + eps)
 * * gamma + beta, the mean and the (biased) variance in float32 over each row, two passes. */
TGT static void layernorm_rows(long m0, long m1, long N, float *Y, long ldy, const float *gamma,
                               const float *beta, float eps)
{
    for (long i = m0; i < m1; i++) {
        float *y = Y + i * ldy;
        __m256 acc = _mm256_setzero_ps();
        long j = 0;
        for (; j + 8 <= N; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(y + j));
        float sum = hsum256(acc);
        for (; j < N; j++) sum += y[j];
        float mean = sum / (float)N;
        __m256 mv = _mm256_set1_ps(mean);
        acc = _mm256_setzero_ps();
        for (j = 0; j + 8 <= N; j += 8) {
            __m256 d = _mm256_sub_ps(_mm256_loadu_ps(y + j), mv);
            acc = _mm256_fmadd_ps(d, d, acc);
        }
        float sq = hsum256(acc);
        for (; j < N; j++) sq += (y[j] - mean) * (y[j] - mean);
        float inv = 1.0f / sqrtf(sq / (float)N + eps);
        __m256 iv = _mm256_set1_ps(inv);
        for (j = 0; j + 8 <= N; j += 8) {
            __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(y + j), mv), iv);
            d = _mm256_fmadd_ps(d, _mm256_loadu_ps(gamma + j), beta ? _mm256_loadu_ps(beta + j)
                                                                    : _mm256_setzero_ps());
            _mm256_storeu_ps(y + j, d);
        }
        for (; j < N; j++) y[j] = (y[j] - mean) * inv * gamma[j] + (beta ? beta[j] : 0.0f);
    }
}

void kiln_layernorm(long M, long N, float *Y, long ldy, const float *gamma, const float *beta,
                    float eps, int nthreads)
{
    if (nthreads < 2 || M < 2) { layernorm_rows(0, M, N, Y, ldy, gamma, beta, eps); return; }
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        layernorm_rows(M * t / nt, M * (t + 1) / nt, N, Y, ldy, gamma, beta, eps);
    }
}
