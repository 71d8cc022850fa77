/* 3x3 convolution by Winograd F(2x2, 3x3):
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
#include "kernels.h"


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
        for (long c = 0; c < C; c++)  /* k innermost: the writes below walk u in order */
            for (long k = 0; k < K; k++) {
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

/* One block of tiles [t0, t0 + nb) in flight: what the three phases' items read. */
struct wino_job {
    long H, W, C, K, Ho, Wo, pt, pl, th, tw, t0, nb, vs, ms, usize, panels;
    const float *X, *Up, *bias, *R;
    float *Y, *V, *M;
    int act;
    float alpha, beta;
};

/* Tiles [i0, i1) of the block: their patches' transforms into V. */
TGT static void wino_in_items(void *arg, long i0, long i1)
{
    const struct wino_job *j = arg;
    for (long i = i0; i < i1; i++) {
        long g = j->t0 + i, n = g / (j->th * j->tw), r = g % (j->th * j->tw);
        const float *x = j->X + n * j->H * j->W * j->C;
        for (long c = 0; c < j->C; c += 8)
            wino_in(x, j->H, j->W, j->C, 2 * (r / j->tw) - j->pt, 2 * (r % j->tw) - j->pl, c,
                    j->V + i * j->C, j->vs);
    }
}

/* Items [a, b) of the 16 GEMMs (item e * panels + p: transform position e, weight panel p). */
TGT static void wino_gemm_items(void *arg, long a, long b)
{
    const struct wino_job *j = arg;
    while (a < b) {
        long e = a / j->panels, p0 = a % j->panels;
        long p1 = p0 + (b - a) < j->panels ? p0 + (b - a) : j->panels;
        kiln_gemm_block(0, j->nb, p0, p1, j->K, j->C, j->V + e * j->vs, j->C,
                        j->Up + e * j->usize, NULL, NULL, 0, j->M + e * j->ms, j->K, ACT_NONE,
                        0.0f, 0.0f);
        a += p1 - p0;
    }
}

/* Tiles [i0, i1) of the block: their outputs from the products in M, the epilogue applied. */
TGT static void wino_out_items(void *arg, long i0, long i1)
{
    const struct wino_job *j = arg;
    for (long i = i0; i < i1; i++) {
        long g = j->t0 + i, n = g / (j->th * j->tw), r = g % (j->th * j->tw);
        long off = n * j->Ho * j->Wo * j->K;
        for (long k = 0; k < j->K; k += 8)
            wino_out(j->M + i * j->K, j->ms, j->Ho, j->Wo, j->K, 2 * (r / j->tw),
                     2 * (r % j->tw), k, j->bias, j->R ? j->R + off : NULL, j->Y + off, j->act,
                     j->alpha, j->beta);
    }
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
    /* each phase a kiln_parallel loop (team.c: chunks claimed, never waiting on a thread that
     * is not running), not an OpenMP region with a static split and barriers: that one waited
     * for a woken thread, or one kept from its core by kiln's spinning workers, every phase */
    struct wino_job j = {H, W, C, K, Ho, Wo, pt, pl, th, tw, 0, 0, vs, ms, usize, panels,
                         X, Up, bias, R, Y, V, M, act, alpha, beta};
    for (long t0 = 0; t0 < T; t0 += tb) {
        j.t0 = t0;
        j.nb = T - t0 < tb ? T - t0 : tb;
        kiln_parallel(j.nb, wino_in_items, &j, nthreads);
        kiln_parallel(16 * panels, wino_gemm_items, &j, nthreads);
        kiln_parallel(j.nb, wino_out_items, &j, nthreads);
    }
    free(V); free(M);
    return 0;
}
