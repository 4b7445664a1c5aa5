/* 16-float vectors (one AVX-512 register; two AVX2 ones elsewhere) and the few helpers every C
   kernel here shares. cbuild.py hashes this header with each kernel's source. */
#ifndef RECLAIM_SIMD_H
#define RECLAIM_SIMD_H
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* A fixed tree of halves, the same for every vector: sums stay batch invariant (a serial sum of
   16 lanes cost as much as a third of the multiply-adds of a K = 576 dot product). */
static inline float sum16(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}
#endif
