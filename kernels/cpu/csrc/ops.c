/* Fused float32 ops of the Llama block for the CPU: residual add + RMSNorm, and rope.
 *
 * Compiled without -ffast-math and with -ffp-contract=off: every product and sum is the IEEE
 * operation HF's torch formulas perform, in their order, so rope is bit-identical; RMSNorm
 * differs only in the order of its sum of squares (vector lanes). Called by kernels/cpu/ops.py
 * and by fused.c.
 */
#include <math.h>
#include <stdint.h>

#include "api.h"

/* out = weight * (s * (1 / sqrt(mean(s^2) + eps))) over n floats; out may be s */
static inline void rms_norm_row(const float *s, const float *weight, float *out, int64_t n,
                                float eps)
{
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++)
        ss += s[i] * s[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        out[i] = weight[i] * (s[i] * inv);
}

/* residual (when not NULL) += x, then out = weight * (s * (1 / sqrt(mean(s^2) + eps))) where s
 * is the new residual (or x); rows of `hidden` floats, contiguous. */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t rows, int64_t hidden, float eps, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *s = x + r * hidden;
        if (residual) {
            float *res = residual + r * hidden;
#pragma omp simd
            for (int64_t i = 0; i < hidden; i++)
                res[i] = res[i] + s[i];
            s = res;
        }
        rms_norm_row(s, weight, out + r * hidden, hidden, eps);
    }
}

/* In place, each head its own RMSNorm (Qwen3's and Gemma 3's q/k norms): x [tokens, heads,
 * dim] with rows x_stride floats apart and heads contiguous; weight [dim]. The same numbers
 * as add_rms_norm_f32 over [tokens * heads, dim]. */
void rms_norm_heads_f32(float *x, int64_t x_stride, const float *weight, int64_t tokens,
                        int64_t heads, int64_t dim, float eps, int num_threads)
{
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++) {
            float *s = x + t * x_stride + h * dim;
            rms_norm_row(s, weight, s, dim, eps);
        }
}

/* Rotate-half rope: out[t, h] = x[t, h] * cos[p] + swap(x[t, h]) * sin[p], p = positions[t],
 * swap exchanging the two halves, sin holding its sign (-sin, sin). x: [tokens, heads, dim]
 * with rows x_stride floats apart, heads contiguous; out contiguous; tables [positions, dim]. */
void rope_f32(const float *x, int64_t x_stride, const int64_t *positions, const float *cos_t,
              const float *sin_t, float *out, int64_t tokens, int64_t heads, int64_t dim,
              int num_threads)
{
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * dim, *s = sin_t + positions[t] * dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + t * x_stride + h * dim;
            float *o = out + (t * heads + h) * dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                o[i] = xi[i] * c[i] + xi[i + half] * s[i];
                o[i + half] = xi[i + half] * c[i + half] + xi[i] * s[i + half];
            }
        }
    }
}

/* out[r] = the index of the first largest value of row r (rows `stride` floats apart, n
 * values each), or of its first NaN where it has one: torch.argmax's answer. Three vectorized
 * passes (NaNs counted, the max, its first block of 64), each faster than one fused loop. */
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out,
                     int num_threads)
{
    /* NOTE: rows over threads from 4 rows (a 64-row batch's logits: 12.6 MB) */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 4)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        int nans = 0;
#pragma omp simd reduction(+ : nans)
        for (int64_t i = 0; i < n; i++)
            nans += row[i] != row[i];
        float mx = -INFINITY;
        if (!nans) {
#pragma omp simd reduction(max : mx)
            for (int64_t i = 0; i < n; i++)
                mx = row[i] > mx ? row[i] : mx;
        }
        out[r] = 0;
        for (int64_t i0 = 0; i0 < n; i0 += 64) {
            const int64_t i1 = i0 + 64 < n ? i0 + 64 : n;
            int hit = 0;
#pragma omp simd reduction(+ : hit)
            for (int64_t i = i0; i < i1; i++)
                hit += nans ? row[i] != row[i] : row[i] == mx;
            if (!hit)
                continue;
            for (int64_t i = i0; i < i1; i++)
                if (nans ? row[i] != row[i] : row[i] == mx) {
                    out[r] = i;
                    break;
                }
            break;
        }
    }
}
