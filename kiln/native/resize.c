/* Bilinear resize of the two spatial dims: x [P, H, W, L] -> y [P, Ho, Wo, L], both
 * contiguous, L the values of one pixel (the channels of an NHWC tensor, P its batch; or 1,
 * P = N * C, for NCHW). The source taps and weights of each output row and column come from
 * the caller (kiln/kernels/torch/vision.py computes ONNX's coordinates), so every coordinate
 * mode that reads two taps per axis is the same kernel.
 *
 * Separable, in torch's order of operations: out = hy0 * (wx0 * a + wx1 * b) + hy1 * (wx0 * c
 * + wx1 * d). An input row is interpolated along W once (into a per-thread buffer of two rows,
 * reused while consecutive output rows read the same two input rows: an 8x upsample
 * interpolates each input row about twice, not 16 times), then each output row is the weighted
 * sum of its two rows' buffers: two loads and a multiply-add per float, vectorized by the
 * compiler (AVX2 target). The work is split into (plane, block of output rows) items.
 * The semantic-segmentation heads' final upsample ([1, 21, 40, 40] -> 320 x 320 in
 * torchvision's LR-ASPP) is the case it is for. */
#include "kernels.h"
#include <stdlib.h>

#define RS_ROWS 16 /* output rows per item */

struct rs_job {
    long P, H, W, L, Ho, Wo;
    const float *x;
    float *y;
    const int *y0, *y1, *x0, *x1;
    const float *hy0, *hy1, *wx0, *wx1;
};

/* The half of the two-row buffer for input row ``want``: the one holding it, else the one not
 * holding ``keep`` (the row the output's other tap reads). */
static inline int rs_slot(const long have[2], long want, long keep)
{
    if (have[0] == want)
        return 0;
    if (have[1] == want)
        return 1;
    return have[0] == keep ? 1 : 0;
}

/* Input row h of plane p interpolated along W into out [Wo * L]. */
TGT static inline void rs_row(const struct rs_job *j, long p, long h, float *out)
{
    const float *src = j->x + (p * j->H + h) * j->W * j->L;
    long L = j->L;
    for (long ox = 0; ox < j->Wo; ox++) {
        const float *a = src + j->x0[ox] * L, *b = src + j->x1[ox] * L;
        float w0 = j->wx0[ox], w1 = j->wx1[ox];
        float *o = out + ox * L;
        for (long l = 0; l < L; l++)
            o[l] = w0 * a[l] + w1 * b[l];
    }
}

TGT static void rs_items(void *arg, long i0, long i1)
{
    const struct rs_job *j = arg;
    long n = j->Wo * j->L, blocks = (j->Ho + RS_ROWS - 1) / RS_ROWS;
    float *buf = malloc(sizeof(float) * 2 * n);
    if (!buf)
        return;
    for (long it = i0; it < i1; it++) {
        long p = it / blocks, oy0 = it % blocks * RS_ROWS;
        long oy1 = oy0 + RS_ROWS < j->Ho ? oy0 + RS_ROWS : j->Ho;
        long have[2] = {-1, -1}; /* the input rows in buf's two halves */
        for (long oy = oy0; oy < oy1; oy++) {
            long r0 = j->y0[oy], r1 = j->y1[oy];
            int s0 = rs_slot(have, r0, r1);
            if (have[s0] != r0) {
                rs_row(j, p, r0, buf + s0 * n);
                have[s0] = r0;
            }
            int s1 = rs_slot(have, r1, r0);
            if (have[s1] != r1) {
                rs_row(j, p, r1, buf + s1 * n);
                have[s1] = r1;
            }
            float h0 = j->hy0[oy], h1 = j->hy1[oy];
            float *o = j->y + (p * j->Ho + oy) * n;
            const float *a = buf + s0 * n, *b = buf + s1 * n;
            for (long i = 0; i < n; i++)
                o[i] = h0 * a[i] + h1 * b[i];
        }
    }
    free(buf);
}

/* The tables: y0, y1, hy0, hy1 [Ho] and x0, x1, wx0, wx1 [Wo]; taps within [0, H) / [0, W). */
void kiln_resize_linear2d(long P, long H, long W, long L, long Ho, long Wo, const float *x,
                          float *y, const int *y0, const int *y1, const float *hy0,
                          const float *hy1, const int *x0, const int *x1, const float *wx0,
                          const float *wx1, int nthreads)
{
    struct rs_job j = {P, H, W, L, Ho, Wo, x, y, y0, y1, x0, x1, hy0, hy1, wx0, wx1};
    long items = P * ((Ho + RS_ROWS - 1) / RS_ROWS);
    int nt = P * Ho * Wo * L >= (1L << 16) ? nthreads : 1;
    kiln_parallel(items, rs_items, &j, nt);
}
