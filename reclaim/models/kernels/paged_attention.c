/* Attention of packed query rows over a paged K/V pool, read where it lies (no gathered copy).

   A decode step's attention reads every cached key and value of every row once. Copying each
   row's history out of the pool first (padded to the longest row) cost more than the attention
   itself. Here each (row, K/V head) reads its keys straight from the blocks its table names, 16
   keys at a time, with the query heads that share that K/V head (grouped-query attention) and,
   for a row of several new tokens (a verify row, a prefill chunk), a tile of its queries;
   softmax runs online (flash attention's running max and sum), so nothing of size S is stored.

   Keys are stored transposed within a block ([D, bs] per head): 16 keys' d-th entries are one
   vector, so a query's 16 scores are D multiply-adds into one vector, with no per-key sum
   across lanes (that sum cost more than the multiply-adds themselves).

   Which keys a query sees: slots s with lo <= s < hi, where hi is the query's exclusive limit
   (causal: past + i + 1; a tree row: past + T, its new keys then filtered by the tree mask) and
   lo = pos - window + 1 with a sliding window (pos: the query's position), else 0. No other
   slot's value is read.

   Shapes (float32, contiguous): q and out [N, nh, D]; one layer of the pool, k [blocks, nkv, D,
   bs] and v [blocks, nkv, bs, D]; tables int32 [B, table_stride]; q_start, q_end int32 [B] (row
   r's queries are q_start[r] .. q_end[r] - 1 of q: rows need not cover q, so other rows can
   attend otherwise); past int32 [B]; q_pos, q_hi int32 [N]; tree uint8 [N, tree_stride] or
   NULL: where not NULL and tree_row[r] is set, query i sees new key j (slot past + j) only if
   tree[i * tree_stride + j] (tree_row int32 [B]). D and bs must be multiples of 16, D at most 256.

   Batch invariant: a row's output depends on its own queries and keys only. Threads split the
   (row, head, query tile) items (OpenMP; torch's own runtime when loaded with it). */
#include <math.h>
#include <stdint.h>

#include "simd.h"

typedef int32_t vi16 __attribute__((vector_size(64)));

#define CHUNK 16    /* keys per vector of scores: 16 aligned slots of one block */
#define SPAN 16     /* chunks per online-softmax update (256 keys): the max, exp and sum of an
                       update are a chain of dependent operations; over one chunk they cost
                       several times its multiply-adds */
#define QT 8        /* query vectors (heads x tokens) per tile */
#define MAXD 256

static inline float max16(v16 v) {
    float m = v[0];
    for (int i = 1; i < 16; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* exp(x) for x <= 0 (scores minus their running max), Cephes' expf polynomial after reducing
   by ln 2: about 1 ulp. Lanes below -87 (masked keys are -inf) give exactly 0. */
static inline v16 exp16(v16 x) {
    vi16 dead = x < -87.0f;
    v16 xc = x;
    for (int i = 0; i < 16; i++) xc[i] = xc[i] < -87.0f ? -87.0f : xc[i];
    v16 fn = xc * 1.44269504088896341f - 0.5f;
    vi16 n = __builtin_convertvector(fn, vi16);   /* truncation of y - 0.5 toward 0: round(y) */
    v16 nf = __builtin_convertvector(n, v16);
    v16 r = xc - nf * 0.693359375f + nf * 2.12194440e-4f;
    v16 p = (v16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vi16 pow2 = (n + 127) << 23;
    v16 two_n;
    memcpy(&two_n, &pow2, sizeof two_n);
    vi16 bits;
    p = p * two_n;
    memcpy(&bits, &p, sizeof bits);
    bits &= ~dead;
    memcpy(&p, &bits, sizeof p);
    return p;
}

static const vi16 IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Scores of nq query vectors against the 16 keys of kt (transposed: kt[d * bs + j] is key j's
   d-th entry) into sc[i], -inf where the query does not see the key (slot s0 + j). */
static inline __attribute__((always_inline)) void scores(
        v16 *sc, const float *const *qv, int nq, const float *kt, int bs, int s0, const int *lo,
        const int *hi, const uint8_t *tree, const int *qtok, long tree_stride, int past,
        const int D, float scale) {
    /* PARTS independent sums per query over interleaved d: a multiply-add waits ~4 cycles for
       the one before it in its sum, so a few queries' sums alone leave the FMA units idle */
    enum { PARTS = 4 };
    const int parts = nq <= 2 ? PARTS : nq <= 4 ? 2 : 1;
    v16 a[QT][PARTS];
    for (int i = 0; i < nq; i++)
        for (int u = 0; u < parts; u++) a[i][u] = (v16){0};
    for (int d = 0; d < D; d += parts)
        for (int u = 0; u < parts; u++) {
            v16 kd = load(kt + (long)(d + u) * bs);
            __asm__("" : "+v"(kd));  /* a register, not reloaded for each query */
            for (int i = 0; i < nq; i++) a[i][u] += qv[i][d + u] * kd;
        }
    for (int i = 0; i < nq; i++)
        for (int u = 1; u < parts; u++) a[i][0] += a[i][u];
    vi16 slot = IOTA + s0, ninf;
    v16 inf = (v16){0} - INFINITY;
    memcpy(&ninf, &inf, sizeof ninf);
    for (int i = 0; i < nq; i++) {
        v16 x = a[i][0] * scale;
        vi16 off = (slot < lo[i]) | (slot >= hi[i]), bits;
        memcpy(&bits, &x, sizeof bits);
        bits = (bits & ~off) | (ninf & off);
        memcpy(&x, &bits, sizeof x);
        if (tree && s0 + CHUNK > past)  /* a speculative tree: its new keys only where the mask allows */
            for (int j = 0; j < CHUNK; j++)
                if (s0 + j >= past && s0 + j < hi[i] && !tree[(long)qtok[i] * tree_stride + (s0 + j - past)])
                    x[j] = -INFINITY;
        sc[i] = x;
    }
}

/* acc[i] += sum_j p[i][j] * v_j over keys j0 <= j < j1 of a chunk (p: that chunk's 16
   weights of each query, row stride SPAN * CHUNK). Each value vector is loaded once and used by
   a group of queries whose accumulators stay in registers (bounds constant after inlining for
   whole chunks and common shapes). */
static inline __attribute__((always_inline)) void values(v16 (*acc)[MAXD / 16], const float *p,
                                                         const int nq, const float *vb, const int j0,
                                                         const int j1, const int nd) {
    const int ib = nd <= 4 ? 4 : nd <= 8 ? 2 : 1;  /* queries per group: ib * nd registers */
    for (int i0 = 0; i0 < nq; i0 += ib) {
        const int n = nq - i0 < ib ? nq - i0 : ib;
        v16 a[4][MAXD / 16];
        for (int i = 0; i < n; i++)
            for (int d = 0; d < nd; d++) a[i][d] = acc[i0 + i][d];
        for (int j = j0; j < j1; j++) {
            v16 vr[MAXD / 16];
            for (int d = 0; d < nd; d++) {
                vr[d] = load(vb + (long)j * nd * 16 + 16 * d);
                __asm__("" : "+v"(vr[d]));  /* a register, not reloaded for each query */
            }
            for (int i = 0; i < n; i++) {
                float w = p[(i0 + i) * SPAN * CHUNK + j];
                for (int d = 0; d < nd; d++) a[i][d] += w * vr[d];
            }
        }
        for (int i = 0; i < n; i++)
            for (int d = 0; d < nd; d++) acc[i0 + i][d] = a[i][d];
    }
}

static inline v16 vmax(v16 a, v16 b) {
    vi16 gt = a > b, ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    ia = (ia & gt) | (ib & ~gt);
    memcpy(&a, &ia, sizeof a);
    return a;
}

/* The pool's blocks lie anywhere and the hardware's prefetchers stop at each 4 KB page, so each
   chunk's keys and values are fetched into L2 AHEAD chunks before its scores, one chunk's worth
   per chunk computed (a steady stream). Measured on SmolLM2's shapes, one thread, EPYC: 16 rows
   of 150-700 tokens 30.5 -> 27-28.5 ms over 30 layers, one row of 2,000 8.5 -> 7.3-7.5 ms, against
   the block after next fetched at each block's start (2-8 ahead, or into L1, measured slower). */
#define AHEAD 4

static inline void prefetch_chunk(const float *k, const float *v, const int32_t *table, long block,
                                  long head_off, int s, int bs, int D) {
    const float *kt = k + table[s / bs] * block + head_off + s % bs;
    const float *vt = v + table[s / bs] * block + head_off + (long)(s % bs) * D;
    for (int d = 0; d < D; d++) __builtin_prefetch(kt + (long)d * bs, 0, 2);  /* a 16-key line per d */
    for (int off = 0; off < CHUNK * D; off += 16) __builtin_prefetch(vt + off, 0, 2);
}

/* One tile: nq query vectors (qv[i], D floats each, head h of query token qtok[i]) of row r
   against its visible keys; writes each query's output (D floats) to dst[i]. The pool is
   [blocks, nkv, bs, D]: one head's keys of a block are contiguous. */
static inline __attribute__((always_inline)) void tile(
        const float *const *qv, float *const *dst, const int *qtok, const int nq, int h, const float *k,
        const float *v, const int32_t *table, int bs, int nkv, const int nd, int past,
        const int32_t *q_pos, const int32_t *q_hi, const uint8_t *tree, long tree_stride,
        int window, float scale) {
    const int D = nd * 16;
    v16 acc[QT][MAXD / 16];
    float m[QT], l[QT];
    int lo_t = 1 << 30, hi_t = 0;
    int lo[QT], hi[QT];
    for (int i = 0; i < nq; i++) {
        for (int d = 0; d < nd; d++) acc[i][d] = (v16){0};
        m[i] = -INFINITY;
        l[i] = 0.f;
        int t = qtok[i];
        hi[i] = q_hi[t];
        lo[i] = window > 0 ? q_pos[t] - window + 1 : 0;
        if (lo[i] < 0) lo[i] = 0;
        if (lo[i] < lo_t) lo_t = lo[i];
        if (hi[i] > hi_t) hi_t = hi[i];
    }
    const long head = (long)bs * D, block = (long)nkv * head;
    const int first = lo_t / CHUNK * CHUNK;
    for (int s = first; s < hi_t && s < first + AHEAD * CHUNK; s += CHUNK)
        prefetch_chunk(k, v, table, block, h * head, s, bs, D);
    /* chunks of 16 slots aligned within blocks, from the one holding lo_t; lanes outside a
       query's [lo, hi) are masked */
    for (int s = first; s < hi_t;) {
        const float *kc[SPAN], *vc[SPAN];
        int s0[SPAN], nc = 0;
        for (; nc < SPAN && s < hi_t; nc++, s += CHUNK) {
            int b = s / bs, c = s % bs;
            kc[nc] = k + table[b] * block + h * head + c;
            vc[nc] = v + table[b] * block + h * head + (long)c * D;
            s0[nc] = s;
        }
        v16 sc[SPAN][QT];
        for (int ch = 0; ch < nc; ch++) {
            if (s0[ch] + AHEAD * CHUNK < hi_t)
                prefetch_chunk(k, v, table, block, h * head, s0[ch] + AHEAD * CHUNK, bs, D);
            scores(sc[ch], qv, nq, kc[ch], bs, s0[ch], lo, hi, tree, qtok, tree_stride, past, D, scale);
        }
        float pj[QT][SPAN * CHUNK];
        for (int i = 0; i < nq; i++) {
            v16 vm = sc[0][i];
            for (int ch = 1; ch < nc; ch++) vm = vmax(vm, sc[ch][i]);
            float mc = max16(vm);
            if (mc == -INFINITY) {  /* nothing visible in these chunks */
                memset(pj[i], 0, sizeof pj[i]);
                continue;
            }
            float mn = mc > m[i] ? mc : m[i];
            float corr = m[i] == -INFINITY ? 0.f : expf(m[i] - mn);
            v16 sum = (v16){0};
            for (int ch = 0; ch < nc; ch++) {
                v16 p = exp16(sc[ch][i] - mn);
                sum += p;
                memcpy(pj[i] + ch * CHUNK, &p, sizeof p);
            }
            l[i] = l[i] * corr + sum16(sum);
            m[i] = mn;
            if (corr != 1.f)
                for (int d = 0; d < nd; d++) acc[i][d] *= corr;
        }
        for (int ch = 0; ch < nc; ch++) {
            /* only the values of slots some query may see: others may be unwritten */
            int j0 = lo_t > s0[ch] ? lo_t - s0[ch] : 0, j1 = hi_t - s0[ch] < CHUNK ? hi_t - s0[ch] : CHUNK;
            if (j0 == 0 && j1 == CHUNK)
                values(acc, &pj[0][ch * CHUNK], nq, vc[ch], 0, CHUNK, nd);
            else
                values(acc, &pj[0][ch * CHUNK], nq, vc[ch], j0, j1, nd);
        }
    }
    for (int i = 0; i < nq; i++) {
        float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        for (int d = 0; d < nd; d++) store(dst[i] + 16 * d, acc[i][d] * inv);
    }
}

/* tile() specialised where head_dim and the tile's query count are common: the loops over them
   unroll and the score accumulators stay in registers. Each is a function of its own (not inlined
   into the dispatch): one function holding all of them took gcc 15 s to compile, these 5. */
#define TILE_FN(NQ, ND) \
    static __attribute__((noinline)) void tile_##NQ##_##ND( \
            const float *const *qv, float *const *dst, const int *qtok, int h, const float *k, \
            const float *v, const int32_t *table, int bs, int nkv, int past, const int32_t *q_pos, \
            const int32_t *q_hi, const uint8_t *tree, long tree_stride, int window, float scale) { \
        tile(qv, dst, qtok, NQ, h, k, v, table, bs, nkv, ND, past, q_pos, q_hi, tree, tree_stride, window, \
             scale); \
    }
#define TILE_FNS(ND) TILE_FN(1, ND) TILE_FN(2, ND) TILE_FN(3, ND) TILE_FN(4, ND) TILE_FN(6, ND) TILE_FN(8, ND)
TILE_FNS(4)  /* head_dim 64 */
TILE_FNS(8)  /* head_dim 128 */

void paged_attention(float *out, const float *q, const float *k, const float *v,
                     const int32_t *tables, long table_stride, const int32_t *q_start,
                     const int32_t *q_end, const int32_t *past, const int32_t *q_pos, const int32_t *q_hi,
                     const uint8_t *tree, long tree_stride, const int32_t *tree_row, int B,
                     int nh, int nkv, int D, int bs, int window, float scale, int threads) {
    const int g = nh / nkv;
    /* Items: (row, K/V head, tile of that row's queries); a tile holds QT / g query tokens. */
    const int per = g >= QT ? 1 : QT / g;
    long items = 0;
    for (int r = 0; r < B; r++) items += (long)nkv * ((q_end[r] - q_start[r] + per - 1) / per);
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (long it = 0; it < items; it++) {
        /* Find the item's row by walking (B is small next to the work per item). */
        long rest = it;
        int r = 0, tiles = 0;
        for (; r < B; r++) {
            tiles = (q_end[r] - q_start[r] + per - 1) / per;
            if (rest < (long)nkv * tiles) break;
            rest -= (long)nkv * tiles;
        }
        int h = (int)(rest / tiles), t0 = q_start[r] + (int)(rest % tiles) * per;
        int t1 = t0 + per < q_end[r] ? t0 + per : q_end[r];
        const uint8_t *tr = tree && tree_row[r] ? tree : 0;
        /* Heads h * g .. h * g + g - 1 share this K/V head; tiles of at most QT vectors. */
        for (int hg = 0; hg < g; hg += QT) {
            int ng = g - hg < QT ? g - hg : QT;
            const float *qv[QT];
            float *dst[QT];
            int qtok[QT];
            int nq = 0;
            for (int t = t0; t < t1; t++)
                for (int j = 0; j < ng; j++) {
                    long off = ((long)t * nh + h * g + hg + j) * D;
                    qv[nq] = q + off;
                    dst[nq] = out + off;
                    qtok[nq++] = t;
                }
            const int32_t *table = tables + (long)r * table_stride;
#define TILE(NQ, ND) tile(qv, dst, qtok, NQ, h, k, v, table, bs, nkv, ND, past[r], q_pos, q_hi, tr, \
                          tree_stride, window, scale)
#define CALL(NQ, ND) tile_##NQ##_##ND(qv, dst, qtok, h, k, v, table, bs, nkv, past[r], q_pos, q_hi, tr, \
                                      tree_stride, window, scale)
#define BY_NQ(ND) switch (nq) { \
                case 1: CALL(1, ND); break; case 2: CALL(2, ND); break; case 3: CALL(3, ND); break; \
                case 4: CALL(4, ND); break; case 6: CALL(6, ND); break; case 8: CALL(8, ND); break; \
                default: TILE(nq, ND); }
            if (D == 64) { BY_NQ(4) }
            else if (D == 128) { BY_NQ(8) }
            else TILE(nq, D / 16);
        }
    }
}

/* Store N new tokens' keys and values (k_new, v_new [N, nkv, D], contiguous) in their slots:
   token t goes to block blk[t], offset off[t] of one layer's pool (k [blocks, nkv, D, bs]
   transposed, v [blocks, nkv, bs, D]). */
void paged_write(float *k, float *v, const float *k_new, const float *v_new, const int32_t *blk,
                 const int32_t *off, long N, int nkv, int D, int bs) {
    const long head = (long)bs * D, block = (long)nkv * head;
    for (long t = 0; t < N; t++)
        for (int h = 0; h < nkv; h++) {
            const float *ks = k_new + (t * nkv + h) * D, *vs = v_new + (t * nkv + h) * D;
            float *kd = k + blk[t] * block + h * head + off[t], *vd = v + blk[t] * block + h * head + (long)off[t] * D;
            for (int d = 0; d < D; d++) kd[(long)d * bs] = ks[d];
            memcpy(vd, vs, (size_t)D * sizeof(float));
        }
}
