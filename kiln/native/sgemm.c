/* kiln's CPU single-precision GEMM for inference: C = act(A @ B + bias + R).
 *
 * B is a constant (a layer's weight), packed once into 24-column panels; A is read in place.
 * The 4 x 24 register tile (12 ymm accumulators, three B registers, one broadcast register)
 * keeps both FMA pipes busy on AVX2 + FMA with a load to FMA ratio of 7:12, and a batch of
 * 128 rows is whole tiles. K is blocked (KC) and A's rows in blocks of MC; with K up to ~500 a
 * block of A rows stays in L2, beyond that it comes from L3 (MC from 96 to 1024 timed within
 * +-2% at M = 1024). Threads (OpenMP; loaded after torch, this library shares
 * torch's libgomp and so its thread pool) split the panels, or the rows where panels are few.
 *
 * The code is compiled for AVX2 + FMA by function attribute; kiln_sgemm_supported() says
 * whether this CPU has them, and callers must not call anything else when it says no. */
#include <immintrin.h>
#include <stddef.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#include <omp.h>

#define MR 4 /* rows of the register tile */
#define NV 3 /* 8-float vectors across it */
#define NR (8 * NV) /* columns of the tile and of a packed panel */
#ifndef KC
#define KC 1536 /* 2-4% faster than 768 on K = 1536 and 3072 GEMMs (BERT's, MiniLM's FFN2) */
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

/* dst[c * ldd + r] = src[r * ld + c] for an 8 x 8 block. */
TGT static void transpose8(const float *src, long ld, float *dst, long ldd)
{
    __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + ld),
           r2 = _mm256_loadu_ps(src + 2 * ld), r3 = _mm256_loadu_ps(src + 3 * ld),
           r4 = _mm256_loadu_ps(src + 4 * ld), r5 = _mm256_loadu_ps(src + 5 * ld),
           r6 = _mm256_loadu_ps(src + 6 * ld), r7 = _mm256_loadu_ps(src + 7 * ld);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
           t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
           t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
           u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
           u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
           u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
    _mm256_storeu_ps(dst + ldd, _mm256_permute2f128_ps(u1, u5, 0x20));
    _mm256_storeu_ps(dst + 2 * ldd, _mm256_permute2f128_ps(u2, u6, 0x20));
    _mm256_storeu_ps(dst + 3 * ldd, _mm256_permute2f128_ps(u3, u7, 0x20));
    _mm256_storeu_ps(dst + 4 * ldd, _mm256_permute2f128_ps(u0, u4, 0x31));
    _mm256_storeu_ps(dst + 5 * ldd, _mm256_permute2f128_ps(u1, u5, 0x31));
    _mm256_storeu_ps(dst + 6 * ldd, _mm256_permute2f128_ps(u2, u6, 0x31));
    _mm256_storeu_ps(dst + 7 * ldd, _mm256_permute2f128_ps(u3, u7, 0x31));
}

/* Element (k, n) of B is B[k * sk + n * sn]. The packed layout is [k block][panel][k][NR]:
 * k blocks of KC rows; panel p holds columns NR p .. NR p + NR - 1, zero past N. The panels a
 * thread walks in one k block are thus one sequential stream. */
void kiln_sgemm_pack(long K, long N, const float *B, long sk, long sn, float *out)
{
    long panels = (N + NR - 1) / NR;
    for (long k0 = 0; k0 < K; k0 += KC) {
        long kc = K - k0 < KC ? K - k0 : KC;
        for (long p = 0; p < panels; p++) {
            float *dst = out + k0 * panels * NR + p * kc * NR;
            long n0 = p * NR, nn = N - n0 < NR ? N - n0 : NR;
            long k = 0;
            /* attention packs a head's K^T and V per call: rows of B contiguous (V) are
             * copied, columns contiguous (K^T) go through 8 x 8 transposes */
            if (sn == 1) {
                for (; k < kc; k++) {
                    memcpy(dst + k * NR, B + (k0 + k) * sk + n0, (size_t)nn * sizeof(float));
                    for (long j = nn; j < NR; j++) dst[k * NR + j] = 0.0f;
                }
            } else if (sk == 1 && nn == NR) {
                for (; k + 8 <= kc; k += 8)
                    for (long j = 0; j < NR; j += 8)
                        transpose8(B + (n0 + j) * sn + k0 + k, sn, dst + k * NR + j, NR);
            }
            for (; k < kc; k++) {
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

/* x * Phi(x) = x/2 (1 + erf(x / sqrt 2)), erf by Abramowitz & Stegun 7.1.28 (|error| <= 3e-7):
 * erf(z) = 1 - p(z)^-16 for z >= 0, p a degree-6 polynomial with p(0) = 1. 1 + erf is formed as
 * 2 - p^-16 for x >= 0 and as p^-16 (that is, erfc |z|) for x < 0, so large negative x keeps its
 * accuracy; z is capped at 6, where p^-16 is below 1e-21 and p^16 stays finite. No exp: this
 * costs a third of the 7.1.26 form, which took 10% of an M = 1024, K = 384 GEMM. */
TGT static inline __m256 gelu256(__m256 x)
{
    __m256 z = _mm256_min_ps(_mm256_mul_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x),
                                           _mm256_set1_ps(0.70710678118654752f)),
                             _mm256_set1_ps(6.0f));
    __m256 p = _mm256_set1_ps(0.0000430638f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0002765672f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0001520143f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0092705272f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0422820123f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.0705230784f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(1.0f));
    p = _mm256_mul_ps(p, p);
    p = _mm256_mul_ps(p, p);
    p = _mm256_mul_ps(p, p);
    p = _mm256_mul_ps(p, p);
    __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), p);
    __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256 onep = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(2.0f), r), r, neg);
    return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), onep);  /* NaN x: NaN */
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

/* The tile's epilogue: first k block: + bias + R, else + C; last: the activation; then store
 * the mr x nr corner. */
TGT static inline void store_tile(__m256 acc[MR][NV], float *C, long ldc, int mr, int nr,
                                  int first, int last, const float *bias, const float *R,
                                  long ldr, int act, float alpha, float beta)
{
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
    /* In three passes over the tile, so the activation's long dependency chains of the twelve
     * vectors overlap (one vector at a time, add-activate-store, left them serial). */
    for (int r = 0; r < mr; r++) {
        const float *rr = R ? R + r * ldr : NULL;
        for (int v = 0; v < NV; v++) {
            if (first) {
                acc[r][v] = _mm256_add_ps(acc[r][v], bv[v]);
                if (rr) acc[r][v] = _mm256_add_ps(acc[r][v], LD(rr + 8 * v, v));
            } else {
                acc[r][v] = _mm256_add_ps(acc[r][v], LD(C + r * ldc + 8 * v, v));
            }
        }
    }
    if (last && act) {
        __m256 *y = &acc[0][0];
#pragma GCC unroll 12
        for (int i = 0; i < MR * NV; i++) y[i] = act256(y[i], act, alpha, beta);
    }
    for (int r = 0; r < mr; r++) {
        float *cr = C + r * ldc;
        for (int v = 0; v < NV; v++) {
            if (full) _mm256_storeu_ps(cr + 8 * v, acc[r][v]);
            else _mm256_maskstore_ps(cr + 8 * v, m[v], acc[r][v]);
        }
    }
#undef LD
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
    /* The tile's C rows (and R's) are fetched while the k loop runs: with C fresh (first k
     * block) its lines would otherwise be read for ownership only at the stores, one miss after
     * another; this was 5-10% of a whole GEMM at M = 1024, K = 384. */
    for (int r = 0; r < mr; r++) {
        const float *pc = C + r * ldc, *pr = first && R ? R + r * ldr : NULL;
        _mm_prefetch((const char *)pc, _MM_HINT_T0);
        _mm_prefetch((const char *)(pc + NR - 1), _MM_HINT_T0);
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
    if (mr == MR && nr == NR && first && last && !bias && !R && !act) {  /* plain: store */
        _mm256_storeu_ps(C, c00); _mm256_storeu_ps(C + 8, c01); _mm256_storeu_ps(C + 16, c02);
        C += ldc;
        _mm256_storeu_ps(C, c10); _mm256_storeu_ps(C + 8, c11); _mm256_storeu_ps(C + 16, c12);
        C += ldc;
        _mm256_storeu_ps(C, c20); _mm256_storeu_ps(C + 8, c21); _mm256_storeu_ps(C + 16, c22);
        C += ldc;
        _mm256_storeu_ps(C, c30); _mm256_storeu_ps(C + 8, c31); _mm256_storeu_ps(C + 16, c32);
        return;
    }
    acc[0][0] = c00; acc[0][1] = c01; acc[0][2] = c02; acc[1][0] = c10; acc[1][1] = c11;
    acc[1][2] = c12; acc[2][0] = c20; acc[2][1] = c21; acc[2][2] = c22; acc[3][0] = c30;
    acc[3][1] = c31; acc[3][2] = c32;
    store_tile(acc, C, ldc, mr, nr, first, last, bias, R, ldr, act, alpha, beta);
}

/* The edge panels' tiles, of at most 16 and at most 8 columns: the same product on two vectors
 * or one, so a panel's zero padding is not multiplied, with named accumulators as in tile (an
 * array of them, indexed in loops, was spilled: a 16-column edge panel took as long as three
 * full ones, 44% of an M = 784, K = 64, N = 256 GEMM). The 8-column tile keeps two sums per
 * row (even and odd k) for eight independent FMA chains. */
TGT static void tile_2(long kc, const float *A, long lda, const float *Bp, float *C, long ldc,
                       int mr, int nr, int first, int last, const float *bias, const float *R,
                       long ldr, int act, float alpha, float beta)
{
    const float *a0 = A, *a1 = A + (1 < mr ? 1 : mr - 1) * lda,
                *a2 = A + (2 < mr ? 2 : mr - 1) * lda, *a3 = A + (3 < mr ? 3 : mr - 1) * lda;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00;
#pragma GCC unroll 4
    for (long k = 0; k < kc; k++) {
        const float *bk = Bp + k * NR;
        __m256 w0 = _mm256_load_ps(bk), w1 = _mm256_load_ps(bk + 8), x;
        x = _mm256_broadcast_ss(a0 + k); c00 = _mm256_fmadd_ps(x, w0, c00);
        c01 = _mm256_fmadd_ps(x, w1, c01);
        x = _mm256_broadcast_ss(a1 + k); c10 = _mm256_fmadd_ps(x, w0, c10);
        c11 = _mm256_fmadd_ps(x, w1, c11);
        x = _mm256_broadcast_ss(a2 + k); c20 = _mm256_fmadd_ps(x, w0, c20);
        c21 = _mm256_fmadd_ps(x, w1, c21);
        x = _mm256_broadcast_ss(a3 + k); c30 = _mm256_fmadd_ps(x, w0, c30);
        c31 = _mm256_fmadd_ps(x, w1, c31);
    }
    __m256 z = _mm256_setzero_ps();
    __m256 acc[MR][NV] = {{c00, c01, z}, {c10, c11, z}, {c20, c21, z}, {c30, c31, z}};
    store_tile(acc, C, ldc, mr, nr, first, last, bias, R, ldr, act, alpha, beta);
}

TGT static void tile_1(long kc, const float *A, long lda, const float *Bp, float *C, long ldc,
                       int mr, int nr, int first, int last, const float *bias, const float *R,
                       long ldr, int act, float alpha, float beta)
{
    const float *a0 = A, *a1 = A + (1 < mr ? 1 : mr - 1) * lda,
                *a2 = A + (2 < mr ? 2 : mr - 1) * lda, *a3 = A + (3 < mr ? 3 : mr - 1) * lda;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, d0 = c0, d1 = c0, d2 = c0,
           d3 = c0;
    long k = 0;
    for (; k + 2 <= kc; k += 2) {
        const float *bk = Bp + k * NR;
        __m256 w0 = _mm256_load_ps(bk), w1 = _mm256_load_ps(bk + NR);
        c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(a0 + k), w0, c0);
        c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(a1 + k), w0, c1);
        c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(a2 + k), w0, c2);
        c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(a3 + k), w0, c3);
        d0 = _mm256_fmadd_ps(_mm256_broadcast_ss(a0 + k + 1), w1, d0);
        d1 = _mm256_fmadd_ps(_mm256_broadcast_ss(a1 + k + 1), w1, d1);
        d2 = _mm256_fmadd_ps(_mm256_broadcast_ss(a2 + k + 1), w1, d2);
        d3 = _mm256_fmadd_ps(_mm256_broadcast_ss(a3 + k + 1), w1, d3);
    }
    if (k < kc) {
        __m256 w0 = _mm256_load_ps(Bp + k * NR);
        c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(a0 + k), w0, c0);
        c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(a1 + k), w0, c1);
        c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(a2 + k), w0, c2);
        c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(a3 + k), w0, c3);
    }
    __m256 z = _mm256_setzero_ps();
    __m256 acc[MR][NV] = {{_mm256_add_ps(c0, d0), z, z}, {_mm256_add_ps(c1, d1), z, z},
                          {_mm256_add_ps(c2, d2), z, z}, {_mm256_add_ps(c3, d3), z, z}};
    store_tile(acc, C, ldc, mr, nr, first, last, bias, R, ldr, act, alpha, beta);
}

/* Rows [m0, m1) and panels [p0, p1) of the product: k blocks outermost, then blocks of MC rows
 * of A (which every panel passes over), then the panels, then the row tiles (which reuse the
 * panel's k block from L1/L2). */
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
                void (*tf)(long, const float *, long, const float *, float *, long, int, int,
                           int, int, const float *, const float *, long, int, float, float) =
                    nr <= 8 ? tile_1 : nr <= 16 ? tile_2 : tile;
                for (long i = i0; i < i1; i += MR) {
                    int mr = i1 - i < MR ? (int)(i1 - i) : MR;
                    tf(kc, A + i * lda + k0, lda, bp, C + i * ldc + n0, ldc, mr, nr, first,
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
    /* Split the panels where each thread gets at least two, else the rows (in whole tiles). */
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
            /* nt shares of (panel, row slice) items, panel-major: whole panels, and where the
             * panels do not divide evenly the boundary panel's rows split between two threads
             * (11 panels, N = 256, on 2 threads: 5.5 each, not 5 and 6) */
            long tiles_m = (M + MR - 1) / MR, a = panels * t, b = panels * (t + 1);
#define ROW(s) (tiles_m * (s) / nt * MR < M ? tiles_m * (s) / nt * MR : M)
            if (a % nt) {  /* the tail of a panel: its row slices a % nt .. nt - 1 */
                long p = a / nt, end = b / nt == p ? b % nt : nt;
                block(ROW(a % nt), ROW(end), p, p + 1, N, K, A, lda, Bp, bias, R, ldr, C, ldc,
                      act, alpha, beta);
                a = (p + 1) * nt;
            }
            if (a < b / nt * nt)  /* whole panels */
                block(0, M, a / nt, b / nt, N, K, A, lda, Bp, bias, R, ldr, C, ldc, act, alpha,
                      beta);
            if (b % nt && b / nt * nt >= a)  /* the head of a panel: slices 0 .. b % nt - 1 */
                block(0, ROW(b % nt), b / nt, b / nt + 1, N, K, A, lda, Bp, bias, R, ldr, C,
                      ldc, act, alpha, beta);
#undef ROW
        }
    }
}

/* Rows [m0, m1) of X (row stride ldx, N columns) normalized into Y (row stride ldy; Y may be X):
 * (x - mean) / sqrt(var + eps) * gamma + beta, the mean and the (biased) variance in float32 over
 * each row, two passes. */
TGT static void layernorm_rows(long m0, long m1, long N, const float *X, long ldx, float *Y,
                               long ldy, const float *gamma, const float *beta, float eps)
{
    for (long i = m0; i < m1; i++) {
        const float *x = X + i * ldx;
        float *y = Y + i * ldy;
        __m256 acc = _mm256_setzero_ps();
        long j = 0;
        for (; j + 8 <= N; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + j));
        float sum = hsum256(acc);
        for (; j < N; j++) sum += x[j];
        float mean = sum / (float)N;
        __m256 mv = _mm256_set1_ps(mean);
        acc = _mm256_setzero_ps();
        for (j = 0; j + 8 <= N; j += 8) {
            __m256 d = _mm256_sub_ps(_mm256_loadu_ps(x + j), mv);
            acc = _mm256_fmadd_ps(d, d, acc);
        }
        float sq = hsum256(acc);
        for (; j < N; j++) sq += (x[j] - mean) * (x[j] - mean);
        float inv = 1.0f / sqrtf(sq / (float)N + eps);
        __m256 iv = _mm256_set1_ps(inv);
        for (j = 0; j + 8 <= N; j += 8) {
            __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv), iv);
            d = _mm256_fmadd_ps(d, _mm256_loadu_ps(gamma + j), beta ? _mm256_loadu_ps(beta + j)
                                                                    : _mm256_setzero_ps());
            _mm256_storeu_ps(y + j, d);
        }
        for (; j < N; j++) y[j] = (x[j] - mean) * inv * gamma[j] + (beta ? beta[j] : 0.0f);
    }
}

/* LayerNorm of the M rows of X into Y (in place where Y == X). */
void kiln_layernorm_to(long M, long N, const float *X, long ldx, float *Y, long ldy,
                       const float *gamma, const float *beta, float eps, int nthreads)
{
    if (nthreads < 2 || M < 2) {
        layernorm_rows(0, M, N, X, ldx, Y, ldy, gamma, beta, eps);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        layernorm_rows(M * t / nt, M * (t + 1) / nt, N, X, ldx, Y, ldy, gamma, beta, eps);
    }
}

/* ---- attention ------------------------------------------------------------------------------
 * softmax(scale Q K^T + bias, causal) V for float32, one (batch, head) per work item: K^T and V
 * of the head are packed into panels (kiln_sgemm_pack) and both products run on the GEMM's
 * tiles; the scores of QC query rows at a time live in a per-thread scratch row block. */
#define QC 128

/* One row of scores s[0, n) (n keys, lim of them allowed) turned into unnormalized
 * probabilities in place: x = scale s + bias (bias: NULL, or element j at bias[j * bk]), then
 * e^(x - max); keys from lim on get 0. Returns 1 / sum, which the caller applies to the row's
 * output (Dv values instead of n here). A row with no allowed key, or whose allowed keys are all
 * -inf, becomes all zeros (ONNX's rule; SDPA would give NaN); a NaN score makes the row NaN. */
TGT static float softmax_row(float *s, long n, long lim, float scale, const float *bias, long bk)
{
    long j;
    __m256 sc = _mm256_set1_ps(scale), mx = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();  /* lanes that saw a NaN (max_ps would drop it) */
    if (bias && bk != 1)
        for (j = 0; j < lim; j++) s[j] = s[j] * scale + bias[j * bk];
    for (j = 0; j + 8 <= lim; j += 8) {  /* scale (unless done above) and take the max */
        __m256 x = _mm256_loadu_ps(s + j);
        if (!bias || bk == 1) {
            x = bias ? _mm256_fmadd_ps(x, sc, _mm256_loadu_ps(bias + j)) : _mm256_mul_ps(x, sc);
            _mm256_storeu_ps(s + j, x);
        }
        mx = _mm256_max_ps(mx, x);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float m;
    {
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(h);
    }
    for (; j < lim; j++) {
        if (!bias || bk == 1) s[j] = s[j] * scale + (bias ? bias[j] : 0.0f);
        m = (s[j] > m || s[j] != s[j]) ? s[j] : m;
    }
    if (!(m > -INFINITY)) {  /* nothing allowed (or NaN: propagate it) */
        float fill = m != m ? m : 0.0f;
        for (j = 0; j < n; j++) s[j] = fill;
        return 1.0f;
    }
    __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    for (j = 0; j + 8 <= lim; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        acc = _mm256_add_ps(acc, e);
        _mm256_storeu_ps(s + j, e);
    }
    float sum = hsum256(acc);
    for (; j < lim; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    for (; j < n; j++) s[j] = 0.0f;
    return 1.0f / sum;
}

/* y[0, n) = f x[0, n) */
TGT static void scaled_copy(float *y, const float *x, long n, float f)
{
    __m256 fv = _mm256_set1_ps(f);
    long e = 0;
    for (; e + 8 <= n; e += 8) _mm256_storeu_ps(y + e, _mm256_mul_ps(_mm256_loadu_ps(x + e), fv));
    for (; e < n; e++) y[e] = x[e] * f;
}

/* How many of Skv keys query i sees: all without a causal mask (causal < 0), else keys
 * j <= i + causal. */
static long visible(long i, long Skv, long causal)
{
    if (causal < 0) return Skv;
    long n = i + causal + 1;
    return n < 0 ? 0 : n > Skv ? Skv : n;
}

static float *scratch(long floats)
{
    size_t bytes = ((size_t)floats * sizeof(float) + 63) & ~(size_t)63;
    return (float *)aligned_alloc(64, bytes ? bytes : 64);
}

/* Y[b, i, h, :] = softmax(scale Q[b, h, i, :] . K[b, h, j, :] + bias[b, h, i, j]) V[b, h, j, :]
 * for B batches, H heads, Sq queries, Skv keys, head size D (value size Dv). Every tensor is
 * given by a pointer and its strides in elements for (b, h, row); the last dim is contiguous.
 * bias may be NULL; its strides may be 0 (broadcast) and its key stride is bk. causal >= 0:
 * query i sees keys j <= i + causal only (the absolute offset of query 0); -1: no causal mask.
 * Query heads map to key/value heads h / (H / Hkv) (grouped-query attention). Returns 0, or -1
 * when scratch memory could not be had (Y is then incomplete). */
int kiln_attention(long B, long H, long Hkv, long Sq, long Skv, long D, long Dv,
                   const float *Q, long qb, long qh, long qs,
                   const float *K, long kb, long kh, long ks,
                   const float *V, long vb, long vh, long vs,
                   const float *bias, long bb, long bh, long bq, long bk,
                   long causal, float scale, float *Y, long yb, long yh, long ys, int nthreads)
{
    if (B <= 0 || H <= 0 || Sq <= 0 || Skv <= 0 || D <= 0 || Dv <= 0) return 0;
    if (nthreads < 1) nthreads = 1;
    long items = B * H, group = H / Hkv;
    /* both products run on whole panels (the padding columns are zeros, cheaper to multiply
     * than to cut off with a narrow tile): scores are Skv_pad wide, the values' product lands
     * Dv_pad wide in scratch and its Dv columns are copied out, scaled by the row's 1 / sum */
    long pk = kiln_sgemm_packed_size(D, Skv), pv = kiln_sgemm_packed_size(Skv, Dv);
    long skp = (Skv + NR - 1) / NR * NR, dvp = (Dv + NR - 1) / NR * NR;
    long qc = Sq < QC ? Sq : QC;
    int failed = 0;
    if (items < nthreads) nthreads = (int)items;
#pragma omp parallel num_threads(nthreads) reduction(|: failed)
    {
        float *kp = scratch(pk), *vp = scratch(pv), *sb = scratch(qc * skp),
              *ob = scratch(qc * dvp);
        if (!kp || !vp || !sb || !ob) failed = 1;
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        float inv[QC];  /* each query row's 1 / sum of its softmax */
        for (long it = items * t / nt; !failed && it < items * (t + 1) / nt; it++) {
            long b = it / H, h = it % H, hk = h / group;
            const float *k = K + b * kb + hk * kh, *v = V + b * vb + hk * vh;
            const float *q = Q + b * qb + h * qh;
            float *y = Y + b * yb + h * yh;
            kiln_sgemm_pack(D, Skv, k, 1, ks, kp);   /* B(d, j) = K[j, d] */
            kiln_sgemm_pack(Skv, Dv, v, vs, 1, vp);  /* B(j, e) = V[j, e] */
            for (long i0 = 0; i0 < Sq; i0 += qc) {
                long rows = Sq - i0 < qc ? Sq - i0 : qc;
                long lim = visible(i0 + rows - 1, Skv, causal);  /* keys any row may see */
                long panels = (lim + NR - 1) / NR;
                if (panels > 0)
                    block(0, rows, 0, panels, skp, D, q + i0 * qs, qs, kp, NULL, NULL, 0, sb, skp,
                          ACT_NONE, 0.0f, 0.0f);
                for (long r = 0; r < rows; r++) {
                    long i = i0 + r;
                    const float *br = bias ? bias + b * bb + h * bh + i * bq : NULL;
                    inv[r] = softmax_row(sb + r * skp, Skv, visible(i, Skv, causal), scale, br,
                                         bk);
                }
                block(0, rows, 0, dvp / NR, dvp, Skv, sb, skp, vp, NULL, NULL, 0, ob, dvp,
                      ACT_NONE, 0.0f, 0.0f);
                for (long r = 0; r < rows; r++)  /* the softmax's normalization, applied here */
                    scaled_copy(y + (i0 + r) * ys, ob + r * dvp, Dv, inv[r]);
            }
        }
        free(kp); free(vp); free(sb); free(ob);
    }
    return failed ? -1 : 0;
}

/* ---- 3x3 convolution by Winograd F(2x2, 3x3) -----------------------------------------------
 * Y = act(conv(X, W) + bias + R) for a 3x3 kernel, stride 1, dilation 1, one group, on NHWC
 * tensors (channels contiguous; X [N, H, W, C], Y and R [N, Ho, Wo, K]). Each 2 x 2 block of
 * outputs (a tile) is computed from the 4 x 4 input patch around it as A^T [(G g G^T) . (B^T d
 * B)] A (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2015): the
 * elementwise product over the 16 transform positions summed over C is 16 GEMMs of [tiles, C] @
 * [C, K], 16 multiplies per tile and channel pair where the direct convolution takes 36. The
 * transformed weight (16 matrices [C, K]) is packed once like any GEMM weight. Tiles go in
 * blocks of tb, each block in three phases split over the threads (input transform by tiles;
 * the 16 GEMMs by transform position and panel; output transform by tiles), so a block's
 * transformed input and products stay in L2/L3. C and K must be multiples of 8. */

/* The 16 transformed vectors of input channels c .. c + 7 of the patch whose top-left corner is
 * (y0, x0) (rows outside [0, H), columns outside [0, W) read as zeros), stored to V + e * vs for
 * e = 4 i + j: B^T d B with B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]. */
TGT static inline void wino_in(const float *X, long H, long W, long C, long y0, long x0, long c,
                               float *V, long vs)
{
    __m256 d[4][4], z = _mm256_setzero_ps();
    int inside = y0 >= 0 && x0 >= 0 && y0 + 4 <= H && x0 + 4 <= W;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            long y = y0 + i, x = x0 + j;
            d[i][j] = inside || (y >= 0 && y < H && x >= 0 && x < W)
                          ? _mm256_loadu_ps(X + (y * W + x) * C + c) : z;
        }
    __m256 t[4][4];
    for (int j = 0; j < 4; j++) {
        t[0][j] = _mm256_sub_ps(d[0][j], d[2][j]);
        t[1][j] = _mm256_add_ps(d[1][j], d[2][j]);
        t[2][j] = _mm256_sub_ps(d[2][j], d[1][j]);
        t[3][j] = _mm256_sub_ps(d[1][j], d[3][j]);
    }
    for (int i = 0; i < 4; i++) {
        float *v = V + 4 * i * vs + c;
        _mm256_storeu_ps(v, _mm256_sub_ps(t[i][0], t[i][2]));
        _mm256_storeu_ps(v + vs, _mm256_add_ps(t[i][1], t[i][2]));
        _mm256_storeu_ps(v + 2 * vs, _mm256_sub_ps(t[i][2], t[i][1]));
        _mm256_storeu_ps(v + 3 * vs, _mm256_sub_ps(t[i][1], t[i][3]));
    }
}

/* Output channels k .. k + 7 of the tile whose top-left output is (y0, x0) of image n, from
 * its 16 products M + e * ms: A^T m A with A^T = [1 1 1 0; 0 1 -1 -1], then + bias + R, the
 * activation, and stores of the outputs inside [0, Ho) x [0, Wo). */
TGT static inline void wino_out(const float *M, long ms, long Ho, long Wo, long K, long y0,
                                long x0, long k, const float *bias, const float *R, float *Y,
                                int act, float alpha, float beta)
{
    __m256 s[2][4];
    for (int j = 0; j < 4; j++) {
        __m256 m0 = _mm256_loadu_ps(M + j * ms + k), m1 = _mm256_loadu_ps(M + (4 + j) * ms + k),
               m2 = _mm256_loadu_ps(M + (8 + j) * ms + k),
               m3 = _mm256_loadu_ps(M + (12 + j) * ms + k);
        s[0][j] = _mm256_add_ps(_mm256_add_ps(m0, m1), m2);
        s[1][j] = _mm256_sub_ps(_mm256_sub_ps(m1, m2), m3);
    }
    __m256 b = bias ? _mm256_loadu_ps(bias + k) : _mm256_setzero_ps();
    __m256 y[2][2];
    for (int i = 0; i < 2; i++) {
        y[i][0] = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s[i][0], s[i][1]), s[i][2]), b);
        y[i][1] = _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(s[i][1], s[i][2]), s[i][3]), b);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) {
            long oy = y0 + i, ox = x0 + j;
            if (oy >= Ho || ox >= Wo) continue;
            long at = (oy * Wo + ox) * K + k;
            __m256 v = y[i][j];
            if (R) v = _mm256_add_ps(v, _mm256_loadu_ps(R + at));
            if (act) v = act256(v, act, alpha, beta);
            _mm256_storeu_ps(Y + at, v);
        }
}

long kiln_wino_packed_size(long C, long K)
{
    return 16 * kiln_sgemm_packed_size(C, K);
}

/* The conv weight Wt [K][C][3][3] transformed for Winograd, U = G g G^T for each filter g (in
 * double, rounded once; G = [1 0 0; 1/2 1/2 1/2; 1/2 -1/2 1/2; 0 0 1]), and packed as 16 GEMM
 * weights [C, K] one after another, for transform position e = 4 a + b. One row a of positions
 * at a time goes through a scratch of 4 C K floats. Returns 0, or -1 without scratch memory. */
int kiln_wino_pack(long C, long K, const float *Wt, float *out)
{
    static const double G[4][3] = {{1, 0, 0}, {0.5, 0.5, 0.5}, {0.5, -0.5, 0.5}, {0, 0, 1}};
    long size = kiln_sgemm_packed_size(C, K);
    float *u = scratch(4 * C * K);
    if (!u) return -1;
    for (int a = 0; a < 4; a++) {
        for (long k = 0; k < K; k++)
            for (long c = 0; c < C; c++) {
                const float *g = Wt + (k * C + c) * 9;
                double t[3];  /* row a of G g */
                for (int j = 0; j < 3; j++)
                    t[j] = G[a][0] * g[j] + G[a][1] * g[3 + j] + G[a][2] * g[6 + j];
                for (int b = 0; b < 4; b++)
                    u[(b * C + c) * K + k] = (float)(t[0] * G[b][0] + t[1] * G[b][1] +
                                                     t[2] * G[b][2]);
            }
        for (int b = 0; b < 4; b++)
            kiln_sgemm_pack(C, K, u + b * C * K, K, 1, out + (4 * a + b) * size);
    }
    free(u);
    return 0;
}

/* Y = act(conv3x3(X, W) + bias + R) as above, the image padded by pt rows on top and pl columns
 * on the left (Ho, Wo: the output's size, whatever padding that implies at the bottom and
 * right); Up: kiln_wino_pack's result; bias, R may be NULL; tb: tiles per block (<= 0: chosen
 * here). Returns 0, or -1 when scratch memory could not be had (Y is then incomplete). */
int kiln_wino3x3(long N, long H, long W, long C, long K, long Ho, long Wo, long pt, long pl,
                 const float *X, const float *Up, const float *bias, const float *R, float *Y,
                 int act, float alpha, float beta, long tb, int nthreads)
{
    long th = (Ho + 1) / 2, tw = (Wo + 1) / 2, T = N * th * tw;
    if (T <= 0 || C <= 0 || K <= 0) return 0;
    if (nthreads < 1) nthreads = 1;
    if (tb <= 0) {  /* the block's transformed input and products in about 1 MiB */
        tb = (1L << 20) / (16 * (C + K) * (long)sizeof(float));
        tb = tb < 16 ? 16 : tb / MR * MR;
    }
    if (tb > T) tb = T;
    long usize = kiln_sgemm_packed_size(C, K), panels = (K + NR - 1) / NR;
    /* the 16 matrices of a block one cache line more than their size apart: at a power-of-two
     * distance (tb C = 8192 floats) the transforms' 16 streams fall in one L1 set */
    long vs = tb * C + 16, ms = tb * K + 16;
    float *V = scratch(16 * vs), *M = scratch(16 * ms);
    if (!V || !M) {
        free(V); free(M);
        return -1;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        for (long t0 = 0; t0 < T; t0 += tb) {
            long nb = T - t0 < tb ? T - t0 : tb;
            for (long i = nb * t / nt; i < nb * (t + 1) / nt; i++) {
                long g = t0 + i, n = g / (th * tw), r = g % (th * tw);
                const float *x = X + n * H * W * C;
                for (long c = 0; c < C; c += 8)
                    wino_in(x, H, W, C, 2 * (r / tw) - pt, 2 * (r % tw) - pl, c, V + i * C, vs);
            }
#pragma omp barrier
            long items = 16 * panels, a = items * t / nt, b = items * (t + 1) / nt;
            while (a < b) {
                long e = a / panels, p0 = a % panels;
                long p1 = p0 + (b - a) < panels ? p0 + (b - a) : panels;
                block(0, nb, p0, p1, K, C, V + e * vs, C, Up + e * usize, NULL, NULL, 0,
                      M + e * ms, K, ACT_NONE, 0.0f, 0.0f);
                a += p1 - p0;
            }
#pragma omp barrier
            for (long i = nb * t / nt; i < nb * (t + 1) / nt; i++) {
                long g = t0 + i, n = g / (th * tw), r = g % (th * tw);
                long off = n * Ho * Wo * K;
                for (long k = 0; k < K; k += 8)
                    wino_out(M + i * K, ms, Ho, Wo, K, 2 * (r / tw), 2 * (r % tw), k, bias,
                             R ? R + off : NULL, Y + off, act, alpha, beta);
            }
#pragma omp barrier
        }
    }
    free(V); free(M);
    return 0;
}

/* ---- chains ---------------------------------------------------------------------------------
 * A straight run of GEMM and LayerNorm ops, encoded by kiln/engine/chains.py as longs, executed
 * in one call so that no Python or PyTorch code runs between them. An operand is a buffer index
 * (into bufs; -1: none), an element offset and a row stride; float parameters are in fp. */
enum { OP_GEMM = 1, OP_LN = 2, OP_ATTN = 3 };
#define GEMM_LEN 17 /* kind M N K a aoff lda w bias r roff ldr c coff ldc act fparam */
#define LN_LEN 12   /* kind M N x xoff ldx y yoff ldy gamma beta fparam */
#define ATTN_LEN 36 /* kind B H Hkv Sq Skv D Dv, (buf off b h s) for q k v, (buf off b h q k) for
                     * the bias, causal, fparam (scale), (buf off b h s) for y */

/* Returns n, or the position of the first op it does not know or could not run (nothing
 * from there on ran). */
long kiln_chain_run(const long *prog, long n, const float *fp, float *const *bufs, int nthreads)
{
#define PTR(b, off) ((b) >= 0 ? bufs[b] + (off) : NULL)
    long i = 0;
    while (i < n) {
        const long *p = prog + i;
        if (p[0] == OP_GEMM && i + GEMM_LEN <= n) {
            kiln_sgemm(p[1], p[2], p[3], PTR(p[4], p[5]), p[6], PTR(p[7], 0), PTR(p[8], 0),
                       PTR(p[9], p[10]), p[11], PTR(p[12], p[13]), p[14], (int)p[15],
                       fp[p[16]], fp[p[16] + 1], nthreads);
            i += GEMM_LEN;
        } else if (p[0] == OP_LN && i + LN_LEN <= n) {
            kiln_layernorm_to(p[1], p[2], PTR(p[3], p[4]), p[5], PTR(p[6], p[7]), p[8],
                              PTR(p[9], 0), PTR(p[10], 0), fp[p[11]], nthreads);
            i += LN_LEN;
        } else if (p[0] == OP_ATTN && i + ATTN_LEN <= n) {
            const long *q = p + 8, *k = q + 5, *v = k + 5, *bi = v + 5, *y = bi + 8;
            if (kiln_attention(p[1], p[2], p[3], p[4], p[5], p[6], p[7],
                               PTR(q[0], q[1]), q[2], q[3], q[4], PTR(k[0], k[1]), k[2], k[3], k[4],
                               PTR(v[0], v[1]), v[2], v[3], v[4],
                               PTR(bi[0], bi[1]), bi[2], bi[3], bi[4], bi[5], bi[6], fp[bi[7]],
                               PTR(y[0], y[1]), y[2], y[3], y[4], nthreads) != 0)
                return i;  /* out of memory */
            i += ATTN_LEN;
        } else {
            return i;
        }
    }
    return n;
#undef PTR
}
