/* Direct convolution on NHWC tensors (one group), the bias, the residual and the activation
 * applied in registers: what a network's stem (3 input channels, 3x3, stride 2) and other
 * convolutions that are neither 1x1 (kiln's GEMM), 3x3 stride 1 (Winograd) nor depthwise
 * need. Any kernel size, stride, dilation and pads per side.
 *
 * The weight is packed [kh][kw][C][Kp] (kiln_conv_pack; Kp = K rounded up to whole vectors,
 * zeros past K), so a tap's weights for 8 output channels are one load. A register block is PX
 * output pixels x KV vectors of output channels: per (tap, input channel), KV weight loads and
 * PX broadcasts of the input feed PX * KV FMAs. Pixels whose window sticks out at the left or
 * right run one at a time with the taps checked. Work items are (image, output row, group of
 * KV output-channel vectors) on kiln's team (team.c).
 *
 * Where a pixel's window holds many values (kh kw C >= IM2COL_MIN: every conv but a tiny one)
 * the register block above, 12 FMAs per 7 loads, runs at a third of kiln's GEMM: a 3x3 stride-2
 * conv of 128 channels at 56x56 took 1.8 ms against onnxruntime's 0.5. There the conv is kiln's
 * GEMM (gemm.c) on the windows gathered into rows (im2col: row = output pixel, columns (ky, kx,
 * c)), the weight packed [kh kw C, K] into its panels; the rows are gathered a block at a time
 * (ROWS_L2 bytes of them, in L2 while the block's product reads them), or all at once where the
 * rows are too few to give every thread blocks (the product then splits the panels). */
#include "kernels.h"

#define PX 4
#define KV 3

#define IM2COL_MIN 32
#define ROWS_L2 (192L * 1024)
#define ROWS_TILE 8 /* a block's rows: whole AVX-512 tiles (gemm.c's 8 x 48) */

static int im2col(long C, long kh, long kw)
{
    return kh * kw * C >= IM2COL_MIN;
}

long kiln_conv_packed_size(long C, long K, long kh, long kw)
{
    if (im2col(C, kh, kw))
        return kiln_sgemm_packed_size(kh * kw * C, K);
    return kh * kw * C * ((K + 7) / 8 * 8);
}

/* w [K, C, kh, kw] -> out [kh][kw][C][Kp], or (im2col) GEMM panels of B [(ky, kx, c), K].
 * Returns -1 where the GEMM layout's staging copy cannot be allocated. */
int kiln_conv_pack(long C, long K, long kh, long kw, const float *w, float *out)
{
    long kp = (K + 7) / 8 * 8;
    if (im2col(C, kh, kw)) {
        long t = kh * kw;
        float *b = scratch(t * C * K);
        if (!b)
            return -1;
        /* the transpose in blocks of 16 output channels: each (c, i) writes 16 adjacent
         * floats, read from 16 rows of w that are each walked in order (was k outermost: every
         * write a new cache line, 0.5 GB/s on a 3x3 512 x 512 weight) */
        for (long k0 = 0; k0 < K; k0 += 16) {
            long kn = K - k0 < 16 ? K - k0 : 16;
            for (long c = 0; c < C; c++)
                for (long i = 0; i < t; i++) {
                    const float *src = w + (k0 * C + c) * t + i;
                    float *dst = b + (i * C + c) * K + k0;
                    for (long kk = 0; kk < kn; kk++)
                        dst[kk] = src[kk * C * t];
                }
        }
        kiln_sgemm_pack(t * C, K, b, K, 1, out);
        free(b);
        return 0;
    }
    for (long t = 0; t < kh * kw; t++)
        for (long c = 0; c < C; c++)
            for (long k = 0; k < kp; k++)
                out[(t * C + c) * kp + k] = k < K ? w[(k * C + c) * kh * kw + t] : 0.0f;
    return 0;
}

struct conv_job {
    const long *g;
    const float *x, *wp, *bias, *r;
    float *y;
    int act;
    float p0, p1;
};

TGT static inline __m256i kmask(long m)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6,
                                                                           7));
}

/* The epilogue and store of one pixel's nv vectors (output channels k0 .. k0 + 8 nv, the
 * last one cut at K). */
TGT static inline void put(const struct conv_job *j, long o, long k0, long K, int nv,
                           const __m256 *acc)
{
    for (int v = 0; v < nv; v++) {
        long k = k0 + 8 * v, m = K - k < 8 ? K - k : 8;
        __m256i mask = kmask(m);
        __m256 a = acc[v];
        if (j->bias)
            a = _mm256_add_ps(a, _mm256_maskload_ps(j->bias + k, mask));
        if (j->r)
            a = _mm256_add_ps(a, _mm256_maskload_ps(j->r + o + k, mask));
        a = act256(a, j->act, j->p0, j->p1);
        if (m == 8)
            _mm256_storeu_ps(j->y + o + k, a);
        else
            _mm256_maskstore_ps(j->y + o + k, mask, a);
    }
}

/* n pixels ow0 .. ow0 + n - 1 of row oh, all inside the width (n <= PX, nv <= KV: constants
 * after inlining); xrow: the input at (n, ih0, 0, 0). */
TGT static inline __attribute__((always_inline)) void conv_block(
    const struct conv_job *j, const float *xrow, long ih0, long ky0, long ky1, long ow0, long k0,
    int n, int nv)
{
    const long *g = j->g;
    long W = g[2], C = g[3], K = g[4], kw = g[8], sw = g[10], dh = g[11], dw = g[12];
    long pl = g[14], kp = (K + 7) / 8 * 8;
    __m256 acc[PX][KV];
    for (int p = 0; p < n; p++)
        for (int v = 0; v < nv; v++)
            acc[p][v] = _mm256_setzero_ps();
    /* with dilation 1 a row's taps and channels are kw * C consecutive floats of x and of the
     * packed weight: one loop (a stem's 3 x 3 channels is 9 steps, not 3 of 3) */
    long runs = dw == 1 ? 1 : kw, len = dw == 1 ? kw * C : C;
    for (long ky = ky0; ky < ky1; ky++) {
        const float *xr = xrow + (ih0 + ky * dh) * W * C;
        for (long kx = 0; kx < runs; kx++) {
            const float *xp = xr + (ow0 * sw - pl + kx * dw) * C;
            const float *wt = j->wp + (ky * kw + kx) * C * kp + k0;
            for (long c = 0; c < len; c++) {
                __m256 wv[KV];
                for (int v = 0; v < nv; v++)
                    wv[v] = _mm256_loadu_ps(wt + c * kp + 8 * v);
                for (int p = 0; p < n; p++) {
                    __m256 xv = _mm256_broadcast_ss(xp + p * sw * C + c);
                    for (int v = 0; v < nv; v++)
                        acc[p][v] = _mm256_fmadd_ps(xv, wv[v], acc[p][v]);
                }
            }
        }
    }
    for (int p = 0; p < n; p++)
        put(j, (ow0 + p) * K, k0, K, nv, acc[p]);
}

/* One pixel whose window may stick out left or right. */
TGT static void conv_edge(const struct conv_job *j, const float *xrow, long ih0, long ky0,
                          long ky1, long ow, long k0, int nv)
{
    const long *g = j->g;
    long W = g[2], C = g[3], K = g[4], kw = g[8], sw = g[10], dh = g[11], dw = g[12];
    long pl = g[14], kp = (K + 7) / 8 * 8;
    __m256 acc[KV] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long ky = ky0; ky < ky1; ky++) {
        const float *xr = xrow + (ih0 + ky * dh) * W * C;
        for (long kx = 0; kx < kw; kx++) {
            long iw = ow * sw - pl + kx * dw;
            if (iw < 0 || iw >= W)
                continue;
            const float *wt = j->wp + (ky * kw + kx) * C * kp + k0;
            for (long c = 0; c < C; c++) {
                __m256 xv = _mm256_broadcast_ss(xr + iw * C + c);
                for (int v = 0; v < nv; v++)
                    acc[v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(wt + c * kp + 8 * v), acc[v]);
            }
        }
    }
    put(j, ow * K, k0, K, nv, acc);
}

/* The AVX2 blocks of many pixels, accumulators named (REP macros, as for AVX-512 below; an
 * array of them was kept in memory, a store after every FMA): 4 pixels x 3 vectors, 6 x 2 and
 * 8 x 1, so that a group of one or two vectors (a stem's 32 filters are 24 + 8) still has 8 or
 * 12 FMAs in flight; LEN 9 (3 channels, 3x3) unrolls the channel loop whole. */
#define REPA4(M) M(0) M(1) M(2) M(3)
#define REPA6(M) REPA4(M) M(4) M(5)
#define REPA8(M) REPA6(M) M(6) M(7)
#define YDECL(p) __m256 b##p##_0 = _mm256_setzero_ps(), b##p##_1 = b##p##_0, b##p##_2 = b##p##_0;
#define YFMA(p)                                                           \
    {                                                                     \
        __m256 xv = _mm256_broadcast_ss(xp + (p) * step + c);             \
        b##p##_0 = _mm256_fmadd_ps(xv, w0, b##p##_0);                     \
        if (nv_ > 1)                                                      \
            b##p##_1 = _mm256_fmadd_ps(xv, w1, b##p##_1);                 \
        if (nv_ > 2)                                                      \
            b##p##_2 = _mm256_fmadd_ps(xv, w2, b##p##_2);                 \
    }
#define YPUT(p)                                                           \
    {                                                                     \
        __m256 acc[KV] = {b##p##_0, b##p##_1, b##p##_2};                  \
        put(j, (ow0 + (p)) * K, k0, K, nv_, acc);                         \
    }

#define BLOCK256(NAME, REP, NV, LEN)                                                        \
    TGT static void NAME(const struct conv_job *j, const float *xrow, long ih0, long ky0,    \
                         long ky1, long ow0, long k0)                                       \
    {                                                                                       \
        const long *g = j->g;                                                               \
        long W = g[2], C = g[3], K = g[4], kw = g[8], sw = g[10], dh = g[11], dw = g[12];  \
        long pl = g[14], kp = (K + 7) / 8 * 8, step = sw * C;                               \
        long runs = dw == 1 ? 1 : kw, len = (LEN) ? (LEN) : (dw == 1 ? kw * C : C);         \
        const int nv_ = NV;                                                                 \
        REP(YDECL)                                                                          \
        for (long ky = ky0; ky < ky1; ky++) {                                               \
            const float *xr = xrow + (ih0 + ky * dh) * W * C;                               \
            for (long kx = 0; kx < runs; kx++) {                                            \
                const float *xp = xr + (ow0 * sw - pl + kx * dw) * C;                       \
                const float *wt = j->wp + (ky * kw + kx) * C * kp + k0;                     \
                for (long c = 0; c < len; c++) {                                            \
                    __m256 w0 = _mm256_loadu_ps(wt + c * kp);                               \
                    __m256 w1 = nv_ > 1 ? _mm256_loadu_ps(wt + c * kp + 8) : w0;            \
                    __m256 w2 = nv_ > 2 ? _mm256_loadu_ps(wt + c * kp + 16) : w0;           \
                    REP(YFMA)                                                               \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        REP(YPUT)                                                                           \
    }

BLOCK256(blk4x3_9, REPA4, 3, 9)
BLOCK256(blk4x3, REPA4, 3, 0)
BLOCK256(blk6x2_9, REPA6, 2, 9)
BLOCK256(blk6x2, REPA6, 2, 0)
BLOCK256(blk8x1_9, REPA8, 1, 9)
BLOCK256(blk8x1, REPA8, 1, 0)

#define BLOCKS(NV, P, BIG, BIG9)                                                   \
    do {                                                                           \
        for (; ow < lo; ow++)                                                      \
            conv_edge(j, xrow, ih0, ky0, ky1, ow, k0, NV);                         \
        for (; ow + (P) <= hi; ow += (P))                                          \
            (len9 ? BIG9 : BIG)(j, xrow, ih0, ky0, ky1, ow, k0);                   \
        for (; ow < hi; ow++)                                                      \
            conv_block(j, xrow, ih0, ky0, ky1, ow, k0, 1, NV);                     \
        for (; ow < Wo; ow++)                                                      \
            conv_edge(j, xrow, ih0, ky0, ky1, ow, k0, NV);                         \
    } while (0)

/* Items [i0, i1) of (image, output row, group of KV output-channel vectors). */
TGT static void conv_items(void *arg, long i0, long i1)
{
    const struct conv_job *job = arg;
    const long *g = job->g;
    long H = g[1], W = g[2], C = g[3], K = g[4], Ho = g[5], Wo = g[6], kh = g[7], kw = g[8];
    long sh = g[9], sw = g[10], dh = g[11], dw = g[12], pt = g[13], pl = g[14];
    long groups = ((K + 7) / 8 + KV - 1) / KV;
    /* interior: ow * sw - pl >= 0 and ow * sw - pl + (kw - 1) dw <= W - 1 */
    long lo = (pl + sw - 1) / sw, last = W - 1 + pl - (kw - 1) * dw;
    long hi = last < 0 ? 0 : last / sw + 1;
    if (hi > Wo)
        hi = Wo;
    if (lo > hi)
        lo = hi;
    for (long it = i0; it < i1; it++) {
        long n = it / (Ho * groups), oh = it / groups % Ho, k0 = it % groups * 8 * KV;
        long nv = ((K - k0) + 7) / 8 < KV ? ((K - k0) + 7) / 8 : KV;
        long ih0 = oh * sh - pt, ky0 = 0, ky1 = kh;
        while (ky0 < kh && ih0 + ky0 * dh < 0)
            ky0++;
        while (ky1 > ky0 && ih0 + (ky1 - 1) * dh >= H)
            ky1--;
        const float *xrow = job->x + n * H * W * C;
        struct conv_job row = *job;  /* y and r from this output row on */
        row.y = job->y + (n * Ho + oh) * Wo * K;
        row.r = job->r ? job->r + (n * Ho + oh) * Wo * K : NULL;
        const struct conv_job *j = &row;
        long ow = 0;
        int len9 = (dw == 1 ? kw * C : C) == 9;
        if (nv == 3)
            BLOCKS(3, 4, blk4x3, blk4x3_9);
        else if (nv == 2)
            BLOCKS(2, 6, blk6x2, blk6x2_9);
        else
            BLOCKS(1, 8, blk8x1, blk8x1_9);
    }
}

/* AVX-512 (where kiln_use_avx512 says so): a register block of n <= 16 pixels x nz <= 2 zmm of
 * 16 output channels (a group of 32: a stem's 32 filters are one group, 16 and 24 are one
 * group with the last vector masked), per (tap, input channel) nz weight loads and n
 * broadcasts for n nz FMAs, against the AVX2 block's 4 x 3 ymm. len (a row's taps times the
 * channels: 9 for a 3-channel 3x3 stem) is a constant where the caller dispatches it, so the
 * inner loop unrolls whole. The masked weight loads read no float past a packed row's Kp. */
#define PXZ 12 /* pixels per block at 2 vectors (24 accumulators); 16 at 1 */

/* The accumulators are named variables, one per (pixel, vector), made by the REP macros: gcc
 * kept an array of them in memory, storing each after its FMA (as gemm.c's tiles note). */
#define REP1(M) M(0)
#define REP4(M) M(0) M(1) M(2) M(3)
#define REP12(M) REP4(M) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define REP16(M) REP12(M) M(12) M(13) M(14) M(15)
#define ZDECL(p) __m512 a##p##_0 = _mm512_setzero_ps(), a##p##_1 = a##p##_0;
#define ZFMA(p)                                                           \
    {                                                                     \
        __m512 xv = _mm512_set1_ps(xp[(p) * step + c]);                   \
        a##p##_0 = _mm512_fmadd_ps(xv, w0, a##p##_0);                     \
        if (nz_ > 1)                                                      \
            a##p##_1 = _mm512_fmadd_ps(xv, w1, a##p##_1);                 \
    }
#define ZPUT(p) put512(j, (ow0 + (p)) * K + k0, nz_, a##p##_0, a##p##_1, bv0, bv1, m0, m1);

/* The epilogue and store of one pixel's nz vectors (output channels k0 .. k0 + 16 nz, masked). */
TGT_ZMM static inline __attribute__((always_inline)) void put512(
    const struct conv_job *j, long o, int nz, __m512 a0, __m512 a1, __m512 bv0, __m512 bv1,
    __mmask16 m0, __mmask16 m1)
{
    __m512 a[2] = {_mm512_add_ps(a0, bv0), _mm512_add_ps(a1, bv1)};
    for (int v = 0; v < nz; v++) {
        __mmask16 m = v ? m1 : m0;
        if (j->r)
            a[v] = _mm512_add_ps(a[v], _mm512_maskz_loadu_ps(m, j->r + o + 16 * v));
        _mm512_mask_storeu_ps(j->y + o + 16 * v, m, act512(a[v], j->act, j->p0, j->p1));
    }
}

/* n pixels (REP) x NZ vectors from ow0, all inside the width; LEN: a row's taps times channels
 * (0: not a constant, len is). */
#define BLOCK512(NAME, REP, NZ, LEN)                                                        \
    TGT_ZMM static void NAME(const struct conv_job *j, const float *xrow, long ih0, long ky0, \
                             long ky1, long ow0, long k0, long len_, __mmask16 m0,          \
                             __mmask16 m1)                                                  \
    {                                                                                       \
        const long *g = j->g;                                                               \
        long W = g[2], C = g[3], K = g[4], kw = g[8], sw = g[10], dh = g[11], dw = g[12];  \
        long pl = g[14], kp = (K + 7) / 8 * 8, step = sw * C;                               \
        long len = (LEN) ? (LEN) : len_, runs = dw == 1 ? 1 : kw;                          \
        const int nz_ = NZ;                                                                 \
        REP(ZDECL)                                                                          \
        for (long ky = ky0; ky < ky1; ky++) {                                               \
            const float *xr = xrow + (ih0 + ky * dh) * W * C;                               \
            for (long kx = 0; kx < runs; kx++) {                                            \
                const float *xp = xr + (ow0 * sw - pl + kx * dw) * C;                       \
                const float *wt = j->wp + (ky * kw + kx) * C * kp + k0;                     \
                for (long c = 0; c < len; c++) {                                            \
                    __m512 w0 = _mm512_maskz_loadu_ps(m0, wt + c * kp);                     \
                    __m512 w1 = NZ > 1 ? _mm512_maskz_loadu_ps(m1, wt + c * kp + 16) : w0;  \
                    REP(ZFMA)                                                               \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        __m512 bv0 = j->bias ? _mm512_maskz_loadu_ps(m0, j->bias + k0) : _mm512_setzero_ps(); \
        __m512 bv1 = j->bias && NZ > 1 ? _mm512_maskz_loadu_ps(m1, j->bias + k0 + 16)        \
                                       : _mm512_setzero_ps();                               \
        REP(ZPUT)                                                                           \
    }

BLOCK512(blk12x2_9, REP12, 2, 9)
BLOCK512(blk16x1_9, REP16, 1, 9)
BLOCK512(blk12x2, REP12, 2, 0)
BLOCK512(blk16x1, REP16, 1, 0)
BLOCK512(blk4x2, REP4, 2, 0)
BLOCK512(blk4x1, REP4, 1, 0)
BLOCK512(blk1x2, REP1, 2, 0)
BLOCK512(blk1x1, REP1, 1, 0)

/* One row's pixels [ow, hi) (inside the width) in AVX-512 blocks. */
TGT_ZMM static long row512(const struct conv_job *j, const float *xrow, long ih0, long ky0,
                           long ky1, long ow, long hi, long k0, int nz, long len, __mmask16 m0,
                           __mmask16 m1)
{
#define ARGS j, xrow, ih0, ky0, ky1, ow, k0, len, m0, m1
    if (nz == 2) {  /* a 3-channel 3x3 stem (len 9): the channel loop unrolled whole */
        for (; ow + PXZ <= hi; ow += PXZ)
            len == 9 ? blk12x2_9(ARGS) : blk12x2(ARGS);
        for (; ow + 4 <= hi; ow += 4)
            blk4x2(ARGS);
        for (; ow < hi; ow++)
            blk1x2(ARGS);
    } else {
        for (; ow + 16 <= hi; ow += 16)
            len == 9 ? blk16x1_9(ARGS) : blk16x1(ARGS);
        for (; ow + 4 <= hi; ow += 4)
            blk4x1(ARGS);
        for (; ow < hi; ow++)
            blk1x1(ARGS);
    }
#undef ARGS
    return ow;
}

/* The edge pixels of a 32-channel group: conv_edge's AVX2 vectors, 3 at a time. */
TGT static void edge_group(const struct conv_job *j, const float *xrow, long ih0, long ky0,
                           long ky1, long ow, long k0, long k1)
{
    for (long k = k0; k < k1; k += 8 * KV) {
        long nv = (k1 - k + 7) / 8 < KV ? (k1 - k + 7) / 8 : KV;
        if (nv == 3)
            conv_edge(j, xrow, ih0, ky0, ky1, ow, k, 3);
        else if (nv == 2)
            conv_edge(j, xrow, ih0, ky0, ky1, ow, k, 2);
        else
            conv_edge(j, xrow, ih0, ky0, ky1, ow, k, 1);
    }
}

/* Items [i0, i1) of (image, output row, group of 32 output channels), AVX-512. */
TGT_ZMM static void conv_items512(void *arg, long i0, long i1)
{
    const struct conv_job *job = arg;
    const long *g = job->g;
    long H = g[1], W = g[2], C = g[3], K = g[4], Ho = g[5], Wo = g[6], kh = g[7], kw = g[8];
    long sh = g[9], sw = g[10], dh = g[11], dw = g[12], pt = g[13], pl = g[14];
    long groups = (K + 31) / 32, len = dw == 1 ? kw * C : C;
    long lo = (pl + sw - 1) / sw, last = W - 1 + pl - (kw - 1) * dw;
    long hi = last < 0 ? 0 : last / sw + 1;
    if (hi > Wo)
        hi = Wo;
    if (lo > hi)
        lo = hi;
    for (long it = i0; it < i1; it++) {
        long n = it / (Ho * groups), oh = it / groups % Ho, k0 = it % groups * 32;
        long k1 = k0 + 32 < K ? k0 + 32 : K, left = k1 - k0;
        int nz = left > 16 ? 2 : 1;
        __mmask16 m0 = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __mmask16 m1 = left >= 32 ? (__mmask16)0xFFFF
                       : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
        long ih0 = oh * sh - pt, ky0 = 0, ky1 = kh;
        while (ky0 < kh && ih0 + ky0 * dh < 0)
            ky0++;
        while (ky1 > ky0 && ih0 + (ky1 - 1) * dh >= H)
            ky1--;
        const float *xrow = job->x + n * H * W * C;
        struct conv_job row = *job;
        row.y = job->y + (n * Ho + oh) * Wo * K;
        row.r = job->r ? job->r + (n * Ho + oh) * Wo * K : NULL;
        const struct conv_job *j = &row;
        long ow = 0;
        for (; ow < lo; ow++)
            edge_group(j, xrow, ih0, ky0, ky1, ow, k0, k1);
        ow = row512(j, xrow, ih0, ky0, ky1, ow, hi, k0, nz, len, m0, m1);
        for (; ow < Wo; ow++)
            edge_group(j, xrow, ih0, ky0, ky1, ow, k0, k1);
    }
}

struct gather_job {
    const long *g;
    const float *x, *wp, *bias, *r;
    float *y, *rows;  /* rows: all of them (gather_items), else NULL (each block its own) */
    long block;        /* output pixels per block */
    int act, nthreads;
    float p0, p1;
};

/* Output pixels [m0, m1) (over N Ho Wo) as rows of kh kw C values: their windows, zero where
 * a tap is in the padding. */
static void gather(const long *g, const float *x, long m0, long m1, float *rows)
{
    long H = g[1], W = g[2], C = g[3], Ho = g[5], Wo = g[6], kh = g[7], kw = g[8];
    long sh = g[9], sw = g[10], dh = g[11], dw = g[12], pt = g[13], pl = g[14];
    long len = kh * kw * C;
    for (long m = m0; m < m1; m++) {
        long n = m / (Ho * Wo), oh = m / Wo % Ho, ow = m % Wo;
        long ih0 = oh * sh - pt, iw0 = ow * sw - pl;
        float *d = rows + (m - m0) * len;
        const float *xn = x + n * H * W * C;
        int inside = iw0 >= 0 && iw0 + (kw - 1) * dw < W;
        for (long ky = 0; ky < kh; ky++, d += kw * C) {
            long ih = ih0 + ky * dh;
            if (ih < 0 || ih >= H) {
                memset(d, 0, (size_t)(kw * C) * sizeof(float));
                continue;
            }
            const float *xr = xn + (ih * W + iw0) * C;
            if (inside && dw == 1) {  /* the row's taps: one run of kw C floats */
                memcpy(d, xr, (size_t)(kw * C) * sizeof(float));
                continue;
            }
            for (long kx = 0; kx < kw; kx++) {
                long iw = iw0 + kx * dw;
                if (iw < 0 || iw >= W)
                    memset(d + kx * C, 0, (size_t)C * sizeof(float));
                else
                    memcpy(d + kx * C, xr + kx * dw * C, (size_t)C * sizeof(float));
            }
        }
    }
}

static void gather_items(void *arg, long i0, long i1)
{
    const struct gather_job *j = arg;
    long len = j->g[7] * j->g[8] * j->g[3];
    gather(j->g, j->x, i0, i1, j->rows + i0 * len);
}

/* Blocks [i0, i1) of output pixels: each gathered into this chunk's scratch, then its product
 * over every panel. */
static void block_items(void *arg, long i0, long i1)
{
    const struct gather_job *j = arg;
    const long *g = j->g;
    long M = g[0] * g[5] * g[6], K = g[4], len = g[7] * g[8] * g[3];
    float *rows = j->rows;
    float *own = rows ? NULL : scratch(j->block * len);
    for (long b = i0; b < i1; b++) {
        long m0 = b * j->block, m1 = m0 + j->block < M ? m0 + j->block : M;
        if (own) {
            gather(g, j->x, m0, m1, own);
            kiln_gemm_block(0, m1 - m0, 0, (K + NR - 1) / NR, K, len, own, len, j->wp,
                            j->bias, j->r ? j->r + m0 * K : NULL, K, j->y + m0 * K, K,
                            j->act, j->p0, j->p1);
        } else {  /* no scratch: one row at a time, on the stack's worth of it */
            for (long m = m0; m < m1; m++) {
                float row[len];
                gather(g, j->x, m, m + 1, row);
                kiln_gemm_block(0, 1, 0, (K + NR - 1) / NR, K, len, row, len, j->wp, j->bias,
                                j->r ? j->r + m * K : NULL, K, j->y + m * K, K, j->act, j->p0,
                                j->p1);
            }
        }
    }
    free(own);
}

/* The conv as kiln's GEMM on gathered windows (the file's comment). Returns -1 where the
 * rows' scratch cannot be allocated. */
static int conv_im2col(const long *g, const float *x, const float *wp, const float *bias,
                       const float *r, float *y, int act, float p0, float p1, int nthreads)
{
    long M = g[0] * g[5] * g[6], K = g[4], len = g[7] * g[8] * g[3];
    long block = ROWS_L2 / (len * (long)sizeof(float)) / ROWS_TILE * ROWS_TILE;
    if (block < ROWS_TILE)
        block = ROWS_TILE;
    if (block > MC)
        block = MC;
    long blocks = (M + block - 1) / block;
    struct gather_job j = {g, x, wp, bias, r, y, NULL, block, act, nthreads, p0, p1};
    if (nthreads > 1 && blocks < 2L * nthreads && M * K * len >= (1L << 18)) {
        float *rows = scratch(M * len);  /* few rows: gathered whole, the product threaded */
        if (!rows)
            return -1;
        j.rows = rows;
        kiln_parallel(M, gather_items, &j, nthreads);
        kiln_sgemm(M, K, len, rows, len, wp, bias, r, K, y, K, act, p0, p1, nthreads);
        free(rows);
        return 0;
    }
    int nt = M * K * len >= (1L << 16) ? nthreads : 1;
    kiln_parallel(blocks, block_items, &j, nt);
    return 0;
}

/* g: N H W C K Ho Wo kh kw sh sw dh dw pt pl (bottom and right pads: what Ho, Wo imply).
 * x [N, H, W, C], r and y [N, Ho, Wo, K], contiguous; wp packed by kiln_conv_pack; bias [K]
 * or NULL, r or NULL. Returns -1 where the im2col path's scratch cannot be allocated. */
TGT int kiln_conv(const long *g, const float *x, const float *wp, const float *bias,
                  const float *r, float *y, int act, float p0, float p1, int nthreads)
{
    long N = g[0], C = g[3], K = g[4], Ho = g[5], Wo = g[6], kh = g[7], kw = g[8];
    if (im2col(C, kh, kw))
        return conv_im2col(g, x, wp, bias, r, y, act, p0, p1, nthreads);
    struct conv_job j = {g, x, wp, bias, r, y, act, p0, p1};
    int nt = N * Ho * Wo * K * C * kh * kw >= (1L << 16) ? nthreads : 1;
    if (kiln_use_avx512()) {
        kiln_parallel(N * Ho * ((K + 31) / 32), conv_items512, &j, nt);
        return 0;
    }
    long groups = ((K + 7) / 8 + KV - 1) / KV;
    kiln_parallel(N * Ho * groups, conv_items, &j, nt);
    return 0;
}
