/* Products with GGUF-quantized weights on the CPU: out[M, N] = x[M, K] @ W[N, K]^T.
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
 *
 * One pass over W serves every row: threads take chunks of output features, each chunk's
 * weights are reused from cache for every tile of rows. ISA paths (scalar, AVX2, AVX-512 VNNI)
 * are compiled with per-function target attributes and chosen at run time (or forced).
 * Built and loaded by kernels/cpu_quant.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
enum { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3 };
enum { NUM_A32 = 0, NUM_A8 = 1 };

#define NCHUNK 16 /* output features per task */
#define GEMM_CHUNK 32 /* output features per task of the expanded-tile path */
/* rows from which a32 takes the expanded-tile path on AVX-512: 576 x 3072 Q4_1, one thread,
 * 0.39 ms against 0.40 for register tiles at 8 rows, 0.55 against 0.79 at 16 */
int GEMM_ROWS = 8;

/* ---- shared helpers ------------------------------------------------------------------------ */

static float f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

int block_elems(int type)
{
    switch (type) {
    case T_Q4_0: case T_Q4_1: case T_Q5_0: case T_Q5_1: case T_Q8_0: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: return 256;
    default: return 0;
    }
}

int block_bytes(int type)
{
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

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

static inline Scales group_scales(int type, const uint8_t *row, int64_t g)
{
    Scales s;
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        const uint8_t *blk = row + (g >> 3) * block_bytes(type);
        const int j = (int)(g & 7);
        if (type == T_Q6_K) {
            const float d = f16_to_f32(rd16(blk + 208));
            const int8_t *sc = (const int8_t *)(blk + 192);
            s.a0 = d * sc[2 * j];
            s.a1 = d * sc[2 * j + 1];
            s.b = 0.0f;
        } else {
            int sc, m;
            k_scale_min(blk + 4, j, &sc, &m);
            s.a0 = s.a1 = f16_to_f32(rd16(blk)) * (float)sc;
            s.b = -f16_to_f32(rd16(blk + 2)) * (float)m;
        }
        return s;
    }
    const uint8_t *blk = row + g * block_bytes(type);
    const float d = f16_to_f32(rd16(blk));
    s.a0 = s.a1 = d;
    switch (type) {
    case T_Q4_0: s.b = -8.0f * d; break;
    case T_Q5_0: s.b = -16.0f * d; break;
    case T_Q4_1: case T_Q5_1: s.b = f16_to_f32(rd16(blk + 2)); break;
    default: s.b = 0.0f;
    }
    return s;
}

/* The 32 integers of group g (int8 bit patterns for the signed types). */
static inline void group_q_scalar(int type, const uint8_t *row, int64_t g, uint8_t q[32])
{
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        const uint8_t *blk = row + (g >> 3) * block_bytes(type);
        const int j = (int)(g & 7);
        if (type == T_Q6_K) {
            const int h = j >> 2, sh = ((j >> 1) & 1) * 4, half = j & 1, t = j & 3;
            const uint8_t *ql = blk + h * 64 + half * 32, *qh = blk + 128 + h * 32;
            for (int i = 0; i < 32; i++)
                q[i] = (uint8_t)((int)(((ql[i] >> sh) & 0xF) | (((qh[i] >> (2 * t)) & 3) << 4)) - 32);
            return;
        }
        const uint8_t *qs = blk + (type == T_Q4_K ? 16 : 48) + (j >> 1) * 32;
        const int sh = (j & 1) * 4;
        for (int i = 0; i < 32; i++)
            q[i] = (qs[i] >> sh) & 0xF;
        if (type == T_Q5_K)
            for (int i = 0; i < 32; i++)
                q[i] |= ((blk[16 + i] >> j) & 1) << 4;
        return;
    }
    const uint8_t *blk = row + g * block_bytes(type);
    if (type == T_Q8_0) {
        memcpy(q, blk + 2, 32);
        return;
    }
    const uint8_t *qs = blk + (type == T_Q4_0 ? 2 : type == T_Q4_1 ? 4 : type == T_Q5_0 ? 6 : 8);
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 0xF;
        q[i + 16] = qs[i] >> 4;
    }
    if (type == T_Q5_0 || type == T_Q5_1) {
        uint32_t qh;
        memcpy(&qh, blk + (type == T_Q5_0 ? 2 : 4), 4);
        for (int i = 0; i < 32; i++)
            q[i] |= ((qh >> i) & 1) << 4;
    }
}

static inline void group_f32_scalar(int type, const uint8_t *row, int64_t g, float w[32])
{
    uint8_t q[32];
    group_q_scalar(type, row, g, q);
    const Scales s = group_scales(type, row, g);
    const int sg = is_signed(type);
    for (int i = 0; i < 32; i++) {
        const float v = sg ? (float)(int8_t)q[i] : (float)q[i];
        w[i] = (i < 16 ? s.a0 : s.a1) * v + s.b;
    }
}

/* ---- activations to int8 (A8) ------------------------------------------------------------ */

typedef struct {
    int8_t *q;   /* [M, K] */
    float *dx;   /* [M, K / 32] */
    float *sx;   /* [M, K / 32]: dx * sum(q) */
} QAct;

static void quantize_row(const float *x, int64_t K, int8_t *q, float *dx, float *sx)
{
    for (int64_t g = 0; g < K / 32; g++) {
        const float *xg = x + g * 32;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++)
            amax = fmaxf(amax, fabsf(xg[i]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            float v = nearbyintf(xg[i] * id);
            v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
            q[g * 32 + i] = (int8_t)v;
            sum += (int)v;
        }
        dx[g] = d;
        sx[g] = d * (float)sum;
    }
}

/* ---- scalar path --------------------------------------------------------------------------- */

static void rows_scalar(int type, int numerics, const uint8_t *w, int64_t row_bytes, int64_t n0,
                        int64_t n1, int64_t K, const float *x, int64_t xs, const QAct *qa,
                        int64_t M, float *out, int64_t os)
{
    const int64_t G = K / 32;
    const int sg = is_signed(type);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t r = 0; r < M; r++) {
            double acc = 0.0; /* NOTE: a reference path: exactness over speed */
            for (int64_t g = 0; g < G; g++) {
                if (numerics == NUM_A32) {
                    float wf[32];
                    group_f32_scalar(type, row, g, wf);
                    const float *xg = x + r * xs + g * 32;
                    float s = 0.0f;
                    for (int i = 0; i < 32; i++)
                        s += wf[i] * xg[i];
                    acc += s;
                } else {
                    uint8_t q[32];
                    group_q_scalar(type, row, g, q);
                    const Scales sc = group_scales(type, row, g);
                    const int8_t *qx = qa->q + r * K + g * 32;
                    int32_t lo = 0, hi = 0;
                    for (int i = 0; i < 16; i++) {
                        lo += (sg ? (int)(int8_t)q[i] : (int)q[i]) * qx[i];
                        hi += (sg ? (int)(int8_t)q[i + 16] : (int)q[i + 16]) * qx[i + 16];
                    }
                    const float dx = qa->dx[r * G + g];
                    acc += sc.a0 * dx * (float)lo + sc.a1 * dx * (float)hi
                           + sc.b * qa->sx[r * G + g];
                }
            }
            out[r * os + n] = (float)acc;
        }
    }
}

/* ---- x86 SIMD paths ------------------------------------------------------------------------ */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define T2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline
#define T2F __attribute__((target("avx2,fma,f16c")))
#define T5F __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define T5 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"), \
                          always_inline)) static inline

T2 float h2f(const uint8_t *p) { return _cvtsh_ss(rd16(p)); }

/* 32 bits -> 32 bytes of `val` where the bit is set */
T2 __m256i bits_to_bytes(uint32_t bits, int val)
{
    const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuf);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8((char)val));
}

/* Group g: its 32 integers in a ymm and its scales (the type is a constant after inlining). */
T2 __m256i group_q_avx2(int type, const uint8_t *row, int64_t g, Scales *s)
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

T2 float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* q (32 bytes) -> four vectors of 8 floats: w = a * q + b */
T2 void expand_avx2(__m256i q, int sg, Scales s, __m256 w[4])
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
T2 __m256i dot_avx2(__m256i q, int sg, __m256i qx)
{
    if (sg) {
        qx = _mm256_sign_epi8(qx, q);
        q = _mm256_abs_epi8(q);
    }
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, qx), _mm256_set1_epi16(1));
}

#define RT2 4 /* rows per tile, AVX2 */

/* Rows r0..r0+RT of output features [n0, n1); RT is a constant after inlining. */
T2 void tile_avx2(int type, int numerics, const int RT, const uint8_t *w, int64_t row_bytes,
                  int64_t n0, int64_t n1, int64_t K, const float *x, int64_t xs, const QAct *qa,
                  int64_t r0, float *out, int64_t os)
{
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

T5 float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

T5 void tile_avx512(int type, int numerics, const int RT, const uint8_t *w, int64_t row_bytes,
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

/* One instance per type, so that the type-dependent branches fold away. */
#define INSTANCES(X) X(T_Q4_0) X(T_Q4_1) X(T_Q5_0) X(T_Q5_1) X(T_Q8_0) X(T_Q4_K) X(T_Q5_K) X(T_Q6_K)

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

T2F static void rows_avx2(int type, int numerics, const uint8_t *w, int64_t rb, int64_t n0,
                          int64_t n1, int64_t K, const float *x, int64_t xs, const QAct *qa,
                          int64_t M, float *out, int64_t os)
{
#define CASE2(T)                                                                              \
    case T:                                                                                   \
        if (numerics == NUM_A32)                                                              \
            TILES(tile_avx2, RT2, T, NUM_A32)                                                 \
        else                                                                                  \
            TILES(tile_avx2, RT2, T, NUM_A8)                                                  \
        break;
    switch (type) { INSTANCES(CASE2) }
}

T5F static void rows_avx512(int type, int numerics, const uint8_t *w, int64_t rb, int64_t n0,
                            int64_t n1, int64_t K, const float *x, int64_t xs, const QAct *qa,
                            int64_t M, float *out, int64_t os)
{
#define CASE5(T)                                                                              \
    case T:                                                                                   \
        if (numerics == NUM_A32)                                                              \
            TILES(tile_avx512, RT5, T, NUM_A32)                                               \
        else                                                                                  \
            TILES(tile_avx512, RT5, T, NUM_A8)                                                \
        break;
    switch (type) { INSTANCES(CASE5) }
}

T2F static void dequant_avx2(int type, const uint8_t *row, int64_t K, float *out)
{
#define CASED(T)                                                                              \
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
T5F static void gemm_avx512(int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1,
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

/* ---- packed tiles (AVX-512): 16 output features interleaved ------------------------------
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
 * Same bytes as the raw blocks. */

static inline int packs(int type) { return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0; }

static inline int pgroup_bytes(int type)
{
    return type == T_Q4_0 ? 32 + 256 : type == T_Q4_1 ? 64 + 256 : type == T_Q8_0 ? 32 + 512 : 0;
}

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
    memset(packed, 0, (size_t)quant_packed_bytes(type, N, K));
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n / 16, j = n % 16;
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
            const float d = f16_to_f32(rd16(p + 2 * j));
            const float m = type == T_Q4_1 ? f16_to_f32(rd16(p + 32 + 2 * j))
                                           : (type == T_Q4_0 ? -8.0f : -128.0f) * d;
            for (int k = 0; k < 32; k++)
                out[i * K + g * 32 + k] = fmaf(d, (float)packed_u(type, p + qoff, j, k), m);
        }
    }
    return 0;
}

#if defined(__x86_64__) || defined(__i386__)
/* A packed group's scales: d and m for the 16 features. */
T5 void pscales(int type, const uint8_t *p, __m512 *d, __m512 *m)
{
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    if (type == T_Q4_1)
        *m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
    else
        *m = _mm512_mul_ps(*d, _mm512_set1_ps(type == T_Q4_0 ? -8.0f : -128.0f));
}

/* The 8 quant rows of a packed group as unsigned bytes: row r holds weights 4r..4r+3. */
T5 void prows(int type, const uint8_t *q, __m512i u[8])
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
T5 void ptile_a8(int type, const int RT, const uint8_t *tile, const uint8_t *next, int64_t G,
                 int64_t K, const QAct *qa, int64_t r0, float *out, int64_t os, __mmask16 valid)
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
            for (int64_t b = 0; b < gb; b += 64)
                __builtin_prefetch(next + g * gb + b, 0, 2);
        __m512 d, m;
        __m512i u[8];
        pscales(type, p, &d, &m);
        prows(type, p + qoff, u);
        for (int t = 0; t < RT; t++) {
            const int8_t *xq = qa->q + (r0 + t) * K + g * 32;
            __m512i ia = _mm512_setzero_si512(), ib = _mm512_setzero_si512();
            for (int r = 0; r < 4; r++) {
                int32_t xa, xb;
                memcpy(&xa, xq + 4 * r, 4);
                memcpy(&xb, xq + 16 + 4 * r, 4);
                ia = _mm512_dpbusd_epi32(ia, u[r], _mm512_set1_epi32(xa));
                ib = _mm512_dpbusd_epi32(ib, u[r + 4], _mm512_set1_epi32(xb));
            }
            const __m512 sc = _mm512_mul_ps(d, _mm512_set1_ps(qa->dx[(r0 + t) * G + g]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(ia, ib)), sc, acc[t]);
            macc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(qa->sx[(r0 + t) * G + g]), macc[t]);
        }
    }
    for (int t = 0; t < RT; t++)
        _mm512_mask_storeu_ps(out + (r0 + t) * os, valid, _mm512_add_ps(acc[t], macc[t]));
}

/* A32: w = d u + m expanded to float32 per weight (16 features per zmm), float32 FMA. */
T5 void ptile_a32(int type, const int RT, const uint8_t *tile, const uint8_t *next, int64_t G,
                  const float *x, int64_t xs, int64_t r0, float *out, int64_t os,
                  __mmask16 valid)
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
            for (int64_t b = 0; b < gb; b += 64)
                __builtin_prefetch(next + g * gb + b, 0, 2);
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
    for (int t = 0; t < RT; t++)
        _mm512_mask_storeu_ps(out + (r0 + t) * os, valid,
                              _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]),
                                            _mm512_add_ps(acc[t][2], acc[t][3])));
}

/* Rows r0.. of one tile in register tiles of up to MAXRT rows (4 or 8), the rest 3, 2, 1.
 * NOTE: a8 takes 8-row tiles for Q4_0/Q4_1: the unpacked 4-bit weights serve twice the rows
 * (576 -> 3072 Q4_1, 64 rows: 0.27-0.29 ms against 0.31-0.32 with 4-row tiles); Q8_0's eight
 * raw weight registers leave too few for 8 rows (its 64-row head product went from 5.5 to
 * 5.9-6.4 ms), so it keeps 4-row tiles, as a32 does. MAXRT is a constant: where it is 4 the
 * 8-row call is compiled out (ptile_a32's accumulators hold 4 rows). */
#define PTILES(MAXRT, FN, T, ...)                                                             \
    for (int64_t r0 = 0; r0 < M;) {                                                           \
        if ((MAXRT) >= 8 && M - r0 >= 8) { FN(T, 8, __VA_ARGS__); r0 += 8; continue; }        \
        switch (M - r0 >= 4 ? 4 : M - r0) {                                                   \
        case 4: FN(T, 4, __VA_ARGS__); r0 += 4; break;                                        \
        case 3: FN(T, 3, __VA_ARGS__); r0 += 3; break;                                        \
        case 2: FN(T, 2, __VA_ARGS__); r0 += 2; break;                                        \
        default: FN(T, 1, __VA_ARGS__); r0 += 1; break;                                       \
        }                                                                                     \
    }

T5F static void ptile_rows(int type, int numerics, const uint8_t *tile, const uint8_t *next,
                           int64_t G, int64_t K, const float *x, int64_t xs, const QAct *qa,
                           int64_t M, float *out, int64_t os, __mmask16 valid)
{
#define PCASE(T)                                                                              \
    case T:                                                                                   \
        if (numerics == NUM_A8)                                                               \
            PTILES(T == T_Q8_0 ? 4 : 8, ptile_a8, T, tile, next, G, K, qa, r0, out, os, valid) \
        else                                                                                  \
            PTILES(4, ptile_a32, T, tile, next, G, x, xs, r0, out, os, valid)                 \
        break;
    switch (type) {
        PCASE(T_Q4_0) PCASE(T_Q4_1) PCASE(T_Q8_0)
    }
}

/* outT[k, n - 16 t0] (row stride ld) = W[n, k] for the features of tiles t0..t1: K-major
 * float32 weights, for a GEMM x @ outT. */
T5F static void ptiles_kmajor(int type, const uint8_t *packed, int64_t G, int64_t t0,
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

#if defined(__x86_64__) || defined(__i386__)
/* quantize_row with AVX-512: the same numbers (cvtps rounds to nearest even, as nearbyintf
 * does in the default rounding mode; |x| / dx <= 127 needs no clamp beyond the saturating
 * narrowing). */
T5F static void quantize_row_avx512(const float *x, int64_t K, int8_t *q, float *dx, float *sx)
{
    for (int64_t g = 0; g < K / 32; g++) {
        const __m512 a = _mm512_loadu_ps(x + g * 32), b = _mm512_loadu_ps(x + g * 32 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        const __m512i ia = _mm512_cvtps_epi32(_mm512_mul_ps(a, vid));
        const __m512i ib = _mm512_cvtps_epi32(_mm512_mul_ps(b, vid));
        _mm_storeu_si128((__m128i *)(q + g * 32), _mm512_cvtsepi32_epi8(ia));
        _mm_storeu_si128((__m128i *)(q + g * 32 + 16), _mm512_cvtsepi32_epi8(ib));
        dx[g] = d;
        sx[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(ia, ib));
    }
}
#endif

static int qact_alloc(int64_t M, int64_t K, QAct *qa)
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
static int quantize_act(const float *x, int64_t xs, int64_t M, int64_t K, QAct *qa, int isa,
                        int num_threads)
{
    const int64_t G = K / 32;
    if (qact_alloc(M, K, qa))
        return -1;
#if defined(__x86_64__) || defined(__i386__)
    const int simd = isa == ISA_AVX512 && isa_supported(ISA_AVX512);
#else
    const int simd = 0;
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (M >= 8)
    for (int64_t r = 0; r < M; r++) {
#if defined(__x86_64__) || defined(__i386__)
        if (simd) {
            quantize_row_avx512(x + r * xs, K, qa->q + r * K, qa->dx + r * G, qa->sx + r * G);
            continue;
        }
#endif
        quantize_row(x + r * xs, K, qa->q + r * K, qa->dx + r * G, qa->sx + r * G);
    }
    return 0;
}

/* As quant_matmul, W packed (quant_pack); AVX-512 VNNI only (returns -1 without it). */
int quant_matmul_packed(int type, const uint8_t *packed, int64_t N, int64_t K, const float *x,
                        int64_t xs, int64_t M, float *out, int64_t os, int numerics,
                        int num_threads)
{
    if (quant_packed_bytes(type, N, K) < 0 || M < 1 || num_threads < 1
        || !isa_supported(ISA_AVX512))
        return -1;
#if defined(__x86_64__) || defined(__i386__)
    const int64_t G = K / 32, tiles = (N + 15) / 16, tb = G * pgroup_bytes(type);
    QAct qa = {NULL, NULL, NULL};
    if (numerics == NUM_A8 && quantize_act(x, xs, M, K, &qa, ISA_AVX512, num_threads))
        return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t left = N - 16 * t;
        const __mmask16 valid = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
        ptile_rows(type, numerics, packed + t * tb, t + 1 < tiles ? packed + (t + 1) * tb : NULL,
                   G, K, x, xs, &qa, M, out + 16 * t, os, valid);
    }
    free(qa.q), free(qa.dx), free(qa.sx);
    return 0;
#else
    return -1;
#endif
}

#if defined(__x86_64__) || defined(__i386__)
/* e^x, 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r (Cephes'
 * expf coefficients, about 1 ulp), scaled by 2^n. */
T5 __m512 exp512(__m512 x)
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
T5 __m512 act_mul(int act, __m512 g, __m512 u)
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

T5F static void act_rows(int act, const float *h, int64_t I, int64_t r, int64_t i0, int64_t i1,
                         float *a)
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
 * One OpenMP region: the gate/up tiles, the activation, the down tiles, barriers between.
 * x and out contiguous. AVX-512 VNNI only. */
int quant_mlp_packed(int tgu, const uint8_t *gu, int td, const uint8_t *dn, int64_t I,
                     int64_t H, const float *x, int64_t M, float *out, int numerics, int act,
                     int num_threads)
{
    if (quant_packed_bytes(tgu, 2 * I, H) < 0 || quant_packed_bytes(td, H, I) < 0 || M < 1
        || num_threads < 1
        || !isa_supported(ISA_AVX512) || (act != 0 && act != 1))
        return -1;
#if defined(__x86_64__) || defined(__i386__)
    const int64_t GH = H / 32, GI = I / 32, tiles_gu = (2 * I + 15) / 16, tiles_dn = (H + 15) / 16;
    const int64_t tb_gu = GH * pgroup_bytes(tgu), tb_dn = GI * pgroup_bytes(td);
    float *h = malloc(sizeof(float) * (size_t)(M * 2 * I)), *a = malloc(sizeof(float) * (size_t)(M * I));
    QAct qx = {NULL, NULL, NULL}, qa = {NULL, NULL, NULL};
    int failed = !h || !a;
    if (!failed && numerics == NUM_A8)
        failed = quantize_act(x, H, M, H, &qx, ISA_AVX512, num_threads) || qact_alloc(M, I, &qa);
    if (failed) {
        free(h), free(a), free(qx.q), free(qx.dx), free(qx.sx);
        free(qa.q), free(qa.dx), free(qa.sx);
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
    }
    free(h), free(a), free(qx.q), free(qx.dx), free(qx.sx);
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
#if defined(__x86_64__) || defined(__i386__)
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

/* ---- entry points -------------------------------------------------------------------------- */

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
#if defined(__x86_64__) || defined(__i386__)
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
#if defined(__x86_64__) || defined(__i386__)
        if (isa != ISA_SCALAR) {
            dequant_avx2(type, row, K, out + i * K);
            continue;
        }
#endif
        for (int64_t g = 0; g < K / 32; g++)
            group_f32_scalar(type, row, g, out + i * K + g * 32);
    }
    return 0;
}
