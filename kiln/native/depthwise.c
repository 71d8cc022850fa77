/* Depthwise convolution (one input channel per output channel) on NHWC tensors, the bias,
 * the residual and the activation applied in registers. Pads are given per side, so an
 * explicit Pad folded into the conv (TF-style "same" padding, often asymmetric) costs nothing.
 * The weight is packed [kh][kw][C] (kiln_dw_pack), so that a vector of 8 channels of one tap is
 * one load.
 *
 * Work is split into (image, output row, 8-channel block) items, so that a map of few rows
 * (a text line's 3 x 96) still spreads over the threads (kiln's team, team.c). Inside an
 * item, output pixels whose window lies wholly inside the row's width run PX at a time: each
 * tap's weight vector is loaded once for PX accumulators (one load per FMA was the old
 * kernel's bound); the pixels at the left and right borders, whose windows stick out, run one
 * at a time. */
#include "kernels.h"

#define PX 8 /* output pixels per block of the interior */

void kiln_dw_pack(long C, long kh, long kw, const float *w, float *out)
{
    for (long c = 0; c < C; c++)
        for (long k = 0; k < kh * kw; k++)
            out[k * C + c] = w[c * kh * kw + k];  /* from [C, 1, kh, kw] */
}

TGT static inline __m256i tail_mask(long m)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6,
                                                                           7));
}

/* A vector of 8 channels, or the first m of them (mask) at the last block. */
TGT static inline __m256 ld(const float *p, int full, __m256i mask)
{
    return full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask);
}

TGT static inline void st(float *p, __m256 v, int full, __m256i mask)
{
    if (full)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, mask, v);
}

struct dw_row {  /* one item's geometry: the input row base, the taps in range, the epilogue */
    const float *xn, *wp, *r;
    float *y;
    long W, C, kw, sw, dw, pl, ih0, dh, ky0, ky1;
    int act;
    float p0, p1;
};

/* n output pixels (ow0, ow0 + 1, ...) whose windows are inside the width: n <= PX, a constant
 * after inlining. */
TGT static inline __attribute__((always_inline)) void dw_block(const struct dw_row *q, long ow0,
                                                                long c, int n, __m256 b0, int full,
                                                                __m256i mask)
{
    __m256 acc[PX];
    for (int j = 0; j < n; j++)
        acc[j] = b0;
    long step = q->sw * q->C;
    for (long ky = q->ky0; ky < q->ky1; ky++) {
        const float *xr = q->xn + (q->ih0 + ky * q->dh) * q->W * q->C + c;
        const float *wr = q->wp + ky * q->kw * q->C + c;
        for (long kx = 0; kx < q->kw; kx++) {
            __m256 wv = ld(wr + kx * q->C, full, mask);
            const float *xp = xr + (ow0 * q->sw - q->pl + kx * q->dw) * q->C;
            for (int j = 0; j < n; j++)
                acc[j] = _mm256_fmadd_ps(ld(xp + j * step, full, mask), wv, acc[j]);
        }
    }
    for (int j = 0; j < n; j++) {
        long o = (ow0 + j) * q->C + c;
        __m256 v = acc[j];
        if (q->r)
            v = _mm256_add_ps(v, ld(q->r + o, full, mask));
        st(q->y + o, act256(v, q->act, q->p0, q->p1), full, mask);
    }
}

/* One output pixel whose window may stick out left or right. */
TGT static inline void dw_edge(const struct dw_row *q, long ow, long c, __m256 b0, int full,
                               __m256i mask)
{
    __m256 acc = b0;
    for (long ky = q->ky0; ky < q->ky1; ky++) {
        const float *xr = q->xn + (q->ih0 + ky * q->dh) * q->W * q->C + c;
        for (long kx = 0; kx < q->kw; kx++) {
            long iw = ow * q->sw - q->pl + kx * q->dw;
            if (iw < 0 || iw >= q->W)
                continue;
            acc = _mm256_fmadd_ps(ld(xr + iw * q->C, full, mask),
                                  ld(q->wp + (ky * q->kw + kx) * q->C + c, full, mask), acc);
        }
    }
    long o = ow * q->C + c;
    if (q->r)
        acc = _mm256_add_ps(acc, ld(q->r + o, full, mask));
    st(q->y + o, act256(acc, q->act, q->p0, q->p1), full, mask);
}

TGT static void dw_item(const struct dw_row *q, long Wo, long c, const float *bias)
{
    long m = q->C - c < 8 ? q->C - c : 8;
    int full = m == 8;
    __m256i mask = tail_mask(m);
    __m256 b0 = bias ? ld(bias + c, full, mask) : _mm256_setzero_ps();
    /* interior: ow * sw - pl >= 0 and ow * sw - pl + (kw - 1) dw <= W - 1 */
    long lo = (q->pl + q->sw - 1) / q->sw;
    long last = q->W - 1 + q->pl - (q->kw - 1) * q->dw;
    long hi = last < 0 ? 0 : last / q->sw + 1;
    if (hi > Wo)
        hi = Wo;
    if (lo > hi)
        lo = hi;
    long ow = 0;
    for (; ow < lo; ow++)
        dw_edge(q, ow, c, b0, full, mask);
    if (full) {
        for (; ow + PX <= hi; ow += PX)
            dw_block(q, ow, c, PX, b0, 1, mask);
        for (; ow + 4 <= hi; ow += 4)
            dw_block(q, ow, c, 4, b0, 1, mask);
        for (; ow < hi; ow++)
            dw_block(q, ow, c, 1, b0, 1, mask);
    } else {
        for (; ow + 4 <= hi; ow += 4)
            dw_block(q, ow, c, 4, b0, 0, mask);
        for (; ow < hi; ow++)
            dw_block(q, ow, c, 1, b0, 0, mask);
    }
    for (; ow < Wo; ow++)
        dw_edge(q, ow, c, b0, full, mask);
}

struct dw_job {
    const long *g;
    const float *x, *wp, *bias, *r;
    float *y;
    int act;
    float p0, p1;
};

/* Items [i0, i1) of (image, output row, 8-channel block). */
TGT static void dw_items(void *arg, long i0, long i1)
{
    const struct dw_job *j = arg;
    const long *g = j->g;
    long H = g[1], W = g[2], C = g[3], Ho = g[4], Wo = g[5], kh = g[6], kw = g[7];
    long sh = g[8], sw = g[9], dh = g[10], dw = g[11], pt = g[12], pl = g[13];
    long cb = (C + 7) / 8;
    for (long it = i0; it < i1; it++) {
        long n = it / (Ho * cb), oh = it / cb % Ho, c = it % cb * 8;
        struct dw_row q = {j->x + n * H * W * C, j->wp,
                           j->r ? j->r + (n * Ho + oh) * Wo * C : NULL,
                           j->y + (n * Ho + oh) * Wo * C, W, C, kw, sw, dw, pl, oh * sh - pt, dh,
                           0, kh, j->act, j->p0, j->p1};
        while (q.ky0 < kh && q.ih0 + q.ky0 * dh < 0)  /* taps whose row is inside the image */
            q.ky0++;
        while (q.ky1 > q.ky0 && q.ih0 + (q.ky1 - 1) * dh >= H)
            q.ky1--;
        dw_item(&q, Wo, c, j->bias);
    }
}

/* g: N H W C Ho Wo kh kw sh sw dh dw pt pl (the bottom and right pads are what Ho, Wo imply).
 * x [N, H, W, C], r and y [N, Ho, Wo, C], contiguous; bias [C] or NULL, r or NULL. */
TGT void kiln_depthwise(const long *g, const float *x, const float *wp, const float *bias,
                        const float *r, float *y, int act, float p0, float p1, int nthreads)
{
    long N = g[0], C = g[3], Ho = g[4], Wo = g[5], kh = g[6], kw = g[7];
    struct dw_job j = {g, x, wp, bias, r, y, act, p0, p1};
    int nt = N * Ho * Wo * C * kh * kw >= (1L << 15) ? nthreads : 1;
    kiln_parallel(N * Ho * ((C + 7) / 8), dw_items, &j, nt);
}
