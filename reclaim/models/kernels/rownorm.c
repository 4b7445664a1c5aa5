/* RMSNorm and rotary embedding over float32 rows: the per-token ops between a CPU decode step's
   matrix products.

   In torch each is 6-8 small ops (RMSNorm: pow, mean, add, rsqrt, two multiplies; RoPE: slices,
   neg, cat, two multiplies, add), 25-35 us a call for one token where the arithmetic takes
   under 1 us; a decode step of SmolLM2 calls them 121 times.

   rms_norm: y = w * (x * 1 / sqrt(mean(x^2) + eps)) per row, as transformers' LlamaRMSNorm;
   the mean is a 16-lane float32 sum in order plus a fixed tree (each row alone: batch invariant).
   rope: out = x * cos + rotate_half(x) * sin, the same multiplies and adds as the torch
   formula (no fused multiply-add), so it equals `apply_rope` bit for bit.

   Shapes: x, y [rows, n] with row strides ldx, ldy; w [n]. rope: x, out [tokens, heads, D]
   contiguous, cos and sin [tokens, D] contiguous (each half repeated, as the model builds them). */
#pragma GCC optimize("fp-contract=off")
#include <math.h>

#include "simd.h"

void rms_norm(const float *x, long ldx, const float *w, float *y, long ldy, long rows, long n, float eps) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        v16 acc = {0};
        long i = 0;
        for (; i + 16 <= n; i += 16) {
            v16 v = load(xr + i);
            acc += v * v;
        }
        float ss = sum16(acc);
        for (; i < n; i++) ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (i = 0; i + 16 <= n; i += 16) store(yr + i, load(w + i) * (load(xr + i) * inv));
        for (; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
    }
}

void rope(float *out, const float *x, const float *cos_, const float *sin_, long tokens, int heads, int D) {
    const int half = D / 2;
    for (long t = 0; t < tokens; t++) {
        const float *c = cos_ + t * D, *s = sin_ + t * D;
        for (int h = 0; h < heads; h++) {
            const float *xh = x + (t * heads + h) * D;
            float *oh = out + (t * heads + h) * D;
            for (int d = 0; d < half; d++) oh[d] = xh[d] * c[d] + -xh[d + half] * s[d];
            for (int d = half; d < D; d++) oh[d] = xh[d] * c[d] + xh[d - half] * s[d];
        }
    }
}
