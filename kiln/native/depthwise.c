/* Depthwise convolution (one input channel per output channel) on NHWC tensors, the bias,
 * the residual and the activation applied in registers. Pads are given per side, so an
 * explicit Pad folded into the conv (TF-style "same" padding, often asymmetric) costs nothing.
 * The weight is packed [kh][kw][C] (kiln_dw_pack), so that a vector of channels of one tap is
 * one load.
 *
 * Work is split into (image, output row, channel block) items, so that a map of few rows (a
 * text line's 3 x 96) still spreads over the threads (kiln's team, team.c); a block is 8
 * channels (AVX2) or 16 (AVX-512, where kiln_use_avx512 says so). Inside an item, output
 * pixels whose window lies wholly inside the row's width run in blocks; the pixels at the left
 * and right borders, whose windows stick out, one at a time with the taps checked (dw_edge*).
 * - AVX2: blocks of PX = 8, 4, 1 pixels, each tap's weight vector loaded once for the block's
 *   pixels (one load per FMA was the kernel before that's bound).
 * - AVX-512: blocks of PXZ = 16, 8, 4, 2, 1 pixels. For 3x3 and 5x5 windows (strides 1 and 2
 *   without dilation, dilation 2 at stride 1) a block loads each input vector of a tap row
 *   once for every output pixel whose window holds it (a stride-1 3-tap row: 18 loads for 16
 *   pixels, not 48; a dilation-2 5-tap one: 24, not 80) and the row's weights once, then the
 *   FMAs (dw_run16); other windows go as AVX2's (dw_block16). A short row under a wide
 *   window (5x5 on a 7 x 7 or 14 x 14 map, where 4 of the 7 or 14 pixels are border ones) is
 *   first copied into a zero-padded buffer, so that every pixel takes the blocks: 1.3-1.55x on
 *   efficientnet's and mobilenet_v3's 5x5 layers; with 3x3 windows the copy cost more than the
 *   border pixels did. On AVX2 the shared loads measured no faster (16 ymm registers for 8
 *   sums, 5 weights and the input): not there.
 * Each output sums its taps in (ky, kx) order after the bias on every path, so the two
 * instruction sets agree to the bit (a padded tap adds 0 * w, which changes no sum but -0). */
#include "kernels.h"

#define PX 8     /* output pixels per AVX2 block */
#define PXZ 16   /* per AVX-512 block */
#define KWMAX 5  /* the widest window row dw_run takes */

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
    /* the AVX-512 blocks' view of x: tap (ky, kx) of output pixel ow, channel c + j, is at
     * x0 + ky ys + (ow sw + kx dw) xs + cx + j */
    const float *x0;
    long ys, xs, cx;
};

/* ---------------------------------------------------------------- AVX2 */

/* n output pixels (ow0, ow0 + 1, ...) whose windows are inside the width: n <= PX, a constant
 * after inlining. */
TGT static inline __attribute__((always_inline)) void dw_block8(const struct dw_row *q, long ow0,
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
TGT static inline void dw_edge8(const struct dw_row *q, long ow, long c, __m256 b0, int full,
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

TGT static void dw_item8(const struct dw_row *q, long Wo, long c, const float *bias)
{  /* the AVX2 path: the PX-pixel blocks reload a tap's input per pixel (dw_run16's shared loads
    * took as long or longer here, 16 ymm registers holding 8 sums, 5 weights and the input) */
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
        dw_edge8(q, ow, c, b0, full, mask);
    if (full) {
        for (; ow + PX <= hi; ow += PX)
            dw_block8(q, ow, c, PX, b0, 1, mask);
        for (; ow + 4 <= hi; ow += 4)
            dw_block8(q, ow, c, 4, b0, 1, mask);
        for (; ow < hi; ow++)
            dw_block8(q, ow, c, 1, b0, 1, mask);
    } else {
        for (; ow + 4 <= hi; ow += 4)
            dw_block8(q, ow, c, 4, b0, 0, mask);
        for (; ow < hi; ow++)
            dw_block8(q, ow, c, 1, b0, 0, mask);
    }
    for (; ow < Wo; ow++)
        dw_edge8(q, ow, c, b0, full, mask);
}

/* ---------------------------------------------------------------- AVX-512 */

TGT_ZMM static inline __attribute__((always_inline)) void dw_run16(
    const struct dw_row *q, long ow0, long c, const int n, const int KW, const int SW,
    const int DW, __m512 b0, __mmask16 m)
{
    __m512 acc[PXZ];
    for (int p = 0; p < n; p++)
        acc[p] = b0;
    long C = q->C, xs = q->xs;
    for (long ky = q->ky0; ky < q->ky1; ky++) {
        const float *xr = q->x0 + ky * q->ys + ow0 * SW * xs + q->cx;
        const float *wr = q->wp + ky * KW * C + c;
        __m512 w[KWMAX];
        for (int kx = 0; kx < KW; kx++)
            w[kx] = _mm512_maskz_loadu_ps(m, wr + kx * C);
#pragma GCC unroll 40
        for (int i = 0; i < (n - 1) * SW + (KW - 1) * DW + 1; i++) {
            __m512 xi = _mm512_maskz_loadu_ps(m, xr + i * xs);
#pragma GCC unroll 16
            for (int p = 0; p < n; p++) {  /* pixel p's tap kx reads column p SW + kx DW */
                int rel = i - p * SW, kx = rel / DW;
                if (rel >= 0 && rel % DW == 0 && kx < KW)
                    acc[p] = _mm512_fmadd_ps(xi, w[kx], acc[p]);
            }
        }
    }
    for (int p = 0; p < n; p++) {
        long o = (ow0 + p) * C + c;
        __m512 v = acc[p];
        if (q->r)
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, q->r + o));
        _mm512_mask_storeu_ps(q->y + o, m, act512(v, q->act, q->p0, q->p1));
    }
}

TGT_ZMM static inline __attribute__((always_inline)) void dw_block16(
    const struct dw_row *q, long ow0, long c, const int n, __m512 b0, __mmask16 m)
{
    __m512 acc[PXZ];
    for (int p = 0; p < n; p++)
        acc[p] = b0;
    long step = q->sw * q->xs;
    for (long ky = q->ky0; ky < q->ky1; ky++) {
        const float *xr = q->x0 + ky * q->ys + q->cx;
        const float *wr = q->wp + ky * q->kw * q->C + c;
        for (long kx = 0; kx < q->kw; kx++) {
            __m512 wv = _mm512_maskz_loadu_ps(m, wr + kx * q->C);
            const float *xp = xr + (ow0 * q->sw + kx * q->dw) * q->xs;
            for (int p = 0; p < n; p++)
                acc[p] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, xp + p * step), wv, acc[p]);
        }
    }
    for (int p = 0; p < n; p++) {
        long o = (ow0 + p) * q->C + c;
        __m512 v = acc[p];
        if (q->r)
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, q->r + o));
        _mm512_mask_storeu_ps(q->y + o, m, act512(v, q->act, q->p0, q->p1));
    }
}

TGT_ZMM static void dw_edge16(const struct dw_row *q, long ow, long c, __m512 b0, __mmask16 m)
{
    __m512 acc = b0;
    for (long ky = q->ky0; ky < q->ky1; ky++) {
        const float *xr = q->xn + (q->ih0 + ky * q->dh) * q->W * q->C + c;
        for (long kx = 0; kx < q->kw; kx++) {
            long iw = ow * q->sw - q->pl + kx * q->dw;
            if (iw < 0 || iw >= q->W)
                continue;
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, xr + iw * q->C),
                                  _mm512_maskz_loadu_ps(m, q->wp + (ky * q->kw + kx) * q->C + c),
                                  acc);
        }
    }
    long o = ow * q->C + c;
    if (q->r)
        acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, q->r + o));
    _mm512_mask_storeu_ps(q->y + o, m, act512(acc, q->act, q->p0, q->p1));
}

#define RUN16(KW, SW, DW)                                                          \
    do {                                                                           \
        for (; ow + PXZ <= hi; ow += PXZ)                                          \
            dw_run16(q, ow, c, PXZ, KW, SW, DW, b0, m);                            \
        for (; ow + 8 <= hi; ow += 8)                                              \
            dw_run16(q, ow, c, 8, KW, SW, DW, b0, m);                              \
        for (; ow + 4 <= hi; ow += 4)                                              \
            dw_run16(q, ow, c, 4, KW, SW, DW, b0, m);                              \
        for (; ow + 2 <= hi; ow += 2)                                              \
            dw_run16(q, ow, c, 2, KW, SW, DW, b0, m);                              \
        for (; ow < hi; ow++)                                                      \
            dw_run16(q, ow, c, 1, KW, SW, DW, b0, m);                              \
    } while (0)

TGT_ZMM static long dw_span16(const struct dw_row *q, long ow, long hi, long c, __m512 b0,
                              __mmask16 m)
{
    /* window width, stride, dilation: the ones with shared-load runs (dilation 2 at stride 1
     * is the segmentation backbones' 5x5: torchvision's DeepLabV3 and LR-ASPP) */
    int kind = q->dw <= 2 && q->sw <= 2 && (q->kw == 3 || q->kw == 5) && !(q->dw == 2 &&
               q->sw == 2) ? (int)(q->kw * 100 + q->sw * 10 + q->dw) : 0;
    if (kind == 311)
        RUN16(3, 1, 1);
    else if (kind == 321)
        RUN16(3, 2, 1);
    else if (kind == 511)
        RUN16(5, 1, 1);
    else if (kind == 521)
        RUN16(5, 2, 1);
    else if (kind == 312)
        RUN16(3, 1, 2);
    else if (kind == 512)
        RUN16(5, 1, 2);
    for (; ow + PXZ <= hi; ow += PXZ)
        dw_block16(q, ow, c, PXZ, b0, m);
    for (; ow + 4 <= hi; ow += 4)
        dw_block16(q, ow, c, 4, b0, m);
    for (; ow < hi; ow++)
        dw_block16(q, ow, c, 1, b0, m);
    return ow;
}

/* ---------------------------------------------------------------- items */

/* Pixels [0, lo) and [hi, Wo) at the borders, [lo, hi) in blocks (AVX-512). */
TGT_ZMM static void dw_pixels16(const struct dw_row *q, long lo, long hi, long Wo, long c,
                                const float *bias)
{
    long m = q->C - c < 16 ? q->C - c : 16, ow = 0;
    __mmask16 mk = m >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1);
    __m512 b0 = bias ? _mm512_maskz_loadu_ps(mk, bias + c) : _mm512_setzero_ps();
    for (; ow < lo; ow++)
        dw_edge16(q, ow, c, b0, mk);
    ow = dw_span16(q, ow, hi, c, b0, mk);
    for (; ow < Wo; ow++)
        dw_edge16(q, ow, c, b0, mk);
}

/* The item's input rows ky0 .. ky1 - 1, 16 channels from c (zeros past C), copied into buf
 * [kh][wp][16] with the padding columns zero: column j is input column j - pl. */
TGT_ZMM static void pad_rows16(const struct dw_row *q, long c, long wp, float *buf)
{
    long m = q->C - c < 16 ? q->C - c : 16;
    __mmask16 mk = m >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1);
    for (long ky = q->ky0; ky < q->ky1; ky++) {
        const float *xr = q->xn + (q->ih0 + ky * q->dh) * q->W * q->C + c;
        float *d = buf + ky * wp * 16;
        for (long j = 0; j < wp; j++) {
            long iw = j - q->pl;
            _mm512_storeu_ps(d + j * 16, iw < 0 || iw >= q->W ? _mm512_setzero_ps()
                                                              : _mm512_maskz_loadu_ps(
                                                                    mk, xr + iw * q->C));
        }
    }
}

#define PAD_BUF 4096 /* floats of a padded item's rows (16 KB, on the stack) */

/* One AVX-512 item: 16 channels from c of output row q's pixels [0, Wo). A row whose border
 * pixels are a quarter or more of it under a window of 5 or more columns (a 5x5 window on a 7 x
 * 7 or 14 x 14 map: 4 of 7 or 14) is first copied into a zero-padded buffer, so that every
 * pixel takes the shared-load blocks; with 3x3 windows the copy cost more than it saved. */
TGT_ZMM static void dw_item16(struct dw_row *q, long Wo, long kh, long c, const float *bias)
{
    /* interior: ow * sw - pl >= 0 and ow * sw - pl + (kw - 1) dw <= W - 1 */
    long lo = (q->pl + q->sw - 1) / q->sw;
    long last = q->W - 1 + q->pl - (q->kw - 1) * q->dw;
    long hi = last < 0 ? 0 : last / q->sw + 1;
    if (hi > Wo)
        hi = Wo;
    if (lo > hi)
        lo = hi;
    long edges = lo + (Wo - hi);
    long wp = (Wo - 1) * q->sw + (q->kw - 1) * q->dw + 1;
    if (wp < q->pl + q->W)
        wp = q->pl + q->W;
    if (q->kw >= 5 && edges && 4 * edges >= Wo && kh * wp * 16 <= PAD_BUF) {
        float buf[PAD_BUF];
        pad_rows16(q, c, wp, buf);
        q->x0 = buf;
        q->ys = wp * 16;
        q->xs = 16;
        q->cx = 0;
        dw_pixels16(q, 0, Wo, Wo, c, bias);
        return;
    }
    q->x0 = q->xn + q->ih0 * q->W * q->C - q->pl * q->C;
    q->ys = q->dh * q->W * q->C;
    q->xs = q->C;
    q->cx = c;
    dw_pixels16(q, lo, hi, Wo, c, bias);
}

struct dw_job {
    const long *g;
    const float *x, *wp, *bias, *r;
    float *y;
    int act, wide;
    float p0, p1;
};

/* Item it of (image, output row, channel block of cbw): the row's geometry. The item loops
 * are compiled per instruction set (dw_items8, dw_items16): with one plain-C loop calling
 * the AVX2 item function, the AVX2 path ran 0.8x as fast as the same code inlined. */
static inline __attribute__((always_inline)) struct dw_row item_row(const struct dw_job *j,
                                                                   long it, long cbw, long *c)
{
    const long *g = j->g;
    long H = g[1], W = g[2], C = g[3], Ho = g[4], Wo = g[5], kh = g[6], kw = g[7];
    long sh = g[8], sw = g[9], dh = g[10], dw = g[11], pt = g[12], pl = g[13];
    long cb = (C + cbw - 1) / cbw;
    long n = it / (Ho * cb), oh = it / cb % Ho;
    *c = it % cb * cbw;
    struct dw_row q = {j->x + n * H * W * C, j->wp, j->r ? j->r + (n * Ho + oh) * Wo * C : NULL,
                       j->y + (n * Ho + oh) * Wo * C, W, C, kw, sw, dw, pl, oh * sh - pt, dh, 0,
                       kh, j->act, j->p0, j->p1, NULL, 0, 0, 0};
    while (q.ky0 < kh && q.ih0 + q.ky0 * dh < 0)  /* taps whose row is inside the image */
        q.ky0++;
    while (q.ky1 > q.ky0 && q.ih0 + (q.ky1 - 1) * dh >= H)
        q.ky1--;
    return q;
}

TGT static void dw_items8(void *arg, long i0, long i1)
{
    const struct dw_job *j = arg;
    for (long it = i0; it < i1; it++) {
        long c;
        struct dw_row q = item_row(j, it, 8, &c);
        dw_item8(&q, j->g[5], c, j->bias);
    }
}

TGT_ZMM static void dw_items16(void *arg, long i0, long i1)
{
    const struct dw_job *j = arg;
    for (long it = i0; it < i1; it++) {
        long c;
        struct dw_row q = item_row(j, it, 16, &c);
        dw_item16(&q, j->g[5], j->g[6], c, j->bias);
    }
}

/* g: N H W C Ho Wo kh kw sh sw dh dw pt pl (the bottom and right pads are what Ho, Wo imply).
 * x [N, H, W, C], r and y [N, Ho, Wo, C], contiguous; bias [C] or NULL, r or NULL. */
TGT void kiln_depthwise(const long *g, const float *x, const float *wp, const float *bias,
                        const float *r, float *y, int act, float p0, float p1, int nthreads)
{
    long N = g[0], C = g[3], Ho = g[4], Wo = g[5], kh = g[6], kw = g[7];
    int wide = kiln_use_avx512();
    struct dw_job j = {g, x, wp, bias, r, y, act, wide, p0, p1};
    int nt = N * Ho * Wo * C * kh * kw >= (1L << 15) ? nthreads : 1;
    long cbw = wide ? 16 : 8;
    kiln_parallel(N * Ho * ((C + cbw - 1) / cbw), wide ? dw_items16 : dw_items8, &j, nt);
}
