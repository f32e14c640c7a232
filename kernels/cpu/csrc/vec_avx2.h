/* The AVX2 helpers the CPU library's sources share, one copy each (as ggml's vec.h), with
 * common.h's AVX2 target, so a source compiled without -march includes it.
 */
#ifndef PAGEDSERVE_VEC_AVX2_H
#define PAGEDSERVE_VEC_AVX2_H

#include "common.h"

#if KERNELS_X86
#include <immintrin.h>

/* the sum of 8 lanes: halves, then pairs, then the last two */
INLINE_AVX2 float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#endif
