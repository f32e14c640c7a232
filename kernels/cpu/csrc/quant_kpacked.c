/* Packed 16-feature tiles for the 5-bit and K-quant GGUF types (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)
 * on AVX-512 VNNI: the counterpart of quant_packed.c's packed Q4_0/Q4_1/Q8_0 tiles, with the
 * same entry points (kq_ prefix) and the same numerics (a32: float32 FMA of the expanded
 * weights; a8: activations to int8 per 32 values, vpdpbusd of unsigned weights).
 *
 * Layout. Tile t holds features 16t..16t+15 (zeros past N). Its K weights are super-blocks
 * (256 weights for the K types, 32 for Q5_0/Q5_1), each a head of per-feature scales and then
 * its 32-weight groups. Every group holds unsigned integers u (w = a u + b):
 *   nibble rows: 4 zmm rows of 64 bytes; row r, lane j (feature), byte i: low nibble = bits 0-3
 *     of weight 4r+i, high nibble = bits 0-3 of weight 16+4r+i (as quant_packed.c's Q4 tiles);
 *   5-bit types: one 64-byte plane, lane j byte i: bit r = bit 4 of weight 4r+i, bit 4+r =
 *     bit 4 of weight 16+4r+i;
 *   Q6_K: two 64-byte planes (weights 0-15, 16-31), lane j byte i: bits 2r..2r+1 = bits 4-5 of
 *     weight 4r+i of that half.
 * Heads (f16 per feature, lane j at 2j; bytes per feature at 16 g + j):
 *   Q5_0: d (a = d, b = -16 d)            Q5_1: d, m (a = d, b = m)
 *   Q4_K, Q5_K: d, dmin, 8 scales, 8 mins (6-bit values as bytes): a = d sc, b = -dmin mn
 *   Q6_K: d, 16 int8 scales (one per 16 weights): a = d sc, b = -32 a (per half group)
 * Bytes: Q5_0/Q5_1/Q6_K tiles are the raw blocks' size; Q4_K and Q5_K 64 bytes more per tile
 * and super-block (2.8% and 2.3%), the scales unpacked from their 6-bit fields.
 * Called through kernels/cpu/kquant.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h" /* float16 bits, the GGML type ids (T_*), rd16 */
#include "lora.h"   /* the MLP's LoRA deltas */
#include "vec_avx512.h"

enum { NUM_A32 = 0, NUM_A8 = 1 };


static inline int is_k(int type) { return type >= T_Q4_K; }
static inline int sb_elems(int type) { return is_k(type) ? 256 : 32; }

static inline int raw_block_bytes(int type)
{
    switch (type) {
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}

static inline int64_t head_bytes(int type)
{
    switch (type) {
    case T_Q5_0: return 32;
    case T_Q5_1: return 64;
    case T_Q4_K: case T_Q5_K: return 64 + 256;
    default: return 32 + 256; /* Q6_K */
    }
}

static inline int64_t group_bytes(int type)
{
    return type == T_Q4_K ? 256 : type == T_Q6_K ? 384 : 320;
}

static inline int64_t sb_bytes(int type)
{
    return head_bytes(type) + sb_elems(type) / 32 * group_bytes(type);
}

int64_t kq_packed_bytes(int type, int64_t N, int64_t K)
{
    if (!kq_type(type) || N < 1 || K < 1 || K % sb_elems(type) != 0)
        return -1;
    return (N + 15) / 16 * (K / sb_elems(type)) * sb_bytes(type);
}

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

/* The unsigned integers of group g (0..sb_elems/32) of one raw block. */
static void raw_group_u(int type, const uint8_t *blk, int g, uint8_t u[32])
{
    if (type == T_Q5_0 || type == T_Q5_1) {
        const uint8_t *qs = blk + (type == T_Q5_0 ? 6 : 8);
        uint32_t qh;
        memcpy(&qh, blk + (type == T_Q5_0 ? 2 : 4), 4);
        for (int i = 0; i < 16; i++) {
            u[i] = (uint8_t)((qs[i] & 0xF) | ((qh >> i) & 1) << 4);
            u[i + 16] = (uint8_t)((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4);
        }
    } else if (type == T_Q6_K) {
        const int h = g >> 2, sh = ((g >> 1) & 1) * 4, half = g & 1, t = g & 3;
        const uint8_t *ql = blk + h * 64 + half * 32, *qh = blk + 128 + h * 32;
        for (int i = 0; i < 32; i++)
            u[i] = (uint8_t)(((ql[i] >> sh) & 0xF) | (((qh[i] >> (2 * t)) & 3) << 4));
    } else {
        const uint8_t *qs = blk + (type == T_Q4_K ? 16 : 48) + (g >> 1) * 32;
        const int sh = (g & 1) * 4;
        for (int i = 0; i < 32; i++)
            u[i] = (uint8_t)(((qs[i] >> sh) & 0xF)
                             | (type == T_Q5_K ? ((blk[16 + i] >> g) & 1) << 4 : 0));
    }
}

/* Feature j's head fields of one raw super-block into a tile's head. */
static void pack_head(int type, const uint8_t *blk, int j, uint8_t *head)
{
    if (type == T_Q5_0 || type == T_Q5_1) {
        memcpy(head + 2 * j, blk, 2);
        if (type == T_Q5_1)
            memcpy(head + 32 + 2 * j, blk + 2, 2);
    } else if (type == T_Q6_K) {
        memcpy(head + 2 * j, blk + 208, 2);
        for (int h = 0; h < 16; h++)
            head[32 + 16 * h + j] = blk[192 + h];
    } else {
        memcpy(head + 2 * j, blk, 2);
        memcpy(head + 32 + 2 * j, blk + 2, 2);
        for (int g = 0; g < 8; g++) {
            int sc, m;
            k_scale_min(blk + 4, g, &sc, &m);
            head[64 + 16 * g + j] = (uint8_t)sc;
            head[192 + 16 * g + j] = (uint8_t)m;
        }
    }
}

/* Feature j's integers u of one group into a tile's group (nibble rows, high planes). */
static void pack_group(int type, const uint8_t u[32], int j, uint8_t *p)
{
    for (int k = 0; k < 16; k++) {
        const int at = (k / 4) * 64 + j * 4 + k % 4;
        p[at] = (uint8_t)((u[k] & 0xF) | (u[k + 16] & 0xF) << 4);
        if (type == T_Q6_K) {
            p[256 + j * 4 + k % 4] |= (uint8_t)(((u[k] >> 4) & 3) << (2 * (k / 4)));
            p[320 + j * 4 + k % 4] |= (uint8_t)(((u[k + 16] >> 4) & 3) << (2 * (k / 4)));
        } else if (type != T_Q4_K) {
            p[256 + j * 4 + k % 4] |= (uint8_t)(((u[k] >> 4) & 1) << (k / 4)
                                                | ((u[k + 16] >> 4) & 1) << (4 + k / 4));
        }
    }
}

/* raw blocks [N, K / sb_elems blocks] -> packed tiles (kq_packed_bytes(type, N, K) bytes) */
int kq_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *packed)
{
    if (kq_packed_bytes(type, N, K) < 0)
        return -1;
    const int64_t S = K / sb_elems(type), rb = S * raw_block_bytes(type), sbb = sb_bytes(type);
    const int groups = sb_elems(type) / 32;
    const int64_t tiles = (N + 15) / 16;
    /* NOTE: tile by tile over the cores: at load, Gemma 3 270M's 82 matrices took 0.41 s on
     * one (each tile's bytes are its own, so the threads never write the same line) */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        memset(packed + t * S * sbb, 0, (size_t)(S * sbb));
        for (int64_t n = 16 * t; n < N && n < 16 * t + 16; n++) {
            const int j = (int)(n % 16);
            for (int64_t s = 0; s < S; s++) {
                const uint8_t *blk = w + n * rb + s * raw_block_bytes(type);
                uint8_t *sb = packed + (t * S + s) * sbb;
                pack_head(type, blk, j, sb);
                for (int g = 0; g < groups; g++) {
                    uint8_t u[32];
                    raw_group_u(type, blk, g, u);
                    pack_group(type, u, j, sb + head_bytes(type) + g * group_bytes(type));
                }
            }
        }
    }
    return 0;
}

/* Lane j's scales of group g of a packed super-block: a0 (weights 0-15), a1, b0, b1. */
static void scalar_scales(int type, const uint8_t *sb, int g, int j, float *a0, float *a1,
                          float *b0, float *b1)
{
    const float d = half_bits_to_float(rd16(sb + 2 * j));
    if (type == T_Q5_0 || type == T_Q5_1) {
        *a0 = *a1 = d;
        *b0 = *b1 = type == T_Q5_0 ? -16.0f * d : half_bits_to_float(rd16(sb + 32 + 2 * j));
    } else if (type == T_Q6_K) {
        *a0 = d * (float)(int8_t)sb[32 + 16 * (2 * g) + j];
        *a1 = d * (float)(int8_t)sb[32 + 16 * (2 * g + 1) + j];
        *b0 = -32.0f * *a0;
        *b1 = -32.0f * *a1;
    } else {
        *a0 = *a1 = d * (float)sb[64 + 16 * g + j];
        *b0 = *b1 = -(half_bits_to_float(rd16(sb + 32 + 2 * j)) * (float)sb[192 + 16 * g + j]);
    }
}

/* The unsigned integer of weight k (0..31) of lane j in a packed group. */
static int scalar_u(int type, const uint8_t *p, int j, int k)
{
    const int r = (k % 16) / 4, i = k % 4;
    const uint8_t b = p[r * 64 + j * 4 + i];
    int u = k < 16 ? (b & 0xF) : (b >> 4);
    if (type == T_Q6_K)
        u |= ((p[(k < 16 ? 256 : 320) + j * 4 + i] >> (2 * r)) & 3) << 4;
    else if (type != T_Q4_K)
        u |= ((p[256 + j * 4 + i] >> (r + (k < 16 ? 0 : 4))) & 1) << 4;
    return u;
}

/* out[i, :] = the float32 weights of feature ids[i] (ids NULL: first + i) of a packed matrix. */
int kq_packed_rows(int type, const uint8_t *packed, int64_t N, int64_t K, const int64_t *ids,
                   int64_t first, int64_t M, float *out, int num_threads)
{
    if (kq_packed_bytes(type, N, K) < 0 || num_threads < 1)
        return -1;
    for (int64_t i = 0; i < M; i++) {
        const int64_t id = ids ? ids[i] : first + i;
        if (id < 0 || id >= N)
            return -2;
    }
    const int64_t S = K / sb_elems(type), sbb = sb_bytes(type);
    const int groups = sb_elems(type) / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t i = 0; i < M; i++) {
        const int64_t n = ids ? ids[i] : first + i, t = n / 16;
        const int j = (int)(n % 16);
        for (int64_t s = 0; s < S; s++) {
            const uint8_t *sb = packed + (t * S + s) * sbb;
            for (int g = 0; g < groups; g++) {
                const uint8_t *p = sb + head_bytes(type) + g * group_bytes(type);
                float a0, a1, b0, b1;
                scalar_scales(type, sb, g, j, &a0, &a1, &b0, &b1);
                float *o = out + i * K + s * sb_elems(type) + g * 32;
                for (int k = 0; k < 32; k++)
                    o[k] = fmaf(k < 16 ? a0 : a1, (float)scalar_u(type, p, j, k), k < 16 ? b0 : b1);
            }
        }
    }
    return 0;
}

/* ---- AVX-512 VNNI kernels ------------------------------------------------------------------ */
#if defined(__x86_64__) || defined(__i386__)
int kq_isa_supported(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
           && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx512f")
           && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
           && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}

/* int8 activations: q, dx = max|x| / 127 per 32, sx = dx sum(q) per 32 and, for Q6_K's two
 * scales per group, sl = dx sum(q[0:16]) and sh = dx sum(q[16:32]). */
typedef struct {
    int8_t *q;
    float *dx, *sx, *sl, *sh;
} QAct;

static void qact_free(QAct *qa)
{
    free(qa->q), free(qa->dx), free(qa->sx), free(qa->sl), free(qa->sh);
    memset(qa, 0, sizeof *qa);
}

static int qact_alloc(int64_t M, int64_t K, QAct *qa)
{
    const size_t G = (size_t)(M * (K / 32));
    qa->q = malloc((size_t)(M * K));
    qa->dx = malloc(sizeof(float) * G), qa->sx = malloc(sizeof(float) * G);
    qa->sl = malloc(sizeof(float) * G), qa->sh = malloc(sizeof(float) * G);
    if (!qa->q || !qa->dx || !qa->sx || !qa->sl || !qa->sh) {
        qact_free(qa);
        return -1;
    }
    return 0;
}

static void quantize_rows(const float *x, int64_t xs, int64_t r0, int64_t r1, int64_t K,
                          QAct *qa)
{
    const int64_t G = K / 32;
    for (int64_t r = r0; r < r1; r++)
        quantize_row_avx512(x + r * xs, K, qa->q + r * K, qa->dx + r * G, qa->sx + r * G,
                            qa->sl + r * G, qa->sh + r * G);
}

/* One group's 16 features: u[r] (r = 0..7) holds weights 4r..4r+3 in each lane's dword;
 * a0/b0 apply to weights 0-15, a1/b1 to 16-31 (equal except for Q6_K). */
typedef struct {
    __m512i u[8];
    __m512 a0, a1, b0, b1;
} Group;

/* A | (B & C) */
INLINE_AVX512 __m512i or_and(__m512i a, __m512i b, __m512i c)
{
    return _mm512_ternarylogic_epi32(a, b, c, 0xF8);
}

INLINE_AVX512 void load_group(int type, const uint8_t *sb, int g, Group *G)
{
    const uint8_t *p = sb + head_bytes(type) + g * group_bytes(type);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < 4; r++) {
        const __m512i v = _mm512_loadu_si512(p + 64 * r);
        G->u[r] = _mm512_and_si512(v, m4);
        G->u[r + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    if (type == T_Q6_K) {
        const __m512i m = _mm512_set1_epi8(0x30);
        for (int half = 0; half < 2; half++) {
            const __m512i h = _mm512_loadu_si512(p + 256 + 64 * half);
            __m512i *u = G->u + 4 * half;
            u[0] = or_and(u[0], _mm512_slli_epi16(h, 4), m);
            u[1] = or_and(u[1], _mm512_slli_epi16(h, 2), m);
            u[2] = or_and(u[2], h, m);
            u[3] = or_and(u[3], _mm512_srli_epi16(h, 2), m);
        }
    } else if (type != T_Q4_K) {
        const __m512i m = _mm512_set1_epi8(0x10), h = _mm512_loadu_si512(p + 256);
        G->u[0] = or_and(G->u[0], _mm512_slli_epi16(h, 4), m);
        G->u[1] = or_and(G->u[1], _mm512_slli_epi16(h, 3), m);
        G->u[2] = or_and(G->u[2], _mm512_slli_epi16(h, 2), m);
        G->u[3] = or_and(G->u[3], _mm512_slli_epi16(h, 1), m);
        G->u[4] = or_and(G->u[4], h, m);
        G->u[5] = or_and(G->u[5], _mm512_srli_epi16(h, 1), m);
        G->u[6] = or_and(G->u[6], _mm512_srli_epi16(h, 2), m);
        G->u[7] = or_and(G->u[7], _mm512_srli_epi16(h, 3), m);
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
    if (type == T_Q5_0) {
        G->a0 = G->a1 = d;
        G->b0 = G->b1 = _mm512_mul_ps(d, _mm512_set1_ps(-16.0f));
    } else if (type == T_Q5_1) {
        G->a0 = G->a1 = d;
        G->b0 = G->b1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32)));
    } else if (type == T_Q6_K) {
        const __m128i s0 = _mm_loadu_si128((const __m128i *)(sb + 32 + 32 * g));
        const __m128i s1 = _mm_loadu_si128((const __m128i *)(sb + 48 + 32 * g));
        G->a0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s0)));
        G->a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s1)));
        G->b0 = _mm512_mul_ps(G->a0, _mm512_set1_ps(-32.0f));
        G->b1 = _mm512_mul_ps(G->a1, _mm512_set1_ps(-32.0f));
    } else {
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32)));
        const __m128i sc = _mm_loadu_si128((const __m128i *)(sb + 64 + 16 * g));
        const __m128i mn = _mm_loadu_si128((const __m128i *)(sb + 192 + 16 * g));
        G->a0 = G->a1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
        G->b0 = G->b1 = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(
            dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))));
    }
}

/* A8: rows r0..r0+RT of one tile; `next` (the next tile, or NULL) is prefetched on the first
 * row pass, as quant_packed.c's ptile_a8 does. */
INLINE_AVX512 void ktile_a8(int type, const int RT, const uint8_t *tile, const uint8_t *next,
                            int64_t S, int64_t K, const QAct *qa, int64_t r0, float *out,
                            int64_t os, __mmask16 valid)
{
    const int64_t G = K / 32, sbb = sb_bytes(type);
    const int groups = sb_elems(type) / 32;
    __m512 acc[8], macc[8];
    for (int t = 0; t < RT; t++)
        acc[t] = macc[t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *sb = tile + s * sbb;
        if (next && r0 == 0)
            prefetch_l2(next + s * sbb, sbb);
        for (int g = 0; g < groups; g++) {
            Group w;
            load_group(type, sb, g, &w);
            const int64_t gi = s * groups + g;
            for (int t = 0; t < RT; t++) {
                const int64_t row = r0 + t;
                __m512i ia, ib;
                dot_a8(w.u, qa->q + row * K + gi * 32, &ia, &ib);
                const __m512 dx = _mm512_set1_ps(qa->dx[row * G + gi]);
                if (type == T_Q6_K) {
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(w.a0, dx), acc[t]);
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_mul_ps(w.a1, dx), acc[t]);
                    macc[t] = _mm512_fmadd_ps(w.b0, _mm512_set1_ps(qa->sl[row * G + gi]), macc[t]);
                    macc[t] = _mm512_fmadd_ps(w.b1, _mm512_set1_ps(qa->sh[row * G + gi]), macc[t]);
                } else {
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia, ib)),
                                             _mm512_mul_ps(w.a0, dx), acc[t]);
                    macc[t] = _mm512_fmadd_ps(w.b0, _mm512_set1_ps(qa->sx[row * G + gi]), macc[t]);
                }
            }
        }
    }
    store_a8(RT, acc, macc, r0, out, os, valid);
}

/* Weight 4r+i of each lane of a group as float32: a u + b. */
INLINE_AVX512 __m512 weight_f32(const Group *w, int r, int i)
{
    const __m512 u = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w->u[r], 8 * i),
                                                         _mm512_set1_epi32(0xFF)));
    return r < 4 ? _mm512_fmadd_ps(w->a0, u, w->b0) : _mm512_fmadd_ps(w->a1, u, w->b1);
}

/* A32: the weights expanded to float32 (16 features per zmm), float32 FMA, 4 rows at most. */
INLINE_AVX512 void ktile_a32(int type, const int RT, const uint8_t *tile, const uint8_t *next,
                             int64_t S, const float *x, int64_t xs, int64_t r0, float *out,
                             int64_t os, __mmask16 valid)
{
    const int64_t sbb = sb_bytes(type);
    const int groups = sb_elems(type) / 32;
    __m512 acc[4][4];
    for (int t = 0; t < RT; t++)
        for (int i = 0; i < 4; i++)
            acc[t][i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < S; s++) {
        const uint8_t *sb = tile + s * sbb;
        if (next && r0 == 0)
            prefetch_l2(next + s * sbb, sbb);
        for (int g = 0; g < groups; g++) {
            Group w;
            load_group(type, sb, g, &w);
            const int64_t k0 = (s * groups + g) * 32;
            for (int r = 0; r < 8; r++)
                for (int i = 0; i < 4; i++) {
                    const __m512 wf = weight_f32(&w, r, i);
                    for (int t = 0; t < RT; t++)
                        acc[t][i] = _mm512_fmadd_ps(
                            wf, _mm512_set1_ps(x[(r0 + t) * xs + k0 + 4 * r + i]), acc[t][i]);
                }
        }
    }
    store_a32(RT, acc, r0, out, os, valid);
}

/* NOTE: a8 takes 8-row tiles but for Q6_K, whose two scales per group and two high planes
 * leave too few registers for 16 accumulators; a32's accumulators hold 4 rows. */
TARGET_AVX512 static void ktile_rows(int type, int numerics, const uint8_t *tile,
                                     const uint8_t *next, int64_t S, int64_t K, const float *x,
                                     int64_t xs, const QAct *qa, int64_t M, float *out,
                                     int64_t os, __mmask16 valid)
{
#define KCASE(T)                                                                              \
    case T:                                                                                   \
        if (numerics == NUM_A8)                                                               \
            TILE_ROWS(T == T_Q6_K ? 4 : 8, ktile_a8, T, tile, next, S, K, qa, r0, out, os,     \
                      valid)                                                                  \
        else                                                                                  \
            TILE_ROWS(4, ktile_a32, T, tile, next, S, x, xs, r0, out, os, valid)              \
        break;
    switch (type) {
        KCASE(T_Q5_0) KCASE(T_Q5_1) KCASE(T_Q4_K) KCASE(T_Q5_K) KCASE(T_Q6_K)
    }
}

/* Tiles t of [0, tiles) of one product, inside an OpenMP region (a `for` of its own). */
static inline void product_tiles(int type, int numerics, const uint8_t *packed, int64_t N,
                                 int64_t K, const float *x, int64_t xs, const QAct *qa,
                                 int64_t M, float *out, int64_t os)
{
    const int64_t S = K / sb_elems(type), tiles = (N + 15) / 16, tb = S * sb_bytes(type);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        ktile_rows(type, numerics, packed + t * tb, t + 1 < tiles ? packed + (t + 1) * tb : NULL,
                   S, K, x, xs, qa, M, out + 16 * t, os, mask_below(N - 16 * t));
}

/* One group's float32 weights, K-major: outT[k, lane] for its 32 weights k (row stride ld). */
TARGET_AVX512 static void kmajor_group(int type, const uint8_t *sb, int g, float *outT,
                                       int64_t ld)
{
    Group w;
    load_group(type, sb, g, &w);
    for (int r = 0; r < 8; r++)
        for (int i = 0; i < 4; i++)
            _mm512_storeu_ps(outT + (4 * r + i) * ld, weight_f32(&w, r, i));
}
#else
int kq_isa_supported(void) { return 0; }
#endif

/* out[m, n] (row stride os) = sum_k x[m, k] (row stride xs) W[n, k], W packed (kq_pack).
 * AVX-512 VNNI only: -1 without it, for a bad shape or no memory. */
int kq_matmul_packed(int type, const uint8_t *packed, int64_t N, int64_t K, const float *x,
                     int64_t xs, int64_t M, float *out, int64_t os, int numerics,
                     int num_threads)
{
    if (kq_packed_bytes(type, N, K) < 0 || M < 1 || num_threads < 1 || !kq_isa_supported())
        return -1;
#if defined(__x86_64__) || defined(__i386__)
    QAct qa = {0};
    if (numerics == NUM_A8 && qact_alloc(M, K, &qa))
        return -1;
#pragma omp parallel num_threads(num_threads)
    {
        if (numerics == NUM_A8) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                quantize_rows(x, xs, r, r + 1, K, &qa);
        }
        product_tiles(type, numerics, packed, N, K, x, xs, &qa, M, out, os);
    }
    qact_free(&qa);
    return 0;
#else
    return -1;
#endif
}

/* outT[k, n - 16 t0] (row stride ld) = W[n, k] for the features of tiles t0..t1: K-major
 * float32 weights, for a GEMM x @ outT. */
int kq_packed_kmajor(int type, const uint8_t *packed, int64_t N, int64_t K, int64_t t0,
                     int64_t t1, float *outT, int64_t ld, int num_threads)
{
    if (kq_packed_bytes(type, N, K) < 0 || t0 < 0 || t1 > (N + 15) / 16 || t0 >= t1
        || ld < 16 * (t1 - t0) || num_threads < 1 || !kq_isa_supported())
        return -1;
#if defined(__x86_64__) || defined(__i386__)
    const int64_t S = K / sb_elems(type), sbb = sb_bytes(type);
    const int groups = sb_elems(type) / 32;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = t0; t < t1; t++)
        for (int64_t s = 0; s < S; s++)
            for (int g = 0; g < groups; g++)
                kmajor_group(type, packed + (t * S + s) * sbb, g,
                             outT + (s * groups + g) * 32 * ld + (t - t0) * 16, ld);
    return 0;
#else
    return -1;
#endif
}

/* out[M, H] = down(act(gate) * up), gate|up the rows of `gu` ([2I, H], gate first, type tgu)
 * and `dn` [H, I] (type td), both packed by kq_pack; act 0 silu, 1 gelu_tanh; with `lora`
 * (NULL: none) each adapted product's delta right after it. One OpenMP region, as
 * mlp.c's quant_mlp_packed. x and out contiguous. AVX-512 VNNI only. */
int kq_mlp_packed(int tgu, const uint8_t *gu, int td, const uint8_t *dn, int64_t I, int64_t H,
                  const float *x, int64_t M, float *out, int numerics, int act,
                  const MlpLora *lora, int num_threads)
{
    if (kq_packed_bytes(tgu, 2 * I, H) < 0 || kq_packed_bytes(td, H, I) < 0 || M < 1
        || num_threads < 1 || !kq_isa_supported() || (act != 0 && act != 1))
        return -1;
#if defined(__x86_64__) || defined(__i386__)
    float *h = malloc(sizeof(float) * (size_t)(M * 2 * I));
    float *a = malloc(sizeof(float) * (size_t)(M * I));
    QAct qx = {0}, qa = {0};
    LoraGroups lg;
    int adapted;
    int failed = lora_mlp_group(lora, M, &lg, &adapted) || !h || !a;
    if (!failed && numerics == NUM_A8)
        failed = qact_alloc(M, H, &qx) || qact_alloc(M, I, &qa);
    if (failed) {
        free(h), free(a), qact_free(&qx), qact_free(&qa), lora_groups_free(&lg);
        return -1;
    }
    const int64_t ichunks = (I + 63) / 64;
#pragma omp parallel num_threads(num_threads)
    {
        if (numerics == NUM_A8) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                quantize_rows(x, H, r, r + 1, H, &qx);
        }
        product_tiles(tgu, numerics, gu, 2 * I, H, x, H, &qx, M, h, 2 * I);
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
                quantize_rows(a, I, r, r + 1, I, &qa);
        }
        product_tiles(td, numerics, dn, H, I, a, I, &qa, M, out, H);
        if (adapted && lora->down.a)
            lora_delta_team(&lg, &lora->down, a, I, I, out, H, H, ISA_AVX512);
    }
    free(h), free(a), qact_free(&qx), qact_free(&qa), lora_groups_free(&lg);
    return 0;
#else
    return -1;
#endif
}
