/* Elementwise ops over strided tensors (up to PW_RANK dims): y = op(a) or y = op(a, b), where
 * every operand has its own strides over y's index space (0 where it broadcasts), so one kernel
 * covers activations, ONNX-broadcasting arithmetic, transposing copies and writing into a slice
 * (concatenation). The vector math is kernels.h's (the GEMM epilogue's), so an activation run
 * here and one fused into a GEMM agree. */
#include "kernels.h"

/* op codes: 0-9 are the ACT_* codes (0: a copy); then unary 10+, binary 32+. The last few
 * serve bool values, which a program keeps as float 0/1 (kiln/engine/program_bool.py):
 * NONZERO is a != 0 as 0/1 (Cast to bool: NaN is true), SELECT a != 0 ? p0 : p1 (Where of two
 * scalars, Not), SELECT_B a != 0 ? b : p0 and SELECT_A a != 0 ? p0 : b (Where of a tensor and a
 * scalar), NE a != b as 0/1 (Xor). */
enum { PW_EXP = 10, PW_NEG, PW_ABS, PW_SQRT, PW_RECIP, PW_HARD_SIGMOID, PW_QDQ_U8, PW_QDQ_S8,
       PW_NONZERO, PW_SELECT };
enum { PW_ADD = 32, PW_SUB, PW_MUL, PW_DIV, PW_MAX, PW_MIN, PW_PRELU, PW_SELECT_B, PW_SELECT_A,
       PW_NE };

/* QuantizeLinear then DequantizeLinear with one scale s and zero point z:
 * (clamp(round(x / s) + z, lo, hi) - z) * s, each step the float32 operation kiln's torch
 * kernels (and onnxruntime) do: a true division, round half to even, so the codes are the
 * same to the bit. */
TGT static inline __m256 qdq8(__m256 x, float s, float z, float lo, float hi)
{
    __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
    __m256 q = _mm256_round_ps(_mm256_div_ps(x, vs), _MM_FROUND_TO_NEAREST_INT |
                               _MM_FROUND_NO_EXC);
    q = _mm256_add_ps(q, vz);
    q = _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
    return _mm256_mul_ps(_mm256_sub_ps(q, vz), vs);
}

TGT static inline __m256 unary8(int op, __m256 a, float p0, float p1)
{
    switch (op) {
    case PW_EXP: return exp256(a);
    case PW_NEG: return _mm256_sub_ps(_mm256_setzero_ps(), a);
    case PW_ABS: return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);
    case PW_SQRT: return _mm256_sqrt_ps(a);
    case PW_RECIP: return _mm256_div_ps(_mm256_set1_ps(1.0f), a);
    case PW_HARD_SIGMOID:  /* max(0, min(1, alpha x + beta)) */
        return _mm256_min_ps(_mm256_set1_ps(1.0f), _mm256_max_ps(
            _mm256_setzero_ps(), _mm256_fmadd_ps(a, _mm256_set1_ps(p0), _mm256_set1_ps(p1))));
    case PW_QDQ_U8:
        return qdq8(a, p0, p1, 0.0f, 255.0f);
    case PW_QDQ_S8:
        return qdq8(a, p0, p1, -128.0f, 127.0f);
    case PW_NONZERO:
        return _mm256_and_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_UQ),
                             _mm256_set1_ps(1.0f));
    case PW_SELECT:
        return _mm256_blendv_ps(_mm256_set1_ps(p1), _mm256_set1_ps(p0),
                                _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    default: return act256(a, op, p0, p1);
    }
}

TGT static inline __m256 binary8(int op, __m256 a, __m256 b, float p0)
{
    switch (op) {
    case PW_ADD: return _mm256_add_ps(a, b);
    case PW_SUB: return _mm256_sub_ps(a, b);
    case PW_MUL: return _mm256_mul_ps(a, b);
    case PW_DIV: return _mm256_div_ps(a, b);
    /* NaN in either operand gives NaN, as torch.maximum/minimum do */
    case PW_MAX: {
        __m256 m = _mm256_max_ps(a, b), nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
        return _mm256_blendv_ps(m, _mm256_add_ps(a, b), nan);
    }
    case PW_MIN: {
        __m256 m = _mm256_min_ps(a, b), nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
        return _mm256_blendv_ps(m, _mm256_add_ps(a, b), nan);
    }
    case PW_PRELU:
        return _mm256_blendv_ps(a, _mm256_mul_ps(a, b),
                                _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_LT_OQ));
    case PW_SELECT_B:
        return _mm256_blendv_ps(_mm256_set1_ps(p0), b,
                                _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    case PW_SELECT_A:
        return _mm256_blendv_ps(b, _mm256_set1_ps(p0),
                                _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    case PW_NE:
        return _mm256_and_ps(_mm256_cmp_ps(a, b, _CMP_NEQ_UQ), _mm256_set1_ps(1.0f));
    default: return a;
    }
}

TGT static inline __m256 load8(const float *p, long s, long n)
{
    if (s == 1 && n == 8)
        return _mm256_loadu_ps(p);
    if (s == 0)
        return _mm256_set1_ps(*p);
    float t[8] = {0};
    for (long j = 0; j < n; j++)
        t[j] = p[j * s];
    return _mm256_loadu_ps(t);
}

/* Elements [j, n) of a row, any strides, 8 at a time (the tail and odd strides). */
TGT static void row_tail(int op, long j, long n, float *y, long sy, const float *a, long sa,
                         const float *b, long sb, float p0, float p1)
{
    for (; j < n; j += 8) {
        long m = n - j < 8 ? n - j : 8;
        __m256 va = load8(a + j * sa, sa, m);
        __m256 v = b ? binary8(op, va, load8(b + j * sb, sb, m), p0) : unary8(op, va, p0, p1);
        if (sy == 1 && m == 8) {
            _mm256_storeu_ps(y + j, v);
        } else {
            float t[8];
            _mm256_storeu_ps(t, v);
            for (long k = 0; k < m; k++)
                y[(j + k) * sy] = t[k];
        }
    }
}

/* Whole vectors of a row whose output is contiguous and whose operands are contiguous or
 * broadcast (stride 0): one loop per op, so that the op's switch folds away. Returns where it
 * stopped. */
#define LD(p, s, j) ((s) ? _mm256_loadu_ps((p) + (j)) : _mm256_set1_ps(*(p)))
#define UN(code) case code: \
    for (; j + 8 <= n; j += 8) \
        _mm256_storeu_ps(y + j, unary8(code, LD(a, sa, j), p0, p1)); \
    break;
#define BIN(code) case code: \
    for (; j + 8 <= n; j += 8) \
        _mm256_storeu_ps(y + j, binary8(code, LD(a, sa, j), LD(b, sb, j), p0)); \
    break;

TGT static long row_fast(int op, long n, float *y, const float *a, long sa, const float *b,
                         long sb, float p0, float p1)
{
    long j = 0;
    switch (op) {
    UN(0) UN(ACT_RELU) UN(ACT_GELU) UN(ACT_GELU_TANH) UN(ACT_SIGMOID) UN(ACT_SILU) UN(ACT_TANH)
    UN(ACT_CLIP) UN(ACT_LEAKY_RELU) UN(ACT_HARD_SWISH) UN(PW_EXP) UN(PW_NEG) UN(PW_ABS)
    UN(PW_SQRT) UN(PW_RECIP) UN(PW_HARD_SIGMOID) UN(PW_QDQ_U8) UN(PW_QDQ_S8) UN(PW_NONZERO)
    UN(PW_SELECT)
    BIN(PW_ADD) BIN(PW_SUB) BIN(PW_MUL) BIN(PW_DIV) BIN(PW_MAX) BIN(PW_MIN) BIN(PW_PRELU)
    BIN(PW_SELECT_B) BIN(PW_SELECT_A) BIN(PW_NE)
    default: break;
    }
    return j;
}

/* One row of n elements along the innermost dim. */
TGT static void row(int op, long n, float *y, long sy, const float *a, long sa, const float *b,
                    long sb, float p0, float p1)
{
    long j = 0;
    if (sy == 1 && (sa == 0 || sa == 1) && (!b || sb == 0 || sb == 1))
        j = row_fast(op, n, y, a, sa, b, sb, p0, p1);
    row_tail(op, j, n, y, sy, a, sa, b, sb, p0, p1);
}

static void outer_row(int op, int rank, const long *shape, long o, float *y, const long *sy,
                      const float *a, const long *sa, const float *b, const long *sb, float p0,
                      float p1);

struct pw_job {
    int op, rank;
    const long *shape, *sy, *sa, *sb;
    float *y;
    const float *a, *b;
    float p0, p1;
};

static void pw_rows(void *arg, long o0, long o1)
{
    const struct pw_job *j = arg;
    for (long o = o0; o < o1; o++)
        outer_row(j->op, j->rank, j->shape, o, j->y, j->sy, j->a, j->sa, j->b, j->sb, j->p0,
                  j->p1);
}

/* The index space reordered so that y's smallest stride is innermost (a channels-last
 * [N, C, H, W] walked as [N, H, W, C]: whole vectors of channels, not a strided row per
 * channel), size-1 dims dropped, and neighbours merged where every operand steps evenly
 * across them. Returns the new rank (0: a single element). */
static int order_dims(int rank, const long *shape, const long *sy, const long *sa,
                      const long *sb, long *osh, long *oy, long *oa, long *ob)
{
    int d[PW_RANK], n = 0;
    for (int i = 0; i < rank; i++)
        if (shape[i] != 1)
            d[n++] = i;
    for (int i = 1; i < n; i++)  /* insertion sort, y's strides descending (stable) */
        for (int j = i; j > 0 && labs(sy[d[j]]) > labs(sy[d[j - 1]]); j--) {
            int t = d[j];
            d[j] = d[j - 1];
            d[j - 1] = t;
        }
    int m = 0;
    for (int i = 0; i < n; i++) {
        long e = shape[d[i]], ya = sy[d[i]], aa = sa[d[i]], ba = sb ? sb[d[i]] : 0;
        if (m > 0 && oy[m - 1] == ya * e && oa[m - 1] == aa * e && (!sb || ob[m - 1] == ba * e)) {
            osh[m - 1] *= e;  /* the dim before steps evenly over this one: one dim */
            oy[m - 1] = ya;
            oa[m - 1] = aa;
            ob[m - 1] = ba;
            continue;
        }
        osh[m] = e;
        oy[m] = ya;
        oa[m] = aa;
        ob[m] = ba;
        m++;
    }
    return m;
}

/* A copy that transposes the two innermost dims (after order_dims): y[i ldy + j] = a[i + j lda]
 * for i < R, j < Cn, over `planes` outer positions. That is a layout change, NCHW -> NHWC
 * (R = H W, Cn = C) or back; walked as rows it reads or writes a stride per element (a 3 x 224
 * x 224 image took 59 us on 2 threads). Here it goes in tiles of TR x TC that stay in L1, each
 * as 8 x 8 register transposes (transpose8), and 3 channels (an image) as whole vectors: 8
 * pixels of the 3 planes interleaved by permutes into 24 consecutive floats. Edges: scalar. */
#define TR 64
#define TC 64

struct tr_job {
    const long *shape, *sy, *sa;
    int rank;
    long R, Cn, ldy, lda, tiles_r, tiles_c;
    float *y;
    const float *a;
};

/* The 3-channel interleave of 8 pixels: out = r0 g0 b0 r1 g1 b1 ... r7 g7 b7. */
TGT static inline void interleave3(const float *r, const float *g, const float *b, float *out)
{
    __m256 vr = _mm256_loadu_ps(r), vg = _mm256_loadu_ps(g), vb = _mm256_loadu_ps(b);
#define P(v, a0, a1, a2, a3, a4, a5, a6, a7) \
    _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7))
    __m256 o0 = _mm256_blend_ps(_mm256_blend_ps(P(vr, 0, 0, 0, 1, 0, 0, 2, 0),
                                                P(vg, 0, 0, 0, 0, 1, 0, 0, 2), 0x92),
                                P(vb, 0, 0, 0, 0, 0, 1, 0, 0), 0x24);
    __m256 o1 = _mm256_blend_ps(_mm256_blend_ps(P(vr, 0, 3, 0, 0, 4, 0, 0, 5),
                                                P(vg, 0, 0, 3, 0, 0, 4, 0, 0), 0x24),
                                P(vb, 2, 0, 0, 3, 0, 0, 4, 0), 0x49);
    __m256 o2 = _mm256_blend_ps(_mm256_blend_ps(P(vr, 0, 0, 6, 0, 0, 7, 0, 0),
                                                P(vg, 5, 0, 0, 6, 0, 0, 7, 0), 0x49),
                                P(vb, 0, 5, 0, 0, 6, 0, 0, 7), 0x92);
#undef P
    _mm256_storeu_ps(out, o0);
    _mm256_storeu_ps(out + 8, o1);
    _mm256_storeu_ps(out + 16, o2);
}

TGT static void tr_tile(const struct tr_job *t, float *y, const float *a, long i0, long i1,
                        long j0, long j1)
{
    long ldy = t->ldy, lda = t->lda;
    long i = i0;
    if (t->Cn == 3 && ldy == 3) {
        for (; i + 8 <= i1; i += 8)
            interleave3(a + i, a + lda + i, a + 2 * lda + i, y + 3 * i);
    } else if (j1 - j0 >= 8) {
        for (; i + 8 <= i1; i += 8) {
            long j = j0;
            for (; j + 8 <= j1; j += 8)
                transpose8(a + j * lda + i, lda, y + i * ldy + j, ldy);
            for (; j < j1; j++)
                for (long k = i; k < i + 8; k++)
                    y[k * ldy + j] = a[j * lda + k];
        }
    }
    for (; i < i1; i++)
        for (long j = j0; j < j1; j++)
            y[i * ldy + j] = a[j * lda + i];
}

/* Items [i0, i1) of (plane, row tile, column tile). */
TGT static void tr_items(void *arg, long i0, long i1)
{
    const struct tr_job *t = arg;
    long per = t->tiles_r * t->tiles_c;
    for (long it = i0; it < i1; it++) {
        long p = it / per, tr = it % per / t->tiles_c, tc = it % t->tiles_c;
        long oy = 0, oa = 0, r = p;
        for (int d = t->rank - 3; d >= 0; d--) {
            long k = r % t->shape[d];
            r /= t->shape[d];
            oy += k * t->sy[d];
            oa += k * t->sa[d];
        }
        long r0 = tr * TR, r1 = r0 + TR < t->R ? r0 + TR : t->R;
        long c0 = tc * TC, c1 = c0 + TC < t->Cn ? c0 + TC : t->Cn;
        tr_tile(t, t->y + oy, t->a + oa, r0, r1, c0, c1);
    }
}

/* The copy of kiln_pointwise's ordered dims when they are such a transpose; 0 where not. */
static int transpose_copy(int rank, const long *shape, float *y, const long *sy, const float *a,
                          const long *sa, int nthreads)
{
    if (rank < 2 || sy[rank - 1] != 1 || sa[rank - 2] != 1 || sa[rank - 1] == 1)
        return 0;
    long R = shape[rank - 2], Cn = shape[rank - 1], planes = 1;
    if (R < 8 && Cn < 8)
        return 0;
    for (int d = 0; d < rank - 2; d++)
        planes *= shape[d];
    struct tr_job t = {shape, sy, sa, rank, R, Cn, sy[rank - 2], sa[rank - 1], (R + TR - 1) / TR,
                       (Cn + TC - 1) / TC, y, a};
    long items = planes * t.tiles_r * t.tiles_c;
    kiln_parallel(items, tr_items, &t, planes * R * Cn >= (1L << 15) ? nthreads : 1);
    return 1;
}

/* shape[rank] and the strides (in elements) of y, a and b (b NULL for a unary op) over it. */
void kiln_pointwise(int op, int rank, const long *shape0, float *y, const long *sy0,
                    const float *a, const long *sa0, const float *b, const long *sb0, float p0,
                    float p1, int nthreads)
{
    long shape[PW_RANK], sy[PW_RANK], sa[PW_RANK], sbv[PW_RANK];
    for (int i = 0; i < rank; i++)
        if (shape0[i] == 0)
            return;
    rank = order_dims(rank, shape0, sy0, sa0, b ? sb0 : NULL, shape, sy, sa, sbv);
    const long *sb = b ? sbv : NULL;
    if (rank < 1) {  /* a scalar */
        row(op, 1, y, 1, a, 1, b, 1, p0, p1);
        return;
    }
    if (op == 0 && !b && transpose_copy(rank, shape, y, sy, a, sa, nthreads))
        return;
    if (!b && rank >= 2 && shape[rank - 1] < 8 && sa[rank - 1] != 1) {
        /* a short innermost dim that a reads strided (an NCHW image of 3 channels written
         * channels-last): rows of 3, each a walk through the outer dims, took 0.46 ms for a
         * 224 x 224 image; rows along a's unit-stride dim instead, written strided */
        for (int d = rank - 2; d >= 0; d--)
            if (sa[d] == 1 && shape[d] >= 8) {
                long t0 = shape[d], t1 = sy[d], t2 = sa[d];
                shape[d] = shape[rank - 1], sy[d] = sy[rank - 1], sa[d] = sa[rank - 1];
                shape[rank - 1] = t0, sy[rank - 1] = t1, sa[rank - 1] = t2;
                break;
            }
    }
    long inner = shape[rank - 1], outer = 1;
    for (int d = 0; d < rank - 1; d++)
        outer *= shape[d];
    if (outer * inner == 0)
        return;
    int nt = outer * inner >= (1L << 16) && outer > 1 ? nthreads : 1;
    struct pw_job j = {op, rank, shape, sy, sa, sb, y, a, b, p0, p1};
    kiln_parallel(outer, pw_rows, &j, nt);
}

/* Row o of the dims before the innermost one. */
static void outer_row(int op, int rank, const long *shape, long o, float *y, const long *sy,
                      const float *a, const long *sa, const float *b, const long *sb, float p0,
                      float p1)
{
    {
        long r = o, oy = 0, oa = 0, ob = 0;
        for (int d = rank - 2; d >= 0; d--) {
            long i = r % shape[d];
            r /= shape[d];
            oy += i * sy[d];
            oa += i * sa[d];
            if (b)
                ob += i * sb[d];
        }
        row(op, shape[rank - 1], y + oy, sy[rank - 1], a + oa, sa[rank - 1],
            b ? b + ob : NULL, b ? sb[rank - 1] : 0, p0, p1);
    }
}
