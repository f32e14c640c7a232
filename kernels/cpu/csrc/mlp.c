/* The fused MLP over packed tiles: down(act(gate) * up) in one call and one OpenMP region
 * (quant_packed.c's tile products, a vectorized exp for SiLU and tanh-GELU, and the A8
 * requantization of the activation between them), with the rows' LoRA deltas (lora.c) added
 * after each product: gate_up's before the activation. AVX-512 VNNI only.
 */
#include <stdint.h>
#include <stdlib.h>

#include "api.h"
#include "lora.h"
#include "quant.h"

#if KERNELS_X86
#include <immintrin.h>
#endif

#if KERNELS_X86
/* e^x, 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r (Cephes'
 * expf coefficients, about 1 ulp), scaled by 2^n. */
INLINE_AVX512 __m512 exp512(__m512 x)
{
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* a = act(gate) * up for 16 values: silu(g) = g / (1 + e^-g); gelu_tanh(g) = g (1 - 1 /
 * (1 + e^(2y))) with y = sqrt(2 / pi) (g + 0.044715 g^3), i.e. 0.5 g (1 + tanh y). */
INLINE_AVX512 __m512 act_mul(int act, __m512 g, __m512 u)
{
    const __m512 one = _mm512_set1_ps(1.0f);
    if (act == 0)
        return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(
            _mm512_setzero_ps(), g)))), u);
    const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                   _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
    const __m512 e = exp512(_mm512_add_ps(y, y));
    const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(one, e)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g),
                                       _mm512_add_ps(one, t)), u);
}

TARGET_AVX512 static void act_rows(int act, const float *h, int64_t I, int64_t r, int64_t i0,
                                   int64_t i1, float *a)
{
    for (int64_t i = i0; i < i1; i += 16) {
        const __mmask16 k = i1 - i >= 16 ? 0xFFFF : (__mmask16)((1u << (i1 - i)) - 1);
        const __m512 g = _mm512_maskz_loadu_ps(k, h + r * 2 * I + i);
        const __m512 u = _mm512_maskz_loadu_ps(k, h + r * 2 * I + I + i);
        _mm512_mask_storeu_ps(a + r * I + i, k, act_mul(act, g, u));
    }
}
#endif

/* A whole MLP for packed weights in one call: out[M, H] = down(act(gate) * up) with gate|up
 * = the rows of `gu` ([2I, H]: gate features first) and `dn` [H, I]; act 0 silu, 1 gelu_tanh.
 * One OpenMP region: the gate/up tiles, the activation, the down tiles, barriers between;
 * with `lora` (NULL: none) each adapted product's delta right after it. x and out contiguous.
 * AVX-512 VNNI only. */
int quant_mlp_packed(int tgu, const uint8_t *gu, int td, const uint8_t *dn, int64_t I,
                     int64_t H, const float *x, int64_t M, float *out, int numerics, int act,
                     const MlpLora *lora, int num_threads)
{
    if (quant_packed_bytes(tgu, 2 * I, H) < 0 || quant_packed_bytes(td, H, I) < 0 || M < 1
        || num_threads < 1
        || !isa_supported(ISA_AVX512) || (act != 0 && act != 1))
        return -1;
#if KERNELS_X86
    const int64_t GH = H / 32, GI = I / 32, tiles_gu = (2 * I + 15) / 16, tiles_dn = (H + 15) / 16;
    const int64_t tb_gu = GH * pgroup_bytes(tgu), tb_dn = GI * pgroup_bytes(td);
    float *h = malloc(sizeof(float) * (size_t)(M * 2 * I)), *a = malloc(sizeof(float) * (size_t)(M * I));
    QAct qx = {NULL, NULL, NULL}, qa = {NULL, NULL, NULL};
    LoraGroups lg;
    int adapted;
    int failed = lora_mlp_group(lora, M, &lg, &adapted) || !h || !a;
    if (!failed && numerics == NUM_A8)
        failed = quantize_act(x, H, M, H, &qx, ISA_AVX512, num_threads) || qact_alloc(M, I, &qa);
    if (failed) {
        free(h), free(a), free(qx.q), free(qx.dx), free(qx.sx);
        free(qa.q), free(qa.dx), free(qa.sx), lora_groups_free(&lg);
        return -1;
    }
    const int64_t ichunks = (I + 63) / 64;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles_gu; t++) {
            const int64_t left = 2 * I - 16 * t;
            const __mmask16 valid = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            ptile_rows(tgu, numerics, gu + t * tb_gu,
                       t + 1 < tiles_gu ? gu + (t + 1) * tb_gu : NULL, GH, H, x, H, &qx, M,
                       h + 16 * t, 2 * I, valid);
        }
        if (adapted && lora->gate_up.a)
            lora_delta_team(&lg, &lora->gate_up, x, H, H, h, 2 * I, 2 * I, ISA_AVX512);
#pragma omp for schedule(static) collapse(2)
        for (int64_t r = 0; r < M; r++)
            for (int64_t c = 0; c < ichunks; c++) {
                const int64_t i0 = 64 * c, i1 = i0 + 64 < I ? i0 + 64 : I;
                act_rows(act, h, I, r, i0, i1, a);
            }
        if (numerics == NUM_A8) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                quantize_row_avx512(a + r * I, I, qa.q + r * I, qa.dx + r * GI, qa.sx + r * GI);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles_dn; t++) {
            const int64_t left = H - 16 * t;
            const __mmask16 valid = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
            ptile_rows(td, numerics, dn + t * tb_dn, t + 1 < tiles_dn ? dn + (t + 1) * tb_dn : NULL,
                       GI, I, a, I, &qa, M, out + 16 * t, H, valid);
        }
        if (adapted && lora->down.a)
            lora_delta_team(&lg, &lora->down, a, I, I, out, H, H, ISA_AVX512);
    }
    free(h), free(a), free(qx.q), free(qx.dx), free(qx.sx);
    free(qa.q), free(qa.dx), free(qa.sx), lora_groups_free(&lg);
    return 0;
#else
    return -1;
#endif
}
