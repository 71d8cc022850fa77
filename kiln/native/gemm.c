/* kiln's CPU single-precision GEMM for inference: C = act(A @ B + bias + R).
 *
 * B is a constant (a layer's weight), packed once into 24-column panels; A is read in place.
 * The 4 x 24 register tile (12 ymm accumulators, three B registers, one broadcast register)
 * keeps both FMA pipes busy on AVX2 + FMA with a load to FMA ratio of 7:12, and a batch of
 * 128 rows is whole tiles. K is blocked (KC) and A's rows in blocks of MC; with K up to ~500 a
 * block of A rows stays in L2, beyond that it comes from L3 (MC from 96 to 1024 timed within
 * +-2% at M = 1024). Threads (kiln's team, team.c) take blocks of rows, or groups of panels
 * where the rows are few.
 *
 * The code is compiled for AVX2 + FMA by function attribute; kiln_sgemm_supported() says
 * whether this CPU has them, and callers must not call anything else when it says no. Where the
 * CPU also has AVX-512 (F, DQ), pairs of full panels run as one 8 x 48 AVX-512 tile
 * (tile_pair), on the same packed layout. */
#include "kernels.h"

int kiln_sgemm_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* The register tile's rows and columns and the K block, for tests that aim at their edges. */
void kiln_sgemm_tile(int *mr, int *nr, int *kc)
{
    *mr = MR;
    *nr = NR;
    *kc = KC;
}

long kiln_sgemm_packed_size(long K, long N)
{
    return ((N + NR - 1) / NR) * K * NR;
}

/* Element (k, n) of B is B[k * sk + n * sn]. The packed layout is [k block][panel][k][NR]:
 * k blocks of KC rows; panel p holds columns NR p .. NR p + NR - 1, zero past N. The panels a
 * thread walks in one k block are thus one sequential stream. */
void kiln_sgemm_pack(long K, long N, const float *B, long sk, long sn, float *out)
{
    long panels = (N + NR - 1) / NR;
    for (long k0 = 0; k0 < K; k0 += KC) {
        long kc = K - k0 < KC ? K - k0 : KC;
        for (long p = 0; p < panels; p++) {
            float *dst = out + k0 * panels * NR + p * kc * NR;
            long n0 = p * NR, nn = N - n0 < NR ? N - n0 : NR;
            long k = 0;
            /* attention packs a head's K^T and V per call: rows of B contiguous (V) are
             * copied, columns contiguous (K^T) go through 8 x 8 transposes */
            if (sn == 1) {
                for (; k < kc; k++) {
                    memcpy(dst + k * NR, B + (k0 + k) * sk + n0, (size_t)nn * sizeof(float));
                    for (long j = nn; j < NR; j++) dst[k * NR + j] = 0.0f;
                }
            } else if (sk == 1 && nn == NR) {
                for (; k + 8 <= kc; k += 8)
                    for (long j = 0; j < NR; j += 8)
                        transpose8(B + (n0 + j) * sn + k0 + k, sn, dst + k * NR + j, NR);
            }
            for (; k < kc; k++) {
                const float *src = B + (k0 + k) * sk + n0 * sn;
                long j = 0;
                for (; j < nn; j++) dst[k * NR + j] = src[j * sn];
                for (; j < NR; j++) dst[k * NR + j] = 0.0f;
            }
        }
    }
}

/* The tile's epilogue: first k block: + bias + R, else + C; last: the activation; then store
 * the mr x nr corner. */
TGT static inline void store_tile(__m256 acc[MR][NV], float *C, long ldc, int mr, int nr,
                                  int first, int last, const float *bias, const float *R,
                                  long ldr, int act, float alpha, float beta)
{
    int full = nr == NR;
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i m[NV];
    __m256 bv[NV];
    for (int v = 0; v < NV; v++) {
        m[v] = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr - 8 * v), idx);
        bv[v] = _mm256_setzero_ps();
    }
#define LD(p, v) (full ? _mm256_loadu_ps(p) : _mm256_maskload_ps((p), m[v]))
    if (first && bias)
        for (int v = 0; v < NV; v++) bv[v] = LD(bias + 8 * v, v);
    /* In three passes over the tile, so the activation's long dependency chains of the twelve
     * vectors overlap (one vector at a time, add-activate-store, left them serial). */
    for (int r = 0; r < mr; r++) {
        const float *rr = R ? R + r * ldr : NULL;
        for (int v = 0; v < NV; v++) {
            if (first) {
                acc[r][v] = _mm256_add_ps(acc[r][v], bv[v]);
                if (rr) acc[r][v] = _mm256_add_ps(acc[r][v], LD(rr + 8 * v, v));
            } else {
                acc[r][v] = _mm256_add_ps(acc[r][v], LD(C + r * ldc + 8 * v, v));
            }
        }
    }
    if (last && act) {
        __m256 *y = &acc[0][0];
#pragma GCC unroll 12
        for (int i = 0; i < MR * NV; i++) y[i] = act256(y[i], act, alpha, beta);
    }
    for (int r = 0; r < mr; r++) {
        float *cr = C + r * ldc;
        for (int v = 0; v < NV; v++) {
            if (full) _mm256_storeu_ps(cr + 8 * v, acc[r][v]);
            else _mm256_maskstore_ps(cr + 8 * v, m[v], acc[r][v]);
        }
    }
#undef LD
}

/* One tile of mr <= MR rows and nr <= NR columns over k in [0, kc): the MR x NV accumulators
 * live in named registers for the whole k loop (gcc spills an array of them to the stack). Rows
 * past mr re-read the last row and are not stored. first: add bias and R (else C); last: apply
 * the activation. */
TGT static void tile(long kc, const float *A, long lda, const float *Bp, float *C, long ldc,
                     int mr, int nr, int first, int last, const float *bias, const float *R,
                     long ldr, int act, float alpha, float beta)
{
    const float *a[MR];
    for (int r = 0; r < MR; r++) a[r] = A + (r < mr ? r : mr - 1) * lda;
    /* The tile's C rows (and R's) are fetched while the k loop runs: with C fresh (first k
     * block) its lines would otherwise be read for ownership only at the stores, one miss after
     * another; this was 5-10% of a whole GEMM at M = 1024, K = 384. */
    for (int r = 0; r < mr; r++) {
        const float *pc = C + r * ldc, *pr = first && R ? R + r * ldr : NULL;
        _mm_prefetch((const char *)pc, _MM_HINT_T0);
        _mm_prefetch((const char *)(pc + NR - 1), _MM_HINT_T0);
        if (pr) { _mm_prefetch((const char *)pr, _MM_HINT_T0);
                  _mm_prefetch((const char *)(pr + NR - 1), _MM_HINT_T0); }
    }
    __m256 acc[MR][NV];
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3];
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00,
           c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
#pragma GCC unroll 4
    for (long k = 0; k < kc; k++) {
        _mm_prefetch((const char *)(Bp + (k + PF) * NR), _MM_HINT_T0);
        const float *bk = Bp + k * NR;
        __m256 w0 = _mm256_load_ps(bk), w1 = _mm256_load_ps(bk + 8), w2 = _mm256_load_ps(bk + 16);
        __m256 x;
        x = _mm256_broadcast_ss(a0 + k); c00 = _mm256_fmadd_ps(x, w0, c00);
        c01 = _mm256_fmadd_ps(x, w1, c01); c02 = _mm256_fmadd_ps(x, w2, c02);
        x = _mm256_broadcast_ss(a1 + k); c10 = _mm256_fmadd_ps(x, w0, c10);
        c11 = _mm256_fmadd_ps(x, w1, c11); c12 = _mm256_fmadd_ps(x, w2, c12);
        x = _mm256_broadcast_ss(a2 + k); c20 = _mm256_fmadd_ps(x, w0, c20);
        c21 = _mm256_fmadd_ps(x, w1, c21); c22 = _mm256_fmadd_ps(x, w2, c22);
        x = _mm256_broadcast_ss(a3 + k); c30 = _mm256_fmadd_ps(x, w0, c30);
        c31 = _mm256_fmadd_ps(x, w1, c31); c32 = _mm256_fmadd_ps(x, w2, c32);
    }
    if (mr == MR && nr == NR && first && last && !bias && !R && !act) {  /* plain: store */
        _mm256_storeu_ps(C, c00); _mm256_storeu_ps(C + 8, c01); _mm256_storeu_ps(C + 16, c02);
        C += ldc;
        _mm256_storeu_ps(C, c10); _mm256_storeu_ps(C + 8, c11); _mm256_storeu_ps(C + 16, c12);
        C += ldc;
        _mm256_storeu_ps(C, c20); _mm256_storeu_ps(C + 8, c21); _mm256_storeu_ps(C + 16, c22);
        C += ldc;
        _mm256_storeu_ps(C, c30); _mm256_storeu_ps(C + 8, c31); _mm256_storeu_ps(C + 16, c32);
        return;
    }
    acc[0][0] = c00; acc[0][1] = c01; acc[0][2] = c02; acc[1][0] = c10; acc[1][1] = c11;
    acc[1][2] = c12; acc[2][0] = c20; acc[2][1] = c21; acc[2][2] = c22; acc[3][0] = c30;
    acc[3][1] = c31; acc[3][2] = c32;
    store_tile(acc, C, ldc, mr, nr, first, last, bias, R, ldr, act, alpha, beta);
}

/* The edge panels' tiles, of at most 16 and at most 8 columns: the same product on two vectors
 * or one, so a panel's zero padding is not multiplied, with named accumulators as in tile (an
 * array of them, indexed in loops, was spilled: a 16-column edge panel took as long as three
 * full ones, 44% of an M = 784, K = 64, N = 256 GEMM). The 8-column tile keeps two sums per
 * row (even and odd k) for eight independent FMA chains. */
TGT static void tile_2(long kc, const float *A, long lda, const float *Bp, float *C, long ldc,
                       int mr, int nr, int first, int last, const float *bias, const float *R,
                       long ldr, int act, float alpha, float beta)
{
    const float *a0 = A, *a1 = A + (1 < mr ? 1 : mr - 1) * lda,
                *a2 = A + (2 < mr ? 2 : mr - 1) * lda, *a3 = A + (3 < mr ? 3 : mr - 1) * lda;
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00;
#pragma GCC unroll 4
    for (long k = 0; k < kc; k++) {
        const float *bk = Bp + k * NR;
        __m256 w0 = _mm256_load_ps(bk), w1 = _mm256_load_ps(bk + 8), x;
        x = _mm256_broadcast_ss(a0 + k); c00 = _mm256_fmadd_ps(x, w0, c00);
        c01 = _mm256_fmadd_ps(x, w1, c01);
        x = _mm256_broadcast_ss(a1 + k); c10 = _mm256_fmadd_ps(x, w0, c10);
        c11 = _mm256_fmadd_ps(x, w1, c11);
        x = _mm256_broadcast_ss(a2 + k); c20 = _mm256_fmadd_ps(x, w0, c20);
        c21 = _mm256_fmadd_ps(x, w1, c21);
        x = _mm256_broadcast_ss(a3 + k); c30 = _mm256_fmadd_ps(x, w0, c30);
        c31 = _mm256_fmadd_ps(x, w1, c31);
    }
    __m256 z = _mm256_setzero_ps();
    __m256 acc[MR][NV] = {{c00, c01, z}, {c10, c11, z}, {c20, c21, z}, {c30, c31, z}};
    store_tile(acc, C, ldc, mr, nr, first, last, bias, R, ldr, act, alpha, beta);
}

TGT static void tile_1(long kc, const float *A, long lda, const float *Bp, float *C, long ldc,
                       int mr, int nr, int first, int last, const float *bias, const float *R,
                       long ldr, int act, float alpha, float beta)
{
    const float *a0 = A, *a1 = A + (1 < mr ? 1 : mr - 1) * lda,
                *a2 = A + (2 < mr ? 2 : mr - 1) * lda, *a3 = A + (3 < mr ? 3 : mr - 1) * lda;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, d0 = c0, d1 = c0, d2 = c0,
           d3 = c0;
    long k = 0;
    for (; k + 2 <= kc; k += 2) {
        const float *bk = Bp + k * NR;
        __m256 w0 = _mm256_load_ps(bk), w1 = _mm256_load_ps(bk + NR);
        c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(a0 + k), w0, c0);
        c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(a1 + k), w0, c1);
        c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(a2 + k), w0, c2);
        c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(a3 + k), w0, c3);
        d0 = _mm256_fmadd_ps(_mm256_broadcast_ss(a0 + k + 1), w1, d0);
        d1 = _mm256_fmadd_ps(_mm256_broadcast_ss(a1 + k + 1), w1, d1);
        d2 = _mm256_fmadd_ps(_mm256_broadcast_ss(a2 + k + 1), w1, d2);
        d3 = _mm256_fmadd_ps(_mm256_broadcast_ss(a3 + k + 1), w1, d3);
    }
    if (k < kc) {
        __m256 w0 = _mm256_load_ps(Bp + k * NR);
        c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(a0 + k), w0, c0);
        c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(a1 + k), w0, c1);
        c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(a2 + k), w0, c2);
        c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(a3 + k), w0, c3);
    }
    __m256 z = _mm256_setzero_ps();
    __m256 acc[MR][NV] = {{_mm256_add_ps(c0, d0), z, z}, {_mm256_add_ps(c1, d1), z, z},
                          {_mm256_add_ps(c2, d2), z, z}, {_mm256_add_ps(c3, d3), z, z}};
    store_tile(acc, C, ldc, mr, nr, first, last, bias, R, ldr, act, alpha, beta);
}

/* One row against a full panel (a decode step's GEMMs, M = 1; and the last row where M = 4q + 1,
 * which is alone in its tile however the rows are split over threads, so a thread count never
 * changes an element's bits): four partial sums over k (k mod 4) of three vectors each, twelve
 * independent FMA chains; the 4-row tile given one row has four copies of three chains (3
 * useful FMAs of 12). 1 x 256 x 1024 on one core: 23 -> 14 us (torch.mm 14). */
TGT static void tile_row(long kc, const float *a, const float *Bp, float *C, int first,
                         int last, const float *bias, const float *R, int act, float alpha,
                         float beta)
{
    __m256 z = _mm256_setzero_ps();
    __m256 c0 = z, c1 = z, c2 = z, d0 = z, d1 = z, d2 = z, e0 = z, e1 = z, e2 = z, f0 = z,
           f1 = z, f2 = z, x;
    long k = 0;
    for (; k + 4 <= kc; k += 4) {
        const float *b = Bp + k * NR;
        _mm_prefetch((const char *)(b + 4 * NR * 4), _MM_HINT_T0);
        x = _mm256_broadcast_ss(a + k);
        c0 = _mm256_fmadd_ps(x, _mm256_load_ps(b), c0);
        c1 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 8), c1);
        c2 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 16), c2);
        x = _mm256_broadcast_ss(a + k + 1);
        d0 = _mm256_fmadd_ps(x, _mm256_load_ps(b + NR), d0);
        d1 = _mm256_fmadd_ps(x, _mm256_load_ps(b + NR + 8), d1);
        d2 = _mm256_fmadd_ps(x, _mm256_load_ps(b + NR + 16), d2);
        x = _mm256_broadcast_ss(a + k + 2);
        e0 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 2 * NR), e0);
        e1 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 2 * NR + 8), e1);
        e2 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 2 * NR + 16), e2);
        x = _mm256_broadcast_ss(a + k + 3);
        f0 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 3 * NR), f0);
        f1 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 3 * NR + 8), f1);
        f2 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 3 * NR + 16), f2);
    }
    for (; k < kc; k++) {
        const float *b = Bp + k * NR;
        x = _mm256_broadcast_ss(a + k);
        c0 = _mm256_fmadd_ps(x, _mm256_load_ps(b), c0);
        c1 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 8), c1);
        c2 = _mm256_fmadd_ps(x, _mm256_load_ps(b + 16), c2);
    }
    __m256 acc[MR][NV] = {{_mm256_add_ps(_mm256_add_ps(c0, d0), _mm256_add_ps(e0, f0)),
                           _mm256_add_ps(_mm256_add_ps(c1, d1), _mm256_add_ps(e1, f1)),
                           _mm256_add_ps(_mm256_add_ps(c2, d2), _mm256_add_ps(e2, f2))},
                          {z, z, z}, {z, z, z}, {z, z, z}};
    store_tile(acc, C, 0, 1, NR, first, last, bias, R, 0, act, alpha, beta);
}

/* AVX-512 (where the CPU has it): two neighbouring full panels as one 8 x 48 tile, three zmm
 * per row (the first panel's 16 columns, its last 8 with the second's first 8, the second's
 * last 16), 24 accumulators. On a CPU with 512-bit FMA units this does twice the work of an
 * AVX2 FMA per instruction (onnxruntime's MLAS runs its AVX-512 kernels there: a 128 x 256 x
 * 1024 GEMM took 295 us against the AVX2 tile's 576 on one core). Each output still sums its
 * k terms in order in one accumulator, as the AVX2 tiles do (but tile_1: see tile_one); the
 * epilogue (store_wide) does theirs at full width. The second panel may be partial. */
#define MR2 8
#define TGT512 TGT_ZMM

/* The float kernels' instruction set (GEMM, direct and depthwise conv): 1 AVX2 + FMA, 2 also
 * AVX-512 (F, DQ); the best this CPU has unless kiln_conv_set_isa picked a lower one (tests run
 * each path on an AVX-512 machine). */
static int float_isa;

static int isa_best(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") ? 2 : 1;
}

int kiln_conv_isa_best(void)
{
    return isa_best();
}

/* want 1 or 2 (0: the best); a level this CPU lacks gives the best. Returns the one in force. */
int kiln_conv_set_isa(int want)
{
    int best = isa_best();
    float_isa = want <= 0 || want > best ? best : want;
    return float_isa;
}

int kiln_use_avx512(void)
{
    if (!float_isa)
        kiln_conv_set_isa(0);
    return float_isa == 2;
}

static int has_avx512(void)
{
    return kiln_use_avx512();
}

/* The AVX-512 tiles' epilogue at full width: 8 rows of nc <= 48 columns as nv zmm each (the
 * columns past nc masked off): first k block: + bias + R, else + C; last: the activation; then
 * the stores. The operations per element are store_tile's in its order (the zero bias added
 * too), so the bits are the AVX2 epilogue's; the 4 x 24 quarters it took before (extracts,
 * 256-bit adds and stores) were most of a K = 16 GEMM's time (12544 x 16 x 64: 210 us). */
TGT512 static inline __attribute__((always_inline)) void store_wide(
    __m512 acc[MR2][3], int nv, int nc, float *C, long ldc, int first, int last,
    const float *bias, const float *R, long ldr, int act, float alpha, float beta)
{
    __mmask16 m[3];
    __m512 bv[3];
    for (int v = 0; v < 3; v++) {
        int left = nc - 16 * v;
        m[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        bv[v] = _mm512_setzero_ps();
    }
    if (first && bias)
        for (int v = 0; v < nv; v++)
            bv[v] = _mm512_maskz_loadu_ps(m[v], bias + 16 * v);
    for (int r = 0; r < MR2; r++)
        for (int v = 0; v < nv; v++) {
            if (first) {
                acc[r][v] = _mm512_add_ps(acc[r][v], bv[v]);
                if (R)
                    acc[r][v] = _mm512_add_ps(acc[r][v],
                                              _mm512_maskz_loadu_ps(m[v], R + r * ldr + 16 * v));
            } else {
                acc[r][v] = _mm512_add_ps(acc[r][v],
                                          _mm512_maskz_loadu_ps(m[v], C + r * ldc + 16 * v));
            }
        }
    if (last && act)
        for (int r = 0; r < MR2; r++)
            for (int v = 0; v < nv; v++)
                acc[r][v] = act512(acc[r][v], act, alpha, beta);
    for (int r = 0; r < MR2; r++)
        for (int v = 0; v < nv; v++) {
            if (m[v] == 0xFFFF)
                _mm512_storeu_ps(C + r * ldc + 16 * v, acc[r][v]);
            else
                _mm512_mask_storeu_ps(C + r * ldc + 16 * v, m[v], acc[r][v]);
        }
}

/* store_wide with the common activations a constant (the per-vector switch folded away: a
 * ReLU or clip then costs one op per vector, not a branch and a reload of the tile) */
#define STORE_WIDE(acc, nv, nc, C, ldc, first, last, bias, R, ldr, act, alpha, beta)          \
    do {                                                                                     \
        int act_ = (last) ? (act) : ACT_NONE;                                                \
        if (act_ == ACT_NONE)                                                                \
            store_wide(acc, nv, nc, C, ldc, first, 0, bias, R, ldr, ACT_NONE, alpha, beta);  \
        else if (act_ == ACT_RELU)                                                           \
            store_wide(acc, nv, nc, C, ldc, first, 1, bias, R, ldr, ACT_RELU, alpha, beta);  \
        else if (act_ == ACT_CLIP)                                                           \
            store_wide(acc, nv, nc, C, ldc, first, 1, bias, R, ldr, ACT_CLIP, alpha, beta);  \
        else if (act_ == ACT_HARD_SWISH)                                                     \
            store_wide(acc, nv, nc, C, ldc, first, 1, bias, R, ldr, ACT_HARD_SWISH, alpha,   \
                       beta);                                                                \
        else                                                                                 \
            store_wide(acc, nv, nc, C, ldc, first, 1, bias, R, ldr, act_, alpha, beta);      \
    } while (0)

/* nc <= 48 columns from the first panel's: the second panel may be partial (its zero padding
 * multiplied, the stores masked); NVZ = 2 where nc <= 32 (no third vector's FMAs). */
TGT512 static inline __attribute__((always_inline)) void tile_pair_(
    long kc, const float *A, long lda, const float *Bp, float *C, long ldc, int first, int last,
    const float *bias, const float *R, long ldr, int act, float alpha, float beta, int nc,
    const int NVZ)
{
    const float *b0 = Bp, *b1 = Bp + kc * NR;  /* the two panels' k blocks */
    const float *a0 = A, *a1 = A + lda, *a2 = A + 2 * lda, *a3 = A + 3 * lda, *a4 = A + 4 * lda,
                *a5 = A + 5 * lda, *a6 = A + 6 * lda, *a7 = A + 7 * lda;
    __m512 z = _mm512_setzero_ps();
    __m512 l0 = z, m0 = z, h0 = z, l1 = z, m1 = z, h1 = z, l2 = z, m2 = z, h2 = z, l3 = z,
           m3 = z, h3 = z, l4 = z, m4 = z, h4 = z, l5 = z, m5 = z, h5 = z, l6 = z, m6 = z,
           h6 = z, l7 = z, m7 = z, h7 = z;
#pragma GCC unroll 2
    for (long k = 0; k < kc; k++) {
        _mm_prefetch((const char *)(b0 + (k + PF) * NR), _MM_HINT_T0);
        _mm_prefetch((const char *)(b1 + (k + PF) * NR), _MM_HINT_T0);
        const float *p0 = b0 + k * NR, *p1 = b1 + k * NR;
        __m512 wl = _mm512_loadu_ps(p0);  /* (rows of 24 floats: 32-byte aligned only) */
        __m512 wm = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(p0 + 16)),
                                       _mm256_loadu_ps(p1), 1);
        __m512 wh = NVZ > 2 ? _mm512_loadu_ps(p1 + 8) : wl;
        __m512 x;
#define ROW(r) x = _mm512_set1_ps(a##r[k]); l##r = _mm512_fmadd_ps(x, wl, l##r); \
        m##r = _mm512_fmadd_ps(x, wm, m##r); if (NVZ > 2) h##r = _mm512_fmadd_ps(x, wh, h##r);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)
#undef ROW
    }
    __m512 acc[MR2][3] = {{l0, m0, h0}, {l1, m1, h1}, {l2, m2, h2}, {l3, m3, h3},
                          {l4, m4, h4}, {l5, m5, h5}, {l6, m6, h6}, {l7, m7, h7}};
    STORE_WIDE(acc, NVZ, nc, C, ldc, first, last, bias, R, ldr, act, alpha, beta);
}

TGT512 static void tile_pair(long kc, const float *A, long lda, const float *Bp, float *C,
                             long ldc, int first, int last, const float *bias, const float *R,
                             long ldr, int act, float alpha, float beta, int nc)
{
    if (nc > 32)
        tile_pair_(kc, A, lda, Bp, C, ldc, first, last, bias, R, ldr, act, alpha, beta, nc, 3);
    else
        tile_pair_(kc, A, lda, Bp, C, ldc, first, last, bias, R, ldr, act, alpha, beta, nc, 2);
}

/* AVX-512: one panel alone (a lone full panel, or an edge: 64 = 48 + 16 columns) as an 8-row
 * tile: a zmm of columns 0-15 and, where the panel has more than 16, a ymm of 16-23 per row.
 * Each output sums its k terms in order in one accumulator, as tile and tile_2 do, so its bits
 * are theirs; an edge of 8 or fewer columns is tile_1's on AVX2 (two sums per row, for eight
 * FMA chains in 4 rows), so there the two ISAs agree to rounding, not to the bit. It ran the
 * 8-column edge before (a 12544 x 16 x 32 product, 24 + 8 columns, took 232 us against 75 for
 * the pair tile on one thread). */
TGT512 static inline __attribute__((always_inline)) void tile_one_(
    long kc, const float *A, long lda, const float *Bp, float *C, long ldc, int nr, int first,
    int last, const float *bias, const float *R, long ldr, int act, float alpha, float beta,
    int hi)
{
    const float *a0 = A, *a1 = A + lda, *a2 = A + 2 * lda, *a3 = A + 3 * lda, *a4 = A + 4 * lda,
                *a5 = A + 5 * lda, *a6 = A + 6 * lda, *a7 = A + 7 * lda;
    __m512 z = _mm512_setzero_ps();
    __m256 y = _mm256_setzero_ps();
    __m512 l0 = z, l1 = z, l2 = z, l3 = z, l4 = z, l5 = z, l6 = z, l7 = z;
    __m256 h0 = y, h1 = y, h2 = y, h3 = y, h4 = y, h5 = y, h6 = y, h7 = y;
#pragma GCC unroll 2
    for (long k = 0; k < kc; k++) {
        _mm_prefetch((const char *)(Bp + (k + PF) * NR), _MM_HINT_T0);
        const float *p = Bp + k * NR;
        __m512 wl = _mm512_loadu_ps(p), x;
        __m256 wh = hi ? _mm256_load_ps(p + 16) : y;
#define ROW(r) x = _mm512_set1_ps(a##r[k]); l##r = _mm512_fmadd_ps(x, wl, l##r); \
        if (hi) h##r = _mm256_fmadd_ps(_mm512_castps512_ps256(x), wh, h##r);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)
#undef ROW
    }
#define Z(h) _mm512_zextps256_ps512(h)
    __m512 acc[MR2][3] = {{l0, Z(h0), z}, {l1, Z(h1), z}, {l2, Z(h2), z}, {l3, Z(h3), z},
                          {l4, Z(h4), z}, {l5, Z(h5), z}, {l6, Z(h6), z}, {l7, Z(h7), z}};
#undef Z
    STORE_WIDE(acc, hi ? 2 : 1, nr, C, ldc, first, last, bias, R, ldr, act, alpha, beta);
}

TGT512 static void tile_one(long kc, const float *A, long lda, const float *Bp, float *C,
                            long ldc, int nr, int first, int last, const float *bias,
                            const float *R, long ldr, int act, float alpha, float beta)
{
    if (nr > 16)
        tile_one_(kc, A, lda, Bp, C, ldc, nr, first, last, bias, R, ldr, act, alpha, beta, 1);
    else
        tile_one_(kc, A, lda, Bp, C, ldc, nr, first, last, bias, R, ldr, act, alpha, beta, 0);
}

/* Rows [m0, m1) and panels [p0, p1) of the product: k blocks outermost, then blocks of MC rows
 * of A (which every panel passes over), then the panels, then the row tiles (which reuse the
 * panel's k block from L1/L2). */
TGT void kiln_gemm_block(long m0, long m1, long p0, long p1, long N, long K, const float *A,
                         long lda, const float *Bp, const float *bias, const float *R, long ldr,
                         float *C, long ldc, int act, float alpha, float beta)
{
    long panels = (N + NR - 1) / NR;
    int wide = m1 - m0 >= MR2 && has_avx512();
    for (long k0 = 0; k0 < K; k0 += KC) {
        long kc = K - k0 < KC ? K - k0 : KC;
        int first = k0 == 0, last = k0 + kc == K;
        for (long i0 = m0; i0 < m1; i0 += MC) {
            long i1 = i0 + MC < m1 ? i0 + MC : m1;
            for (long p = p0; p < p1; p++) {
                long n0 = p * NR;
                int nr = N - n0 < NR ? (int)(N - n0) : NR;
                const float *bp = Bp + k0 * panels * NR + p * kc * NR;
                const float *bb = bias ? bias + n0 : NULL;
                long i = i0;
                /* a full panel and the next one, whole or partial (a panel's 8-row tiles are
                 * AVX-512 ones, in-order sums, whether it is paired or alone: the bits do not
                 * depend on how the panels fell to the threads) */
                if (wide && p + 1 < p1 && N - n0 > NR) {
                    int nc = N - n0 < 2 * NR ? (int)(N - n0) : 2 * NR;
                    for (; i + MR2 <= i1; i += MR2)
                        tile_pair(kc, A + i * lda + k0, lda, bp, C + i * ldc + n0, ldc, first,
                                  last, bb, R ? R + i * ldr + n0 : NULL, ldr, act, alpha, beta,
                                  nc);
                    for (int q = 0; q < 2; q++, n0 += NR, bp += kc * NR) {
                        int nq = N - n0 < NR ? (int)(N - n0) : NR;  /* the rows left: AVX2 */
                        void (*tq)(long, const float *, long, const float *, float *, long, int,
                                   int, int, int, const float *, const float *, long, int, float,
                                   float) = nq <= 8 ? tile_1 : nq <= 16 ? tile_2 : tile;
                        for (long j = i; j < i1; j += MR) {
                            int mr = i1 - j < MR ? (int)(i1 - j) : MR;
                            if (mr == 1 && nq == NR)  /* as below: a lone row is tile_row's */
                                tile_row(kc, A + j * lda + k0, bp, C + j * ldc + n0, first,
                                         last, bias ? bias + n0 : NULL,
                                         R ? R + j * ldr + n0 : NULL, act, alpha, beta);
                            else
                                tq(kc, A + j * lda + k0, lda, bp, C + j * ldc + n0, ldc, mr, nq,
                                   first, last, bias ? bias + n0 : NULL,
                                   R ? R + j * ldr + n0 : NULL, ldr, act, alpha, beta);
                        }
                    }
                    p++;
                    continue;
                }
                void (*tf)(long, const float *, long, const float *, float *, long, int, int,
                           int, int, const float *, const float *, long, int, float, float) =
                    nr <= 8 ? tile_1 : nr <= 16 ? tile_2 : tile;
                if (wide)  /* (an edge of 8 or fewer columns too: see the pairs above) */
                    for (; i + MR2 <= i1; i += MR2)
                        tile_one(kc, A + i * lda + k0, lda, bp, C + i * ldc + n0, ldc, nr, first,
                                 last, bb, R ? R + i * ldr + n0 : NULL, ldr, act, alpha, beta);
                for (; i < i1; i += MR) {
                    int mr = i1 - i < MR ? (int)(i1 - i) : MR;
                    if (mr == 1 && nr == NR) {
                        tile_row(kc, A + i * lda + k0, bp, C + i * ldc + n0, first, last, bb,
                                 R ? R + i * ldr + n0 : NULL, act, alpha, beta);
                        continue;
                    }
                    tf(kc, A + i * lda + k0, lda, bp, C + i * ldc + n0, ldc, mr, nr, first,
                         last, bb, R ? R + i * ldr + n0 : NULL, ldr, act, alpha, beta);
                }
            }
        }
    }
}


struct gemm_job {
    long M, N, K, lda, ldr, ldc, panels, tiles_m, rb, pg;
    const float *A, *Bp, *bias, *R;
    float *C;
    int act;
    float alpha, beta;
};

/* Items [i0, i1) of the rb x pg grid of (row block of whole 8-row tiles, panel group). */
TGT static void gemm_items(void *arg, long i0, long i1)
{
    const struct gemm_job *j = arg;
    for (long it = i0; it < i1; it++) {
        long r = it / j->pg, p = it % j->pg;
        long a = j->tiles_m * r / j->rb * MR2, b = j->tiles_m * (r + 1) / j->rb * MR2;
        long p0 = j->panels * p / j->pg, p1 = j->panels * (p + 1) / j->pg;
        if (b > j->M)
            b = j->M;
        if (a < b && p0 < p1)
            kiln_gemm_block(a, b, p0, p1, j->N, j->K, j->A, j->lda, j->Bp, j->bias, j->R, j->ldr,
                            j->C, j->ldc, j->act, j->alpha, j->beta);
    }
}

/* C[M, N] (row stride ldc) = act(A[M, K] (row stride lda) @ B + bias[N] + R[M, N] (row stride
 * ldr)), B packed by kiln_sgemm_pack, K >= 1; bias and R may be NULL; act: an ACT_ code, alpha and beta
 * its parameters (Clip's bounds, LeakyRelu's slope). The work is a grid of (row block, panel
 * group) items on kiln's team (team.c): row blocks where the rows are many (each reads the
 * packed weight whole), else panel groups (each reads A whole), else both. */
void kiln_sgemm(long M, long N, long K, const float *A, long lda, const float *Bp,
                const float *bias, const float *R, long ldr, float *C, long ldc, int act,
                float alpha, float beta, int nthreads)
{
    long panels = (N + NR - 1) / NR;
    if (nthreads < 1) nthreads = 1;
    if (M <= 0 || N <= 0 || K <= 0)  /* callers pass K >= 1 (there is no product to take) */
        return;
    if (nthreads == 1 || (M * N * K) < 64L * 64 * 64) {
        kiln_gemm_block(0, M, 0, panels, N, K, A, lda, Bp, bias, R, ldr, C, ldc, act, alpha, beta);
        return;
    }
    /* Row blocks are whole 8-row tiles (the AVX-512 ones): at M = 49 (a late CNN stage's 7 x 7)
     * blocks of one or two 4-row tiles ran the AVX2 tiles only, each reading the packed weight
     * whole; with fewer than 8 such blocks the panels are split instead (49 x 1280 x 320:
     * 246 -> 196 us on 2 threads). */
    long tiles_m = (M + MR2 - 1) / MR2, want = 4L * nthreads, rb, pg;
    if (tiles_m >= want) {
        rb = want;
        pg = 1;
    } else if (panels >= want) {
        rb = 1;
        pg = want;
    } else {
        rb = tiles_m;
        pg = (want + rb - 1) / rb < panels ? (want + rb - 1) / rb : panels;
    }
    struct gemm_job j = {M, N, K, lda, ldr, ldc, panels, tiles_m, rb, pg, A, Bp, bias, R, C, act,
                         alpha, beta};
    kiln_parallel(rb * pg, gemm_items, &j, nthreads);
}
