/* The GGUF block formats and the internals the quantized-product sources share: quant.c (entry
 * points, ISA dispatch), quant_ref.c (scalar reference), quant_x86.c (AVX2 / AVX-512 row
 * tiles), quant_packed.c (16-feature packed tiles) and mlp.c (the one-call MLP).
 *
 * W stays in its file's blocks, row-major: row n is K / block_elems blocks. Every type is read
 * as groups of 32 weights: 32 small integers q (unsigned, or signed for Q8_0 and Q6_K) with
 * w = a * q + b, where a is one scale per 16 weights (a0, a1; equal except for Q6_K) and b one
 * offset per group (the min of the _1 and _K types, -offset * scale for Q4_0 and Q5_0, zero
 * for the signed ones). Block formats (ggml's, as the `gguf` package documents them):
 *   Q4_0: f16 d, 16 bytes of nibbles (low nibbles: weights 0-15, high: 16-31), w = d (q - 8)
 *   Q4_1: f16 d, f16 m, 16 bytes of nibbles, w = d q + m
 *   Q5_0: f16 d, u32 qh (bit i: 5th bit of weight i), 16 bytes of nibbles, w = d (q - 16)
 *   Q5_1: f16 d, f16 m, u32 qh, 16 bytes of nibbles, w = d q + m
 *   Q8_0: f16 d, 32 int8, w = d q
 *   Q4_K (256 weights): f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles;
 *         group g: w = d sc[g] q - dmin m[g]
 *   Q5_K: as Q4_K plus 32 bytes qh (bit g of byte i: 5th bit of weight i of group g)
 *   Q6_K: 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16), f16 d;
 *         w = d sc (q - 32)
 *
 * Two numerics: A32 expands each group to float32 in registers and multiplies in float32
 * (the dequantized model's product up to summation order); A8 quantizes each row's 32-value
 * groups of x to int8 (dx = max|x| / 127, round to nearest) and multiplies with integer dot
 * products (vpdpbusd with VNNI: unsigned weights times signed activations, so the unsigned
 * types need no sign trick; the b term is b * dx * sum(qx) per group).
 */
#ifndef PAGEDSERVE_QUANT_BLOCKS_H
#define PAGEDSERVE_QUANT_BLOCKS_H

#include <stdint.h>

#include "common.h"

enum { NUM_A32 = 0, NUM_A8 = 1 };

static inline int is_signed(int type) { return type == T_Q8_0 || type == T_Q6_K; }

/* The 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Scales of group g of a row: a0 (weights 0-15), a1 (16-31), b; and where its bytes are. */
typedef struct {
    float a0, a1, b;
} Scales;

/* Activations quantized to int8 per 32 values (A8). */
typedef struct {
    int8_t *q;   /* [M, K] */
    float *dx;   /* [M, K / 32] */
    float *sx;   /* [M, K / 32]: dx * sum(q) */
} QAct;

/* quant.c: QAct buffers; the activations' int8 blocks (AVX-512 quantizer only for isa AVX-512) */
HIDDEN int qact_alloc(int64_t M, int64_t K, QAct *qa);
HIDDEN int quantize_act(const float *x, int64_t xs, int64_t M, int64_t K, QAct *qa, int isa,
                        int num_threads);

/* quant_ref.c: the scalar reference */
HIDDEN void quantize_row(const float *x, int64_t K, int8_t *q, float *dx, float *sx);
HIDDEN void rows_scalar(int type, int numerics, const uint8_t *w, int64_t row_bytes, int64_t n0,
                        int64_t n1, int64_t K, const float *x, int64_t xs, const QAct *qa,
                        int64_t M, float *out, int64_t os);
HIDDEN void dequant_scalar(int type, const uint8_t *row, int64_t K, float *out);

#if KERNELS_X86
/* quant_x86.c: row tiles over raw blocks, one pass over W for every row */
HIDDEN TARGET_AVX2 void rows_avx2(int type, int numerics, const uint8_t *w, int64_t rb,
                                  int64_t n0, int64_t n1, int64_t K, const float *x,
                                  int64_t xs, const QAct *qa, int64_t M, float *out,
                                  int64_t os);
HIDDEN TARGET_AVX512 void rows_avx512(int type, int numerics, const uint8_t *w, int64_t rb,
                                      int64_t n0, int64_t n1, int64_t K, const float *x,
                                      int64_t xs, const QAct *qa, int64_t M, float *out,
                                      int64_t os);
HIDDEN TARGET_AVX2 void dequant_avx2(int type, const uint8_t *row, int64_t K, float *out);
HIDDEN TARGET_AVX512 void gemm_avx512(int type, const uint8_t *w, int64_t rb, int64_t n0,
                                      int64_t n1, int64_t K, const float *x, int64_t xs,
                                      int64_t M, float *out, int64_t os, float *wbuf);

/* quant_packed.c: a product over packed tiles, inside an OpenMP region (a `for` of its own) */
HIDDEN void ptiles_product(int type, int numerics, const uint8_t *packed, int64_t N, int64_t K,
                           const float *x, int64_t xs, const QAct *qa, int64_t M, float *out,
                           int64_t os);
#endif

/* bytes of one packed 32-weight group of 16 features (0: the type does not pack) */
static inline int pgroup_bytes(int type)
{
    return type == T_Q4_0 ? 32 + 256 : type == T_Q4_1 ? 64 + 256 : type == T_Q8_0 ? 32 + 512 : 0;
}

#endif
