/* Packed tiles (AVX-512): 16 output features interleaved.
 *
 * Q4_0, Q4_1 and Q8_0 matrices can be repacked once at load (quant_pack) into tiles of 16
 * features. Tile t holds features 16t..16t+15 (zeros past N); per 32-weight group g, in order:
 * the 16 fp16 scales d, (Q4_1) the 16 fp16 mins m, then the quants as zmm-sized rows of 64
 * bytes where the dword of lane j holds 4 consecutive weights of feature j:
 *   Q4: 4 rows; row r, lane j, byte i = raw byte qs[4r + i] of feature j, i.e. low nibble
 *       weight 4r+i, high nibble weight 16+4r+i (the raw layout, transposed by dwords);
 *   Q8: 8 rows; row r, lane j, byte i = weight 4r+i of feature j, xor 0x80 (unsigned q+128).
 * So every type reads w = d u + m with u unsigned (m = -8d for Q4_0, -128d for Q8_0), and one
 * vpdpbusd of a row with a broadcast dword of int8 activations gives 16 features' partial dots
 * at once (no horizontal sums); a32 expands the same rows to 16 features' floats per weight.
 * Same bytes as the raw blocks.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api.h"
#include "quant_blocks.h"
#include "vec_avx512.h"

static inline int packs(int type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0; }

int64_t quant_packed_bytes(int type, int64_t N, int64_t K)
{
    if (!packs(type) || K % 32 != 0 || N < 1)
        return -1;
    return (N + 15) / 16 * (K / 32) * pgroup_bytes(type);
}

/* raw blocks [N, K / 32 blocks] -> packed tiles (quant_packed_bytes(type, N, K) bytes) */
int quant_pack(int type, const uint8_t *w, int64_t N, int64_t K, uint8_t *packed)
{
    if (quant_packed_bytes(type, N, K) < 0)
        return -1;
    const int64_t G = K / 32, rb = G * block_bytes(type), gb = pgroup_bytes(type);
    const int qoff = type == T_Q4_1 ? 64 : 32;
    const int64_t tiles = (N + 15) / 16;
    /* NOTE: tile by tile over the cores (each tile's bytes are its own), as kq_pack */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        memset(packed + t * G * gb, 0, (size_t)(G * gb));
        for (int64_t n = 16 * t; n < N && n < 16 * t + 16; n++) {
            const int64_t j = n % 16;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t *blk = w + n * rb + g * block_bytes(type);
                uint8_t *p = packed + (t * G + g) * gb;
                memcpy(p + 2 * j, blk, 2);
                if (type == T_Q4_1)
                    memcpy(p + 32 + 2 * j, blk + 2, 2);
                uint8_t *q = p + qoff;
                if (type == T_Q8_0) {
                    for (int k = 0; k < 32; k++)
                        q[(k / 4) * 64 + j * 4 + k % 4] = blk[2 + k] ^ 0x80;
                } else {
                    const uint8_t *qs = blk + (type == T_Q4_0 ? 2 : 4);
                    for (int k = 0; k < 16; k++)
                        q[(k / 4) * 64 + j * 4 + k % 4] = qs[k];
                }
            }
        }
    }
    return 0;
}

/* The unsigned integer of weight k (0..31) of lane j in a packed group's quants. */
static inline int packed_u(int type, const uint8_t *q, int j, int k)
{
    if (type == T_Q8_0)
        return q[(k / 4) * 64 + j * 4 + k % 4];
    const uint8_t b = q[((k % 16) / 4) * 64 + j * 4 + k % 4];
    return k < 16 ? (b & 0xF) : (b >> 4);
}

/* out[i, :] = the float32 weights of feature ids[i] (ids NULL: first + i) of a packed matrix. */
int quant_packed_rows(int type, const uint8_t *packed, int64_t N, int64_t K, const int64_t *ids,
                      int64_t first, int64_t M, float *out, int num_threads)
{
    if (quant_packed_bytes(type, N, K) < 0)
        return -1;
    for (int64_t i = 0; i < M; i++) {
        const int64_t id = ids ? ids[i] : first + i;
        if (id < 0 || id >= N)
            return -2;
    }
    const int64_t G = K / 32, gb = pgroup_bytes(type);
    const int qoff = type == T_Q4_1 ? 64 : 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)
    for (int64_t i = 0; i < M; i++) {
        const int64_t n = ids ? ids[i] : first + i, t = n / 16;
        const int j = (int)(n % 16);
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *p = packed + (t * G + g) * gb;
            const float d = half_bits_to_float(rd16(p + 2 * j));
            const float m = type == T_Q4_1 ? half_bits_to_float(rd16(p + 32 + 2 * j))
                                           : (type == T_Q4_0 ? -8.0f : -128.0f) * d;
            for (int k = 0; k < 32; k++)
                out[i * K + g * 32 + k] = fmaf(d, (float)packed_u(type, p + qoff, j, k), m);
        }
    }
    return 0;
}

#if KERNELS_X86
/* A packed group's scales: d and m for the 16 features. */
INLINE_AVX512 void pscales(int type, const uint8_t *p, __m512 *d, __m512 *m)
{
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (type == T_Q4_1)
        *m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
    else
        *m = _mm512_mul_ps(*d, _mm512_set1_ps(type == T_Q4_0 ? -8.0f : -128.0f));
}

/* The 8 quant rows of a packed group as unsigned bytes: row r holds weights 4r..4r+3. */
INLINE_AVX512 void prows(int type, const uint8_t *q, __m512i u[8])
{
    if (type == T_Q8_0) {
        for (int r = 0; r < 8; r++)
            u[r] = _mm512_loadu_si512(q + 64 * r);
        return;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < 4; r++) {
        const __m512i v = _mm512_loadu_si512(q + 64 * r);
        u[r] = _mm512_and_si512(v, m4);
        u[r + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
}

/* A8: rows r0..r0+RT of one tile (16 features from n0; nvalid of them stored). */
INLINE_AVX512 void ptile_a8(int type, const int RT, const uint8_t *tile, const uint8_t *next,
                            int64_t G, int64_t K, const QAct *qa, int64_t r0, float *out,
                            int64_t os, __mmask16 valid)
{
    const int64_t gb = pgroup_bytes(type), qoff = type == T_Q4_1 ? 64 : 32;
    __m512 acc[8], macc[8];
    for (int t = 0; t < RT; t++)
        acc[t] = macc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *p = tile + g * gb;
        /* NOTE: the next tile's group fetched into L2 on the first row pass: the stack's
         * weights come from DRAM each step (30 MLPs of 64 rows: 14.95-16.29 ms against
         * 16.29-17.35; a decode step at 64 streams 44.1-44.8 against 47.1-48.2 ms) */
        if (next && r0 == 0)
            prefetch_l2(next + g * gb, gb);
        __m512 d, m;
        __m512i u[8];
        pscales(type, p, &d, &m);
        prows(type, p + qoff, u);
        for (int t = 0; t < RT; t++) {
            __m512i ia, ib;
            dot_a8(u, qa->q + (r0 + t) * K + g * 32, &ia, &ib);
            const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(qa->dx[(r0 + t) * G + g]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia, ib)), sc, acc[t]);
            macc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(qa->sx[(r0 + t) * G + g]), macc[t]);
        }
    }
    store_a8(RT, acc, macc, r0, out, os, valid);
}

/* A32: w = d u + m expanded to float32 per weight (16 features per zmm), float32 FMA. */
INLINE_AVX512 void ptile_a32(int type, const int RT, const uint8_t *tile, const uint8_t *next,
                             int64_t G, const float *x, int64_t xs, int64_t r0, float *out,
                             int64_t os, __mmask16 valid)
{
    const int64_t gb = pgroup_bytes(type), qoff = type == T_Q4_1 ? 64 : 32;
    __m512 acc[4][4];
    for (int t = 0; t < RT; t++)
        for (int i = 0; i < 4; i++)
            acc[t][i] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi32(type == T_Q8_0 ? 0xFF : 0x0F);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t *p = tile + g * gb;
        if (next && r0 == 0) /* as ptile_a8 does */
            prefetch_l2(next + g * gb, gb);
        __m512 d, m;
        pscales(type, p, &d, &m);
        const int nrows = type == T_Q8_0 ? 8 : 4;
        for (int r = 0; r < nrows; r++) {
            const __m512i v = _mm512_loadu_si512(p + qoff + 64 * r);
            for (int i = 0; i < 4; i++) {
                /* Q8: weight 4r+i; Q4: 4r+i (low nibble) and 16+4r+i (high) */
                const __m512 wa = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(
                    _mm512_srli_epi32(v, 8 * i), mask)), m);
                for (int t = 0; t < RT; t++) {
                    const float *xg = x + (r0 + t) * xs + g * 32;
                    acc[t][i] = _mm512_fmadd_ps(wa, _mm512_set1_ps(xg[4 * r + i]), acc[t][i]);
                }
                if (type != T_Q8_0) {
                    const __m512 wb = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(
                        _mm512_srli_epi32(v, 8 * i + 4), mask)), m);
                    for (int t = 0; t < RT; t++) {
                        const float *xg = x + (r0 + t) * xs + g * 32;
                        acc[t][i] = _mm512_fmadd_ps(wb, _mm512_set1_ps(xg[16 + 4 * r + i]),
                                                    acc[t][i]);
                    }
                }
            }
        }
    }
    store_a32(RT, acc, r0, out, os, valid);
}

/* One tile's rows (16 features; `valid` of them stored) in TILE_ROWS's register tiles.
 * NOTE: a8 takes 8-row tiles for Q4_0/Q4_1: the unpacked 4-bit weights serve twice the rows
 * (576 -> 3072 Q4_1, 64 rows: 0.27-0.29 ms against 0.31-0.32 with 4-row tiles); Q8_0's eight
 * raw weight registers leave too few for 8 rows (its 64-row head product went from 5.5 to
 * 5.9-6.4 ms), so it keeps 4-row tiles, as a32 does (ptile_a32's accumulators hold 4 rows). */
TARGET_AVX512 static void ptile_rows(int type, int numerics, const uint8_t *tile,
                                     const uint8_t *next, int64_t G, int64_t K, const float *x,
                                     int64_t xs, const QAct *qa, int64_t M, float *out,
                                     int64_t os, __mmask16 valid)
{
#define PCASE(T)                                                                              \
    case T:                                                                                   \
        if (numerics == NUM_A8)                                                               \
            TILE_ROWS(T == T_Q8_0 ? 4 : 8, ptile_a8, T, tile, next, G, K, qa, r0, out, os,     \
                      valid)                                                                  \
        else                                                                                  \
            TILE_ROWS(4, ptile_a32, T, tile, next, G, x, xs, r0, out, os, valid)              \
        break;
    switch (type) {
        PCASE(T_Q4_0) PCASE(T_Q4_1) PCASE(T_Q8_0)
    }
}

void ptiles_product(int type, int numerics, const uint8_t *packed, int64_t N, int64_t K,
                    const float *x, int64_t xs, const QAct *qa, int64_t M, float *out, int64_t os)
{
    const int64_t G = K / 32, tiles = (N + 15) / 16, tb = G * pgroup_bytes(type);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        ptile_rows(type, numerics, packed + t * tb, t + 1 < tiles ? packed + (t + 1) * tb : NULL,
                   G, K, x, xs, qa, M, out + 16 * t, os, mask_below(N - 16 * t));
}

/* outT[k, n - 16 t0] (row stride ld) = W[n, k] for the features of tiles t0..t1: K-major
 * float32 weights, for a GEMM x @ outT. */
TARGET_AVX512 static void ptiles_kmajor(int type, const uint8_t *packed, int64_t G, int64_t t0,
                                        int64_t t1, float *outT, int64_t ld)
{
    const int64_t gb = pgroup_bytes(type), qoff = type == T_Q4_1 ? 64 : 32;
    const __m512i mask = _mm512_set1_epi32(type == T_Q8_0 ? 0xFF : 0x0F);
    for (int64_t t = t0; t < t1; t++)
        for (int64_t g = 0; g < G; g++) {
            const uint8_t *p = packed + (t * G + g) * gb;
            __m512 d, m;
            pscales(type, p, &d, &m);
            float *o = outT + g * 32 * ld + (t - t0) * 16;
            for (int r = 0; r < (type == T_Q8_0 ? 8 : 4); r++) {
                const __m512i v = _mm512_loadu_si512(p + qoff + 64 * r);
                for (int i = 0; i < 4; i++) {
                    _mm512_storeu_ps(o + (4 * r + i) * ld, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(
                        _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), mask)), m));
                    if (type != T_Q8_0)
                        _mm512_storeu_ps(o + (16 + 4 * r + i) * ld, _mm512_fmadd_ps(
                            d, _mm512_cvtepi32_ps(_mm512_and_si512(
                                _mm512_srli_epi32(v, 8 * i + 4), mask)), m));
                }
            }
        }
}
#endif

/* As quant_matmul, W packed (quant_pack); AVX-512 VNNI only (returns -1 without it). */
int quant_matmul_packed(int type, const uint8_t *packed, int64_t N, int64_t K, const float *x,
                        int64_t xs, int64_t M, float *out, int64_t os, int numerics,
                        int num_threads)
{
    if (quant_packed_bytes(type, N, K) < 0 || M < 1 || num_threads < 1
        || !isa_supported(ISA_AVX512))
        return -1;
#if KERNELS_X86
    QAct qa = {NULL, NULL, NULL};
    if (numerics == NUM_A8 && quantize_act(x, xs, M, K, &qa, ISA_AVX512, num_threads))
        return -1;
#pragma omp parallel num_threads(num_threads)
    ptiles_product(type, numerics, packed, N, K, x, xs, &qa, M, out, os);
    free(qa.q), free(qa.dx), free(qa.sx);
    return 0;
#else
    return -1;
#endif
}

/* outT [K, 16 (t1 - t0)] (row stride ld): the float32 weights of tiles t0..t1, K-major. */
int quant_packed_kmajor(int type, const uint8_t *packed, int64_t N, int64_t K, int64_t t0,
                        int64_t t1, float *outT, int64_t ld, int num_threads)
{
    if (quant_packed_bytes(type, N, K) < 0 || t0 < 0 || t1 > (N + 15) / 16 || t0 >= t1
        || ld < 16 * (t1 - t0) || num_threads < 1 || !isa_supported(ISA_AVX512))
        return -1;
#if KERNELS_X86
    const int64_t G = K / 32;
    const int64_t per = (t1 - t0 + num_threads - 1) / num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int th = 0; th < num_threads; th++) {
        const int64_t a = t0 + th * per, b = a + per < t1 ? a + per : t1;
        if (a < b)
            ptiles_kmajor(type, packed, G, a, b, outT + (a - t0) * 16, ld);
    }
    return 0;
#else
    return -1;
#endif
}

/* As quant_matmul_parts, each part's data packed tiles of its type (quant_pack's for Q4_0,
 * Q4_1 and Q8_0, kq_pack's for the others) of rows[p] features: a fused projection whose parts
 * differ in type (Q4_K_M's q|k Q4_K and v Q6_K), one packed product per part into its columns.
 * AVX-512 VNNI only (-1 without it). */
int quant_matmul_packed_parts(const BlockParts *w, int64_t K, const float *x, int64_t xs,
                              int64_t M, float *out, int64_t os, int numerics, int num_threads)
{
    if (w->parts < 1 || w->parts > MAX_PARTS)
        return -1;
    int64_t n0 = 0;
    for (int64_t p = 0; p < w->parts; p++) {
        const int type = (int)w->type[p];
        if ((kq_type(type) ? kq_matmul_packed : quant_matmul_packed)(
                type, w->data[p], w->rows[p], K, x, xs, M, out + n0, os, numerics, num_threads))
            return -1;
        n0 += w->rows[p];
    }
    return 0;
}
