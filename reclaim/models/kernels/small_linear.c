/* y = x @ w.T (+ b) for a few rows of x: the matrix products of decoding on a CPU.

   A decode step multiplies one row (or a verify row of a few tokens, or one row per running
   sequence) by every weight once. With one row that is memory-bound: the weights stream from
   DRAM. With 8-16 rows each weight is used 8-16 times and it is compute-bound. MKL's and
   oneDNN's products reach neither bound at these shapes.

   The weights are read from a packed copy (`pack_weights`, made once per weight by linear.py):
   panels of P = 48 output columns, each panel [K][48] contiguous, so a panel streams front to
   back and the hardware prefetcher follows it (plus the next panel's lines fetched into L2 as
   this one is used). An output tile of up to MR = 8 input rows by 48 columns is 24 AVX-512
   accumulators; each k adds x[m, k] (broadcast) times the panel's 3 vectors at k. No sums across
   lanes. Against the unpacked kernel it replaced (16-lane dot products over rows of w, summed
   across lanes), on SmolLM2's shapes, one thread, EPYC (peak 113 GFLOP/s): 1 row 19-22 -> 22-25
   GB/s, 8 rows 52-70 -> 81-95 GFLOP/s, 16 rows 62-79 -> 93-97 GFLOP/s.

   Batch invariant: y[m, n] is one float32 multiply-add chain over k in order, whatever M is and
   whichever rows share the tile, so a row gives bitwise the same output alone or among others
   (a verify row's first token equals a decode row's).

   Shapes: x [M, K] with row stride ldx, wp the packed [ceil(N / 48), K, 48] (zeros past N), b [N]
   or NULL, y [M, N] with row stride ldy. Threads split the panels (OpenMP; torch's own runtime
   when loaded with it). */
#include "simd.h"

#define NR 3          /* vectors per panel row: 48 columns */
#define P (16 * NR)
#define MR 8          /* input rows per pass over a panel: MR * NR accumulators, NR weight
                         vectors and the broadcast fit AVX-512's 32 registers; (MR, NR) = (6, 4)
                         and (12, 2) measured 10-15% slower at 16 rows */

/* w [N, K] into wp [ceil(N / P), K, P], the columns past N zero. */
void pack_weights(const float *w, float *wp, long N, long K, int threads) {
    long panels = (N + P - 1) / P;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long p = 0; p < panels; p++)
        for (long j = 0; j < P; j++) {
            long n = p * P + j;
            float *dst = wp + p * K * P + j;
            if (n < N)
                for (long k = 0; k < K; k++) dst[k * P] = w[n * K + k];
            else
                for (long k = 0; k < K; k++) dst[k * P] = 0.f;
        }
}

/* rows input rows against one panel; rows is a constant after inlining, so the accumulators are
   registers. next: the panel after this one, fetched into L2 a few lines each k (NULL: none). */
static inline __attribute__((always_inline)) void tile(const float *x, long ldx, const float *wp,
                                                       const float *b, float *y, long ldy, long K,
                                                       const int rows, long cols, const float *next) {
    v16 acc[MR][NR];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = (v16){0};
    for (long k = 0; k < K; k++) {
        if (next && (k & 3) == 0)  /* 4 panel rows = 12 lines ahead, one panel on */
            for (int j = 0; j < 4 * NR; j++) __builtin_prefetch(next + k * P + 16 * j, 0, 2);
        v16 wv[NR];
        for (int j = 0; j < NR; j++) wv[j] = load(wp + k * P + 16 * j);
        for (int i = 0; i < rows; i++) {
            v16 xb = (v16){0} + x[i * ldx + k];
            for (int j = 0; j < NR; j++) acc[i][j] += xb * wv[j];
        }
    }
    float t[P];
    for (int i = 0; i < rows; i++) {
        for (int j = 0; j < NR; j++) store(t + 16 * j, acc[i][j]);
        for (long c = 0; c < cols; c++) y[i * ldy + c] = t[c] + (b ? b[c] : 0.f);
    }
}

void small_linear(const float *x, long ldx, const float *wp, const float *b, float *y, long ldy,
                  long M, long N, long K, int threads) {
    long panels = (N + P - 1) / P;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long p = 0; p < panels; p++) {
        const float *w = wp + p * K * P, *bp = b ? b + p * P : 0;
        long cols = N - p * P < P ? N - p * P : P;
        for (long m = 0; m < M; m += MR) {
            const float *xm = x + m * ldx;
            float *ym = y + m * ldy + p * P;
            const float *next = m == 0 && p + 1 < panels ? w + K * P : 0;
            long rows = M - m < MR ? M - m : MR;
            /* One call per row count, each a constant after inlining. */
            if (rows == MR) tile(xm, ldx, w, bp, ym, ldy, K, MR, cols, next);
            else if (rows == 1) tile(xm, ldx, w, bp, ym, ldy, K, 1, cols, next);
            else if (rows == 2) tile(xm, ldx, w, bp, ym, ldy, K, 2, cols, next);
            else if (rows == 3) tile(xm, ldx, w, bp, ym, ldy, K, 3, cols, next);
            else if (rows == 4) tile(xm, ldx, w, bp, ym, ldy, K, 4, cols, next);
            else if (rows == 5) tile(xm, ldx, w, bp, ym, ldy, K, 5, cols, next);
            else if (rows == 6) tile(xm, ldx, w, bp, ym, ldy, K, 6, cols, next);
            else tile(xm, ldx, w, bp, ym, ldy, K, 7, cols, next);
        }
    }
}
