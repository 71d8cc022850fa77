/* Shared by kiln's C kernels (one file per concept: gemm.c, layernorm.c, attention.c,
 * winograd.c, pointwise.c, pool.c, depthwise.c, conv.c, chain.c, rnn.c, llm.c, quant.c,
 * team.c; linked into one library, kiln/native/_kernels*.so): the register tile's geometry,
 * the AVX2 + FMA target attribute, the vector math the epilogues apply, scratch memory, and the
 * entry points the kernels call each other through. */
#ifndef KILN_KERNELS_H
#define KILN_KERNELS_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
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

TGT static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* dst[c * ldd + r] = src[r * ld + c] for an 8 x 8 block (gemm.c's packing, pointwise.c's
 * transposing copy). */
TGT static inline void transpose8(const float *src, long ld, float *dst, long ldd)
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

/* Activations, applied to the tile in registers (codes as in kiln/native/__init__.py).
 * ACT_HARD_SWISH_AFFINE: alpha * hardswish(x) + beta (an activation with a scale and shift
 * after it, PP-LCNetV3's); its code is clear of the pointwise ops' (10..17, 32..). */
enum { ACT_NONE, ACT_RELU, ACT_GELU, ACT_GELU_TANH, ACT_SIGMOID, ACT_SILU, ACT_TANH, ACT_CLIP,
       ACT_LEAKY_RELU, ACT_HARD_SWISH, ACT_HARD_SWISH_AFFINE = 20 };

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
    case ACT_HARD_SWISH_AFFINE: {
        __m256 g = _mm256_fmadd_ps(v, _mm256_set1_ps(1.0f / 6.0f), _mm256_set1_ps(0.5f));
        g = _mm256_min_ps(_mm256_set1_ps(1.0f), _mm256_max_ps(zero, g));
        return _mm256_fmadd_ps(_mm256_mul_ps(v, g), _mm256_set1_ps(alpha), _mm256_set1_ps(beta));
    }
    default: return v;
    }
}


/* The AVX-512 forms of exp256, sigmoid256 and act256 (the same operations in the same order, so
 * a value's bits are the AVX2 form's), for the float kernels' AVX-512 epilogues. GELU's two
 * forms run as two halves through act256 (their AVX2 code's blends have no one-op zmm form). */
#define TGT_ZMM __attribute__((target("avx512f,avx512dq,avx2,fma")))

TGT_ZMM static inline __m512 exp512(__m512 x)
{
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                   _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

TGT_ZMM static inline __m512 sigmoid512(__m512 x)
{
    __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

TGT_ZMM static inline __m512 act512(__m512 v, int act, float alpha, float beta)
{
    __m512 zero = _mm512_setzero_ps();
    switch (act) {
    case ACT_RELU: return _mm512_max_ps(zero, v);
    case ACT_SIGMOID: return sigmoid512(v);
    case ACT_SILU: return _mm512_mul_ps(v, sigmoid512(v));
    case ACT_TANH:
        return _mm512_fmsub_ps(_mm512_set1_ps(2.0f), sigmoid512(_mm512_add_ps(v, v)),
                               _mm512_set1_ps(1.0f));
    case ACT_CLIP:
        return _mm512_min_ps(_mm512_set1_ps(beta), _mm512_max_ps(_mm512_set1_ps(alpha), v));
    case ACT_LEAKY_RELU:
        return _mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), v,
                                  _mm512_set1_ps(alpha));
    case ACT_HARD_SWISH: {
        __m512 g = _mm512_fmadd_ps(v, _mm512_set1_ps(1.0f / 6.0f), _mm512_set1_ps(0.5f));
        g = _mm512_min_ps(_mm512_set1_ps(1.0f), _mm512_max_ps(zero, g));
        return _mm512_mul_ps(v, g);
    }
    case ACT_HARD_SWISH_AFFINE: {
        __m512 g = _mm512_fmadd_ps(v, _mm512_set1_ps(1.0f / 6.0f), _mm512_set1_ps(0.5f));
        g = _mm512_min_ps(_mm512_set1_ps(1.0f), _mm512_max_ps(zero, g));
        return _mm512_fmadd_ps(_mm512_mul_ps(v, g), _mm512_set1_ps(alpha), _mm512_set1_ps(beta));
    }
    case ACT_NONE: return v;
    default: {
        __m256 lo = act256(_mm512_castps512_ps256(v), act, alpha, beta);
        __m256 hi = act256(_mm512_extractf32x8_ps(v, 1), act, alpha, beta);
        return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
    }
    }
}

static inline float *scratch(long floats)
{
    size_t bytes = ((size_t)floats * sizeof(float) + 63) & ~(size_t)63;
    return (float *)aligned_alloc(64, bytes ? bytes : 64);
}

long kiln_sgemm_packed_size(long K, long N);
/* gemm.c: whether the float kernels take their AVX-512 paths (the CPU has it and
 * kiln_conv_set_isa did not pick AVX2) */
int kiln_use_avx512(void);
void kiln_sgemm_pack(long K, long N, const float *B, long sk, long sn, float *out);
/* Rows [m0, m1) and panels [p0, p1) of C = act(A @ Bp + bias + R), single-threaded (gemm.c). */
TGT void kiln_gemm_block(long m0, long m1, long p0, long p1, long N, long K, const float *A,
                         long lda, const float *Bp, const float *bias, const float *R, long ldr,
                         float *C, long ldc, int act, float alpha, float beta);
void kiln_sgemm(long M, long N, long K, const float *A, long lda, const float *Bp,
                const float *bias, const float *R, long ldr, float *C, long ldc, int act,
                float alpha, float beta, int nthreads);
void kiln_layernorm_to(long M, long N, const float *X, long ldx, float *Y, long ldy,
                       const float *gamma, const float *beta, float eps, int nthreads);
void kiln_rmsnorm_to(long M, long N, const float *X, long ldx, float *Y, long ldy,
                     const float *gamma, float eps, int nthreads);
int kiln_attention(long B, long H, long Hkv, long Sq, long Skv, long D, long Dv,
                   const float *Q, long qb, long qh, long qs,
                   const float *K, long kb, long kh, long ks,
                   const float *V, long vb, long vh, long vs,
                   const float *bias, long bb, long bh, long bq, long bk,
                   long causal, float scale, float *Y, long yb, long yh, long ys, int nthreads);
int kiln_wino3x3(long N, long H, long W, long C, long K, long Ho, long Wo, long pt, long pl,
                 const float *X, const float *Up, const float *bias, const float *R, float *Y,
                 int act, float alpha, float beta, long tb, int nthreads);
/* team.c: fn(ctx, i0, i1) over [0, n) in chunks on up to nthreads threads, the caller one of
 * them (kiln's own team: see team.c for why not an OpenMP region). */
typedef void (*kiln_range_fn)(void *ctx, long i0, long i1);
void kiln_parallel(long n, kiln_range_fn fn, void *ctx, int nthreads);
void kiln_team_rest(void);
#define PW_RANK 6 /* dims of an elementwise op's index space */
void kiln_pointwise(int op, int rank, const long *shape, float *y, const long *sy,
                    const float *a, const long *sa, const float *b, const long *sb, float p0,
                    float p1, int nthreads);
TGT void kiln_pool2d(int kind, const long *g, const float *x, const long *xs, float *y,
                     const long *ys, int nthreads);
TGT int kiln_conv(const long *g, const float *x, const float *wp, const float *bias,
                  const float *r, float *y, int act, float p0, float p1, int nthreads);
TGT void kiln_depthwise(const long *g, const float *x, const float *wp, const float *bias,
                        const float *r, float *y, int act, float p0, float p1, int nthreads);

/* quant.c: DynamicQuantizeLinear's codes, scale and zero point of n floats */
void kiln_dynamic_quantize(long n, const float *x, unsigned char *y, float *scale, float *zero,
                           int nthreads);
/* qconv.c: integer convolution of 8-bit codes (ConvInteger, ConvIntegerScaled) on VNNI */
int kiln_qconv(long batch, long C, long H, long W, const uint8_t *x, int x_signed, int x_zero,
               long OC, long kh, long kw, long sh, long sw, long ph, long pw, long dh, long dw,
               long OH, long OW, const uint8_t *A, int a_zero, const int32_t *wsum,
               const float *bias, float scale, void *out, int nthreads);
/* qconv.c: DynamicQuantizeLinear of a float32 input, then kiln_qconv's ConvIntegerScaled */
int kiln_dq_qconv(long batch, long C, long H, long W, const float *x, long OC, long kh, long kw,
                  long sh, long sw, long ph, long pw, long dh, long dw, long OH, long OW,
                  const uint8_t *A, int a_zero, const int32_t *wsum, const float *bias,
                  float w_scale, float *out, int nthreads);
/* quant.c: uint8 codes of float32 rows, by a given or (dynamic) their own scale and zero */
void kiln_quantize_rows(long M, long K, const float *x, long ldx, unsigned char *y,
                        float *scale, float *zero, int dynamic, int nthreads);

int kiln_qgemm_best_path(void);
/* qgemm.c: kiln_qgemm with an int32 added to each row's sums (qconv.c) */
int kiln_qgemm_rows(int path, long M, long N, long K, const uint8_t *A, long lda, int a_zero,
                    const void *B, const int32_t *colsum, const int32_t *row_add,
                    float a_scale, const float *w_scale, long w_scale_n, const float *bias,
                    const float *R, long ldr, int act, const float *ep, float *C, long ldc,
                    int nthreads);
/* qgemm.c: float32 rows quantized to uint8 (x_scale 0: by their own range), times an int8
 * weight packed by kiln_qgemm_pack, with its epilogue */
int kiln_qgemm_f32(int path, long M, long N, long K, const float *X, long ldx, float x_scale,
                   int x_zero, const void *B, const int *colsum, const float *w_scale,
                   long w_scale_n, const float *bias, const float *R, long ldr, int act,
                   const float *ep, float *C, long ldc, int nthreads);
/* qgemm.c: kiln_qgemm_f32 of a weight's integers B + col_off (uint8 codes beyond int8) */
int kiln_qgemm_f32_off(int path, long M, long N, long K, const float *X, long ldx,
                       float x_scale, int x_zero, const void *B, const int32_t *colsum,
                       int col_off, const float *w_scale, long w_scale_n, const float *bias,
                       const float *R, long ldr, int act, const float *ep, float *C, long ldc,
                       int nthreads);
/* qgemm.c: QDQ's DQ -> MatMul -> Q of two float32 activations as one integer batched matmul */
int kiln_qbmm_qdq(int path, const long *dims, const float *A, const long *sa, const float *B,
                  const long *sb, float *C, const long *sc, const float *qp, int nthreads);

#define RNN_FIELDS 37 /* kiln_rnn's long array (rnn.c's P_COUNT) */
#define RNN_RECORD_BUFS 7 /* program buffers a recurrent record names: xw x h0 c0 y yh yc */
TGT int kiln_rnn(const long *p, const float *f);
TGT int kiln_rnn_record(const long *rec, const float *fp, float *const *bufs, int nthreads);

#endif
