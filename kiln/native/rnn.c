/* ONNX RNN, GRU and LSTM recurrences: one direction over a whole sequence in one call.
 *
 * The input projection x W^T + biases is one GEMM the caller makes for every step at once; what
 * is left per step is h R^T (a GEMV per batch row) and the gate arithmetic, both here, so that
 * nothing runs in Python between steps. Each gate's columns are padded to HP (a multiple of 8)
 * so that every gate is whole vectors: the padded columns of the weights and biases are zero,
 * so the padded state columns stay zero and are never read back as h's inputs (the GEMV reads
 * only h's first H columns). Gate orders are ONNX's: RNN (h), GRU (z, r, h), LSTM (i, o, f, c).
 */
#include "kernels.h"

enum { RNN_RNN, RNN_GRU, RNN_LSTM };
enum { RNN_REVERSE = 1, RNN_LINEAR_BEFORE_RESET = 2, RNN_INPUT_FORGET = 4, RNN_CLIP = 8,
       RNN_VNNI = 16 /* kiln_dq_lstm: R as int8 VNNI panels (see gemv_vnni) */ };
/* activation codes (kiln/native/rnn.py's RNN_ACTIVATIONS) */
enum { RA_SIGMOID, RA_TANH, RA_RELU, RA_LEAKY_RELU, RA_HARD_SIGMOID, RA_AFFINE, RA_SCALED_TANH };

typedef struct {
    int code;
    float alpha, beta;
} rnn_act;

TGT static inline __m256 tanh256(__m256 v)  /* 2 sigmoid(2x) - 1 */
{
    return _mm256_fmsub_ps(_mm256_set1_ps(2.0f), sigmoid256(_mm256_add_ps(v, v)),
                           _mm256_set1_ps(1.0f));
}

TGT static inline __m256 apply(__m256 v, const rnn_act *a)
{
    __m256 al = _mm256_set1_ps(a->alpha), be = _mm256_set1_ps(a->beta);
    switch (a->code) {
    case RA_SIGMOID: return sigmoid256(v);
    case RA_TANH: return tanh256(v);
    case RA_RELU: return _mm256_max_ps(_mm256_setzero_ps(), v);
    case RA_LEAKY_RELU:
        return _mm256_blendv_ps(v, _mm256_mul_ps(v, al),
                                _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    case RA_HARD_SIGMOID:
        return _mm256_min_ps(_mm256_set1_ps(1.0f),
                             _mm256_max_ps(_mm256_setzero_ps(), _mm256_fmadd_ps(al, v, be)));
    case RA_AFFINE: return _mm256_fmadd_ps(al, v, be);
    case RA_SCALED_TANH: return _mm256_mul_ps(al, tanh256(_mm256_mul_ps(be, v)));
    default: return v;
    }
}

TGT static inline __m256 clip8(__m256 v, int on, float clip)
{
    if (!on)
        return v;
    return _mm256_min_ps(_mm256_set1_ps(clip), _mm256_max_ps(_mm256_set1_ps(-clip), v));
}

enum { RNN_PF = 8 };  /* rows ahead that gemv_acc prefetches */

TGT static void gemv_acc_ymm(long K, long j0, long j1, const float *h, const float *RT, long ldr,
                             float *acc);

/* AVX-512: blocks of 128 columns, eight zmm accumulators; each column's sum is the AVX2
 * block's (one chain over k in order) and the columns past the last 128-block take the AVX2
 * path, which splits them as it splits any, so the two ISAs give the same bits. */
TGT_ZMM static void gemv_acc_zmm(long K, long j0, long j1, const float *h, const float *RT,
                                 long ldr, float *acc)
{
    long j = j0;
    for (; j + 128 <= j1; j += 128) {
        __m512 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm512_loadu_ps(acc + j + 16 * u);
        for (long k = 0; k < K; k++) {
            __m512 hk = _mm512_set1_ps(h[k]);
            const float *r = RT + k * ldr + j;
            if (k + RNN_PF < K) {
                const char *f = (const char *)(r + RNN_PF * ldr);
                for (int c = 0; c < 8; c++) _mm_prefetch(f + 64 * c, _MM_HINT_T0);
            }
            for (int u = 0; u < 8; u++)
                a[u] = _mm512_fmadd_ps(hk, _mm512_loadu_ps(r + 16 * u), a[u]);
        }
        for (int u = 0; u < 8; u++) _mm512_storeu_ps(acc + j + 16 * u, a[u]);
    }
    if (j < j1)
        gemv_acc_ymm(K, j, j1, h, RT, ldr, acc);
}

/* acc[j0..j1) += h[0..K) RT[:, j0..j1) (RT row stride ldr); j0, j1 multiples of 8. */
TGT static void gemv_acc(long K, long j0, long j1, const float *h, const float *RT, long ldr,
                         float *acc)
{
    if (j1 - j0 >= 128 && kiln_use_avx512())
        gemv_acc_zmm(K, j0, j1, h, RT, ldr, acc);
    else
        gemv_acc_ymm(K, j0, j1, h, RT, ldr, acc);
}

/* Eight accumulators per 64-column block: enough independent FMAs to cover their latency. */
TGT static void gemv_acc_ymm(long K, long j0, long j1, const float *h, const float *RT, long ldr,
                             float *acc)
{
    long j = j0;
    for (; j + 64 <= j1; j += 64) {
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_loadu_ps(acc + j + 8 * u);
        for (long k = 0; k < K; k++) {
            __m256 hk = _mm256_broadcast_ss(h + k);
            const float *r = RT + k * ldr + j;
            if (k + RNN_PF < K) {  /* rows ldr apart: ahead of what the prefetchers follow */
                const char *f = (const char *)(r + RNN_PF * ldr);
                _mm_prefetch(f, _MM_HINT_T0); _mm_prefetch(f + 64, _MM_HINT_T0);
                _mm_prefetch(f + 128, _MM_HINT_T0); _mm_prefetch(f + 192, _MM_HINT_T0);
            }
            for (int u = 0; u < 8; u++) a[u] = _mm256_fmadd_ps(hk, _mm256_loadu_ps(r + 8 * u), a[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + j + 8 * u, a[u]);
    }
    for (; j + 8 <= j1; j += 8) {
        __m256 a0 = _mm256_loadu_ps(acc + j), a1 = _mm256_setzero_ps();
        long k = 0;
        for (; k + 2 <= K; k += 2) {
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(h + k), _mm256_loadu_ps(RT + k * ldr + j), a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(h + k + 1),
                                 _mm256_loadu_ps(RT + (k + 1) * ldr + j), a1);
        }
        for (; k < K; k++)
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(h + k), _mm256_loadu_ps(RT + k * ldr + j), a0);
        _mm256_storeu_ps(acc + j, _mm256_add_ps(a0, a1));
    }
}

struct gemv_job {
    long blocks, K, N, ldh, ldr, lda;
    const unsigned char *live;
    const float *h, *RT;
    float *acc;
};

/* items of (batch row, 64-column block) */
static void gemv_items(void *ctx, long i0, long i1)
{
    const struct gemv_job *g = ctx;
    for (long i = i0; i < i1; i++) {
        long b = i / g->blocks, q = i % g->blocks;
        if (!g->live[b])
            continue;
        long j0 = q * 64, j1 = j0 + 64 < g->N ? j0 + 64 : g->N;
        gemv_acc(g->K, j0, j1, g->h + b * g->ldh, g->RT, g->ldr, g->acc + b * g->lda);
    }
}

/* acc rows of the active batch rows += h rows RT[:, 0..N): split by column blocks over kiln's
 * team (team.c: the caller takes blocks too, so a worker the loaded machine has not scheduled
 * takes none and the step never waits for it) when the work is large enough to pay for it. */
TGT static void gemv_rows(long B, const unsigned char *live, long K, long N, const float *h,
                          long ldh, const float *RT, long ldr, float *acc, long lda, int nthreads)
{
    long blocks = (N + 63) / 64;
    int par = nthreads > 1 && blocks > 1 && B * K * N >= (1L << 17);
    if (!par) {
        for (long b = 0; b < B; b++)
            if (live[b])
                gemv_acc(K, 0, N, h + b * ldh, RT, ldr, acc + b * lda);
        return;
    }
    struct gemv_job g = {blocks, K, N, ldh, ldr, lda, live, h, RT, acc};
    kiln_parallel(B * blocks, gemv_items, &g, nthreads);
}

/* What kiln_rnn reads from its long array (pointers as integers), in this order. */
enum { P_KIND, P_DIRS, P_T, P_B, P_H, P_HP, P_I, P_XW, P_XWT, P_XWB, P_X, P_XT, P_XB, P_WT,
       P_BIAS, P_RT, P_RBH, P_PEEP, P_H0, P_C0, P_STATE_ROW, P_STATE_DIR, P_LENS, P_FLAGS,
       P_CODES, P_Y = P_CODES + 6, P_YT, P_YB, P_YDIR, P_YH, P_YC, P_THREADS, P_COUNT };
_Static_assert(P_COUNT == RNN_FIELDS, "kernels.h's RNN_FIELDS is kiln_rnn's argument count");

typedef struct {
    long kind, T, B, H, HP, I, N, xwt, xwb, xt, xb, ldw, srow;
    const float *xw, *x, *wt, *bias, *rt, *rbh, *peep, *h0, *c0;
    const long *lens;
    int flags, nthreads;
    float clip;
    rnn_act act[3];
    float *y, *yh, *yc;
    long yt, yb;
} rnn_dir;

/* One direction over T steps and B batch rows. Its input rows (x W^T + W's bias + R's bias,
 * except GRU's h gate, whose R bias is rbh) are read from xw when given, else made here per step
 * from x and wt (for short sequences, where a GEMM over all steps would cost more to call than
 * it saves). Returns 0, or 1 when scratch memory could not be had. */
TGT static int rnn_direction(const rnn_dir *q)
{
    long T = q->T, B = q->B, H = q->H, HP = q->HP, N = q->N, kind = q->kind;
    int reverse = q->flags & RNN_REVERSE, lbr = q->flags & RNN_LINEAR_BEFORE_RESET;
    int cl = (q->flags & RNN_CLIP) != 0;
    float clip = q->clip;
    const rnn_act *act = q->act;
    float *h = scratch(B * HP), *c = scratch(B * HP), *acc = scratch(B * N), *rh = scratch(HP);
    float *xa = q->xw ? NULL : scratch(B * N);
    unsigned char *live = malloc(B ? B : 1);
    if (!h || !c || !acc || !rh || !live || (!q->xw && !xa)) {
        free(h); free(c); free(acc); free(rh); free(live); free(xa);
        return 1;
    }
    memset(h, 0, sizeof(float) * B * HP);
    memset(c, 0, sizeof(float) * B * HP);
    for (long b = 0; b < B; b++) {
        if (q->h0) memcpy(h + b * HP, q->h0 + b * q->srow, sizeof(float) * H);
        if (q->c0) memcpy(c + b * HP, q->c0 + b * q->srow, sizeof(float) * H);
    }
    __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (long s = 0; s < T; s++) {
        long t = reverse ? T - 1 - s : s;
        for (long b = 0; b < B; b++) {
            live[b] = !q->lens || t < q->lens[b];
            if (xa && live[b]) {
                memcpy(xa + b * N, q->bias, sizeof(float) * N);
                gemv_acc(q->I, 0, N, q->x + t * q->xt + b * q->xb, q->wt, q->ldw, xa + b * N);
            }
            float *a = acc + b * N;
            const float *x = xa ? xa + b * N : q->xw + t * q->xwt + b * q->xwb;
            if (kind == RNN_GRU) {  /* z, r from x; h's R part starts from its R bias */
                memcpy(a, x, sizeof(float) * 2 * HP);
                if (q->rbh) memcpy(a + 2 * HP, q->rbh, sizeof(float) * HP);
                else memset(a + 2 * HP, 0, sizeof(float) * HP);
            } else {
                memcpy(a, x, sizeof(float) * N);
            }
        }
        /* GRU without linear_before_reset multiplies r into h before h's GEMV: done below */
        long ncols = kind == RNN_GRU && !lbr ? 2 * HP : N;
        gemv_rows(B, live, H, ncols, h, HP, q->rt, N, acc, N, q->nthreads);
        for (long b = 0; b < B; b++) {
            float *hb = h + b * HP, *cb = c + b * HP, *a = acc + b * N;
            float *yb = q->y ? q->y + t * q->yt + b * q->yb : NULL;
            if (!live[b]) {
                if (yb) memset(yb, 0, sizeof(float) * H);
                continue;
            }
            const float *x = xa ? xa + b * N : q->xw + t * q->xwt + b * q->xwb;
            if (kind == RNN_RNN) {
                for (long j = 0; j < HP; j += 8)
                    _mm256_storeu_ps(hb + j, apply(clip8(_mm256_loadu_ps(a + j), cl, clip),
                                                   &act[0]));
            } else if (kind == RNN_GRU) {
                for (long j = 0; j < 2 * HP; j += 8)  /* z, r */
                    _mm256_storeu_ps(a + j, apply(clip8(_mm256_loadu_ps(a + j), cl, clip),
                                                  &act[0]));
                if (!lbr) {  /* h's R part: (r * h) Rh^T + Rbh */
                    for (long j = 0; j < HP; j += 8)
                        _mm256_storeu_ps(rh + j, _mm256_mul_ps(_mm256_loadu_ps(a + HP + j),
                                                               _mm256_loadu_ps(hb + j)));
                    gemv_acc(H, 0, HP, rh, q->rt + 2 * HP, N, a + 2 * HP);
                }
                for (long j = 0; j < HP; j += 8) {
                    __m256 z = _mm256_loadu_ps(a + j), r = _mm256_loadu_ps(a + HP + j);
                    __m256 hr = _mm256_loadu_ps(a + 2 * HP + j);
                    __m256 pre = _mm256_add_ps(_mm256_loadu_ps(x + 2 * HP + j),
                                               lbr ? _mm256_mul_ps(r, hr) : hr);
                    __m256 ht = apply(clip8(pre, cl, clip), &act[1]);
                    __m256 hv = _mm256_loadu_ps(hb + j);  /* (1 - z) ht + z h */
                    _mm256_storeu_ps(hb + j, _mm256_fmadd_ps(z, _mm256_sub_ps(hv, ht), ht));
                }
            } else {
                const float *peep = q->peep;
                for (long j = 0; j < HP; j += 8) {
                    __m256 cv = _mm256_loadu_ps(cb + j);
                    __m256 gi = _mm256_loadu_ps(a + j), go = _mm256_loadu_ps(a + HP + j);
                    __m256 gf = _mm256_loadu_ps(a + 2 * HP + j);
                    __m256 gc = _mm256_loadu_ps(a + 3 * HP + j);
                    __m256 pi = peep ? _mm256_loadu_ps(peep + j) : zero;
                    __m256 po = peep ? _mm256_loadu_ps(peep + HP + j) : zero;
                    __m256 pf = peep ? _mm256_loadu_ps(peep + 2 * HP + j) : zero;
                    __m256 it = apply(clip8(_mm256_fmadd_ps(pi, cv, gi), cl, clip), &act[0]);
                    __m256 ft = q->flags & RNN_INPUT_FORGET ? _mm256_sub_ps(one, it)
                        : apply(clip8(_mm256_fmadd_ps(pf, cv, gf), cl, clip), &act[0]);
                    __m256 ct = apply(clip8(gc, cl, clip), &act[1]);
                    __m256 cn = _mm256_fmadd_ps(ft, cv, _mm256_mul_ps(it, ct));
                    __m256 ot = apply(clip8(_mm256_fmadd_ps(po, cn, go), cl, clip), &act[0]);
                    _mm256_storeu_ps(cb + j, cn);
                    _mm256_storeu_ps(hb + j, _mm256_mul_ps(ot, apply(cn, &act[2])));
                }
            }
            if (yb) memcpy(yb, hb, sizeof(float) * H);
        }
    }
    for (long b = 0; b < B; b++) {
        if (q->yh) memcpy(q->yh + b * q->srow, h + b * HP, sizeof(float) * H);
        if (q->yc) memcpy(q->yc + b * q->srow, c + b * HP, sizeof(float) * H);
    }
    free(h); free(c); free(acc); free(rh); free(live); free(xa);
    return 0;
}

struct rnn_dirs {
    rnn_dir *q;
    _Atomic int rc;
};

static void rnn_dir_items(void *ctx, long i0, long i1)
{
    struct rnn_dirs *d = ctx;
    for (long i = i0; i < i1; i++)
        if (rnn_direction(&d->q[i]) != 0)
            d->rc = 1;
}

/* An RNN, GRU or LSTM node, every direction (the second, of a bidirectional node, runs in
 * reverse; with two threads the two run side by side when there is enough work for it).
 * p: the P_* entries (pointers as integers; a 0 pointer is absent), per direction d the
 * weights at rt + d*H*N, wt columns + d*N, bias + d*N, rbh + d*HP, peep + d*3*HP, states
 * (h0, c0, yh, yc: [B, H] at row stride P_STATE_ROW) + d*P_STATE_DIR, y + d*P_YDIR, xw + d*N;
 * y[t, b] at y + t*P_YT + b*P_YB, xw[t, b] at xw + t*P_XWT + b*P_XWB, x[t, b] likewise.
 * f: clip, then per direction 3 alphas and 3 betas. acts: P_CODES + 3*d .. + 2 (f, g, h as ONNX
 * names them; RNN reads f only, GRU f and g). Returns 0, or 1 when memory ran out. */
TGT int kiln_rnn(const long *p, const float *f)
{
    long dirs = p[P_DIRS], kind = p[P_KIND], HP = p[P_HP], H = p[P_H];
    long G = kind == RNN_LSTM ? 4 : kind == RNN_GRU ? 3 : 1, N = G * HP;
    rnn_dir q[2];
    for (long d = 0; d < dirs && d < 2; d++) {
        rnn_dir *r = &q[d];
        long so = d * p[P_STATE_DIR];
#define PTR(k, off) (p[k] ? (float *)p[k] + (off) : NULL)
        *r = (rnn_dir){
            .kind = kind, .T = p[P_T], .B = p[P_B], .H = H, .HP = HP, .I = p[P_I], .N = N,
            .xwt = p[P_XWT], .xwb = p[P_XWB], .xt = p[P_XT], .xb = p[P_XB], .ldw = dirs * N,
            .srow = p[P_STATE_ROW], .xw = PTR(P_XW, d * N), .x = PTR(P_X, 0),
            .wt = PTR(P_WT, d * N), .bias = PTR(P_BIAS, d * N), .rt = PTR(P_RT, d * H * N),
            .rbh = PTR(P_RBH, d * HP), .peep = PTR(P_PEEP, d * 3 * HP), .h0 = PTR(P_H0, so),
            .c0 = PTR(P_C0, so), .lens = (const long *)p[P_LENS],
            .flags = (int)p[P_FLAGS] | (d == 1 ? RNN_REVERSE : 0), .nthreads = (int)p[P_THREADS],
            .clip = f[0], .y = PTR(P_Y, d * p[P_YDIR]), .yh = PTR(P_YH, so),
            .yc = PTR(P_YC, so), .yt = p[P_YT], .yb = p[P_YB]};
#undef PTR
        for (int i = 0; i < 3; i++)
            r->act[i] = (rnn_act){(int)p[P_CODES + 3 * d + i], f[1 + 6 * d + i], f[4 + 6 * d + i]};
    }
    long work = p[P_T] * p[P_B] * H * N;
    int side = dirs == 2 && p[P_THREADS] > 1 && work >= (1L << 20);
    int rc = 0;
    if (side) {  /* on kiln's team: a worker that gets no core leaves both to the caller */
        q[0].nthreads = q[1].nthreads = 1;
        struct rnn_dirs d = {q, 0};
        kiln_parallel(2, rnn_dir_items, &d, 2);
        rc = d.rc;
    } else {
        for (long d = 0; d < dirs && d < 2; d++) rc |= rnn_direction(&q[d]);
    }
    return rc;
}

/* v[0..n) = act(v), tails through a padded vector */
TGT static void apply_n(float *v, long n, const rnn_act *a)
{
    long i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(v + i, apply(_mm256_loadu_ps(v + i), a));
    if (i < n) {
        float t[8] = {0};
        for (long k = i; k < n; k++) t[k - i] = v[k];
        _mm256_storeu_ps(t, apply(_mm256_loadu_ps(t), a));
        for (long k = i; k < n; k++) v[k] = t[k - i];
    }
}

static void clip_n(float *v, long n, float clip)
{
    for (long i = 0; i < n; i++) v[i] = v[i] < -clip ? -clip : v[i] > clip ? clip : v[i];
}

/* scale and zero point of h's range widened to hold 0 (DynamicQuantizeLinear's float32 steps)
 * and q = codes - zero point */
static void quantize_rows(long n, const float *h, short *q, float *scale, int *zero)
{
    float lo = 0.0f, hi = 0.0f;
    for (long i = 0; i < n; i++) {
        lo = h[i] < lo ? h[i] : lo;
        hi = h[i] > hi ? h[i] : hi;
    }
    float s = hi == lo ? 1.0f : (hi - lo) / 255.0f, z = -lo / s;
    z = nearbyintf(z < 0.0f ? 0.0f : z > 255.0f ? 255.0f : z);
    for (long i = 0; i < n; i++) {
        float c = nearbyintf(h[i] / s) + z;
        q[i] = (short)((c < 0.0f ? 0.0f : c > 255.0f ? 255.0f : c) - z);
    }
    *scale = s;
    *zero = (int)z;
}

#define TGTV __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

/* acc[0..N) = q[0..K) R as int32, exactly, on AVX512-VNNI: q the codes minus zero point z
 * (int16, |q| <= 255), R int8 in qgemm.c's VNNI panels (32 columns x groups of 4 rows, 128
 * bytes a group) after its column sums (int32, N rounded up to 32): the codes (q + z, uint8)
 * times R by vpdpbusd, minus z times the column sums. Half R's bytes of gemv_i16's pairs. */
TGTV static void gemv_vnni(long K, long N, const short *q, int z, const void *r, int *acc)
{
    long kg = (K + 3) / 4, np = (N + 31) / 32;
    const int32_t *cs = r;
    const int8_t *b = (const int8_t *)r + np * 32 * 4;
    uint32_t words[kg];
    for (long g = 0; g < kg; g++) {
        uint32_t w = 0;
        for (int e = 0; e < 4 && 4 * g + e < K; e++)
            w |= (uint32_t)(uint8_t)(q[4 * g + e] + z) << (8 * e);
        words[g] = w;
    }
    __m512i vz = _mm512_set1_epi32(z);
    for (long p = 0; p < np; p++) {
        const int8_t *bp = b + p * 32 * kg * 4;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, c0 = a0, c1 = a0;
        long g = 0;
        for (; g + 2 <= kg; g += 2) {
            __m512i x0 = _mm512_set1_epi32((int)words[g]), x1 = _mm512_set1_epi32((int)words[g + 1]);
            a0 = _mm512_dpbusd_epi32(a0, x0, _mm512_loadu_si512(bp + g * 128));
            a1 = _mm512_dpbusd_epi32(a1, x0, _mm512_loadu_si512(bp + g * 128 + 64));
            c0 = _mm512_dpbusd_epi32(c0, x1, _mm512_loadu_si512(bp + g * 128 + 128));
            c1 = _mm512_dpbusd_epi32(c1, x1, _mm512_loadu_si512(bp + g * 128 + 192));
        }
        if (g < kg) {
            __m512i x0 = _mm512_set1_epi32((int)words[g]);
            a0 = _mm512_dpbusd_epi32(a0, x0, _mm512_loadu_si512(bp + g * 128));
            a1 = _mm512_dpbusd_epi32(a1, x0, _mm512_loadu_si512(bp + g * 128 + 64));
        }
        a0 = _mm512_sub_epi32(_mm512_add_epi32(a0, c0),
                              _mm512_mullo_epi32(vz, _mm512_loadu_si512(cs + p * 32)));
        a1 = _mm512_sub_epi32(_mm512_add_epi32(a1, c1),
                              _mm512_mullo_epi32(vz, _mm512_loadu_si512(cs + p * 32 + 16)));
        _mm512_storeu_si512(acc + p * 32, a0);
        _mm512_storeu_si512(acc + p * 32 + 16, a1);
    }
}

/* acc[0..N) = q[0..K) r as int32, exactly: r holds the int16 rows in pairs, r[(i N + j) 2 + e]
 * = R[2 i + e][j] (K even), so that one vpmaddwd adds two rows' products (|q|, |R| <= 255:
 * no overflow). */
TGT static void gemv_i16(long K, long N, const short *q, const short *r, int *acc)
{
    long j = 0;
    for (; j + 64 <= N; j += 64) {
        __m256i a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_si256();
        for (long i = 0; i < K / 2; i++) {
            int pair = (unsigned short)q[2 * i] | ((unsigned)(unsigned short)q[2 * i + 1] << 16);
            if (!pair)
                continue;
            __m256i qp = _mm256_set1_epi32(pair);
            const short *ri = r + (i * N + j) * 2;
            for (int u = 0; u < 8; u++)
                a[u] = _mm256_add_epi32(a[u], _mm256_madd_epi16(
                    qp, _mm256_loadu_si256((const __m256i *)(ri + 16 * u))));
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_si256((__m256i *)(acc + j + 8 * u), a[u]);
    }
    for (; j + 8 <= N; j += 8) {
        __m256i a = _mm256_setzero_si256();
        for (long i = 0; i < K / 2; i++) {
            int pair = (unsigned short)q[2 * i] | ((unsigned)(unsigned short)q[2 * i + 1] << 16);
            a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_set1_epi32(pair), _mm256_loadu_si256(
                (const __m256i *)(r + (i * N + j) * 2))));
        }
        _mm256_storeu_si256((__m256i *)(acc + j), a);
    }
    for (; j < N; j++) {
        int a = 0;
        for (long i = 0; i < K / 2; i++)
            a += q[2 * i] * r[(i * N + j) * 2] + q[2 * i + 1] * r[(i * N + j) * 2 + 1];
        acc[j] = a;
    }
}

/* com.microsoft DynamicQuantizeLSTM's recurrence, one forward direction, in the float32 steps
 * of kiln's PyTorch kernel (kiln/kernels/torch/dynamic_quantize_lstm.py): each step quantizes
 * the previous step's output rows [B, H] together from their own range, multiplies the codes
 * minus the zero point by R's codes minus its zero points (rq [H, 4H]; float32 sums of
 * integers, exact: the caller checked that 255 sum_k |rq[k][j]| stays below 2**24), scales the
 * product back by h_scale * rs[j], adds the input rows xw [T, B, 4H] and the bias, then runs
 * the gates (i, o, f, c), peepholes and clip as ONNX's LSTM. g: T, B, H, flags (RNN_*), acts:
 * f, g, h codes; ab: their alphas then betas. Each sum is its own float32 operation (no fused
 * multiply-add), as PyTorch computes them. Returns 1 when scratch memory ran out. */
__attribute__((target("avx2,fma"), optimize("fp-contract=off")))
int kiln_dq_lstm(const long *g, const int *acts, const float *ab, float clip, const float *xw,
                 const short *rq, const float *rs, const float *bias, const float *peep,
                 const float *h0, const float *c0, const long *lens, float *y, float *yh,
                 float *yc)
{
    long T = g[0], B = g[1], H = g[2], N = 4 * H;
    int flags = (int)g[3], cl = (flags & RNN_CLIP) != 0, forget = (flags & RNN_INPUT_FORGET) != 0;
    rnn_act f = {acts[0], ab[0], ab[3]}, gg = {acts[1], ab[1], ab[4]}, hf = {acts[2], ab[2], ab[5]};
    long K = H + (H & 1);  /* rq's rows, padded to pairs */
    int vnni = (flags & RNN_VNNI) != 0;
    size_t bh = sizeof(float) * (B * K > 0 ? B * K : 1);
    size_t nb = sizeof(float) * ((N + 31) / 32 * 32 > 0 ? (N + 31) / 32 * 32 : 1);
    float *prev = malloc(bh), *c = malloc(bh), *acc = malloc(nb), *m = malloc(nb);
    short *q = calloc(B * K > 0 ? B * K : 1, sizeof(short));
    int *iacc = malloc(nb);
    if (!prev || !q || !c || !acc || !m || !iacc) {
        free(prev); free(q); free(c); free(acc); free(m); free(iacc);
        return 1;
    }
    for (long i = 0; i < B * H; i++) {
        prev[i] = h0 ? h0[i] : 0.0f;
        c[i] = c0 ? c0[i] : 0.0f;
        yh[i] = 0.0f;
        yc[i] = 0.0f;
    }
    for (long t = 0; t < T; t++) {
        float s;
        int z;
        quantize_rows(B * H, prev, q, &s, &z);  /* all rows together, one scale */
        for (long b = B - 1; b > 0; b--) {  /* rows K apart: a zero code pads an odd H */
            memmove(q + b * K, q + b * H, sizeof(short) * H);
            if (K > H) q[b * K + H] = 0;
        }
        if (K > H) q[H] = 0;
        for (long j = 0; j < N; j++) m[j] = rs[j] * s;
        for (long b = 0; b < B; b++) {
            const float *x = xw + (t * B + b) * N;
            float *cb = c + b * H, *hb = y + (t * B + b) * H;
            if (vnni)
                gemv_vnni(H, N, q + b * K, z, rq, iacc);
            else
                gemv_i16(K, N, q + b * K, rq, iacc);
            for (long j = 0; j < N; j++) {
                float p = (float)iacc[j] * m[j];
                float sum = x[j] + p;
                acc[j] = sum + bias[j];
            }
            float *gi = acc, *go = acc + H, *gf = acc + 2 * H, *gc = acc + 3 * H;
            if (peep) {
                for (long k = 0; k < H; k++) {
                    float pi = peep[k] * cb[k], pf = peep[2 * H + k] * cb[k];
                    gi[k] = gi[k] + pi;
                    gf[k] = gf[k] + pf;
                }
            }
            if (cl) {
                clip_n(gi, H, clip);
                clip_n(gf, H, clip);
                clip_n(gc, H, clip);
            }
            apply_n(gi, H, &f);
            if (forget)
                for (long k = 0; k < H; k++) gf[k] = 1.0f - gi[k];
            else
                apply_n(gf, H, &f);
            apply_n(gc, H, &gg);
            for (long k = 0; k < H; k++) {
                float fc = gf[k] * cb[k], ic = gi[k] * gc[k];
                cb[k] = fc + ic;
            }
            if (peep) {
                for (long k = 0; k < H; k++) {
                    float po = peep[H + k] * cb[k];
                    go[k] = go[k] + po;
                }
            }
            if (cl)
                clip_n(go, H, clip);
            apply_n(go, H, &f);
            for (long k = 0; k < H; k++) gc[k] = cb[k];  /* h(c) in gc's place */
            apply_n(gc, H, &hf);
            int live = t < lens[b], ending = t + 1 == lens[b];
            for (long k = 0; k < H; k++) {
                float h = go[k] * gc[k];
                hb[k] = live ? h : 0.0f;
                prev[b * H + k] = hb[k];
                if (ending) {
                    yh[b * H + k] = h;
                    yc[b * H + k] = cb[k];
                }
            }
        }
    }
    free(prev); free(q); free(c); free(acc); free(m); free(iacc);
    return 0;
}

/* kiln_dq_lstm of several directions (a bidirectional layer's two), each direction an item of
 * kiln's team: on two cores each keeps its own R in its own L2 across the steps. args: per
 * direction 14 pointers (g acts ab xw rq rs bias peep h0 c0 lens y yh yc), clips: one per
 * direction. Returns 1 when scratch memory ran out for any of them. */
struct dq_dirs {
    void *const *args;
    const float *clips;
    _Atomic int failed;
};

static void dq_dir_items(void *ctx, long i0, long i1)
{
    struct dq_dirs *d = ctx;
    for (long i = i0; i < i1; i++) {
        void *const *a = d->args + 14 * i;
        if (kiln_dq_lstm(a[0], a[1], a[2], d->clips[i], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                         a[10], a[11], a[12], a[13]) != 0)
            d->failed = 1;
    }
}

int kiln_dq_lstm_dirs(long ndirs, void *const *args, const float *clips, int nthreads)
{
    struct dq_dirs d = {args, clips, 0};
    kiln_parallel(ndirs, dq_dir_items, &d, nthreads);
    return d.failed;
}

/* A native program's record of a recurrent node (kiln/engine/program_rnn.py):
 * kind, fparam, kiln_rnn's long array (the constants' pointers in place), then (buf off) for
 * xw x h0 c0 y yh yc (buf -1: absent), resolved against the program's buffers here. */
TGT int kiln_rnn_record(const long *rec, const float *fp, float *const *bufs, int nthreads)
{
    static const int fields[RNN_RECORD_BUFS] = {P_XW, P_X, P_H0, P_C0, P_Y, P_YH, P_YC};
    long p[P_COUNT];
    memcpy(p, rec + 2, sizeof p);
    const long *q = rec + 2 + P_COUNT;
    for (int k = 0; k < RNN_RECORD_BUFS; k++)
        p[fields[k]] = q[2 * k] >= 0 ? (long)(bufs[q[2 * k]] + q[2 * k + 1]) : 0;
    p[P_THREADS] = nthreads;
    return kiln_rnn(p, fp + rec[1]);
}
