/* The library's exported entry points (kernels/cpu/library.py declares the same signatures
 * for ctypes). fused.c calls them directly: one library, no addresses passed through Python.
 */
#ifndef PAGEDSERVE_API_H
#define PAGEDSERVE_API_H

#include <stdint.h>

/* ---- decode.c: paged decode attention and KV writes --------------------------------------- */
void paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache,
                      const float *v_cache, const int64_t *tables, int64_t table_stride,
                      const int32_t *seq_lens, float *out, int64_t out_stride, int num_seqs,
                      int heads, int kv_heads, int head_dim, int block_size, float scale,
                      int window, int num_threads);
void paged_decode_f16(const float *q, int64_t q_stride, const uint16_t *k_cache,
                      const uint16_t *v_cache, const int64_t *tables, int64_t table_stride,
                      const int32_t *seq_lens, float *out, int64_t out_stride, int num_seqs,
                      int heads, int kv_heads, int head_dim, int block_size, float scale,
                      int window, int num_threads);
int64_t write_kv_f32(const float *key, int64_t key_stride, const float *value,
                     int64_t value_stride, float *k_cache, float *v_cache, int64_t num_slots,
                     const int64_t *slots, int64_t num_tokens, int64_t width);
int64_t write_kv_f16(const float *key, int64_t key_stride, const float *value,
                     int64_t value_stride, uint16_t *k_cache, uint16_t *v_cache,
                     int64_t num_slots, const int64_t *slots, int64_t num_tokens, int64_t width);
void half_bits_to_float_n(const uint16_t *src, float *dst, int64_t n);
void float_to_half_bits_n(const float *src, uint16_t *dst, int64_t n);

/* ---- ops.c: norms, rope, argmax ----------------------------------------------------------- */
void add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                      int64_t rows, int64_t hidden, float eps, int num_threads);
void rms_norm_heads_f32(float *x, int64_t x_stride, const float *weight, int64_t tokens,
                        int64_t heads, int64_t dim, float eps, int num_threads);
void rope_f32(const float *x, int64_t x_stride, const int64_t *positions, const float *cos_t,
              const float *sin_t, float *out, int64_t tokens, int64_t heads, int64_t dim,
              int num_threads);
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out,
                     int num_threads);

/* ---- lora.c: per-row LoRA deltas ---------------------------------------------------------- */
/* One adapted projection's slots: a [num_slots, rank, K] contiguous and bt [num_slots, rank,
 * N] with rows ldb >= N floats apart (B transposed, the adapter's scaling folded in), float32;
 * a NULL: not adapted. */
typedef struct {
    const float *a, *bt;
    int64_t rank, ldb;
} LoraWeights;

/* An MLP's LoRA for one call: each row's adapter slot (-1: none; slots NULL: no row has one)
 * and the slots of gate_up (K hidden, N 2 inter, gate first) and down (K inter, N hidden). */
typedef struct {
    const int32_t *slots;
    int64_t num_slots;
    LoraWeights gate_up, down;
} MlpLora;

int lora_delta_f32(const float *x, int64_t xs, int64_t M, int64_t K, const int32_t *slots,
                   int64_t num_slots, const float *a, const float *bt, int64_t rank,
                   int64_t ldb, float *out, int64_t os, int64_t N, int isa, int num_threads);

/* ---- quant.c, quant_packed.c, mlp.c: products with GGUF-quantized weights ----------------- */
int quant_block_elems(int type);
int quant_block_bytes(int type);
int isa_supported(int isa);
int best_isa(void);
int quant_matmul(int type, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t xs,
                 int64_t M, float *out, int64_t os, int numerics, int isa, int num_threads);
int quant_dequant_rows(int type, const uint8_t *w, int64_t K, const int64_t *ids, int64_t first,
                       int64_t M, int64_t num_rows, float *out, int isa, int num_threads);
int64_t quant_packed_bytes(int type, int64_t N, int64_t K);
int quant_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *packed);
int quant_packed_rows(int type, const uint8_t *packed, int64_t N, int64_t K, const int64_t *ids,
                      int64_t first, int64_t M, float *out, int num_threads);
int quant_packed_kmajor(int type, const uint8_t *packed, int64_t N, int64_t K, int64_t t0,
                        int64_t t1, float *outT, int64_t ld, int num_threads);
int quant_matmul_packed(int type, const uint8_t *packed, int64_t N, int64_t K, const float *x,
                        int64_t xs, int64_t M, float *out, int64_t os, int numerics,
                        int num_threads);
int quant_mlp_packed(int tgu, const uint8_t *gu, int td, const uint8_t *dn, int64_t I,
                     int64_t H, const float *x, int64_t M, float *out, int numerics, int act,
                     const MlpLora *lora, int num_threads);

/* ---- mlp_blocks.c: products and the one-call MLP over raw blocks -------------------------- */
/* One matrix W [N, K] as row segments of raw blocks (rows summing to N), each of its own ggml
 * type, row-major in its file's blocks. */
#define MAX_PARTS 4
typedef struct {
    const uint8_t *data[MAX_PARTS];
    int64_t type[MAX_PARTS], rows[MAX_PARTS];
    int64_t parts;
} BlockParts;

int quant_matmul_parts(const BlockParts *w, int64_t K, const float *x, int64_t xs, int64_t M,
                       float *out, int64_t os, int numerics, int isa, int num_threads);
/* the same over packed tiles, each part of its own type (quant_packed.c) */
int quant_matmul_packed_parts(const BlockParts *w, int64_t K, const float *x, int64_t xs,
                              int64_t M, float *out, int64_t os, int numerics, int num_threads);
int quant_mlp_blocks(const BlockParts *gu, const BlockParts *dn, int64_t I, int64_t H,
                     const float *x, int64_t M, float *out, int numerics, int act,
                     const MlpLora *lora, int isa, int num_threads);

/* ---- quant_kpacked.c: packed tiles of Q5_0, Q5_1, Q4_K, Q5_K, Q6_K (same arguments) ------- */
int kq_isa_supported(void);
int64_t kq_packed_bytes(int type, int64_t N, int64_t K);
int kq_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *packed);
int kq_packed_rows(int type, const uint8_t *packed, int64_t N, int64_t K, const int64_t *ids,
                   int64_t first, int64_t M, float *out, int num_threads);
int kq_packed_kmajor(int type, const uint8_t *packed, int64_t N, int64_t K, int64_t t0,
                     int64_t t1, float *outT, int64_t ld, int num_threads);
int kq_matmul_packed(int type, const uint8_t *packed, int64_t N, int64_t K, const float *x,
                     int64_t xs, int64_t M, float *out, int64_t os, int numerics,
                     int num_threads);
int kq_mlp_packed(int tgu, const uint8_t *gu, int td, const uint8_t *dn, int64_t I, int64_t H,
                  const float *x, int64_t M, float *out, int numerics, int act,
                  const MlpLora *lora, int num_threads);

/* ---- fused.c: a decode step's decoder stack (its structs in fused.c) ---------------------- */

#endif
