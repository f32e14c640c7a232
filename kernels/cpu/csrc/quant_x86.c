/* The x86 SIMD paths over raw GGUF blocks: AVX2 (FMA, F16C) and AVX-512 VNNI register tiles
 * of rows (one pass over W serves every row: each chunk of output features is reused from
 * cache for every tile of rows) and the AVX-512 expanded-tile GEMM for many rows in a32. Each
 * function carries its own target attribute (common.h), so the file compiles without -march
 * and quant.c picks a path at run time.
 */
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"
#include "vec_avx2.h"

#if KERNELS_X86
#include <immintrin.h>

INLINE_AVX2 float h2f(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }
                      
                      /* 32 bits -> 32 bytes of `val` where the bit is set */
                      INLINE_AVX2 __m256i bits_to_bytes(uint32_t bits, int val)
{
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8((char)val));
}

/* Group g: its 32 integers in a ymm and its scales (the type is a constant after inlining). */
INLINE_AVX2 __m256i group_q_avx2(int type, const uint8_t *row, int64_t g, Scales *s)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        const int bb = type == T_Q4_K ? 144 : type == T_Q5_K ? 176 : 210;
        const uint8_t *blk = row + (g >> 3) * bb;
        const int j = (int)(g & 7);
        if (type == T_Q6_K) {
            const int h = j >> 2, sh = ((j >> 1) & 1) * 4, half = j & 1, t = j & 3;
            const float d = h2f(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            s->a0 = d * sc[2 * j];
            s->a1 = d * sc[2 * j + 1];
            s->b = 0.0f;
            __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + h * 64 + half * 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
            ql = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(sh)), m4);
            qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)),
                                  _mm256_set1_epi8(3));
            return _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)),
                                   _mm256_set1_epi8(32));
        }
        int sc, m;
        k_scale_min(blk + 4, j, &sc, &m);
        s->a0 = s->a1 = h2f(blk) * (float)sc;
        s->b = -h2f(blk + 2) * (float)m;
        __m256i q = _mm256_loadu_si256(
            (const __m256i *)(blk + (type == T_Q4_K ? 16 : 48) + (j >> 1) * 32));
        q = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128((j & 1) * 4)), m4);
        if (type == T_Q5_K) {
            const __m256i hb = _mm256_set1_epi8((char)(1 << j));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
            qh = _mm256_cmpeq_epi8(_mm256_and_si256(qh, hb), hb);
            q = _mm256_or_si256(q, _mm256_and_si256(qh, _mm256_set1_epi8(0x10)));
        }
        return q;
    }
    const int bb = block_bytes(type);
    const uint8_t *blk = row + g * bb;
    const float d = h2f(blk);
    s->a0 = s->a1 = d;
    if (type == T_Q8_0) {
        s->b = 0.0f;
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
    s->b = type == T_Q4_0 ? -8.0f * d : type == T_Q5_0 ? -16.0f * d : h2f(blk + 2);
    const int off = type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8;
    const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + off));
    __m256i q = _mm256_set_m128i(_mm_srli_epi16(qs, 4), qs);
    q = _mm256_and_si256(q, m4);
    if (type == T_Q5_0 || type == T_Q5_1) {
        uint32_t qh;
        memcpy(&qh, blk + (type == T_Q5_0 ? 2 : 4), 4);
        q = _mm256_or_si256(q, bits_to_bytes(qh, 0x10));
    }
    return q;
}

/* q (32 bytes) -> four vectors of 8 floats: w = a * q + b */
INLINE_AVX2 void expand_avx2(__m256i q, int sg, Scales s, __m256 w[4])
{
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i p[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const __m256 b = _mm256_set1_ps(s.b);
    for (int k = 0; k < 4; k++) {
        const __m256i v = sg ? _mm256_cvtepi8_epi32(p[k]) : _mm256_cvtepu8_epi32(p[k]);
        w[k] = _mm256_fmadd_ps(_mm256_set1_ps(k < 2 ? s.a0 : s.a1), _mm256_cvtepi32_ps(v), b);
    }
}

/* int dot of 32 weight integers with 32 int8 activations: 8 int32 lanes (lanes 0-3: 0-15) */
INLINE_AVX2 __m256i dot_avx2(__m256i q, int sg, __m256i qx)
{
    if (sg) {
        qx = _mm256_sign_epi8(qx, q);
        q = _mm256_abs_epi8(q);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, qx), _mm256_set1_epi16(1));
}

#define RT2 4 /* rows per tile, AVX2 */

/* a8 over whole K-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 weights, 8 groups of 32): the
 * scales decoded once per super-block, each group's integer sub-scale applied in the int16
 * products (exact: |pair sum| <= 8128, times |scale| <= 128, fits int32), then one float
 * multiply-add per group and row (d * dx_g); the Q4_K/Q5_K mins as one 8-lane multiply-add
 * per super-block over the activations' group sums. NOTE: the generic tile_avx2 decodes the
 * scales per group and scales each product in float: one row, one thread, Llama 3.2 1B's
 * Q4_K 8192 x 2048 ran at 2.9 GB/s of weights there and 7.6 here, its Q6_K 2048 x 8192 at 3.7
 * and 7.5 (2026-12-03, an AVX2-only EPYC). */
INLINE_AVX2 void tile_kq_a8_avx2(int type, const int RT, const uint8_t *w, int64_t row_bytes,
                                 int64_t n0, int64_t n1, int64_t K, const QAct *qa, int64_t r0,
                                 float *out, int64_t os)
{
    const int64_t G = K / 32;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc[RT2], bacc[RT2];
        for (int t = 0; t < RT; t++)
            acc[t] = bacc[t] = _mm256_setzero_ps();
        for (int64_t g0 = 0; g0 < G; g0 += 8) {
            const uint8_t *blk = row + (g0 / 8) * block_bytes(type);
            if (type == T_Q6_K) {
                const float d = h2f(blk + 208);
                const int8_t *sc = (const int8_t *)(blk + 192);
                for (int j = 0; j < 8; j++) {
                    const int h = j >> 2, t4 = j & 3;
                    __m256i ql = _mm256_loadu_si256((const __m256i *)(blk + h * 64 + (t4 & 1) * 32));
                    __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
                    ql = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128((t4 >> 1) * 4)), m4);
                    qh = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t4)),
                                          _mm256_set1_epi8(3));
                    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(ql, _mm256_slli_epi16(qh, 4)),
                                                      _mm256_set1_epi8(32));
                    const __m256i aq = _mm256_abs_epi8(q);
                    const __m256i s16 = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * j]),
                                                          _mm_set1_epi16(sc[2 * j + 1]));
                    for (int t = 0; t < RT; t++) {
                        const __m256i qx = _mm256_sign_epi8(
                            _mm256_loadu_si256((const __m256i *)(qa->q + (r0 + t) * K + (g0 + j) * 32)), q);
                        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, qx), s16);
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                                 _mm256_set1_ps(d * qa->dx[(r0 + t) * G + g0 + j]), acc[t]);
                    }
                }
                continue;
            }
            const float d = h2f(blk), dmin = h2f(blk + 2);
            int sc[8], mn[8];
            for (int j = 0; j < 8; j++)
                k_scale_min(blk + 4, j, &sc[j], &mn[j]);
            const __m256 mv = _mm256_mul_ps(
                _mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)mn)));
            for (int t = 0; t < RT; t++)
                bacc[t] = _mm256_fmadd_ps(mv, _mm256_loadu_ps(qa->sx + (r0 + t) * G + g0), bacc[t]);
            const uint8_t *qs = blk + (type == T_Q4_K ? 16 : 48);
            const __m256i qhb = type == T_Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16))
                                               : _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + (j >> 1) * 32));
                __m256i q = _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128((j & 1) * 4)), m4);
                if (type == T_Q5_K) {
                    const __m256i hb = _mm256_set1_epi8((char)(1 << j));
                    const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(qhb, hb), hb);
                    q = _mm256_or_si256(q, _mm256_and_si256(on, _mm256_set1_epi8(0x10)));
                }
                const __m256i s16 = _mm256_set1_epi16((short)sc[j]);
                for (int t = 0; t < RT; t++) {
                    const __m256i qx =
                        _mm256_loadu_si256((const __m256i *)(qa->q + (r0 + t) * K + (g0 + j) * 32));
                    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, qx), s16);
                    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                             _mm256_set1_ps(d * qa->dx[(r0 + t) * G + g0 + j]), acc[t]);
                }
            }
        }
        for (int t = 0; t < RT; t++)
            out[(r0 + t) * os + n] = hsum8(acc[t]) + hsum8(bacc[t]);
    }
}

/* Rows r0..r0+RT of output features [n0, n1); RT is a constant after inlining. */
INLINE_AVX2 void tile_avx2(int type, int numerics, const int RT, const uint8_t *w, int64_t row_bytes,
                           int64_t n0, int64_t n1, int64_t K, const float *x, int64_t xs, const QAct *qa,
                           int64_t r0, float *out, int64_t os)
{
    if (numerics == NUM_A8 && (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K)) {
        tile_kq_a8_avx2(type, RT, w, row_bytes, n0, n1, K, qa, r0, out, os);
        return;
    }
    const int64_t G = K / 32;
    const int sg = is_signed(type);
    {
        int64_t rr[8];
        for (int t = 0; t < RT; t++)
            rr[t] = r0 + t;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = w + n * row_bytes;
            __m256 acc[8];
            float bacc[8];
            for (int t = 0; t < RT; t++) {
                acc[t] = _mm256_setzero_ps();
                bacc[t] = 0.0f;
            }
            for (int64_t g = 0; g < G; g++) {
                Scales s;
                const __m256i q = group_q_avx2(type, row, g, &s);
                if (numerics == NUM_A32) {
                    __m256 wv[4];
                    expand_avx2(q, sg, s, wv);
                    for (int t = 0; t < RT; t++) {
                        const float *xg = x + rr[t] * xs + g * 32;
                        for (int k = 0; k < 4; k++)
                            acc[t] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xg + 8 * k), acc[t]);
                    }
                } else {
                    /* NOTE: one scale per group except Q6_K's two halves */
                    const __m256 av = type == T_Q6_K
                        ? _mm256_setr_ps(s.a0, s.a0, s.a0, s.a0, s.a1, s.a1, s.a1, s.a1)
                        : _mm256_set1_ps(s.a0);
                    for (int t = 0; t < RT; t++) {
                        const __m256i qx = _mm256_loadu_si256(
                            (const __m256i *)(qa->q + rr[t] * K + g * 32));
                        const __m256 p = _mm256_cvtepi32_ps(dot_avx2(q, sg, qx));
                        const __m256 sc = _mm256_mul_ps(av, _mm256_set1_ps(qa->dx[rr[t] * G + g]));
                        acc[t] = _mm256_fmadd_ps(p, sc, acc[t]);
                        bacc[t] += s.b * qa->sx[rr[t] * G + g];
                    }
                }
            }
            for (int t = 0; t < RT; t++)
                out[(r0 + t) * os + n] = hsum8(acc[t]) + bacc[t];
        }
    }
}

#define RT5 8 /* rows per tile, AVX-512 */

INLINE_AVX512 float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }
                           
                           INLINE_AVX512 void tile_avx512(int type, int numerics, const int RT, const uint8_t *w, int64_t row_bytes,
                           int64_t n0, int64_t n1, int64_t K, const float *x, int64_t xs,
                           const QAct *qa, int64_t r0, float *out, int64_t os)
{
    const int64_t G = K / 32;
    const int sg = is_signed(type);
    {
        int64_t rr[RT5];
        for (int t = 0; t < RT; t++)
            rr[t] = r0 + t;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *row = w + n * row_bytes;
            if (numerics == NUM_A32) {
                __m512 acc[RT5];
                for (int t = 0; t < RT; t++)
                    acc[t] = _mm512_setzero_ps();
                for (int64_t g = 0; g < G; g++) {
                    Scales s;
                    const __m256i q = group_q_avx2(type, row, g, &s);
                    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
                    const __m512i vl = sg ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
                    const __m512i vh = sg ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
                    const __m512 b = _mm512_set1_ps(s.b);
                    const __m512 wl = _mm512_fmadd_ps(_mm512_set1_ps(s.a0), _mm512_cvtepi32_ps(vl), b);
                    const __m512 wh = _mm512_fmadd_ps(_mm512_set1_ps(s.a1), _mm512_cvtepi32_ps(vh), b);
                    for (int t = 0; t < RT; t++) {
                        const float *xg = x + rr[t] * xs + g * 32;
                        acc[t] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xg), acc[t]);
                        acc[t] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xg + 16), acc[t]);
                    }
                }
                for (int t = 0; t < RT; t++)
                    out[(r0 + t) * os + n] = hsum16(acc[t]);
            } else {
                __m256 acc[RT5];
                float bacc[RT5];
                for (int t = 0; t < RT; t++) {
                    acc[t] = _mm256_setzero_ps();
                    bacc[t] = 0.0f;
                }
                for (int64_t g = 0; g < G; g++) {
                    Scales s;
                    __m256i q = group_q_avx2(type, row, g, &s);
                    /* NOTE: one scale per group except Q6_K's two halves */
                    const __m256 av = type == T_Q6_K
                        ? _mm256_setr_ps(s.a0, s.a0, s.a0, s.a0, s.a1, s.a1, s.a1, s.a1)
                        : _mm256_set1_ps(s.a0);
                    __m256i aq = sg ? _mm256_abs_epi8(q) : q;
                    for (int t = 0; t < RT; t++) {
                        __m256i qx = _mm256_loadu_si256(
                            (const __m256i *)(qa->q + rr[t] * K + g * 32));
                        if (sg)
                            qx = _mm256_sign_epi8(qx, q);
                        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), aq, qx);
                        const __m256 sc = _mm256_mul_ps(av, _mm256_set1_ps(qa->dx[rr[t] * G + g]));
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[t]);
                        bacc[t] += s.b * qa->sx[rr[t] * G + g];
                    }
                }
                for (int t = 0; t < RT; t++)
                    out[(r0 + t) * os + n] = hsum8(acc[t]) + bacc[t];
            }
        }
    }
}

/* One instance per type of common.h's table, so that the type-dependent branches fold away. */
#define INSTANCES(CASE) GGML_TYPES(CASE)

/* Every tile of rows: full tiles of RT2 (RT5) rows, then one tile of the rest. */
#define TILES(FN, RTMAX, T, NUM)                                                              \
    for (int64_t r0 = 0; r0 < M;) {                                                           \
        const int64_t left = M - r0;                                                          \
        switch (left >= RTMAX ? RTMAX : left) {                                               \
        case 8: FN(T, NUM, 8, w, rb, n0, n1, K, x, xs, qa, r0, out, os); r0 += 8; break;      \
        case 7: FN(T, NUM, 7, w, rb, n0, n1, K, x, xs, qa, r0, out, os); r0 += 7; break;      \
        case 6: FN(T, NUM, 6, w, rb, n0, n1, K, x, xs, qa, r0, out, os); r0 += 6; break;      \
        case 5: FN(T, NUM, 5, w, rb, n0, n1, K, x, xs, qa, r0, out, os); r0 += 5; break;      \
        case 4: FN(T, NUM, 4, w, rb, n0, n1, K, x, xs, qa, r0, out, os); r0 += 4; break;      \
        case 3: FN(T, NUM, 3, w, rb, n0, n1, K, x, xs, qa, r0, out, os); r0 += 3; break;      \
        case 2: FN(T, NUM, 2, w, rb, n0, n1, K, x, xs, qa, r0, out, os); r0 += 2; break;      \
        default: FN(T, NUM, 1, w, rb, n0, n1, K, x, xs, qa, r0, out, os); r0 += 1; break;     \
        }                                                                                     \
    }

TARGET_AVX2 void rows_avx2(int type, int numerics, const uint8_t *w, int64_t rb, int64_t n0,
                           int64_t n1, int64_t K, const float *x, int64_t xs, const QAct *qa,
                           int64_t M, float *out, int64_t os)
{
#define CASE2(name, T, elems, bytes)                                                          \
    case T:                                                                                   \
        if (numerics == NUM_A32)                                                              \
            TILES(tile_avx2, RT2, T, NUM_A32)                                                 \
        else                                                                                  \
            TILES(tile_avx2, RT2, T, NUM_A8)                                                  \
        break;
    switch (type) { INSTANCES(CASE2) }
}

TARGET_AVX512 void rows_avx512(int type, int numerics, const uint8_t *w, int64_t rb, int64_t n0,
                               int64_t n1, int64_t K, const float *x, int64_t xs, const QAct *qa,
                               int64_t M, float *out, int64_t os)
{
#define CASE5(name, T, elems, bytes)                                                          \
    case T:                                                                                   \
        if (numerics == NUM_A32)                                                              \
            TILES(tile_avx512, RT5, T, NUM_A32)                                               \
        else                                                                                  \
            TILES(tile_avx512, RT5, T, NUM_A8)                                                \
        break;
    switch (type) { INSTANCES(CASE5) }
}

TARGET_AVX2 void dequant_avx2(int type, const uint8_t *row, int64_t K, float *out)
{
#define CASED(name, T, elems, bytes)                                                          \
    case T:                                                                                   \
        for (int64_t g = 0; g < K / 32; g++) {                                                \
            Scales s;                                                                         \
            __m256 wv[4];                                                                     \
            expand_avx2(group_q_avx2(T, row, g, &s), is_signed(T), s, wv);                    \
            for (int k = 0; k < 4; k++)                                                       \
                _mm256_storeu_ps(out + g * 32 + 8 * k, wv[k]);                                \
        }                                                                                     \
        break;
    switch (type) { INSTANCES(CASED) }
}

/* A32 for many rows: the chunk's weights expanded once into wbuf (L2-resident), then 4 rows x
 * 4 features of float32 FMAs per step of 16 (16 accumulators): an expanded-tile GEMM. */
TARGET_AVX512 void gemm_avx512(int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1,
                               int64_t K, const float *x, int64_t xs, int64_t M, float *out,
                               int64_t os, float *wbuf)
{
    const int64_t nn = n1 - n0;
    for (int64_t i = 0; i < nn; i++)
        dequant_avx2(type, w + (n0 + i) * rb, K, wbuf + i * K);
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
        const int rt = M - r0 < 4 ? (int)(M - r0) : 4;
        const float *xr[4];
        for (int t = 0; t < 4; t++)
            xr[t] = x + (r0 + (t < rt ? t : 0)) * xs; /* NOTE: a short tile repeats a row */
        for (int64_t j = 0; j < nn; j += 4) {
            const int nt = nn - j < 4 ? (int)(nn - j) : 4;
            const float *wr[4];
            for (int u = 0; u < 4; u++)
                wr[u] = wbuf + (j + (u < nt ? u : 0)) * K;
            __m512 acc[4][4];
            for (int t = 0; t < 4; t++)
                for (int u = 0; u < 4; u++)
                    acc[t][u] = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16) {
                __m512 wv[4];
                for (int u = 0; u < 4; u++)
                    wv[u] = _mm512_loadu_ps(wr[u] + k);
                for (int t = 0; t < 4; t++) {
                    const __m512 xv = _mm512_loadu_ps(xr[t] + k);
                    for (int u = 0; u < 4; u++)
                        acc[t][u] = _mm512_fmadd_ps(xv, wv[u], acc[t][u]);
                }
            }
            for (int t = 0; t < rt; t++)
                for (int u = 0; u < nt; u++)
                    out[(r0 + t) * os + n0 + j + u] = _mm512_reduce_add_ps(acc[t][u]);
        }
    }
}
#endif
