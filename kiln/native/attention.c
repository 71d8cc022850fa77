/* Attention:
 * softmax(scale Q K^T + bias, causal) V for float32, one (batch, head) per work item: K^T and V
 * of the head are packed into panels (kiln_sgemm_pack) and both products run on the GEMM's
 * tiles; the scores of QC query rows at a time live in a per-thread scratch row block. */
#include "kernels.h"

#define QC 128
/* multiply-adds (both products, all heads) below which a record runs on the caller's thread */
#define ATTN_SERIAL_WORK (64L * 64 * 64)

/* One row of scores s[0, n) (n keys, lim of them allowed) turned into unnormalized
 * probabilities in place: x = scale s + bias (bias: NULL, or element j at bias[j * bk]), then
 * e^(x - max); keys from lim on get 0. Returns 1 / sum, which the caller applies to the row's
 * output (Dv values instead of n here). A row with no allowed key, or whose allowed keys are all
 * -inf, becomes all zeros (ONNX's rule; SDPA would give NaN); a NaN score makes the row NaN. */
TGT static float softmax_row(float *s, long n, long lim, float scale, const float *bias, long bk)
{
    long j;
    __m256 sc = _mm256_set1_ps(scale), mx = _mm256_set1_ps(-INFINITY);
    __m256 nan = _mm256_setzero_ps();  /* lanes that saw a NaN (max_ps would drop it) */
    if (bias && bk != 1)
        for (j = 0; j < lim; j++) s[j] = s[j] * scale + bias[j * bk];
    for (j = 0; j + 8 <= lim; j += 8) {  /* scale (unless done above) and take the max */
        __m256 x = _mm256_loadu_ps(s + j);
        if (!bias || bk == 1) {
            x = bias ? _mm256_fmadd_ps(x, sc, _mm256_loadu_ps(bias + j)) : _mm256_mul_ps(x, sc);
            _mm256_storeu_ps(s + j, x);
        }
        mx = _mm256_max_ps(mx, x);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    float m;
    {
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        m = _mm256_movemask_ps(nan) ? NAN : _mm_cvtss_f32(h);
    }
    for (; j < lim; j++) {
        if (!bias || bk == 1) s[j] = s[j] * scale + (bias ? bias[j] : 0.0f);
        m = (s[j] > m || s[j] != s[j]) ? s[j] : m;
    }
    if (!(m > -INFINITY)) {  /* nothing allowed (or NaN: propagate it) */
        float fill = m != m ? m : 0.0f;
        for (j = 0; j < n; j++) s[j] = fill;
        return 1.0f;
    }
    __m256 mv = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
    for (j = 0; j + 8 <= lim; j += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        acc = _mm256_add_ps(acc, e);
        _mm256_storeu_ps(s + j, e);
    }
    float sum = hsum256(acc);
    for (; j < lim; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    for (; j < n; j++) s[j] = 0.0f;
    return 1.0f / sum;
}

/* y[0, n) = f x[0, n) */
TGT static void scaled_copy(float *y, const float *x, long n, float f)
{
    __m256 fv = _mm256_set1_ps(f);
    long e = 0;
    for (; e + 8 <= n; e += 8) _mm256_storeu_ps(y + e, _mm256_mul_ps(_mm256_loadu_ps(x + e), fv));
    for (; e < n; e++) y[e] = x[e] * f;
}

/* How many of Skv keys query i sees: all without a causal mask (causal < 0), else keys
 * j <= i + causal. */
static long visible(long i, long Skv, long causal)
{
    if (causal < 0) return Skv;
    long n = i + causal + 1;
    return n < 0 ? 0 : n > Skv ? Skv : n;
}


/* Y[b, i, h, :] = softmax(scale Q[b, h, i, :] . K[b, h, j, :] + bias[b, h, i, j]) V[b, h, j, :]
 * for B batches, H heads, Sq queries, Skv keys, head size D (value size Dv). Every tensor is
 * given by a pointer and its strides in elements for (b, h, row); the last dim is contiguous.
 * bias may be NULL; its strides may be 0 (broadcast) and its key stride is bk. causal >= 0:
 * query i sees keys j <= i + causal only (the absolute offset of query 0); -1: no causal mask.
 * Query heads map to key/value heads h / (H / Hkv) (grouped-query attention). Returns 0, or -1
 * when scratch memory could not be had (Y is then incomplete). */
struct attn_job {
    long H, group, Sq, Skv, D, Dv, qc, pk, pv, skp, dvp;
    const float *Q, *K, *V, *bias;
    long qb, qh, qs, kb, kh, ks, vb, vh, vs, bb, bh, bq, bk, causal;
    float scale;
    float *Y;
    long yb, yh, ys;
    _Atomic int failed;
};

/* (batch, head) items [i0, i1) of a job, with their own scratch. */
static void attention_items(void *ctx, long i0, long i1)
{
    struct attn_job *j = ctx;
    long Sq = j->Sq, Skv = j->Skv, D = j->D, Dv = j->Dv, qc = j->qc, skp = j->skp,
         dvp = j->dvp, causal = j->causal;
    float *kp = scratch(j->pk), *vp = scratch(j->pv), *sb = scratch(qc * skp),
          *ob = scratch(qc * dvp);
    float inv[QC];  /* each query row's 1 / sum of its softmax */
    if (!kp || !vp || !sb || !ob) {
        j->failed = 1;
        i1 = i0;
    }
    for (long it = i0; it < i1; it++) {
        long b = it / j->H, h = it % j->H, hk = h / j->group;
        const float *k = j->K + b * j->kb + hk * j->kh, *v = j->V + b * j->vb + hk * j->vh;
        const float *q = j->Q + b * j->qb + h * j->qh;
        float *y = j->Y + b * j->yb + h * j->yh;
        kiln_sgemm_pack(D, Skv, k, 1, j->ks, kp);   /* B(d, jj) = K[jj, d] */
        kiln_sgemm_pack(Skv, Dv, v, j->vs, 1, vp);  /* B(jj, e) = V[jj, e] */
        for (long r0 = 0; r0 < Sq; r0 += qc) {
            long rows = Sq - r0 < qc ? Sq - r0 : qc;
            long lim = visible(r0 + rows - 1, Skv, causal);  /* keys any row may see */
            long panels = (lim + NR - 1) / NR;
            if (panels > 0)
                kiln_gemm_block(0, rows, 0, panels, skp, D, q + r0 * j->qs, j->qs, kp, NULL, NULL,
                                0, sb, skp, ACT_NONE, 0.0f, 0.0f);
            for (long r = 0; r < rows; r++) {
                long i = r0 + r;
                const float *br = j->bias ? j->bias + b * j->bb + h * j->bh + i * j->bq : NULL;
                inv[r] = softmax_row(sb + r * skp, Skv, visible(i, Skv, causal), j->scale, br,
                                     j->bk);
            }
            kiln_gemm_block(0, rows, 0, dvp / NR, dvp, Skv, sb, skp, vp, NULL, NULL, 0, ob, dvp,
                            ACT_NONE, 0.0f, 0.0f);
            for (long r = 0; r < rows; r++)  /* the softmax's normalization, applied here */
                scaled_copy(y + (r0 + r) * j->ys, ob + r * dvp, Dv, inv[r]);
        }
    }
    free(kp); free(vp); free(sb); free(ob);
}

int kiln_attention(long B, long H, long Hkv, long Sq, long Skv, long D, long Dv,
                   const float *Q, long qb, long qh, long qs,
                   const float *K, long kb, long kh, long ks,
                   const float *V, long vb, long vh, long vs,
                   const float *bias, long bb, long bh, long bq, long bk,
                   long causal, float scale, float *Y, long yb, long yh, long ys, int nthreads)
{
    if (B <= 0 || H <= 0 || Sq <= 0 || Skv <= 0 || D <= 0 || Dv <= 0) return 0;
    if (nthreads < 1) nthreads = 1;
    long items = B * H;
    /* both products run on whole panels (the padding columns are zeros, cheaper to multiply
     * than to cut off with a narrow tile): scores are Skv_pad wide, the values' product lands
     * Dv_pad wide in scratch and its Dv columns are copied out, scaled by the row's 1 / sum */
    struct attn_job j = {H, H / Hkv, Sq, Skv, D, Dv, Sq < QC ? Sq : QC,
                         kiln_sgemm_packed_size(D, Skv), kiln_sgemm_packed_size(Skv, Dv),
                         (Skv + NR - 1) / NR * NR, (Dv + NR - 1) / NR * NR, Q, K, V, bias,
                         qb, qh, qs, kb, kh, ks, vb, vh, vs, bb, bh, bq, bk, causal, scale,
                         Y, yb, yh, ys, 0};
    /* the (batch, head) items go to kiln's team (team.c), not an OpenMP region, which woke a
     * sleeping thread per record under the passive wait policy; a decoder step's attention (one
     * query row per head, a few dozen keys) is a few thousand multiply-adds a head and runs on
     * the caller's thread (handing items out cost more than the whole record) */
    if (items * Sq * Skv * (D + Dv) < ATTN_SERIAL_WORK || nthreads == 1 || items == 1)
        attention_items(&j, 0, items);
    else
        kiln_parallel(items, attention_items, &j, nthreads);
    return j.failed ? -1 : 0;
}
