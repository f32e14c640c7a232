/* The fused MLP over packed tiles: down(act(gate) * up) in one call and one OpenMP region
 * (quant_packed.c's tile products; between them vec_avx512.h's SiLU or tanh-GELU and A8
 * requantization of the activation), with the rows' LoRA deltas (lora.c) added
 * after each product: gate_up's before the activation. AVX-512 VNNI only.
 */
#include <stdint.h>
#include <stdlib.h>

#include "api.h"
#include "lora.h"
#include "quant_blocks.h"
#include "vec_avx512.h"

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
    const int64_t GI = I / 32;
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
        ptiles_product(tgu, numerics, gu, 2 * I, H, x, H, &qx, M, h, 2 * I);
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
                quantize_row_avx512(a + r * I, I, qa.q + r * I, qa.dx + r * GI, qa.sx + r * GI,
                                    NULL, NULL);
        }
        ptiles_product(td, numerics, dn, H, I, a, I, &qa, M, out, H);
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
