/* Products and the one-call MLP over raw GGUF blocks, for CPUs and types without packed tiles
 * (an AVX2-only CPU runs every type this way): a product of several row segments, each of
 * its own type (Q4_K_M files mix Q4_K and Q6_K in one fused projection), as quant.c's
 * quant_matmul per segment; and down(act(gate) * up) with those products, the activation
 * vectorized between them, and the rows' LoRA deltas (lora.c) after each product, gate_up's
 * before the activation. The per-layer path (kernels/cpu/quant.py's BlockProduct and
 * BlockMLP) and the decode stack (fused.c) make these same calls, so both give the same
 * numbers.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "api.h"
#include "common.h"

#if KERNELS_X86
#include <immintrin.h>

/* e^x, 8 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r (Cephes' expf
 * coefficients, about 1 ulp, as mlp.c's AVX-512 one), scaled by 2^n through the exponent
 * bits (n in [-127, 127]; 2^-127 flushes to zero, where e^x is below float's normals). */
INLINE_AVX2 __m256 exp256(__m256 x)
{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* act(gate) * up for 8 values, mlp.c's formulas: silu(g) = g / (1 + e^-g); gelu_tanh(g) =
 * 0.5 g (1 + tanh y), y = sqrt(2 / pi) (g + 0.044715 g^3), tanh y = 1 - 2 / (1 + e^(2y)). */
INLINE_AVX2 __m256 act_mul8(int act, __m256 g, __m256 u)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    if (act == 0)
        return _mm256_mul_ps(
            _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g)))),
            u);
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                   _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
    const __m256 e = exp256(_mm256_add_ps(y, y));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(one, e)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g),
                                       _mm256_add_ps(one, t)), u);
}

/* a[i] = act(g[i]) * u[i], n values, a multiple of 8 (down's width is whole 32-weight
 * blocks) */
TARGET_AVX2 static void act_row_avx2(int act, const float *g, const float *u, float *a,
                                     int64_t n)
{
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(a + i, act_mul8(act, _mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
}
#endif

/* The same formulas with libm's expf, for CPUs without AVX2 */
static void act_row_scalar(int act, const float *g, const float *u, float *a, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        if (act == 0) {
            a[i] = x / (1.0f + expf(-x)) * u[i];
        } else {
            const float y = 0.7978845608028654f * (0.044715f * x * x * x + x);
            const float t = 1.0f - 2.0f / (1.0f + expf(y + y));
            a[i] = 0.5f * x * (1.0f + t) * u[i];
        }
    }
}

/* isa: ISA_AUTO (the best this CPU has) or a forced one, for the products and the activation */
int quant_matmul_parts(const BlockParts *w, int64_t K, const float *x, int64_t xs, int64_t M,
                       float *out, int64_t os, int numerics, int isa, int num_threads)
{
    if (w->parts < 1 || w->parts > MAX_PARTS)
        return -1;
    int64_t n0 = 0;
    for (int64_t p = 0; p < w->parts; p++) {
        if (quant_matmul((int)w->type[p], w->data[p], w->rows[p], K, x, xs, M, out + n0, os,
                         numerics, isa, num_threads))
            return -1;
        n0 += w->rows[p];
    }
    return 0;
}

static int64_t parts_rows(const BlockParts *w)
{
    int64_t n = 0;
    for (int64_t p = 0; p < w->parts && p < MAX_PARTS; p++)
        n += w->rows[p];
    return n;
}

/* out [M, N] += the delta of gate_up (down 0) or down (1) of x [M, K] for the rows with an
 * adapter (lora NULL, or slots NULL: none) */
static int mlp_delta(const MlpLora *lora, int down, const float *x, int64_t K, int64_t M,
                     float *out, int64_t N, int num_threads)
{
    if (!lora || !lora->slots)
        return 0;
    const LoraWeights *w = down ? &lora->down : &lora->gate_up;
    if (!w->a)
        return 0;
    return lora_delta_f32(x, K, M, K, lora->slots, lora->num_slots, w->a, w->bt, w->rank,
                          w->ldb, out, N, N, ISA_AUTO, num_threads);
}

int quant_mlp_blocks(const BlockParts *gu, const BlockParts *dn, int64_t I, int64_t H,
                     const float *x, int64_t M, float *out, int numerics, int act,
                     const MlpLora *lora, int isa, int num_threads)
{
    if (isa == ISA_AUTO)
        isa = best_isa();
    if (M < 1 || num_threads < 1 || (act != 0 && act != 1) || I % 32 || parts_rows(gu) != 2 * I
        || parts_rows(dn) != H || !isa_supported(isa))
        return -1;
    float *h = malloc(sizeof(float) * (size_t)(M * 2 * I));
    float *a = malloc(sizeof(float) * (size_t)(M * I));
    int rc = !h || !a ? -1 : 0;
    if (!rc)
        rc = quant_matmul_parts(gu, H, x, H, M, h, 2 * I, numerics, isa, num_threads);
    if (!rc)
        rc = mlp_delta(lora, 0, x, H, M, h, 2 * I, num_threads);
    if (!rc) {
#if KERNELS_X86
        const int avx2 = isa == ISA_AVX2 || isa == ISA_AVX512;
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * I >= 32768)
        for (int64_t r = 0; r < M; r++) {
            const float *g = h + r * 2 * I, *u = g + I;
#if KERNELS_X86
            if (avx2) {
                act_row_avx2(act, g, u, a + r * I, I);
                continue;
            }
#endif
            act_row_scalar(act, g, u, a + r * I, I);
        }
        rc = quant_matmul_parts(dn, I, a, I, M, out, H, numerics, isa, num_threads);
    }
    if (!rc)
        rc = mlp_delta(lora, 1, a, I, M, out, H, num_threads);
    free(h), free(a);
    return rc;
}
