/* A decode step's whole decoder stack in one call, for Llama-layout models whose projections
 * are packed quantized tiles or raw-block segments (every row one token): per layer add +
 * RMSNorm, the QKV product, the q/k norms (Qwen3, Gemma 3; where the layer has them), rope
 * (a windowed Gemma 3 layer: its local tables), the KV write, paged decode attention (within
 * the layer's window), the O product, add + RMSNorm and the one-call MLP; Gemma's sandwich
 * layers norm attention's output before the add and the MLP's output after it. Then the
 * final norm. The LM head stays with the caller. Rows
 * with a LoRA adapter get its delta (lora.c) after each adapted product: qkv and o here,
 * gate_up (before the activation) and down inside the MLP's call.
 *
 * No kernel is written here: ops.c, quant_packed.c, quant_kpacked.c, mlp.c, mlp_blocks.c and
 * decode.c keep theirs (with their own compile flags) and this driver calls them in the same
 * library (api.h). Each kernel opens its own OpenMP region and they run one after another from this
 * serial driver, so libgomp's pool stays hot and no region nests. The same calls with the
 * same arguments as the per-layer path in engine/models/llama.py, so both give the same
 * numbers.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "common.h"

typedef struct {
    int64_t hidden, inter, heads, kv_heads, head_dim, block_size, num_slots;
    float eps, scale;
    int numerics, act; /* quant_blocks.h's: 0 a32, 1 a8; mlp.c's: 0 silu, 1 gelu_tanh */
    int kv_f16;        /* the pools hold float16 bits */
    int64_t lora_slots; /* the LoRA slots each layer's LoraWeights hold (0: none) */
} Shape;

/* One product's weights as row segments, each of its own type: packed tiles (packed 1:
 * quant_packed.c's or quant_kpacked.c's, by type) or raw blocks (packed 0: mlp_blocks.c). A
 * layer's gate_up and down are both packed or both raw; packed, each is one segment, both of
 * one library's types (the one-call MLP's). */
typedef struct {
    int64_t packed;
    BlockParts blocks;
} Product;

/* One layer's weights, KV pools [num_slots, kv_heads, D] and LoRA slots of its four products
 * (api.h's LoraWeights, a NULL: not adapted). q_norm/k_norm [D] (NULL: none); pre_ff_norm and
 * post_ff_norm [hidden] (NULL: the Llama layout, post_norm the add + norm before the MLP;
 * else Gemma's: post_norm on attention's output alone, pre_ff_norm the add + norm, post_ff_norm
 * on the MLP's output). window: the keys a query sees (0: all); local: rope with the local
 * tables. */
typedef struct {
    const float *input_norm, *post_norm;
    Product qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* float or uint16_t (kv_f16) */
    LoraWeights qkv_lora, o_lora, gate_up_lora, down_lora;
    const float *q_norm, *k_norm, *pre_ff_norm, *post_ff_norm;
    int64_t window, local;
} Layer;

/* out [M, N] += the LoRA delta of x [M, K] for the rows with an adapter (adapters NULL: none) */
static int add_lora(const Shape *s, const LoraWeights *w, const int32_t *adapters,
                    const float *x, int64_t K, int64_t M, float *out, int64_t N,
                    int num_threads)
{
    if (!adapters || !w->a)
        return 0;
    return lora_delta_f32(x, K, M, K, adapters, s->lora_slots, w->a, w->bt, w->rank, w->ldb,
                          out, N, N, ISA_AUTO, num_threads);
}

/* out [M, N] = x [M, K] @ W^T, x and out contiguous */
static int product(const Shape *s, const Product *p, int64_t N, int64_t K, const float *x,
                   int64_t M, float *out, int num_threads)
{
    if (p->packed)
        return quant_matmul_packed_parts(&p->blocks, K, x, K, M, out, N, s->numerics,
                                         num_threads);
    return quant_matmul_parts(&p->blocks, K, x, K, M, out, N, s->numerics, ISA_AUTO,
                              num_threads);
}

static int mlp(const Shape *s, const Layer *L, const float *x, int64_t M, float *out,
               const MlpLora *lora, int num_threads)
{
    const BlockParts *gu = &L->gate_up.blocks, *dn = &L->down.blocks;
    if (L->gate_up.packed != L->down.packed)
        return -1;
    if (L->gate_up.packed) {
        const int tgu = (int)gu->type[0], td = (int)dn->type[0];
        if (gu->parts != 1 || dn->parts != 1 || kq_type(tgu) != kq_type(td))
            return -1;
        return (kq_type(tgu) ? kq_mlp_packed : quant_mlp_packed)(
            tgu, gu->data[0], td, dn->data[0], s->inter, s->hidden, x, M, out, s->numerics,
            s->act, lora, num_threads);
    }
    return quant_mlp_blocks(gu, dn, s->inter, s->hidden, x, M, out, s->numerics, s->act, lora,
                            ISA_AUTO, num_threads);
}

static int64_t write_kv(const Shape *s, const Layer *L, const float *key, int64_t key_stride,
                        const float *value, int64_t value_stride, const int64_t *slots,
                        int64_t rows)
{
    const int64_t width = s->kv_heads * s->head_dim;
    if (s->kv_f16)
        return write_kv_f16(key, key_stride, value, value_stride, L->k_cache, L->v_cache,
                            s->num_slots, slots, rows, width);
    return write_kv_f32(key, key_stride, value, value_stride, L->k_cache, L->v_cache,
                        s->num_slots, slots, rows, width);
}

static void decode(const Shape *s, const Layer *L, const float *q, int64_t q_stride,
                   const int64_t *tables, int64_t table_stride, const int32_t *seq_lens,
                   float *out, int64_t out_stride, int64_t rows, int num_threads)
{
    if (s->kv_f16)
        paged_decode_f16(q, q_stride, L->k_cache, L->v_cache, tables, table_stride, seq_lens,
                         out, out_stride, (int)rows, (int)s->heads, (int)s->kv_heads,
                         (int)s->head_dim, (int)s->block_size, s->scale, (int)L->window,
                         num_threads);
    else
        paged_decode_f32(q, q_stride, L->k_cache, L->v_cache, tables, table_stride, seq_lens,
                         out, out_stride, (int)rows, (int)s->heads, (int)s->kv_heads,
                         (int)s->head_dim, (int)s->block_size, s->scale, (int)L->window,
                         num_threads);
}

/* x [rows, hidden]: the embedded tokens; out [rows, hidden]: the final norm of the last
 * layer's hidden state. positions, slots [rows]; tables [rows, table_stride] block ids;
 * seq_lens [rows] (each with the new token); cos/sin: rope's full [positions, D] tables,
 * local_cos/local_sin the local ones (NULL where no layer is local);
 * adapters [rows]: each row's LoRA slot, -1 for none (NULL: no row has one).
 * Returns 0, -1 when a kernel or an allocation failed (or a LoRA slot is out of range), -2
 * when a KV slot is out of range. */
int fused_decode_stack(const Shape *s, const Layer *layers, int num_layers, const float *x,
                       int64_t rows, const int64_t *positions,
                       const int64_t *slots, const int64_t *tables, int64_t table_stride,
                       const int32_t *seq_lens, const int32_t *adapters, const float *cos_t,
                       const float *sin_t, const float *local_cos, const float *local_sin,
                       const float *final_norm, float *out, int num_threads)
{
    const int64_t H = s->hidden, D = s->head_dim, M = rows;
    const int64_t nq = s->heads * D, nkv = s->kv_heads * D;
    const int64_t nqkv = nq + 2 * nkv, nqk = nq + nkv;
    /* residual stream, layer output, normed input, qkv, rotated q|k, attention, O product */
    float *buf = malloc(sizeof(float) * (size_t)(M * (4 * H + nqkv + nqk + nq)));
    if (!buf)
        return -1;
    float *res = buf, *cur = res + M * H, *h = cur + M * H, *qkv = h + M * H;
    float *qk = qkv + M * nqkv, *attn = qk + M * nqk, *o = attn + M * nq;
    int rc = 0;
    memcpy(res, x, sizeof(float) * (size_t)(M * H));
    for (int l = 0; l < num_layers && !rc; l++) {
        const Layer *L = layers + l;
        /* layer 0 norms the embedding; later layers add their input to the residual first */
        add_rms_norm_f32(l ? cur : res, l ? res : NULL, L->input_norm, h, M, H, s->eps,
                         num_threads);
        if (product(s, &L->qkv, nqkv, H, h, M, qkv, num_threads)
            || add_lora(s, &L->qkv_lora, adapters, h, H, M, qkv, nqkv, num_threads)) {
            rc = -1;
            break;
        }
        if (L->q_norm) {
            rms_norm_heads_f32(qkv, nqkv, L->q_norm, M, s->heads, D, s->eps, num_threads);
            rms_norm_heads_f32(qkv + nq, nqkv, L->k_norm, M, s->kv_heads, D, s->eps,
                               num_threads);
        }
        if (L->local && !local_cos) {
            rc = -1;
            break;
        }
        rope_f32(qkv, nqkv, positions, L->local ? local_cos : cos_t,
                 L->local ? local_sin : sin_t, qk, M, s->heads + s->kv_heads, D, num_threads);
        if (write_kv(s, L, qk + nq, nqk, qkv + nqk, nqkv, slots, M)) {
            rc = -2;
            break;
        }
        decode(s, L, qk, nqk, tables, table_stride, seq_lens, attn, nq, M, num_threads);
        if (product(s, &L->o, H, nq, attn, M, o, num_threads)
            || add_lora(s, &L->o_lora, adapters, attn, nq, M, o, H, num_threads)) {
            rc = -1;
            break;
        }
        if (L->pre_ff_norm) { /* Gemma: attention's output normed before the add */
            add_rms_norm_f32(o, NULL, L->post_norm, o, M, H, s->eps, num_threads);
            add_rms_norm_f32(o, res, L->pre_ff_norm, h, M, H, s->eps, num_threads);
        } else {
            add_rms_norm_f32(o, res, L->post_norm, h, M, H, s->eps, num_threads);
        }
        const MlpLora mlp_lora = {adapters, s->lora_slots, L->gate_up_lora, L->down_lora};
        if (mlp(s, L, h, M, cur, adapters ? &mlp_lora : NULL, num_threads)) {
            rc = -1;
            break;
        }
        if (L->post_ff_norm) /* Gemma: the MLP's output normed before the next add */
            add_rms_norm_f32(cur, NULL, L->post_ff_norm, cur, M, H, s->eps, num_threads);
    }
    if (!rc) {
        if (num_layers > 0)
            add_rms_norm_f32(cur, res, final_norm, out, M, H, s->eps, num_threads);
        else
            add_rms_norm_f32(res, NULL, final_norm, out, M, H, s->eps, num_threads);
    }
    free(buf);
    return rc;
}
