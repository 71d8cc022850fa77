/* Softmax over the last axis of float32 rows: y[r, :] = e^(x[r, :] - max) / sum, rows of any
 * length (a detector's 21 or 91 class scores per box, where torch's kernel spent 0.3 ms on
 * tv_ssdlite320's [3234, 21]: its vectors run along the short row), 8 floats a vector (AVX2,
 * exp256: about 1 ulp; 0 below e^-87), the row's tail masked. Rows are split over kiln's team. A NaN in a row
 * makes the row NaN (its exp is NaN, so is the sum), as torch's. */
#include "kernels.h"

/* e^d for d = x - max <= 0; 0 below -87 (exp256 clamps there, to e^-87; the true value is
 * below float's normal range): a -inf (a masked position) gives 0 exactly, as torch's. */
TGT static inline __m256 sm_exp(__m256 d)
{
    return _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), exp256(d));
}

struct sm_job {
    long n, ldx, ldy;
    const float *x;
    float *y;
};

TGT static inline __m256i sm_mask(long m)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6,
                                                                           7));
}

TGT static inline float sm_hmax(__m256 v)
{
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

TGT static inline float sm_hsum(__m256 v)
{
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_shuffle_ps(a, a, 1));
    return _mm_cvtss_f32(a);
}

TGT static void sm_rows(void *arg, long r0, long r1)
{
    const struct sm_job *j = arg;
    long n = j->n, full = n / 8 * 8;
    __m256i tail = sm_mask(n - full);
    __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (long r = r0; r < r1; r++) {
        const float *x = j->x + r * j->ldx;
        float *y = j->y + r * j->ldy;
        __m256 mv = ninf;
        long i = 0;
        for (; i < full; i += 8)
            mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
        if (i < n)
            mv = _mm256_max_ps(mv, _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + i, tail),
                                                    _mm256_castsi256_ps(tail)));
        __m256 m = _mm256_set1_ps(sm_hmax(mv)), sv = _mm256_setzero_ps();
        for (i = 0; i < full; i += 8) {
            __m256 e = sm_exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
            _mm256_storeu_ps(y + i, e);
            sv = _mm256_add_ps(sv, e);
        }
        if (i < n) {
            __m256 e = sm_exp(_mm256_sub_ps(_mm256_maskload_ps(x + i, tail), m));
            e = _mm256_and_ps(e, _mm256_castsi256_ps(tail));
            _mm256_maskstore_ps(y + i, tail, e);
            sv = _mm256_add_ps(sv, e);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sm_hsum(sv));
        for (i = 0; i < full; i += 8)
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), inv));
        if (i < n)
            _mm256_maskstore_ps(y + i, tail, _mm256_mul_ps(_mm256_maskload_ps(y + i, tail), inv));
    }
}

/* x [rows, n] (row stride ldx) -> y [rows, n] (row stride ldy); y may be x. */
void kiln_softmax_rows(long rows, long n, const float *x, long ldx, float *y, long ldy,
                       int nthreads)
{
    struct sm_job j = {n, ldx, ldy, x, y};
    kiln_parallel(rows, sm_rows, &j, rows * n >= (1L << 15) ? nthreads : 1);
}
