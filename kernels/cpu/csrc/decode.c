/* Paged decode attention for the CPU: reads K/V (float32 or float16) straight through the
 * block table; float32 queries, accumulators and outputs.
 *
 * One task per (sequence, split) walks the split's blocks once per KV head, each head's GQA
 * group of query rows with an online softmax (running max, running sum, rescaled
 * accumulator), so no K/V is gathered or copied. Each sequence's blocks are split every
 * SPLIT_BLOCKS, by its own length alone, and the partial results merged in order
 * (split-KV): its sums never depend on its batch mates or the thread count. A float16 cache is widened to float32 in registers as it is loaded (F16C /
 * AVX-512 `vcvtph2ps`, or common.h's portable bit conversion without them). Called by
 * kernels/attention/cpu_backend.py and by fused.c.
 *
 * Exported: paged_decode_f32 / paged_decode_f16 (same arguments; the caches' element type
 * differs) and write_kv_f32 / write_kv_f16 (float32 rows in; float16 stored saturated at
 * +-65504 and rounded to nearest even, as numpy and torch round).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "api.h"
#include "common.h"

#define MAX_ROWS 4096 /* group x head_dim floats per task, on the stack */
#define MAX_SPLITS 256
#define SPLIT_BLOCKS 16 /* a sequence's keys split every 16 blocks (256 tokens at 16 a block) */

typedef struct {
    const void *k_cache, *v_cache; /* float or uint16_t (float16 bits): the F16 argument */
    const int64_t *table;
    int64_t tok_stride;
    int group, head_dim, block_size, kv_heads;
} Shape;

/* blocks the first head's pass prefetches ahead (attend8 on AVX2, one run each: 2 and 3 took
 * 0.6-0.9x the time of 1, 4 no less than 2; attend16, which took 1 before: the bundled model's
 * batch-1 decode steps no faster or slower, 0.97-1.0x with 2 or 4) */
#define AHEAD 2

/* The first head's pass, at the block holding `start`: the blocks AHEAD ahead, every head
 * (the later heads' passes find them in L2); at the first block, the ones before AHEAD too.
 * Blocks past `last` are not touched (their table entries may not exist). */
static inline __attribute__((always_inline)) void
prefetch_ahead(const Shape *c, int start, int first, int last, int64_t esize)
{
    const int block_size = c->block_size;
    const int64_t bytes = block_size * c->tok_stride * esize;
    for (int ahead = start == first ? 1 : AHEAD; ahead <= AHEAD; ahead++) {
        const int b = start / block_size + ahead;
        if (b * block_size >= last)
            break;
        const char *kn = (const char *)c->k_cache + c->table[b] * bytes;
        const char *vn = (const char *)c->v_cache + c->table[b] * bytes;
        for (int64_t i = 0; i < bytes; i += 64) {
            __builtin_prefetch(kn + i);
            __builtin_prefetch(vn + i);
        }
    }
}

static inline float load1(const void *p, int64_t i, const int F16)
{
    if (!F16)
        return ((const float *)p)[i];
#if defined(__F16C__)
    return _cvtsh_ss(((const uint16_t *)p)[i]);
#else
    return half_bits_to_float(((const uint16_t *)p)[i]);
#endif
}

/* NOTE: KV writes saturate at float16's largest finite value, as the FP8 path clamps: an inf
 * left in a freed block would turn a later request's masked p = 0 into 0 * inf = NaN in the
 * torch backend's gathered attention. */
#define HALF_MAX 65504.0f

static inline float saturate_half(float f)
{
    return f > HALF_MAX ? HALF_MAX : (f < -HALF_MAX ? -HALF_MAX : f);
}

static inline uint16_t to_half(float f)
{
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    return float_to_half_bits(f);
#endif
}

/* Attend one KV head's group of (pre-scaled) query rows over tokens [first, last):
 * acc gets sum p * v, m the running max and l the sum of p per row (not yet divided). */
static inline __attribute__((always_inline)) void
attend(const Shape *c, int h, const float *qs, int first, int last, float *acc, float *m,
       float *l, const int F16)
{
    const int group = c->group, head_dim = c->head_dim, block_size = c->block_size;
    const int64_t tok_stride = c->tok_stride;
    const int kv_heads = c->kv_heads;
    const void *k_cache = c->k_cache, *v_cache = c->v_cache;
    const int64_t *table = c->table;
    float p[64 * 64];
    for (int i = 0; i < group * head_dim; i++)
        acc[i] = 0.0f;
    for (int g = 0; g < group; g++) {
        m[g] = -1e30f; /* not -inf: finite math below */
        l[g] = 0.0f;
    }
    for (int start = first, n; start < last; start += n) {
        /* NOTE: `first` may sit mid-block (a sliding window's start) */
        const int off = start % block_size;
        n = last - start < block_size - off ? last - start : block_size - off;
        const int64_t base = (table[start / block_size] * block_size
                              * kv_heads + h) * head_dim + off * tok_stride;
        /* scores: each K row is loaded once for the whole group */
        for (int t = 0; t < n; t++) {
            const int64_t kt = base + t * tok_stride;
            for (int g = 0; g < group; g++) {
                const float *qg = qs + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; d++)
                    dot += qg[d] * load1(k_cache, kt + d, F16);
                p[g * block_size + t] = dot;
            }
        }
        for (int g = 0; g < group; g++) {
            float *pg = p + g * block_size;
            float mx = m[g];
            for (int t = 0; t < n; t++)
                mx = pg[t] > mx ? pg[t] : mx;
            const float corr = expf(m[g] - mx); /* 0 on the first block */
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < n; t++) {
                pg[t] = expf(pg[t] - mx);
                sum += pg[t];
            }
            m[g] = mx;
            l[g] = l[g] * corr + sum;
            float *ag = acc + g * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++)
                ag[d] *= corr;
        }
        /* values: each V row is loaded once for the whole group */
        for (int t = 0; t < n; t++) {
            const int64_t vt = base + t * tok_stride;
            for (int g = 0; g < group; g++) {
                const float w = p[g * block_size + t];
                float *ag = acc + g * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++)
                    ag[d] += w * load1(v_cache, vt + d, F16);
            }
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define ATTEND8 1 /* AVX2 without AVX-512: 8-lane vectors (attend8) */
#else
#define ATTEND8 0 /* 16-lane vectors (attend16): registers with AVX-512, lowered elsewhere */
#endif

#if ATTEND8
/* The vectorized attend for AVX2 (16 ymm registers): 8 tokens a chunk, their scores folded
 * into one 8-lane vector; each loop keeps at most 8 accumulators in registers and reads its
 * other operand from L1 (the chunk's keys and values widened once, the group's accumulators
 * in memory between chunks), and the first head's pass prefetches AHEAD blocks ahead.
 * NOTE: attend16 lowered to 256-bit halves spilled its 16-lane state (3 group rows of 64:
 * 48 ymm) and shuffled across them; on a 2-core AVX2 EPYC, 9/3 heads of 64, 2 threads,
 * `python -m bench.attention --backends cpu`: 2.5-3.7x the time of SDPA over a contiguous
 * cache that way, 0.96-1.19x this way (float16 cache 2.3-2.6x faster). */
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4))); /* unaligned loads */

#define FOLD8(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))

/* 8 cache elements from index i, as float32 */
static inline __attribute__((always_inline)) v8 load8(const void *p, int64_t i, const int F16)
{
    if (!F16)
        return *(const v8u *)((const float *)p + i);
    const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    v8 r;
    memcpy(&r, &w, 32);
    return r;
}

/* lane i of the result = the sum of x[i]'s 8 lanes */
static inline __attribute__((always_inline)) v8 hsum8(const v8 *x)
{
    v8 c[4], d[2];
    for (int i = 0; i < 4; i++) /* [x2i's 4 partial sums, x2i+1's] */
        c[i] = FOLD8(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + FOLD8(x[2 * i], x[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* [x4i x4i, x4i+1 x4i+1, x4i+2 x4i+2, x4i+3 x4i+3] */
        d[i] = FOLD8(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + FOLD8(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return FOLD8(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14)
         + FOLD8(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

static inline __attribute__((always_inline)) void
attend8(const Shape *c, int h, const float *qs, int first, int last, float *acc, float *m,
        float *l, const int G, const int HD, const int F16)
{
    const int64_t esize = F16 ? 2 : 4;
    const int block_size = c->block_size, kv_heads = c->kv_heads;
    const int64_t tok_stride = c->tok_stride;
    for (int g = 0; g < G; g++) {
        m[g] = -1e30f; /* not -inf: finite math below */
        l[g] = 0.0f;
    }
    for (int i = 0; i < G * HD; i++)
        acc[i] = 0.0f;
    for (int start = first, n; start < last; start += n) {
        const int off = start % block_size; /* a sliding window may start mid-block */
        n = last - start < block_size - off ? last - start : block_size - off;
        const int64_t base = (c->table[start / block_size] * block_size * kv_heads + h) * HD
                             + off * tok_stride;
        if (h == 0)
            prefetch_ahead(c, start, first, last, esize);
        for (int t0 = 0; t0 < n; t0 += 8) {
            const int nt = n - t0 < 8 ? n - t0 : 8;
            const int64_t kb = base + t0 * tok_stride; /* element index of token t0 */
            v8 kv[8][HD / 8]; /* the chunk's keys, then its values, as float32; 0 past nt */
            for (int t = 0; t < 8; t++)
                for (int j = 0; j < HD / 8; j++)
                    kv[t][j] = t < nt ? load8(c->k_cache, kb + t * tok_stride + 8 * j, F16)
                                      : (v8){0};
            float p[G][8], corr[G];
            for (int g = 0; g < G; g++) {
                v8 part[8] = {{0}};
                for (int j = 0; j < HD / 8; j++) {
                    const v8 qj = *(const v8u *)(qs + g * HD + 8 * j);
                    for (int t = 0; t < 8; t++)
                        part[t] += qj * kv[t][j];
                }
                const v8 sc = hsum8(part);
                float mx = m[g];
                for (int t = 0; t < nt; t++)
                    mx = sc[t] > mx ? sc[t] : mx;
                corr[g] = expf(m[g] - mx); /* 0 on the first chunk */
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int t = 0; t < 8; t++) {
                    p[g][t] = t < nt ? expf(sc[t] - mx) : 0.0f;
                    sum += p[g][t];
                }
                m[g] = mx;
                l[g] = l[g] * corr[g] + sum;
            }
            for (int t = 0; t < nt; t++)
                for (int j = 0; j < HD / 8; j++)
                    kv[t][j] = load8(c->v_cache, kb + t * tok_stride + 8 * j, F16);
            for (int j = 0; j < HD / 8; j++) {
                v8 a[G];
                for (int g = 0; g < G; g++)
                    a[g] = *(v8u *)(acc + g * HD + 8 * j) * corr[g];
                for (int t = 0; t < nt; t++)
                    for (int g = 0; g < G; g++)
                        a[g] += p[g][t] * kv[t][j];
                for (int g = 0; g < G; g++)
                    *(v8u *)(acc + g * HD + 8 * j) = a[g];
            }
        }
    }
}
#define ATTEND_VECTOR attend8
#else
/* The vectorized attend for the common shapes: head_dim a multiple of 16 floats, G query rows
 * per KV head. Scores of 16 tokens at a time fill one 16-lane vector (16 per-token product
 * vectors folded by a transposing reduction: no horizontal sum per token), and the group's
 * accumulators stay in registers. G and HD are constants at each call site below. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* unaligned loads */

#define LOAD(ptr) (*(const v16u *)(ptr))
#define FOLD(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))

/* 16 cache elements from index i, as float32 */
static inline __attribute__((always_inline)) v16 load16(const void *p, int64_t i, const int F16)
{
    if (!F16)
        return LOAD((const float *)p + i);
    const uint16_t *h = (const uint16_t *)p + i;
#if defined(__AVX512F__)
    return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
#elif defined(__F16C__)
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
    const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8)));
    v16 r;
    memcpy(&r, &lo, 32);
    memcpy((char *)&r + 32, &hi, 32);
    return r;
#else
    float f[16];
    for (int j = 0; j < 16; j++)
        f[j] = half_bits_to_float(h[j]);
    return LOAD(f);
#endif
}

/* lane i of the result = the sum of x[i]'s 16 lanes */
static inline v16 hsum16(const v16 *x)
{
    v16 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = FOLD(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + FOLD(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        d[i] = FOLD(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + FOLD(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        e[i] = FOLD(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + FOLD(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return FOLD(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + FOLD(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline __attribute__((always_inline)) void
attend16(const Shape *c, int h, const float *qs, int first, int last, float *acc_out,
         float *m, float *l, const int G, const int HD, const int F16)
{
    const int64_t esize = F16 ? 2 : 4;
    const int block_size = c->block_size, kv_heads = c->kv_heads;
    const int64_t tok_stride = c->tok_stride;
    v16 acc[G][HD / 16], q[G][HD / 16];
    for (int g = 0; g < G; g++) {
        m[g] = -1e30f; /* not -inf: finite math below */
        l[g] = 0.0f;
        for (int j = 0; j < HD / 16; j++) {
            acc[g][j] = (v16){0};
            q[g][j] = LOAD(qs + g * HD + 16 * j);
        }
    }
    for (int start = first, n; start < last; start += n) {
        const int off = start % block_size; /* a sliding window may start mid-block */
        n = last - start < block_size - off ? last - start : block_size - off;
        const int64_t base = (c->table[start / block_size] * block_size * kv_heads + h) * HD
                             + off * tok_stride;
        if (h == 0)
            prefetch_ahead(c, start, first, last, esize);
        for (int t0 = 0; t0 < n; t0 += 16) {
            const int nt = n - t0 < 16 ? n - t0 : 16;
            const int64_t kb = base + t0 * tok_stride; /* element index of token t0 */
            float p[G][16];
            /* NOTE: a float16 chunk's keys widened once for the whole group (a widening is
             * two uops: widened per query row, they were the largest part of the work) */
            v16 kf[F16 ? 16 : 1][HD / 16];
            if (F16)
                for (int t = 0; t < nt; t++)
                    for (int j = 0; j < HD / 16; j++)
                        kf[t][j] = load16(c->k_cache, kb + t * tok_stride + 16 * j, F16);
            for (int g = 0; g < G; g++) {
                v16 part[16];
                for (int t = 0; t < 16; t++) {
                    v16 s = {0};
                    if (t < nt)
                        for (int j = 0; j < HD / 16; j++)
                            s += q[g][j] * (F16 ? kf[t][j] : load16(c->k_cache,
                                                                    kb + t * tok_stride + 16 * j, 0));
                    part[t] = s;
                }
                v16 sc = hsum16(part);
                float mx = m[g];
                for (int t = 0; t < nt; t++)
                    mx = sc[t] > mx ? sc[t] : mx;
                const float corr = expf(m[g] - mx); /* 0 on the first chunk */
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int t = 0; t < 16; t++) {
                    p[g][t] = t < nt ? expf(sc[t] - mx) : 0.0f;
                    sum += p[g][t];
                }
                m[g] = mx;
                l[g] = l[g] * corr + sum;
                for (int j = 0; j < HD / 16; j++)
                    acc[g][j] *= corr;
            }
            for (int t = 0; t < nt; t++)
                for (int j = 0; j < HD / 16; j++) {
                    const v16 v = load16(c->v_cache, kb + t * tok_stride + 16 * j, F16);
                    for (int g = 0; g < G; g++)
                        acc[g][j] += p[g][t] * v;
                }
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < HD / 16; j++)
            for (int i = 0; i < 16; i++)
                acc_out[g * HD + 16 * j + i] = acc[g][j][i];
}
#define ATTEND_VECTOR attend16
#endif

/* head_dim 256: Gemma 2 and 3 (4 query heads per KV head at 270M and 1B, 2 from 4B) */
#define CASES_256 CASE(1, 256) CASE(2, 256) CASE(4, 256)
#define CASES                                                                                 \
    CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64) CASE(8, 64) \
    CASE(1, 128) CASE(2, 128) CASE(3, 128) CASE(4, 128) CASE(5, 128) CASE(6, 128) CASE(7, 128)  \
    CASE(8, 128) CASES_256
#define CASE(G, HD)                                                    \
    if (c->group == G && c->head_dim == HD) {                          \
        ATTEND_VECTOR(c, h, qs, first, last, acc, m, l, G, HD, F16);   \
        return;                                                        \
    }

static void attend_f32(const Shape *c, int h, const float *qs, int first, int last, float *acc,
                       float *m, float *l)
{
    enum { F16 = 0 };
    CASES
    attend(c, h, qs, first, last, acc, m, l, F16);
}

static void attend_f16(const Shape *c, int h, const float *qs, int first, int last, float *acc,
                       float *m, float *l)
{
    enum { F16 = 1 };
    CASES
    attend(c, h, qs, first, last, acc, m, l, F16);
}
#undef CASE
#undef CASES
#undef CASES_256

/* the vector attend of this build (ATTEND_VECTOR: attend8 on AVX2, attend16 on AVX-512) where the
 * shape has an instance, else the scalar attend */
static void attend_any(const Shape *c, int h, const float *qs, int first, int last, float *acc,
                       float *m, float *l, int f16)
{
    (f16 ? attend_f16 : attend_f32)(c, h, qs, first, last, acc, m, l);
}

/* The blocks a sequence of `len` keys attends (its window's, where it has one): [b0, b0+nb) */
static void seq_blocks(int len, int window, int block_size, int *lo, int *b0, int *nb)
{
    *lo = window > 0 && len > window ? len - window : 0;
    *b0 = *lo / block_size;
    *nb = (len + block_size - 1) / block_size - *b0;
}

/* How many blocks each split of a sequence of `nb` blocks takes: SPLIT_BLOCKS, more only where
 * MAX_SPLITS would be passed. NOTE: a function of the sequence alone, never of its batch or
 * the thread count, so that a request's attention sums its keys in one order whatever runs
 * beside it (batch invariance: a8's int8 rounding turned the last-bit differences of a
 * batch-size-dependent split into logit differences of 0.3-0.6 on the bundled model). */
static int split_blocks(int nb)
{
    const int per = (nb + MAX_SPLITS - 1) / MAX_SPLITS;
    return per > SPLIT_BLOCKS ? per : SPLIT_BLOCKS;
}

/* One (sequence, KV head)'s split partials (parts: acc [rows], m, l [group] per split) merged
 * in split order into its group's outputs oh [group, head_dim]. */
static void merge_splits(const float *pp, int splits, int64_t part, int group, int head_dim,
                         float *oh)
{
    const int64_t rows = (int64_t)group * head_dim;
    for (int g = 0; g < group; g++) {
        float mx = -1e30f;
        for (int j = 0; j < splits; j++)
            mx = pp[j * part + rows + g] > mx ? pp[j * part + rows + g] : mx;
        float w[MAX_SPLITS], sum = 0.0f;
        for (int j = 0; j < splits; j++) {
            w[j] = expf(pp[j * part + rows + g] - mx);
            sum += w[j] * pp[j * part + rows + group + g];
        }
        for (int d = 0; d < head_dim; d++) {
            float o = 0.0f;
            for (int j = 0; j < splits; j++)
                o += w[j] * pp[j * part + g * head_dim + d];
            oh[g * head_dim + d] = o / sum;
        }
    }
}

static void paged_decode(
    const float *q, int64_t q_stride,      /* [num_seqs, heads, head_dim]; token stride */
    const void *k_cache, const void *v_cache, /* [blocks, block_size, kv_heads, head_dim] */
    const int64_t *tables, int64_t table_stride, /* [num_seqs, max_blocks] */
    const int32_t *seq_lens,                /* [num_seqs] */
    float *out, int64_t out_stride,         /* [num_seqs, heads, head_dim]; token stride */
    int num_seqs, int heads, int kv_heads, int head_dim, int block_size, float scale,
    int window,                             /* > 0: attend the last `window` keys only */
    int num_threads, int f16)               /* f16: the caches hold float16 bits */
{
    const int group = heads / kv_heads;
    const int rows = group * head_dim;
    /* tasks: each sequence's splits in order; first[s]: its first task, and its partials' */
    int *first = malloc(sizeof(int) * (num_seqs + 1));
    if (!first)
        abort();
    first[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        int lo, b0, nb;
        seq_blocks(seq_lens[s], window, block_size, &lo, &b0, &nb);
        const int per = split_blocks(nb);
        first[s + 1] = first[s] + (nb > per ? (nb + per - 1) / per : 1);
    }
    const int tasks = first[num_seqs];
    int *task_seq = malloc(sizeof(int) * (tasks > 0 ? tasks : 1));
    /* per (task, head) of a split sequence: acc [rows], then m and l [group] each */
    const int64_t part = rows + 2 * group;
    float *parts = tasks > num_seqs ? malloc(sizeof(float) * tasks * kv_heads * part) : 0;
    if (!task_seq || (tasks > num_seqs && !parts))
        abort();
    for (int s = 0; s < num_seqs; s++)
        for (int t = first[s]; t < first[s + 1]; t++)
            task_seq[t] = s;
    /* NOTE: one task walks all KV heads of its blocks, head after head: the first head's
     * pass brings the blocks into L2 for the others (a task per head read each block's
     * interleaved heads from DRAM in several places at once: 30 layers of 32 x 192-token
     * decodes took 22.5 ms that way, 17.1 ms this way). */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int t = 0; t < tasks; t++) {
        const int s = task_seq[t], j = t - first[s], splits = first[s + 1] - first[s];
        const int len = seq_lens[s];
        int lo, b0, nb;
        seq_blocks(len, window, block_size, &lo, &b0, &nb);
        const int per = split_blocks(nb);
        const int start = (b0 + j * per) * block_size;
        const int from = start > lo ? start : lo;
        const int end = (b0 + (j + 1) * per) * block_size;
        const int to = end < len ? end : len;
        Shape c = {k_cache, v_cache, tables + s * table_stride,
                   (int64_t)kv_heads * head_dim, group, head_dim, block_size, kv_heads};
        for (int h = 0; h < kv_heads; h++) {
            float qs[MAX_ROWS], acc[MAX_ROWS], m[64], l[64];
            const float *qh = q + s * q_stride + (int64_t)h * rows;
            for (int i = 0; i < rows; i++)
                qs[i] = qh[i] * scale;
            if (splits == 1) {
                float *oh = out + s * out_stride + (int64_t)h * rows;
                attend_any(&c, h, qs, lo, len, acc, m, l, f16);
                for (int g = 0; g < group; g++)
                    for (int d = 0; d < head_dim; d++)
                        oh[g * head_dim + d] = acc[g * head_dim + d] / l[g];
                continue;
            }
            float *pp = parts + ((int64_t)first[s] * kv_heads + (int64_t)h * splits + j) * part;
            attend_any(&c, h, qs, from, to, pp, pp + rows, pp + rows + group, f16);
        }
    }
    if (parts) {
#pragma omp parallel for collapse(2) num_threads(num_threads)
        for (int s = 0; s < num_seqs; s++) {
            for (int h = 0; h < kv_heads; h++) {
                const int splits = first[s + 1] - first[s];
                if (splits > 1)
                    merge_splits(parts + ((int64_t)first[s] * kv_heads + (int64_t)h * splits)
                                 * part, splits, part, group, head_dim,
                                 out + s * out_stride + (int64_t)h * rows);
            }
        }
    }
    free(parts);
    free(task_seq);
    free(first);
}

/* Decode attention over a float32 cache. */
void paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache,
                      const float *v_cache, const int64_t *tables, int64_t table_stride,
                      const int32_t *seq_lens, float *out, int64_t out_stride, int num_seqs,
                      int heads, int kv_heads, int head_dim, int block_size, float scale,
                      int window, int num_threads)
{
    paged_decode(q, q_stride, k_cache, v_cache, tables, table_stride, seq_lens, out,
                 out_stride, num_seqs, heads, kv_heads, head_dim, block_size, scale, window,
                 num_threads, 0);
}

/* The same over a float16 cache (uint16_t bits); q and out stay float32. */
void paged_decode_f16(const float *q, int64_t q_stride, const uint16_t *k_cache,
                      const uint16_t *v_cache, const int64_t *tables, int64_t table_stride,
                      const int32_t *seq_lens, float *out, int64_t out_stride, int num_seqs,
                      int heads, int kv_heads, int head_dim, int block_size, float scale,
                      int window, int num_threads)
{
    paged_decode(q, q_stride, k_cache, v_cache, tables, table_stride, seq_lens, out,
                 out_stride, num_seqs, heads, kv_heads, head_dim, block_size, scale, window,
                 num_threads, 1);
}

/* The new tokens' K and V rows into their cache slots (slot -1: padding, skipped). key, value:
 * [num_tokens, width] rows `*_stride` floats apart; caches: num_slots slots of width floats.
 * Returns the number of slots out of range (not written). */
int64_t write_kv_f32(const float *key, int64_t key_stride, const float *value,
                     int64_t value_stride, float *k_cache, float *v_cache, int64_t num_slots,
                     const int64_t *slots, int64_t num_tokens, int64_t width)
{
    int64_t bad = 0;
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0)
            continue;
        if (slot >= num_slots) {
            bad++;
            continue;
        }
        for (int64_t j = 0; j < width; j++) {
            k_cache[slot * width + j] = key[i * key_stride + j];
            v_cache[slot * width + j] = value[i * value_stride + j];
        }
    }
    return bad;
}

/* write_kv_f32 into float16 caches (uint16_t bits), each value rounded to nearest even. */
int64_t write_kv_f16(const float *key, int64_t key_stride, const float *value,
                     int64_t value_stride, uint16_t *k_cache, uint16_t *v_cache,
                     int64_t num_slots, const int64_t *slots, int64_t num_tokens, int64_t width)
{
    int64_t bad = 0;
    for (int64_t i = 0; i < num_tokens; i++) {
        const int64_t slot = slots[i];
        if (slot < 0)
            continue;
        if (slot >= num_slots) {
            bad++;
            continue;
        }
        const float *k = key + i * key_stride, *v = value + i * value_stride;
        uint16_t *kd = k_cache + slot * width, *vd = v_cache + slot * width;
        int64_t j = 0;
#if defined(__AVX512F__)
        const __m512 hi = _mm512_set1_ps(HALF_MAX), lo = _mm512_set1_ps(-HALF_MAX);
        for (; j + 16 <= width; j += 16) {
            const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m512 kj = _mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_loadu_ps(k + j)));
            const __m512 vj = _mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_loadu_ps(v + j)));
            _mm256_storeu_si256((__m256i *)(kd + j), _mm512_cvtps_ph(kj, mode));
            _mm256_storeu_si256((__m256i *)(vd + j), _mm512_cvtps_ph(vj, mode));
        }
#endif
        for (; j < width; j++) {
            kd[j] = to_half(saturate_half(k[j]));
            vd[j] = to_half(saturate_half(v[j]));
        }
    }
    return bad;
}

/* common.h's portable conversions, exported for tests (a build without F16C uses them). */
void half_bits_to_float_n(const uint16_t *src, float *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = half_bits_to_float(src[i]);
}

void float_to_half_bits_n(const float *src, uint16_t *dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = float_to_half_bits(src[i]);
}
