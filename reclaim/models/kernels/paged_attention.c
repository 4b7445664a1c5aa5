/* Attention of packed query rows over a paged K/V pool, read where it lies (no gathered copy).

   A decode step's attention reads every cached key and value of every row once: memory-bound.
   Copying each row's history out of the pool first (padded to the longest row) cost more than
   the attention itself. Here each (row, K/V head) reads its keys straight from the blocks its
   table names, 16 keys at a time, with the query heads that share that K/V head (grouped-query
   attention) and, for a row of several new tokens (a verify row, a prefill chunk), a tile of
   its queries; softmax runs online (flash attention's running max and sum), so nothing of size
   S is ever stored.

   Which keys a query sees: slots s with lo <= s < hi, where hi is the query's exclusive limit
   (causal: past + i + 1; a tree row: past + T, its new keys then filtered by the tree mask) and
   lo = pos - window + 1 with a sliding window (pos: the query's position), else 0.

   Shapes (float32, contiguous): q and out [N, nh, D]; k and v one layer of the pool, [blocks,
   nkv, bs, D] (a head's keys of a block contiguous: what one (row, head) item streams); tables int32 [B, table_stride]; q_start, q_end int32 [B] (row r's queries are
   q_start[r] .. q_end[r] - 1 of q: rows need not cover q, so other rows can attend otherwise);
   past int32 [B]; q_pos, q_hi int32 [N]; tree uint8
   [N, tree_stride] or NULL: where not NULL and tree_row[r] is set, query i sees new key j (slot
   past + j) only if tree[i * tree_stride + j]. D must be a multiple of 16, at most 256.

   Batch invariant: a row's output depends on its own queries and keys only. Threads split the
   (row, head, query tile) items (OpenMP; torch's own runtime when loaded with it). */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define CHUNK 16    /* keys per online-softmax update: one vector of scores per query */
#define QT 8        /* query vectors (heads x tokens) per tile */
#define MAXD 256

static inline v16 load(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline float sum16(v16 v) {
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

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

/* r[j] = the sum of p[j]'s 16 lanes, for 16 vectors at once: halves added pairwise, 4 levels
   (30 shuffles and 15 adds where 16 separate sums take about 100 operations). */
static inline v16 sum16x16(const v16 *p) {
    v16 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++)
        a[j] = __builtin_shufflevector(p[2 * j], p[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * j], p[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++)
        b[j] = __builtin_shufflevector(a[2 * j], a[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(a[2 * j], a[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++)
        c[j] = __builtin_shufflevector(b[2 * j], b[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(b[2 * j], b[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static const vi16 IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Scores of nq query vectors against n <= 16 keys (rows of kb, D floats each) into lanes
   0..n-1 of sc[i], -inf where the query does not see the key (slot s0 + j) and in lanes >= n. */
static inline void scores(v16 *sc, const float *const *qv, int nq, const float *kb, int n, int s0,
                          const int *lo, const int *hi, const uint8_t *tree, const int *qtok,
                          long tree_stride, int past, int nd, float scale) {
    v16 part[QT][CHUNK];
    for (int j = 0; j < n; j++) {
        v16 kr[MAXD / 16];
        for (int d = 0; d < nd; d++) kr[d] = load(kb + (long)j * nd * 16 + 16 * d);
        for (int i = 0; i < nq; i++) {
            const float *q = qv[i];
            v16 a = load(q) * kr[0];
            for (int d = 1; d < nd; d++) a += load(q + 16 * d) * kr[d];
            part[i][j] = a;
        }
    }
    vi16 slot = IOTA + s0, ninf;
    v16 inf = (v16){0} - INFINITY;
    memcpy(&ninf, &inf, sizeof ninf);
    for (int i = 0; i < nq; i++) {
        for (int j = n; j < CHUNK; j++) part[i][j] = (v16){0};
        v16 x = sum16x16(part[i]) * scale;
        vi16 off = (slot < lo[i]) | (slot >= hi[i]) | (IOTA >= n), bits;
        memcpy(&bits, &x, sizeof bits);
        bits = (bits & ~off) | (ninf & off);
        memcpy(&x, &bits, sizeof x);
        if (tree && s0 + n > past)  /* a speculative tree: its new keys only where the mask allows */
            for (int j = 0; j < n; j++)
                if (s0 + j >= past && !tree[(long)qtok[i] * tree_stride + (s0 + j - past)]) x[j] = -INFINITY;
        sc[i] = x;
    }
}

/* acc[i] += sum_j p[i][j] * v_j over n keys: one accumulator at a time in a register, the
   chunk's values read from L1 (n a constant after inlining, for whole chunks). */
static inline __attribute__((always_inline)) void values(v16 (*acc)[MAXD / 16], float (*p)[CHUNK],
                                                         int nq, const float *vb, const int n,
                                                         const int nd) {
    for (int i = 0; i < nq; i++)
        for (int d = 0; d < nd; d++) {
            v16 a = acc[i][d];
            for (int j = 0; j < n; j++) a += p[i][j] * load(vb + (long)j * nd * 16 + 16 * d);
            acc[i][d] = a;
        }
}

/* One tile: nq query vectors (qv[i], D floats each, head h of query token qtok[i]) of row r
   against its visible keys; writes each query's output (D floats) to dst[i]. The pool is
   [blocks, nkv, bs, D]: one head's keys of a block are contiguous. */
static inline __attribute__((always_inline)) void tile(
        const float *const *qv, float *const *dst, const int *qtok, int nq, int h, const float *k,
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
    for (int b = lo_t / bs; b * bs < hi_t; b++) {
        const float *kblk = k + table[b] * block + h * head, *vblk = v + table[b] * block + h * head;
        if ((b + 1) * bs < hi_t) {  /* the next block's keys and values into L2 while this one runs */
            const float *kn = k + table[b + 1] * block + h * head, *vn = v + table[b + 1] * block + h * head;
            for (long off = 0; off < head; off += 16) {
                __builtin_prefetch(kn + off, 0, 2);
                __builtin_prefetch(vn + off, 0, 2);
            }
        }
        int first = b * bs > lo_t ? b * bs : lo_t, end = (b + 1) * bs < hi_t ? (b + 1) * bs : hi_t;
        for (int s0 = first; s0 < end; s0 += CHUNK) {
            int n = end - s0 < CHUNK ? end - s0 : CHUNK;
            const float *kb = kblk + (long)(s0 - b * bs) * D, *vb = vblk + (long)(s0 - b * bs) * D;
            v16 sc[QT];
            scores(sc, qv, nq, kb, n, s0, lo, hi, tree, qtok, tree_stride, past, nd, scale);
            float pj[QT][CHUNK];
            for (int i = 0; i < nq; i++) {
                float mc = max16(sc[i]);
                if (mc == -INFINITY) {  /* nothing visible in this chunk */
                    for (int j = 0; j < CHUNK; j++) pj[i][j] = 0.f;
                    continue;
                }
                float mn = mc > m[i] ? mc : m[i];
                float corr = m[i] == -INFINITY ? 0.f : expf(m[i] - mn);
                v16 p = exp16(sc[i] - mn);
                l[i] = l[i] * corr + sum16(p);
                m[i] = mn;
                if (corr != 1.f)
                    for (int d = 0; d < nd; d++) acc[i][d] *= corr;
                memcpy(pj[i], &p, sizeof p);
            }
            if (n == CHUNK)
                values(acc, pj, nq, vb, CHUNK, nd);
            else
                values(acc, pj, nq, vb, n, nd);
        }
    }
    for (int i = 0; i < nq; i++) {
        float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        for (int d = 0; d < nd; d++) store(dst[i] + 16 * d, acc[i][d] * inv);
    }
}

void paged_attention(float *out, const float *q, const float *k, const float *v,
                     const int32_t *tables, long table_stride, const int32_t *q_start,
                     const int32_t *q_end, const int32_t *past, const int32_t *q_pos, const int32_t *q_hi,
                     const uint8_t *tree, long tree_stride, const uint8_t *tree_row, int B,
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
            /* head_dim as a constant where it is common, so the loops over it unroll */
            if (D == 64)
                tile(qv, dst, qtok, nq, h, k, v, table, bs, nkv, 4, past[r], q_pos, q_hi, tr,
                     tree_stride, window, scale);
            else if (D == 128)
                tile(qv, dst, qtok, nq, h, k, v, table, bs, nkv, 8, past[r], q_pos, q_hi, tr,
                     tree_stride, window, scale);
            else
                tile(qv, dst, qtok, nq, h, k, v, table, bs, nkv, D / 16, past[r], q_pos, q_hi, tr,
                     tree_stride, window, scale);
        }
    }
}
