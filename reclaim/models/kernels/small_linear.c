/* y = x @ w.T (+ b) for a few rows of x: the matrix products of decoding on a CPU.

   A decode step multiplies one row (or a verify row of a few tokens) by every weight once. That
   is memory-bound: the weights stream from DRAM and each is used M times. MKL's sgemm reads them
   at about half the bandwidth a plain sum reaches here, and for 2-8 rows costs 1.5x one row.
   This kernel streams them once: an output tile of NR weight rows is read in 16-float vectors
   while up to MR input rows are multiplied against it in registers, and the tile 4 ahead is
   prefetched into L2 while this one is used.

   Batch invariant: y[m, n] is one 16-lane accumulator over k in order, summed the same way,
   whatever M is and whichever rows share the tile, so a row gives bitwise the same output alone
   or among others (a verify row's first token equals a decode row's).

   Shapes: x [M, K] with row stride ldx, w [N, K] contiguous, b [N] or NULL, y [M, N] with row
   stride ldy. Threads split the output tiles (OpenMP; torch's own runtime when loaded with it). */
#include "simd.h"

/* Weight rows per tile and input rows per pass over it: MR * NR accumulators, NR weight vectors
   and one input vector fit AVX-512's 32 registers. Of (MR, NR) = (4, 4), (4, 6), (5, 4), (6, 4)
   and (8, 3), (8, 3) was fastest for 4-20 rows and as fast for 1-2 (SmolLM2's shapes). */
#define NR 3
#define MR 8

/* How far ahead the weights are prefetched, in tiles, and into L2 only (locality 2: prefetcht1).
   Over SmolLM2's weights on this project's EPYC VMs, 1 thread, 1 / 4 / 8 / 16 rows: the next tile
   into L1 took 34.5 / 45 / 67 / 90 ms, 4 tiles ahead into L2 27 / 28 / 38 / 67 ms (3 as good; 2,
   5-16 slower): into L1 the weights pushed out the input rows, and one tile ahead the memory and
   the multiply-adds did not overlap (8 rows cost the sum of a pure stream and the in-cache time). */
#define PREFETCH_TILES 4

/* rows input rows against NR weight rows; rows is a constant after inlining, so the
   accumulators are registers. prefetch: also fetch the tile PREFETCH_TILES ahead (first pass). */
static inline __attribute__((always_inline)) void tile(const float *x, long ldx, const float *w,
                                                       const float *b, float *y, long ldy, long K,
                                                       const int rows, int prefetch) {
    v16 acc[MR][NR];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = (v16){0};
    const float *next = w + PREFETCH_TILES * NR * K;  /* past the end near the last tiles: a
                                                          prefetch never faults */
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        if (prefetch) {
            const float *p = next + NR * k;
            for (int j = 0; j < NR; j++) __builtin_prefetch(p + 16 * j, 0, 2);
        }
        v16 wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = load(w + j * K + k);
        for (int i = 0; i < rows; i++) {
            v16 xv = load(x + i * ldx + k);
            for (int j = 0; j < NR; j++) acc[i][j] += xv * wv[j];
        }
    }
    if (k < K) {
        v16 wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = load_tail(w + j * K + k, K - k);
        for (int i = 0; i < rows; i++) {
            v16 xv = load_tail(x + i * ldx + k, K - k);
            for (int j = 0; j < NR; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < NR; j++) y[i * ldy + j] = sum16(acc[i][j]) + (b ? b[j] : 0.f);
}

/* The last N % NR weight rows, one at a time, accumulated exactly as in tile(). */
static void edge(const float *x, long ldx, const float *w, const float *b, float *y, long ldy,
                 long M, long K) {
    for (long m = 0; m < M; m++) {
        v16 acc = {0};
        long k = 0;
        for (; k + 16 <= K; k += 16) acc += load(x + m * ldx + k) * load(w + k);
        if (k < K) acc += load_tail(x + m * ldx + k, K - k) * load_tail(w + k, K - k);
        y[m * ldy] = sum16(acc) + (b ? b[0] : 0.f);
    }
}

void small_linear(const float *x, long ldx, const float *w, const float *b, float *y, long ldy,
                  long M, long N, long K, int threads) {
    long tiles = N / NR;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long t = 0; t < tiles; t++) {
        long n = t * NR;
        const float *wt = w + n * K, *bt = b ? b + n : 0;
        for (long m = 0; m < M; m += MR) {
            const float *xm = x + m * ldx;
            float *ym = y + m * ldy + n;
            int first = m == 0;
            long rows = M - m < MR ? M - m : MR;
            /* One call per row count, each a constant after inlining. */
            if (rows == MR) tile(xm, ldx, wt, bt, ym, ldy, K, MR, first);
            else if (rows == 1) tile(xm, ldx, wt, bt, ym, ldy, K, 1, first);
            else if (rows == 2) tile(xm, ldx, wt, bt, ym, ldy, K, 2, first);
            else if (rows == 3) tile(xm, ldx, wt, bt, ym, ldy, K, 3, first);
            else if (rows == 4) tile(xm, ldx, wt, bt, ym, ldy, K, 4, first);
            else if (rows == 5) tile(xm, ldx, wt, bt, ym, ldy, K, 5, first);
            else if (rows == 6) tile(xm, ldx, wt, bt, ym, ldy, K, 6, first);
            else tile(xm, ldx, wt, bt, ym, ldy, K, 7, first);
        }
    }
    for (long n = tiles * NR; n < N; n++)
        edge(x, ldx, w + n * K, b ? b + n : 0, y + n, ldy, M, K);
}
