/* Depthwise convolution (one input channel per output channel) on NHWC tensors, the bias,
 * the residual and the activation applied in registers. Pads are given per side, so an
 * explicit Pad folded into the conv (TF-style "same" padding, often asymmetric) costs nothing.
 * The weight is packed [kh][kw][C] (kiln_dw_pack), so that a vector of 8 channels of one tap is
 * one load. */
#include "kernels.h"

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

/* g: N H W C Ho Wo kh kw sh sw dh dw pt pl (the bottom and right pads are what Ho, Wo imply).
 * x [N, H, W, C], r and y [N, Ho, Wo, C], contiguous; bias [C] or NULL, r or NULL. */
TGT void kiln_depthwise(const long *g, const float *x, const float *wp, const float *bias,
                        const float *r, float *y, int act, float p0, float p1, int nthreads)
{
    long N = g[0], H = g[1], W = g[2], C = g[3], Ho = g[4], Wo = g[5], kh = g[6], kw = g[7];
    long sh = g[8], sw = g[9], dh = g[10], dw = g[11], pt = g[12], pl = g[13];
    int nt = N * Ho * Wo * C * kh * kw >= (1L << 15) ? nthreads : 1;
#pragma omp parallel for collapse(2) num_threads(nt) schedule(static) if (nt > 1)
    for (long n = 0; n < N; n++)
        for (long oh = 0; oh < Ho; oh++) {
            const float *xn = x + n * H * W * C;
            long ky0 = 0, ky1 = kh;  /* taps whose row is inside the image */
            while (ky0 < kh && oh * sh - pt + ky0 * dh < 0)
                ky0++;
            while (ky1 > ky0 && oh * sh - pt + (ky1 - 1) * dh >= H)
                ky1--;
            for (long ow = 0; ow < Wo; ow++) {
                long o = ((n * Ho + oh) * Wo + ow) * C;
                for (long c = 0; c < C; c += 8) {
                    long m = C - c < 8 ? C - c : 8;
                    __m256i mask = tail_mask(m);
                    __m256 acc = bias ? _mm256_maskload_ps(bias + c, mask) : _mm256_setzero_ps();
                    for (long ky = ky0; ky < ky1; ky++) {
                        long ih = oh * sh - pt + ky * dh;
                        for (long kx = 0; kx < kw; kx++) {
                            long iw = ow * sw - pl + kx * dw;
                            if (iw < 0 || iw >= W)
                                continue;
                            __m256 xv = _mm256_maskload_ps(xn + (ih * W + iw) * C + c, mask);
                            __m256 wv = _mm256_maskload_ps(wp + (ky * kw + kx) * C + c, mask);
                            acc = _mm256_fmadd_ps(xv, wv, acc);
                        }
                    }
                    if (r)
                        acc = _mm256_add_ps(acc, _mm256_maskload_ps(r + o + c, mask));
                    _mm256_maskstore_ps(y + o + c, mask, act256(acc, act, p0, p1));
                }
            }
        }
}
