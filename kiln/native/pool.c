/* Max and average pooling over 2-D windows of a strided [N, C, H, W] tensor (any layout: the
 * channel loop is innermost, so an NHWC tensor is read along rows of channels). */
#include "kernels.h"

#define CB 256 /* channels accumulated at once */

enum { POOL_MAX, POOL_AVG_PAD, POOL_AVG };  /* AVG_PAD counts padded positions */

struct pool_job {
    int kind;
    const long *g, *xs, *ys;
    const float *x;
    float *y;
};

/* Output rows [r0, r1) of (image, row) pairs. */
TGT static void pool_rows(void *arg, long r0, long r1)
{
    const struct pool_job *j = arg;
    const long *g = j->g, *xs = j->xs, *ys = j->ys;
    const float *x = j->x;
    float *y = j->y;
    int kind = j->kind;
    long C = g[1], H = g[2], W = g[3], Ho = g[4], Wo = g[5], kh = g[6], kw = g[7];
    long sh = g[8], sw = g[9], dh = g[10], dw = g[11], pt = g[12], pl = g[13];
    for (long it = r0; it < r1; it++) {
        long n = it / Ho, oh = it % Ho;
        for (long ow = 0; ow < Wo; ow++)
            for (long c0 = 0; c0 < C; c0 += CB) {
                long cn = C - c0 < CB ? C - c0 : CB, count = 0;
                float acc[CB];
                for (long c = 0; c < cn; c++)
                    acc[c] = kind == POOL_MAX ? -INFINITY : 0.0f;
                for (long ky = 0; ky < kh; ky++) {
                    long ih = oh * sh - pt + ky * dh;
                    if (ih < 0 || ih >= H)
                        continue;
                    for (long kx = 0; kx < kw; kx++) {
                        long iw = ow * sw - pl + kx * dw;
                        if (iw < 0 || iw >= W)
                            continue;
                        const float *p = x + n * xs[0] + c0 * xs[1] + ih * xs[2] + iw * xs[3];
                        long s = xs[1];
                        count++;
                        if (kind == POOL_MAX) {
                            if (s == 1)
                                for (long c = 0; c < cn; c++)
                                    acc[c] = p[c] > acc[c] || p[c] != p[c] ? p[c] : acc[c];
                            else
                                for (long c = 0; c < cn; c++)
                                    acc[c] = p[c * s] > acc[c] || p[c * s] != p[c * s]
                                             ? p[c * s] : acc[c];
                        } else if (s == 1) {
                            for (long c = 0; c < cn; c++)
                                acc[c] += p[c];
                        } else {
                            for (long c = 0; c < cn; c++)
                                acc[c] += p[c * s];
                        }
                    }
                }
                float scale = 1.0f;
                if (kind == POOL_AVG_PAD)
                    scale = 1.0f / (float)(kh * kw);
                else if (kind == POOL_AVG)
                    scale = count ? 1.0f / (float)count : 0.0f;
                float *q = y + n * ys[0] + c0 * ys[1] + oh * ys[2] + ow * ys[3];
                for (long c = 0; c < cn; c++)
                    q[c * ys[1]] = kind == POOL_MAX ? acc[c] : acc[c] * scale;
            }
    }
}

/* g: N C H W Ho Wo kh kw sh sw dh dw pt pl; xs, ys: the strides of x and y (n, c, h, w). */
TGT void kiln_pool2d(int kind, const long *g, const float *x, const long *xs, float *y,
                     const long *ys, int nthreads)
{
    long N = g[0], C = g[1], Ho = g[4], Wo = g[5], kh = g[6], kw = g[7];
    int nt = N * Ho * Wo * C * kh * kw >= (1L << 15) ? nthreads : 1;
    struct pool_job j = {kind, g, xs, ys, x, y};
    kiln_parallel(N * Ho, pool_rows, &j, nt);
}
