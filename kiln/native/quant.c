/* DynamicQuantizeLinear: a float32 tensor to uint8 codes with a scale and zero point from its
 * own range (widened to hold 0), in the float32 steps kiln's torch kernel and onnxruntime take:
 * scale = (max - min) / 255, zero = round(clamp(-min / scale, 0, 255)), codes = clamp(round(x /
 * scale) + zero, 0, 255), every round half to even. One pass for the range, one for the codes. */
#include "kernels.h"

TGT static void range(long n, const float *x, float *lo_out, float *hi_out)
{
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  /* the range holds 0 */
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        lo = _mm256_min_ps(lo, v);
        hi = _mm256_max_ps(hi, v);
    }
    float l[8], h[8];
    _mm256_storeu_ps(l, lo);
    _mm256_storeu_ps(h, hi);
    float a = 0.0f, b = 0.0f;
    for (int j = 0; j < 8; j++) {
        a = l[j] < a ? l[j] : a;
        b = h[j] > b ? h[j] : b;
    }
    for (; i < n; i++) {
        a = x[i] < a ? x[i] : a;
        b = x[i] > b ? x[i] : b;
    }
    *lo_out = a;
    *hi_out = b;
}

TGT static void codes(long n, const float *x, unsigned char *y, float scale, float zero)
{
    const __m256 vs = _mm256_set1_ps(scale), vz = _mm256_set1_ps(zero);
    const __m256 top = _mm256_set1_ps(255.0f), bot = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, vz), bot), top);
        __m256i w = _mm256_cvtps_epi32(q);  /* 0..255, exact */
        __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
        _mm_storel_epi64((__m128i *)(y + i), _mm_packus_epi16(p, p));
    }
    for (; i < n; i++) {
        float q = nearbyintf(x[i] / scale) + zero;
        y[i] = (unsigned char)(q < 0.0f ? 0.0f : q > 255.0f ? 255.0f : q);
    }
}

/* The codes' float values (q - zero) * scale: what a layer reading DynamicQuantizeLinear's
 * output through a dequantization sees (the same codes as codes() writes, to the bit). */
TGT static void dequantized(long n, const float *x, float *y, float scale, float zero)
{
    const __m256 vs = _mm256_set1_ps(scale), vz = _mm256_set1_ps(zero);
    const __m256 top = _mm256_set1_ps(255.0f), bot = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, vz), bot), top);
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_sub_ps(q, vz), vs));
    }
    for (; i < n; i++) {
        float q = nearbyintf(x[i] / scale) + zero;
        q = q < 0.0f ? 0.0f : q > 255.0f ? 255.0f : q;
        y[i] = (q - zero) * scale;
    }
}

/* Threads for an n-element pass: one below 1M elements. The passes run at memory speed
 * (131k floats take 20 us on one core), so below that waking a second OpenMP thread costs
 * more than it saves (32 us on two under OMP_WAIT_POLICY=passive, BERT FC2's input). */
static int threads_for(long n, int nthreads)
{
    int nt = n >= (1L << 20) ? nthreads : 1;
    return nt > 64 ? 64 : nt < 1 ? 1 : nt;
}

/* DynamicQuantizeLinear's scale and zero point of the range [lo, hi] (lo <= 0 <= hi) */
static void from_range(float lo, float hi, float *scale, float *zero)
{
    float s = hi == lo ? 1.0f : (hi - lo) / 255.0f;
    float z = -lo / s;
    *scale = s;
    *zero = nearbyintf(z < 0.0f ? 0.0f : z > 255.0f ? 255.0f : z);
}

/* scale and zero point (a float holding an integer 0..255) of x's range, widened to hold 0 */
static void scale_zero(long n, const float *x, int nt, float *scale, float *zero)
{
    float lo = 0.0f, hi = 0.0f, los[64], his[64];
    long per = (n + nt - 1) / nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        long a = t * per, b = a + per < n ? a + per : n;
        range(b > a ? b - a : 0, x + a, &los[t], &his[t]);
    }
    for (int t = 0; t < nt; t++) {
        lo = los[t] < lo ? los[t] : lo;
        hi = his[t] > hi ? his[t] : hi;
    }
    from_range(lo, hi, scale, zero);
}

/* Writes codes y[n], *scale and *zero (as a float holding an integer 0..255). */
void kiln_dynamic_quantize(long n, const float *x, unsigned char *y, float *scale, float *zero,
                           int nthreads)
{
    int nt = threads_for(n, nthreads);
    scale_zero(n, x, nt, scale, zero);
    float s = *scale, z = *zero;
    long per = (n + nt - 1) / nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        long a = t * per, b = a + per < n ? a + per : n;
        if (b > a)
            codes(b - a, x + a, y + a, s, z);
    }
}

/* DynamicQuantizeLinear then DequantizeLinear: y[n] = (codes - zero) * scale, with *scale and
 * *zero as kiln_dynamic_quantize gives them. */
void kiln_dynamic_qdq(long n, const float *x, float *y, float *scale, float *zero, int nthreads)
{
    int nt = threads_for(n, nthreads);
    scale_zero(n, x, nt, scale, zero);
    float s = *scale, z = *zero;
    long per = (n + nt - 1) / nt;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (int t = 0; t < nt; t++) {
        long a = t * per, b = a + per < n ? a + per : n;
        if (b > a)
            dequantized(b - a, x + a, y + a, s, z);
    }
}

/* codes minus zero point of a static scale: y = clamp(round(x / scale) + zero, 0, 255) - zero
 * (QuantizeLinear's float32 steps), the input of a GEMM whose float products are integers */
TGT void kiln_shifted_codes(long n, const float *x, float *y, float scale, float zero)
{
    const __m256 vs = _mm256_set1_ps(scale), vz = _mm256_set1_ps(zero);
    const __m256 top = _mm256_set1_ps(255.0f), bot = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, vz), bot), top);
        _mm256_storeu_ps(y + i, _mm256_sub_ps(q, vz));
    }
    for (; i < n; i++) {
        float q = nearbyintf(x[i] / scale) + zero;
        y[i] = (q < 0.0f ? 0.0f : q > 255.0f ? 255.0f : q) - zero;
    }
}

/* QLinearMatMul's requantization (MLAS's float32 steps) then DequantizeLinear, in place over
 * acc [rows, cols] of integer products: (clamp(round(acc * mult[j]) + zero, lo, hi) - zero) *
 * scale, round half to even. */
TGT void kiln_requantize(long rows, long cols, float *acc, const float *mult, float scale,
                         float zero, float lo, float hi)
{
    const __m256 vs = _mm256_set1_ps(scale), vz = _mm256_set1_ps(zero);
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    for (long r = 0; r < rows; r++) {
        float *a = acc + r * cols;
        long j = 0;
        for (; j + 8 <= cols; j += 8) {
            __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(a + j),
                                                     _mm256_loadu_ps(mult + j)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, vz), vlo), vhi);
            _mm256_storeu_ps(a + j, _mm256_mul_ps(_mm256_sub_ps(q, vz), vs));
        }
        for (; j < cols; j++) {
            float q = nearbyintf(a[j] * mult[j]) + zero;
            q = q < lo ? lo : q > hi ? hi : q;
            a[j] = (q - zero) * scale;
        }
    }
}

/* uint8 codes y [M, K] (row stride K) of the rows of x [M, K] (row stride ldx): with the
 * given *scale and *zero (QuantizeLinear's steps, as codes() takes them), or, where
 * ``dynamic``, with those of x's own range, written to *scale and *zero (DynamicQuantizeLinear:
 * the same codes as kiln_dynamic_quantize gives a contiguous x). */
void kiln_quantize_rows(long M, long K, const float *x, long ldx, unsigned char *y,
                        float *scale, float *zero, int dynamic, int nthreads)
{
    int nt = threads_for(M * K, nthreads);
    if (dynamic) {
        float lo = 0.0f, hi = 0.0f;
        for (long m = 0; m < M; m++) {
            float a, b;
            range(K, x + m * ldx, &a, &b);
            lo = a < lo ? a : lo;
            hi = b > hi ? b : hi;
        }
        from_range(lo, hi, scale, zero);
    }
    float s = *scale, z = *zero;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
    for (long m = 0; m < M; m++)
        codes(K, x + m * ldx, y + m * K, s, z);
}
