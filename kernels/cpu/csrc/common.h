/* What every source of the CPU library shares: the ISA target attributes, float16 <-> float32
 * bits (written once, portable), little-endian loads, and the GGML type table (the Python
 * copy, kernels/cpu/ggml_types.py, is tested against it and against the `gguf` package).
 */
#ifndef PAGEDSERVE_COMMON_H
#define PAGEDSERVE_COMMON_H

#include <stdint.h>
#include <string.h>

/* ---- ISA: paths chosen at run time (quant.c's isa_supported), compiled per function ------ */
enum { ISA_AUTO = 0, ISA_SCALAR = 1, ISA_AVX2 = 2, ISA_AVX512 = 3 };

#if defined(__x86_64__) || defined(__i386__)
#define KERNELS_X86 1
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_AVX512 \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
/* helpers inlined into their callers of the same target */
#define INLINE_AVX2 TARGET_AVX2 __attribute__((always_inline)) static inline
#define INLINE_AVX512 TARGET_AVX512 __attribute__((always_inline)) static inline
#else
#define KERNELS_X86 0
#endif

/* internal to the library: shared between its sources, not exported from the .so */
#define HIDDEN __attribute__((visibility("hidden")))

/* ---- float16 bits <-> float32, portable ---------------------------------------------------
 * Exact widening; narrowing rounds to nearest even, overflow to inf, float16 subnormals kept.
 * Where a source's target has F16C or AVX-512 it may use vcvtph2ps / vcvtps2ph instead: the
 * same numbers. */
static inline float half_bits_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t x;
    float f;
    if (e == 0x1f)
        x = sign | 0x7f800000 | (m << 13);
    else if (e)
        x = sign | ((e + 112) << 23) | (m << 13);
    else {
        f = (float)m * 5.9604644775390625e-8f; /* m * 2^-24: exact */
        memcpy(&x, &f, 4);
        x |= sign;
    }
    memcpy(&f, &x, 4);
    return f;
}

static inline uint16_t float_to_half_bits(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) /* inf, NaN (kept quiet) */
        return sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 | ((ax >> 13) & 0x3ff) : 0);
    if (ax >= 0x477ff000) /* 65520 and up round to inf */
        return sign | 0x7c00;
    uint32_t h, rem, half;
    if (ax < 0x38800000) { /* below 2^-14: a float16 subnormal (or zero) */
        if (ax < 0x33000000) /* below 2^-25: rounds to zero */
            return sign;
        const uint32_t mant = (ax & 0x7fffff) | 0x800000, shift = 126 - (ax >> 23);
        h = mant >> shift;
        rem = mant & ((1u << shift) - 1);
        half = 1u << (shift - 1);
    } else {
        const uint32_t r = ax - (112u << 23); /* rebias 127 -> 15 */
        h = r >> 13;
        rem = r & 0x1fff;
        half = 0x1000;
    }
    h += rem > half || (rem == half && (h & 1)); /* a carry moves into the exponent: right */
    return sign | (uint16_t)h;
}

/* 16 bits at any alignment (GGUF blocks are byte-packed) */
static inline uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ---- the GGML type table: name, ggml type id, weights per block, bytes per block ----------
 * (gguf.GGMLQuantizationType and gguf.GGML_QUANT_SIZES; block formats in quant_blocks.h) */
#define GGML_TYPES(X)                                                                          \
    X(Q4_0, 2, 32, 18) X(Q4_1, 3, 32, 20) X(Q5_0, 6, 32, 22) X(Q5_1, 7, 32, 24)                \
    X(Q8_0, 8, 32, 34) X(Q4_K, 12, 256, 144) X(Q5_K, 13, 256, 176) X(Q6_K, 14, 256, 210)

#define GGML_ENUM_(name, id, elems, bytes) T_##name = id,
enum { GGML_TYPES(GGML_ENUM_) };
#undef GGML_ENUM_

#define GGML_ELEMS_(name, id, elems, bytes) case id: return elems;
#define GGML_BYTES_(name, id, elems, bytes) case id: return bytes;
/* weights per block of a ggml type; 0 for a type the library does not know */
static inline int block_elems(int type)
{
    switch (type) { GGML_TYPES(GGML_ELEMS_) default: return 0; }
}

/* bytes per block of a ggml type; 0 for a type the library does not know */
static inline int block_bytes(int type)
{
    switch (type) { GGML_TYPES(GGML_BYTES_) default: return 0; }
}
#undef GGML_ELEMS_
#undef GGML_BYTES_

/* the types whose packed tiles are quant_kpacked.c's (kq_*); quant_packed.c's (quant_*) hold
 * Q4_0, Q4_1 and Q8_0 */
static inline int kq_type(int type)
{
    return type == T_Q5_0 || type == T_Q5_1 || type == T_Q4_K || type == T_Q5_K || type == T_Q6_K;
}

#endif
