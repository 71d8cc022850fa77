/* Native chains and programs:
 * A straight run of ops, encoded as longs by kiln/engine/chains.py (GEMM, LayerNorm, attention)
 * or kiln/engine/program.py (also elementwise ops, pooling, depthwise, Winograd and direct
 * convs, recurrent nodes), executed in one call so that no Python or PyTorch code runs between
 * them. A record whose kind it does not know (the program's torch steps) stops the run there.
 * An operand is a buffer index (into bufs; -1: none), an element offset and a row stride; float
 * parameters are in fp. */
#include "kernels.h"

/* record kinds: kiln/engine/program_ops.py, program_gemm.py and program_rnn.py name the same */
enum { OP_GEMM = 1, OP_LN = 2, OP_ATTN = 3, OP_PW = 4, OP_POOL = 5, OP_DW = 6, OP_WINO = 7,
       OP_RNN = 8, OP_RMS = 9, OP_CONV = 10, OP_QGEMM = 11,
       OP_QBMM = 12, OP_DQCONV = 13, OP_ICAST = 14, OP_GATHER = 15 };
#define GEMM_LEN 17 /* kind M N K a aoff lda w bias r roff ldr c coff ldc act fparam */
#define LN_LEN 12   /* kind M N x xoff ldx y yoff ldy gamma beta fparam (OP_RMS too, no beta) */
#define ATTN_LEN 36 /* kind B H Hkv Sq Skv D Dv, (buf off b h s) for q k v, (buf off b h q k) for
                     * the bias, causal, fparam (scale), (buf off b h s) for y */
#define PW_LEN (3 + PW_RANK + 3 * (2 + PW_RANK) + 1) /* kind op rank shape, (buf off strides)
                                                      * for y a b, fparam */
#define POOL_LEN 28 /* kind pool-kind g[14], (buf off strides[4]) for x y */
#define DW_LEN 25   /* kind g[14] x xoff w bias r roff y yoff act fparam */
#define WINO_LEN 20 /* kind N H W C K Ho Wo pt pl x xoff w bias r roff y yoff act fparam */
#define RNN_LEN (2 + RNN_FIELDS + 2 * RNN_RECORD_BUFS) /* see kiln_rnn_record (rnn.c) */
#define CONV_LEN 26 /* kind g[15] x xoff w bias r roff y yoff act fparam */
#define QGEMM_LEN 24 /* kind path M N K x xoff ldx fparam(x_scale) x_zero w colsum w_scale
                      * w_scale_n bias r roff ldr y yoff ldy act fparam(epilogue's 6) col_off */
#define DQCONV_LEN 25 /* kind batch C H W x xoff OC kh kw sh sw ph pw dh dw OH OW a a_zero wsum
                       * bias fparam(w_scale) y yoff */
#define QBMM_LEN 25 /* kind path dims[5] a aoff sa[4] b boff sb[4] y yoff sc[3] fparam(13) */
#define ICAST_LEN (4 + PW_RANK + 2 * (2 + PW_RANK)) /* kind src-type nonzero rank shape, (buf off
                                                     * strides) for y and a (a's in its own
                                                     * elements) */

#define GATHER_LEN 12 /* kind src-type n size inner outer x xoff idx idxoff y yoff */

/* Gather along an axis by integer indices a program reads at run time (token ids into an
 * embedding table): x is [outer, size, inner] contiguous, idx n int64 (src 0) or int32 (1)
 * indices (negative ones count from the end), y [outer, n, inner]. Returns 0, or 1 at an index
 * out of range (nothing after it written; the caller names the node). */
static int gather_rows(int src, long n, long size, long inner, long outer, const float *x,
                       const void *idx, float *y)
{
    for (long j = 0; j < n; j++) {
        long i = src == 0 ? (long)((const int64_t *)idx)[j] : (long)((const int32_t *)idx)[j];
        if (i < -size || i >= size)
            return 1;
        if (i < 0)
            i += size;
        for (long o = 0; o < outer; o++)
            memcpy(y + (o * n + j) * inner, x + (o * size + i) * inner, sizeof(float) * inner);
    }
    return 0;
}

/* y = float(a) (or, nonzero, a != 0 as 0/1) for an integer or bool tensor a: int64 (src 0),
 * int32 (1) or bool/uint8 (2), any strides. The integer inputs a program reads are small
 * (attention masks): a plain loop. */
static void icast(int src, int nonzero, int rank, const long *shape, float *y, const long *sy,
                  const void *a, const long *sa)
{
    long total = 1, idx[PW_RANK] = {0};
    for (int d = 0; d < rank; d++)
        total *= shape[d];
    for (long e = 0; e < total; e++) {
        long oy = 0, oa = 0;
        for (int d = 0; d < rank; d++) {
            oy += idx[d] * sy[d];
            oa += idx[d] * sa[d];
        }
        float v = src == 0 ? (float)((const int64_t *)a)[oa]
                : src == 1 ? (float)((const int32_t *)a)[oa] : (float)((const uint8_t *)a)[oa];
        y[oy] = nonzero ? (v != 0.0f ? 1.0f : 0.0f) : v;
        for (int d = rank - 1; d >= 0; d--) {
            if (++idx[d] < shape[d])
                break;
            idx[d] = 0;
        }
    }
}

#include <time.h>

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Returns n, or the position of the first op it does not know or could not run (nothing
 * from there on ran). acc (NULL: not timed): acc[i] += the seconds the record at position i
 * took (the per-record profile of a native program, kiln/engine/program.py). */
static long chain_run(const long *prog, long n, const float *fp, float *const *bufs,
                      int nthreads, double *acc)
{
#define PTR(b, off) ((b) >= 0 ? bufs[b] + (off) : NULL)
    long i = 0, at = 0;
    double t0 = 0.0;
    while (i < n) {
        const long *p = prog + i;
        if (acc != NULL) {
            if (i > 0)
                acc[at] += now_s() - t0;
            at = i;
            t0 = now_s();
        }
        if (p[0] == OP_GEMM && i + GEMM_LEN <= n) {
            kiln_sgemm(p[1], p[2], p[3], PTR(p[4], p[5]), p[6], PTR(p[7], 0), PTR(p[8], 0),
                       PTR(p[9], p[10]), p[11], PTR(p[12], p[13]), p[14], (int)p[15],
                       fp[p[16]], fp[p[16] + 1], nthreads);
            i += GEMM_LEN;
        } else if (p[0] == OP_LN && i + LN_LEN <= n) {
            kiln_layernorm_to(p[1], p[2], PTR(p[3], p[4]), p[5], PTR(p[6], p[7]), p[8],
                              PTR(p[9], 0), PTR(p[10], 0), fp[p[11]], nthreads);
            i += LN_LEN;
        } else if (p[0] == OP_RMS && i + LN_LEN <= n) {
            kiln_rmsnorm_to(p[1], p[2], PTR(p[3], p[4]), p[5], PTR(p[6], p[7]), p[8],
                            PTR(p[9], 0), fp[p[11]], nthreads);
            i += LN_LEN;
        } else if (p[0] == OP_ATTN && i + ATTN_LEN <= n) {
            const long *q = p + 8, *k = q + 5, *v = k + 5, *bi = v + 5, *y = bi + 8;
            if (kiln_attention(p[1], p[2], p[3], p[4], p[5], p[6], p[7],
                               PTR(q[0], q[1]), q[2], q[3], q[4], PTR(k[0], k[1]), k[2], k[3], k[4],
                               PTR(v[0], v[1]), v[2], v[3], v[4],
                               PTR(bi[0], bi[1]), bi[2], bi[3], bi[4], bi[5], bi[6], fp[bi[7]],
                               PTR(y[0], y[1]), y[2], y[3], y[4], nthreads) != 0)
                return i;  /* out of memory */
            i += ATTN_LEN;
        } else if (p[0] == OP_PW && i + PW_LEN <= n) {
            const long *sh = p + 3, *y = sh + PW_RANK, *a = y + 2 + PW_RANK, *b = a + 2 + PW_RANK;
            long fi = b[2 + PW_RANK];
            kiln_pointwise((int)p[1], (int)p[2], sh, PTR(y[0], y[1]), y + 2, PTR(a[0], a[1]),
                           a + 2, PTR(b[0], b[1]), b + 2, fp[fi], fp[fi + 1], nthreads);
            i += PW_LEN;
        } else if (p[0] == OP_POOL && i + POOL_LEN <= n) {
            const long *x = p + 16, *y = x + 6;
            kiln_pool2d((int)p[1], p + 2, PTR(x[0], x[1]), x + 2, PTR(y[0], y[1]), y + 2,
                        nthreads);
            i += POOL_LEN;
        } else if (p[0] == OP_DW && i + DW_LEN <= n) {
            const long *q = p + 15;
            kiln_depthwise(p + 1, PTR(q[0], q[1]), PTR(q[2], 0), PTR(q[3], 0), PTR(q[4], q[5]),
                           PTR(q[6], q[7]), (int)q[8], fp[q[9]], fp[q[9] + 1], nthreads);
            i += DW_LEN;
        } else if (p[0] == OP_WINO && i + WINO_LEN <= n) {
            const long *q = p + 10;
            if (kiln_wino3x3(p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9],
                             PTR(q[0], q[1]), PTR(q[2], 0), PTR(q[3], 0), PTR(q[4], q[5]),
                             PTR(q[6], q[7]), (int)q[8], fp[q[9]], fp[q[9] + 1], 0,
                             nthreads) != 0)
                return i;  /* out of memory */
            i += WINO_LEN;
        } else if (p[0] == OP_RNN && i + RNN_LEN <= n) {
            if (kiln_rnn_record(p, fp, bufs, nthreads) != 0)
                return i;  /* out of memory */
            i += RNN_LEN;
        } else if (p[0] == OP_CONV && i + CONV_LEN <= n) {
            const long *q = p + 16;
            if (kiln_conv(p + 1, PTR(q[0], q[1]), PTR(q[2], 0), PTR(q[3], 0), PTR(q[4], q[5]),
                          PTR(q[6], q[7]), (int)q[8], fp[q[9]], fp[q[9] + 1], nthreads) != 0)
                return i;  /* out of memory */
            i += CONV_LEN;
        } else if (p[0] == OP_QGEMM && i + QGEMM_LEN <= n) {
            if (kiln_qgemm_f32_off((int)p[1], p[2], p[3], p[4], PTR(p[5], p[6]), p[7], fp[p[8]],
                                   (int)p[9], PTR(p[10], 0), (const int *)PTR(p[11], 0),
                                   (int)p[23], PTR(p[12], 0), p[13], PTR(p[14], 0),
                                   PTR(p[15], p[16]), p[17], (int)p[21], fp + p[22],
                                   PTR(p[18], p[19]), p[20], nthreads) != 0)
                return i;  /* out of memory */
            i += QGEMM_LEN;
        } else if (p[0] == OP_QBMM && i + QBMM_LEN <= n) {
            if (kiln_qbmm_qdq((int)p[1], p + 2, PTR(p[7], p[8]), p + 9, PTR(p[13], p[14]),
                              p + 15, PTR(p[19], p[20]), p + 21, fp + p[24], nthreads) != 0)
                return i;  /* out of memory */
            i += QBMM_LEN;
        } else if (p[0] == OP_DQCONV && i + DQCONV_LEN <= n) {
            if (kiln_dq_qconv(p[1], p[2], p[3], p[4], PTR(p[5], p[6]), p[7], p[8], p[9], p[10],
                              p[11], p[12], p[13], p[14], p[15], p[16], p[17],
                              (const uint8_t *)PTR(p[18], 0), (int)p[19],
                              (const int32_t *)PTR(p[20], 0), PTR(p[21], 0), fp[p[22]],
                              PTR(p[23], p[24]), nthreads) != 0)
                return i;  /* out of memory */
            i += DQCONV_LEN;
        } else if (p[0] == OP_ICAST && i + ICAST_LEN <= n) {
            const long *sh = p + 4, *y = sh + PW_RANK, *a = y + 2 + PW_RANK;
            int src = (int)p[1];
            const char *base = a[0] >= 0 ? (const char *)bufs[a[0]] : NULL;
            long esz = src == 0 ? 8 : src == 1 ? 4 : 1;
            icast(src, (int)p[2], (int)p[3], sh, PTR(y[0], y[1]), y + 2,
                  base ? base + esz * a[1] : NULL, a + 2);
            i += ICAST_LEN;
        } else if (p[0] == OP_GATHER && i + GATHER_LEN <= n) {
            int src = (int)p[1];
            const char *ib = p[8] >= 0 ? (const char *)bufs[p[8]] : NULL;
            if (!ib || gather_rows(src, p[2], p[3], p[4], p[5], PTR(p[6], p[7]),
                                   ib + (src == 0 ? 8 : 4) * p[9], PTR(p[10], p[11])) != 0)
                return i;  /* an index out of range */
            i += GATHER_LEN;
        } else {
            return i;
        }
    }
    if (acc != NULL && n > 0)
        acc[at] += now_s() - t0;
    return n;
#undef PTR
}

long kiln_chain_run(const long *prog, long n, const float *fp, float *const *bufs, int nthreads)
{
    return chain_run(prog, n, fp, bufs, nthreads, NULL);
}

long kiln_chain_run_timed(const long *prog, long n, const float *fp, float *const *bufs,
                          int nthreads, double *acc)
{
    return chain_run(prog, n, fp, bufs, nthreads, acc);
}
