/* Products with GGUF-quantized weights on the CPU: out[M, N] = x[M, K] @ W[N, K]^T; the entry
 * points over raw blocks and the run-time ISA choice.
 *
 * W stays in its file's blocks (formats and numerics: quant_blocks.h). One pass over W serves every
 * row: threads take chunks of output features and run the chosen path over them: the scalar
 * reference (quant_ref.c) or the AVX2 / AVX-512 VNNI tiles (quant_x86.c), chosen here at run
 * time by probing the CPU, or forced by the caller. Packed tiles: quant_packed.c; the fused
 * MLP: mlp.c.
 */
#include <stdint.h>
#include <stdlib.h>

#include "api.h"
#include "quant_blocks.h"
#include "vec_avx512.h"

#define NCHUNK 16 /* output features per task */
#define GEMM_CHUNK 32 /* output features per task of the expanded-tile path */
/* rows from which a32 takes the expanded-tile path on AVX-512: 576 x 3072 Q4_1, one thread,
 * 0.39 ms against 0.40 for register tiles at 8 rows, 0.55 against 0.79 at 16 */
int GEMM_ROWS = 8;

int quant_block_elems(int type) { return block_elems(type); }

int quant_block_bytes(int type) { return block_bytes(type); }

#if KERNELS_X86
int isa_supported(int isa)
{
    __builtin_cpu_init();
    switch (isa) {
    case ISA_SCALAR: return 1;
    case ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
               && __builtin_cpu_supports("f16c");
    case ISA_AVX512:
        return isa_supported(ISA_AVX2) && __builtin_cpu_supports("avx512f")
               && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
               && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
    default: return 0;
    }
}
#else
int isa_supported(int isa) { return isa == ISA_SCALAR; }
#endif

int best_isa(void)
{
    return isa_supported(ISA_AVX512) ? ISA_AVX512 : isa_supported(ISA_AVX2) ? ISA_AVX2 : ISA_SCALAR;
}

int qact_alloc(int64_t M, int64_t K, QAct *qa)
{
    const int64_t G = K / 32;
    qa->q = malloc((size_t)(M * K));
    qa->dx = malloc(sizeof(float) * (size_t)(M * G));
    qa->sx = malloc(sizeof(float) * (size_t)(M * G));
    if (!qa->q || !qa->dx || !qa->sx) {
        free(qa->q), free(qa->dx), free(qa->sx);
        qa->q = NULL, qa->dx = qa->sx = NULL;
        return -1;
    }
    return 0;
}

/* The activations' int8 blocks, by the AVX-512 quantizer only when the caller's isa is
 * AVX-512 (a forced scalar or AVX2 product uses the scalar rounding it is tested against). */
int quantize_act(const float *x, int64_t xs, int64_t M, int64_t K, QAct *qa, int isa,
                 int num_threads)
{
    const int64_t G = K / 32;
    if (qact_alloc(M, K, qa))
        return -1;
#if KERNELS_X86
    const int simd = isa == ISA_AVX512 && isa_supported(ISA_AVX512);
#else
    const int simd = 0;
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= 8)
    for (int64_t r = 0; r < M; r++) {
#if KERNELS_X86
        if (simd) {
            quantize_row_avx512(x + r * xs, K, qa->q + r * K, qa->dx + r * G, qa->sx + r * G,
                                NULL, NULL);
            continue;
        }
#endif
        quantize_row(x + r * xs, K, qa->q + r * K, qa->dx + r * G, qa->sx + r * G);
    }
    return 0;
}

/* out[m, n] (row stride os) = sum_k x[m, k] (row stride xs) W[n, k], for n in [0, N).
 * Returns 0, or -1 for an unknown type, a K the type cannot hold, an ISA this CPU lacks, or
 * no memory. */
int quant_matmul(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t xs,
                 int64_t M, float *out, int64_t os, int numerics, int isa, int num_threads)
{
    const int be = block_elems(type);
    if (be == 0 || K % be != 0 || M < 1 || N < 1 || num_threads < 1)
        return -1;
    if (isa == ISA_AUTO)
        isa = best_isa();
    if (!isa_supported(isa))
        return -1;
    const int64_t rb = K / be * block_bytes(type);
    QAct qa = {NULL, NULL, NULL};
    if (numerics == NUM_A8 && quantize_act(x, xs, M, K, &qa, isa, num_threads))
        return -1;
    /* NOTE: a32 from GEMM_ROWS rows on AVX-512: expanded tiles (gemm_avx512) */
    const int gemm = numerics == NUM_A32 && isa == ISA_AVX512 && M >= GEMM_ROWS;
    const int64_t step = gemm ? GEMM_CHUNK : NCHUNK, chunks = (N + step - 1) / step;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *wbuf = gemm ? malloc(sizeof(float) * (size_t)(GEMM_CHUNK * K)) : NULL;
        if (gemm && !wbuf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = c * step, n1 = n0 + step < N ? n0 + step : N;
#if KERNELS_X86
            if (gemm && wbuf)
                gemm_avx512(type, w, rb, n0, n1, K, x, xs, M, out, os, wbuf);
            else if (gemm)
                continue;
            else if (isa == ISA_AVX512)
                rows_avx512(type, numerics, w, rb, n0, n1, K, x, xs, &qa, M, out, os);
            else if (isa == ISA_AVX2)
                rows_avx2(type, numerics, w, rb, n0, n1, K, x, xs, &qa, M, out, os);
            else
#endif
                rows_scalar(type, numerics, w, rb, n0, n1, K, x, xs, &qa, M, out, os);
        }
        free(wbuf);
    }
    if (failed) {
        free(qa.q), free(qa.dx), free(qa.sx);
        return -1;
    }
    free(qa.q), free(qa.dx), free(qa.sx);
    return 0;
}

/* out[i, :] = the float32 weights of row ids[i] (ids NULL: row first + i), i < M. */
int quant_dequant_rows(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t first,
                       int64_t M, int64_t num_rows, float *out, int isa, int num_threads)
{
    const int be = block_elems(type);
    if (be == 0 || K % be != 0)
        return -1;
    if (isa == ISA_AUTO)
        isa = best_isa();
    if (!isa_supported(isa))
        return -1;
    const int64_t rb = K / be * block_bytes(type);
    for (int64_t i = 0; i < M; i++) {
        const int64_t id = ids ? ids[i] : first + i;
        if (id < 0 || id >= num_rows)
            return -2;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t i = 0; i < M; i++) {
        const uint8_t *row = w + (ids ? ids[i] : first + i) * rb;
#if KERNELS_X86
        if (isa != ISA_SCALAR) {
            dequant_avx2(type, row, K, out + i * K);
            continue;
        }
#endif
        dequant_scalar(type, row, K, out + i * K);
    }
    return 0;
}
