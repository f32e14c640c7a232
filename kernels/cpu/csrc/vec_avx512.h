/* The AVX-512 helpers the quantized products share, one copy each (as ggml's vec.h): lane masks,
 * e^x and the MLP's activation, the int8 activation quantizer, a packed group's int8 dot, and
 * the register-tile row loop and its stores of quant_packed.c's and quant_kpacked.c's tiles.
 * Each vector function carries common.h's AVX-512 target, so a source compiled without -march
 * includes them.
 */
#ifndef PAGEDSERVE_VEC_AVX512_H
#define PAGEDSERVE_VEC_AVX512_H

#include <stdint.h>
#include <string.h>

#include "common.h"

#if KERNELS_X86
#include <immintrin.h>

/* lanes [0, left) of 16 (none for left <= 0); integer work, so callable from any target */
static inline __mmask16 mask_below(int64_t left)
{
    return left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
}

/* `bytes` from p fetched toward L2: the next packed tile's, while this one is read */
static inline void prefetch_l2(const uint8_t *p, int64_t bytes)
{
    for (int64_t b = 0; b < bytes; b += 64)
        __builtin_prefetch(p + b, 0, 2);
}

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

/* a[r, i0:i1] = act(gate) * up of row r of h [M, 2I] (gate | up); a is [M, I] */
TARGET_AVX512 static inline void act_rows(int act, const float *h, int64_t I, int64_t r,
                                          int64_t i0, int64_t i1, float *a)
{
    for (int64_t i = i0; i < i1; i += 16) {
        const __mmask16 k = mask_below(i1 - i);
        const __m512 g = _mm512_maskz_loadu_ps(k, h + r * 2 * I + i);
        const __m512 u = _mm512_maskz_loadu_ps(k, h + r * 2 * I + I + i);
        _mm512_mask_storeu_ps(a + r * I + i, k, act_mul(act, g, u));
    }
}

/* quant_ref.c's quantize_row with AVX-512: the same numbers (cvtps rounds to nearest even, as
 * nearbyintf does in the default rounding mode; |x| / dx <= 127 needs no clamp beyond the
 * saturating narrowing). With sl and sh (else NULL), also dx sum(q[0:16]) and dx sum(q[16:32])
 * per 32: Q6_K's two scales per group (quant_kpacked.c). */
TARGET_AVX512 static inline void quantize_row_avx512(const float *x, int64_t K, int8_t *q,
                                                     float *dx, float *sx, float *sl, float *sh)
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
        const int lo = _mm512_reduce_add_epi32(ia), hi = _mm512_reduce_add_epi32(ib);
        dx[g] = d;
        sx[g] = d * (float)(lo + hi);
        if (sl) {
            sl[g] = d * (float)lo;
            sh[g] = d * (float)hi;
        }
    }
}

/* The int8 dots of a packed group's 16 features (u[r]: unsigned weights 4r..4r+3 in each
 * lane's dword) with its 32 activations xq: *ia over weights 0-15, *ib over 16-31. */
INLINE_AVX512 void dot_a8(const __m512i u[8], const int8_t *xq, __m512i *ia, __m512i *ib)
{
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (int r = 0; r < 4; r++) {
        int32_t xa, xb;
        memcpy(&xa, xq + 4 * r, 4);
        memcpy(&xb, xq + 16 + 4 * r, 4);
        a = _mm512_dpbusd_epi32(a, u[r], _mm512_set1_epi32(xa));
        b = _mm512_dpbusd_epi32(b, u[r + 4], _mm512_set1_epi32(xb));
    }
    *ia = a, *ib = b;
}

/* Rows r0.. of one packed tile in register tiles of up to MAXRT rows (8 or 4), the rest 3, 2,
 * 1: FN(T, RT, ...) with RT a constant. MAXRT is a constant: where it is 4 the 8-row call is
 * compiled out. */
#define TILE_ROWS(MAXRT, FN, T, ...)                                                          \
    for (int64_t r0 = 0; r0 < M;) {                                                           \
        if ((MAXRT) >= 8 && M - r0 >= 8) { FN(T, 8, __VA_ARGS__); r0 += 8; continue; }        \
        switch (M - r0 >= 4 ? 4 : M - r0) {                                                   \
        case 4: FN(T, 4, __VA_ARGS__); r0 += 4; break;                                        \
        case 3: FN(T, 3, __VA_ARGS__); r0 += 3; break;                                        \
        case 2: FN(T, 2, __VA_ARGS__); r0 += 2; break;                                        \
        default: FN(T, 1, __VA_ARGS__); r0 += 1; break;                                       \
        }                                                                                     \
    }

/* A register tile's a8 sums stored: out row r0 + t (stride os) = acc[t] + macc[t], its valid
 * features. */
INLINE_AVX512 void store_a8(const int RT, const __m512 *acc, const __m512 *macc, int64_t r0,
                            float *out, int64_t os, __mmask16 valid)
{
    for (int t = 0; t < RT; t++)
        _mm512_mask_storeu_ps(out + (r0 + t) * os, valid, _mm512_add_ps(acc[t], macc[t]));
}

/* A register tile's a32 sums stored: out row r0 + t = the sum of its 4 accumulators. */
INLINE_AVX512 void store_a32(const int RT, __m512 acc[][4], int64_t r0, float *out, int64_t os,
                             __mmask16 valid)
{
    for (int t = 0; t < RT; t++)
        _mm512_mask_storeu_ps(out + (r0 + t) * os, valid,
                              _mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]),
                                            _mm512_add_ps(acc[t][2], acc[t][3])));
}
#endif

#endif
