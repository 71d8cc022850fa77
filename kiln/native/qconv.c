/* Integer convolution (ConvInteger, and kiln's ConvIntegerScaled: ConvInteger + int32 bias
 * floor(B / S) + cast + times S) on qgemm.c's VNNI tile, exact in int32 as onnxruntime's
 * im2col + u8 GEMM. The weight is the GEMM's A (uint8 [OC, K], K = C kh kw, constant), the
 * input's im2col its B: packed per call straight into VNNI's panel layout (32 output pixels
 * x groups of 4 k), so that C [OC, OH OW] is the NCHW output itself. With A = w + woff
 * (uint8, woff 128 for an int8 weight), a_zero = wz + woff, B = x - xoff (int8, xoff 128 for
 * uint8 codes; padding is the code xz):
 *
 *   sum_k (w - wz)(x - xz) = sum_k A B - a_zero colsum_B[n] + (xoff - xz) wsum[m],
 *   wsum[m] = sum_k (w - wz)
 *
 * qgemm's colsum is B's column sums (made by the packer, with VNNI's own dot product against
 * ones), the last term (and the bias floor(B / S)) its row_add. One weight zero point for
 * the whole tensor; one group. */
#include "kernels.h"

#define TGTV __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#define QACT_INT32 101
/* multiply-adds below which one thread does it all: waking the team (a passive wait policy)
 * costs more than the work (a 64 x 64 x 128 1x1 conv: 22 us on one thread, 40 on two) */
#define QCONV_SERIAL_WORK (1L << 20)

struct qconv {
    long C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, OH, OW, K, kp, N;
    const uint8_t *x; /* one image's codes [C, H, W] */
    uint8_t pad; /* the padding code (xz) */
    uint8_t flip; /* 0x80 for uint8 codes (x - 128 as int8), 0 for int8 */
    int8_t *packed;
    int32_t *colsum;
};

/* One panel's pixels as runs within an output row: (first pixel's offset in the panel, oh,
 * ow, length); at most 32 runs. */
struct runs {
    int n;
    long at[32], oh[32], ow[32], len[32];
};

static void panel_runs(const struct qconv *q, long n0, struct runs *r)
{
    long n = n0, end = n0 + 32 < q->N ? n0 + 32 : q->N;
    r->n = 0;
    while (n < end) {
        long oh = n / q->OW, ow = n % q->OW;
        long len = q->OW - ow < end - n ? q->OW - ow : end - n;
        r->at[r->n] = n - n0, r->oh[r->n] = oh, r->ow[r->n] = ow, r->len[r->n] = len;
        r->n++;
        n += len;
    }
}

/* B's row k = (c, i, j) over one panel's runs, as raw codes in ``dst`` (32 bytes, padding
 * past N). */
TGTV static inline void im2col_row(const struct qconv *q, const struct runs *r, long c, long i,
                                   long j, uint8_t *dst)
{
    const uint8_t *xc = q->x + c * q->H * q->W;
    if (r->n == 1 && r->len[0] == 32 && (q->sw == 1 || q->sw == 2)) {
        /* the common case: 32 pixels of one output row, stride 1 or 2: one (masked) load of
         * the input row's span, the columns outside it the padding code (a masked-off byte
         * is not read, so the span may start before the row or end past it) */
        long ih = r->oh[0] * q->sh - q->ph + i * q->dh;
        long iw0 = r->ow[0] * q->sw - q->pw + j * q->dw;
        if (ih < 0 || ih >= q->H) {
            _mm256_store_si256((__m256i *)dst, _mm256_set1_epi8((char)q->pad));
            return;
        }
        const uint8_t *row = xc + ih * q->W;
        long span = 32 * q->sw, lo = iw0 < 0 ? -iw0 : 0, hi = q->W - iw0;
        if (lo == 0 && hi >= span && q->sw == 1) {
            _mm256_store_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)(row + iw0)));
            return;
        }
        hi = hi > span ? span : hi;
        __mmask64 m = 0;
        if (hi > lo)
            m = (hi - lo >= 64 ? ~0ULL : ((1ULL << (hi - lo)) - 1)) << lo;
        const __m512i pad = _mm512_set1_epi8((char)q->pad);
        if (q->sw == 1) {
            __m256i v = _mm256_mask_loadu_epi8(_mm512_castsi512_si256(pad), (__mmask32)m,
                                               row + iw0);
            _mm256_store_si256((__m256i *)dst, v);
        } else { /* every other byte of 64: the low bytes of 32 int16 */
            __m512i v = _mm512_mask_loadu_epi8(pad, m, row + iw0);
            _mm256_store_si256((__m256i *)dst, _mm512_cvtepi16_epi8(v));
        }
        return;
    }
    long filled = 0;
    for (int s = 0; s < r->n; s++) {
        long seg = r->len[s], ih = r->oh[s] * q->sh - q->ph + i * q->dh;
        uint8_t *d = dst + r->at[s];
        filled = r->at[s] + seg;
        if (ih < 0 || ih >= q->H) {
            memset(d, q->pad, (size_t)seg);
            continue;
        }
        const uint8_t *row = xc + ih * q->W;
        long iw0 = r->ow[s] * q->sw - q->pw + j * q->dw;
        if (q->sw == 1) { /* the columns inside the row copied, padding either side */
            long lo = iw0 < 0 ? (-iw0 < seg ? -iw0 : seg) : 0;
            long hi = q->W - iw0 < seg ? q->W - iw0 : seg;
            hi = hi < lo ? lo : hi;
            memset(d, q->pad, (size_t)lo);
            memcpy(d + lo, row + iw0 + lo, (size_t)(hi - lo));
            memset(d + hi, q->pad, (size_t)(seg - hi));
            continue;
        }
        for (long t = 0; t < seg; t++) {
            long iw = iw0 + t * q->sw;
            d[t] = iw >= 0 && iw < q->W ? row[iw] : q->pad;
        }
    }
    if (filled < 32)
        memset(dst + filled, q->pad, (size_t)(32 - filled));
}

/* Panels p0 .. p1 - 1: im2col rows 4 at a time, flipped to int8 and interleaved (column c's 4
 * codes together, 16 columns per 64 bytes), column sums by vpdpbusd against ones. */
TGTV static void pack_panels(void *ctx, long p0, long p1)
{
    const struct qconv *q = ctx;
    const __m512i ones = _mm512_set1_epi8(1);
    const __m128i flip = _mm_set1_epi8((char)q->flip);
    uint8_t rows[4][32] __attribute__((aligned(32)));
    struct runs runs;
    for (long p = p0; p < p1; p++) {
        int8_t *out = q->packed + p * 32 * q->kp;
        __m512i cs0 = _mm512_setzero_si512(), cs1 = _mm512_setzero_si512();
        panel_runs(q, p * 32, &runs);
        long c = 0, i = 0, j = 0; /* k = (c, i, j), stepped along */
        for (long g = 0; g < q->kp / 4; g++) {
            for (int r = 0; r < 4; r++) {
                if (4 * g + r >= q->K) {
                    memset(rows[r], q->flip, 32); /* flips to 0: no term past K */
                    continue;
                }
                im2col_row(q, &runs, c, i, j, rows[r]);
                if (++j == q->kw) {
                    j = 0;
                    if (++i == q->kh)
                        i = 0, c++;
                }
            }
            for (int h = 0; h < 2; h++) {
                __m128i r0 = _mm_xor_si128(_mm_load_si128((const __m128i *)(rows[0] + 16 * h)), flip);
                __m128i r1 = _mm_xor_si128(_mm_load_si128((const __m128i *)(rows[1] + 16 * h)), flip);
                __m128i r2 = _mm_xor_si128(_mm_load_si128((const __m128i *)(rows[2] + 16 * h)), flip);
                __m128i r3 = _mm_xor_si128(_mm_load_si128((const __m128i *)(rows[3] + 16 * h)), flip);
                __m128i a = _mm_unpacklo_epi8(r0, r1), b = _mm_unpackhi_epi8(r0, r1);
                __m128i c = _mm_unpacklo_epi8(r2, r3), d = _mm_unpackhi_epi8(r2, r3);
                /* the 64 bytes in a register, stored once: their column sums from the
                 * register (a 64-byte load of four 16-byte stores just made stalls on
                 * store forwarding: it was most of the pack's time) */
                __m512i v = _mm512_castsi128_si512(_mm_unpacklo_epi16(a, c));
                v = _mm512_inserti32x4(v, _mm_unpackhi_epi16(a, c), 1);
                v = _mm512_inserti32x4(v, _mm_unpacklo_epi16(b, d), 2);
                v = _mm512_inserti32x4(v, _mm_unpackhi_epi16(b, d), 3);
                _mm512_storeu_si512(out + g * 128 + 64 * h, v);
                if (h == 0)
                    cs0 = _mm512_dpbusd_epi32(cs0, ones, v);
                else
                    cs1 = _mm512_dpbusd_epi32(cs1, ones, v);
            }
        }
        _mm512_storeu_si512(q->colsum + p * 32, cs0);
        _mm512_storeu_si512(q->colsum + p * 32 + 16, cs1);
    }
}

/* out [batch, OC, OH, OW] = conv(x - x_zero, w - w_zero) of codes x [batch, C, H, W] (uint8,
 * or int8 where x_signed) and the weight prepared as A = w + woff [OC, K] uint8 with
 * a_zero = w_zero + woff and wsum[m] = sum_k (w - w_zero): int32 sums where scale is 0,
 * else float(sums + floor(bias / scale)) * scale (bias NULL: none). Returns -1 where the CPU
 * has no VNNI or memory runs out. */
int kiln_qconv(long batch, long C, long H, long W, const uint8_t *x, int x_signed, int x_zero,
               long OC, long kh, long kw, long sh, long sw, long ph, long pw, long dh, long dw,
               long OH, long OW, const uint8_t *A, int a_zero, const int32_t *wsum,
               const float *bias, float scale, void *out, int nthreads)
{
    if (kiln_qgemm_best_path() < 3)
        return -1;
    long K = C * kh * kw, kp = (K + 3) / 4 * 4, N = OH * OW, np = (N + 31) / 32;
    int8_t *packed = aligned_alloc(64, (size_t)(np * 32 * kp + 64));
    int32_t *colsum = aligned_alloc(64, (size_t)(np * 32 * 4 + 64));
    int32_t *row_add = malloc((size_t)OC * 4 + 4);
    if (!packed || !colsum || !row_add) {
        free(packed);
        free(colsum);
        free(row_add);
        return -1;
    }
    int xoff = x_signed ? 0 : 128;
    for (long m = 0; m < OC; m++)
        row_add[m] = (xoff - x_zero) * wsum[m] +
            (bias && scale != 0.0f ? (int32_t)floorf(bias[m] / scale) : 0);
    struct qconv q = {C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, OH, OW, K, kp, N, NULL,
                      (uint8_t)x_zero, x_signed ? 0 : 0x80, packed, colsum};
    float one = 1.0f, ep[6] = {0};
    if (OC * N * K < QCONV_SERIAL_WORK)
        nthreads = 1;
    for (long b = 0; b < batch; b++) {
        q.x = x + b * C * H * W;
        if (nthreads < 2 || np < 2 || K * N < (1L << 16))
            pack_panels(&q, 0, np);
        else
            kiln_parallel(np, pack_panels, &q, nthreads);
        void *y = (char *)out + b * OC * N * 4;
        kiln_qgemm_rows(3, OC, N, K, A, K, a_zero, packed, colsum, row_add,
                        scale != 0.0f ? scale : 1.0f, &one, 1, NULL, NULL, 0,
                        scale != 0.0f ? 0 : QACT_INT32, ep, y, N, nthreads);
    }
    free(packed);
    free(colsum);
    free(row_add);
    return 0;
}

/* DynamicQuantizeLinear of the float32 input x [batch, C, H, W] (its own range over the whole
 * tensor, quant.c's codes), then kiln_qconv's ConvIntegerScaled with S = x_scale * w_scale
 * (the float32 product the model's Mul computes): onnxruntime's DynamicQuantizeLinear ->
 * ConvInteger -> bias -> rescale chain in one call. Returns -1 where the CPU has no VNNI or
 * memory runs out. */
int kiln_dq_qconv(long batch, long C, long H, long W, const float *x, long OC, long kh, long kw,
                  long sh, long sw, long ph, long pw, long dh, long dw, long OH, long OW,
                  const uint8_t *A, int a_zero, const int32_t *wsum, const float *bias,
                  float w_scale, float *out, int nthreads)
{
    if (kiln_qgemm_best_path() < 3)
        return -1;
    long n = batch * C * H * W;
    uint8_t *codes = malloc((size_t)n + 64);
    if (!codes)
        return -1;
    float xs, xz;
    kiln_dynamic_quantize(n, x, codes, &xs, &xz, nthreads);
    int rc = kiln_qconv(batch, C, H, W, codes, 0, (int)xz, OC, kh, kw, sh, sw, ph, pw, dh, dw,
                        OH, OW, A, a_zero, wsum, bias, xs * w_scale, out, nthreads);
    free(codes);
    return rc;
}
