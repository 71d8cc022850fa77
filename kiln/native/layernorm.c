/* LayerNorm and RMSNorm over the rows of a float32 matrix, split over threads by rows. */
#include "kernels.h"

/* elements below which a norm runs on the caller's thread: handing rows out costs more */
#define NORM_SERIAL_WORK (1L << 14)

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

/* Rows of a norm split over kiln's team (team.c), not an OpenMP region: with OMP_WAIT_POLICY
 * passive every region woke a sleeping thread, and a ViT's 197 x 192 LayerNorm took 45 us on two
 * threads against 11.5 us on one (a shared 2-core VM); the team's workers spin between the
 * layers of a run and a worker that is not running takes no rows. */
struct norm_job {
    long N;
    const float *X;
    long ldx;
    float *Y;
    long ldy;
    const float *gamma, *beta;
    float eps;
};

static void layernorm_items(void *ctx, long i0, long i1)
{
    const struct norm_job *j = ctx;
    layernorm_rows(i0, i1, j->N, j->X, j->ldx, j->Y, j->ldy, j->gamma, j->beta, j->eps);
}

/* LayerNorm of the M rows of X into Y (in place where Y == X). */
void kiln_layernorm_to(long M, long N, const float *X, long ldx, float *Y, long ldy,
                       const float *gamma, const float *beta, float eps, int nthreads)
{
    if (nthreads < 2 || M < 2 || M * N < NORM_SERIAL_WORK) {
        layernorm_rows(0, M, N, X, ldx, Y, ldy, gamma, beta, eps);
        return;
    }
    struct norm_job j = {N, X, ldx, Y, ldy, gamma, beta, eps};
    kiln_parallel(M, layernorm_items, &j, nthreads);
}

/* Rows [m0, m1) of X RMS-normalized into Y (Y may be X): x / sqrt(mean(x^2) + eps) * gamma, the
 * mean square in float32 over each row. */
TGT static void rmsnorm_rows(long m0, long m1, long N, const float *X, long ldx, float *Y,
                             long ldy, const float *gamma, float eps)
{
    for (long i = m0; i < m1; i++) {
        const float *x = X + i * ldx;
        float *y = Y + i * ldy;
        __m256 acc = _mm256_setzero_ps();
        long j = 0;
        for (; j + 8 <= N; j += 8) {
            __m256 v = _mm256_loadu_ps(x + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sq = hsum256(acc);
        for (; j < N; j++) sq += x[j] * x[j];
        float inv = 1.0f / sqrtf(sq / (float)N + eps);
        __m256 iv = _mm256_set1_ps(inv);
        for (j = 0; j + 8 <= N; j += 8)
            _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), iv),
                                                  _mm256_loadu_ps(gamma + j)));
        for (; j < N; j++) y[j] = x[j] * inv * gamma[j];
    }
}

static void rmsnorm_items(void *ctx, long i0, long i1)
{
    const struct norm_job *j = ctx;
    rmsnorm_rows(i0, i1, j->N, j->X, j->ldx, j->Y, j->ldy, j->gamma, j->eps);
}

/* RMSNorm of the M rows of X into Y (in place where Y == X). */
void kiln_rmsnorm_to(long M, long N, const float *X, long ldx, float *Y, long ldy,
                     const float *gamma, float eps, int nthreads)
{
    if (nthreads < 2 || M < 2 || M * N < NORM_SERIAL_WORK) {
        rmsnorm_rows(0, M, N, X, ldx, Y, ldy, gamma, eps);
        return;
    }
    struct norm_job j = {N, X, ldx, Y, ldy, gamma, NULL, eps};
    kiln_parallel(M, rmsnorm_items, &j, nthreads);
}
