/* The per-row LoRA delta: out[row] += B[s] (A[s] x[row]) with s the row's adapter slot (rows
 * without one are skipped), float32, strided x and out. The rows are grouped by slot so that
 * each adapter's A and B are read once per call, in two worksharing phases: low = A[s] x over
 * (group, row of A) items, then out += low Bt[s] over (group, 64 output features) items. Every
 * value is one item's, summed in a fixed order: the result does not depend on the threads.
 *
 * B is held transposed (Bt [slots, rank, N]) so that the second phase is broadcast
 * multiply-adds along contiguous features. NOTE: the delta is summed on its own and then
 * added to out, as PEFT does (base + B(A x)): summed into out from the start, the tiny test
 * model's large random deltas moved a logprob 5e-4 from PEFT's. Paths: scalar, AVX2, AVX-512 (common.h's targets),
 * chosen at run time by quant.c's isa_supported or forced by the caller. Entry point for
 * kernels/cpu/lora.py and fused.c; the MLPs add it inside their own region (lora.h).
 */
#include <stdint.h>
#include <stdlib.h>

#include "api.h"
#include "lora.h"
#include "vec_avx2.h"
#include "vec_avx512.h"

#define CHUNK 64 /* output features per item of the second phase */
#define DOTS 4   /* rows per pass over a row of A */
#define ASTEP 8  /* rows of A per item of the first phase */
#define QUAD 4   /* rows per pass over a chunk of Bt */

int lora_group(const int32_t *slots, int64_t M, int64_t num_slots, int64_t rank, LoraGroups *g)
{
    *g = (LoraGroups){.rank = rank};
    int64_t *offset = calloc((size_t)(num_slots > 0 ? num_slots : 1), sizeof(int64_t));
    if (!offset)
        return -1;
    for (int64_t r = 0; r < M; r++) {
        if (slots[r] < 0)
            continue;
        if (slots[r] >= num_slots) {
            free(offset);
            return -2;
        }
        g->num_groups += offset[slots[r]]++ == 0;
        g->count++;
    }
    g->rows = malloc(sizeof(int64_t) * (size_t)(g->count + 1));
    g->start = malloc(sizeof(int64_t) * (size_t)(g->num_groups + 1));
    g->slot = malloc(sizeof(int64_t) * (size_t)(g->num_groups + 1));
    g->low = malloc(sizeof(float) * (size_t)(g->count * rank + 1));
    const int64_t most_blocks = g->count / LORA_BLOCK + g->num_groups + 1;
    g->block = malloc(sizeof(int64_t) * (size_t)most_blocks);
    g->block_group = malloc(sizeof(int64_t) * (size_t)most_blocks);
    if (!g->rows || !g->start || !g->slot || !g->low || !g->block || !g->block_group) {
        free(offset);
        lora_groups_free(g);
        return -1;
    }
    /* counts -> each slot's first position; groups in slot order */
    int64_t pos = 0, k = 0;
    for (int64_t s = 0; s < num_slots; s++) {
        if (!offset[s])
            continue;
        g->slot[k] = s;
        g->start[k++] = pos;
        const int64_t n = offset[s];
        offset[s] = pos;
        pos += n;
    }
    g->start[k] = pos;
    for (int64_t grp = 0; grp < k; grp++)
        for (int64_t i = g->start[grp]; i < g->start[grp + 1]; i += LORA_BLOCK) {
            g->block[g->num_blocks] = i;
            g->block_group[g->num_blocks++] = grp;
        }
    for (int64_t r = 0; r < M; r++)
        if (slots[r] >= 0)
            g->rows[offset[slots[r]]++] = r;
    free(offset);
    return 0;
}

void lora_groups_free(LoraGroups *g)
{
    free(g->rows), free(g->start), free(g->slot), free(g->low), free(g->block);
    free(g->block_group);
    *g = (LoraGroups){0};
}

int lora_mlp_group(const MlpLora *lora, int64_t M, LoraGroups *g, int *active)
{
    *g = (LoraGroups){0};
    *active = 0;
    if (!lora || !lora->slots || (!lora->gate_up.a && !lora->down.a))
        return 0;
    const int64_t gu = lora->gate_up.a ? lora->gate_up.rank : 0;
    const int64_t dn = lora->down.a ? lora->down.rank : 0;
    if (gu < 0 || dn < 0 || (lora->gate_up.a && !lora->gate_up.bt)
        || (lora->down.a && !lora->down.bt))
        return -1;
    const int rc = lora_group(lora->slots, M, lora->num_slots, gu > dn ? gu : dn, g);
    *active = !rc && g->count > 0;
    return rc;
}

/* ---- phase 1: low[i * ldl] = a . x[rows[i]] for n rows ------------------------------------ */
static void low_scalar(const float *a, int64_t K, const float *x, int64_t xs,
                       const int64_t *rows, int64_t n, float *low, int64_t ldl)
{
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + rows[i] * xs;
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++)
            s += a[k] * xr[k];
        low[i * ldl] = s;
    }
}

/* ---- phase 2: o[d][n0:n1] += sum_j t[d][j] bt[j, n0:n1] for m <= QUAD rows d (bt rows N
 * floats apart). NOTE: QUAD rows share each load of bt (one row at a time: half the speed) */
static void add_scalar(const float *bt, int64_t N, const float *const t[], int64_t R,
                       float *const o[], int m, int64_t n0, int64_t n1)
{
    for (int d = 0; d < m; d++)
        for (int64_t n = n0; n < n1; n++) {
            float s = 0.0f;
            for (int64_t j = 0; j < R; j++)
                s += t[d][j] * bt[j * N + n];
            o[d][n] += s;
        }
}

#if KERNELS_X86
INLINE_AVX2 __m256i lanes_below(int64_t left)
{
    const int32_t n = left < 0 ? 0 : left > 8 ? 8 : (int32_t)left;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

TARGET_AVX2 static void low_avx2(const float *a, int64_t K, const float *x, int64_t xs,
                                 const int64_t *rows, int64_t n, float *low, int64_t ldl)
{
    for (int64_t i = 0; i < n; i += DOTS) {
        const int64_t m = n - i < DOTS ? n - i : DOTS;
        const float *xr[DOTS];
        __m256 acc[DOTS];
        for (int d = 0; d < DOTS; d++) {
            xr[d] = x + rows[i + (d < m ? d : 0)] * xs; /* NOTE: spare lanes redo a real row */
            acc[d] = _mm256_setzero_ps();
        }
        for (int64_t k = 0; k < K; k += 8) {
            const __m256i mk = lanes_below(K - k);
            const __m256 av = _mm256_maskload_ps(a + k, mk);
            for (int d = 0; d < DOTS; d++)
                acc[d] = _mm256_fmadd_ps(av, _mm256_maskload_ps(xr[d] + k, mk), acc[d]);
        }
        for (int64_t d = 0; d < m; d++)
            low[(i + d) * ldl] = hsum8(acc[d]);
    }
}

/* two rows at a time, 32 features per pass: 8 accumulators of the 16 registers */
TARGET_AVX2 static void add_avx2(const float *bt, int64_t N, const float *const t[], int64_t R,
                                 float *const o[], int m, int64_t n0, int64_t n1)
{
    for (int d0 = 0; d0 < m; d0 += 2) {
        const int pair = m - d0 >= 2;
        for (int64_t c0 = n0; c0 < n1; c0 += 32) {
            __m256i mk[4];
            __m256 acc[2][4];
            for (int c = 0; c < 4; c++) {
                mk[c] = lanes_below(n1 - c0 - 8 * c);
                acc[0][c] = acc[1][c] = _mm256_setzero_ps();
            }
            for (int64_t j = 0; j < R; j++) {
                const __m256 t0 = _mm256_set1_ps(t[d0][j]);
                const __m256 t1 = _mm256_set1_ps(t[d0 + pair][j]);
                for (int c = 0; c < 4; c++) {
                    const __m256 b = _mm256_maskload_ps(bt + j * N + c0 + 8 * c, mk[c]);
                    acc[0][c] = _mm256_fmadd_ps(t0, b, acc[0][c]);
                    acc[1][c] = _mm256_fmadd_ps(t1, b, acc[1][c]);
                }
            }
            for (int d = 0; d <= pair; d++)
                for (int c = 0; c < 4; c++) {
                    float *dst = o[d0 + d] + c0 + 8 * c;
                    _mm256_maskstore_ps(dst, mk[c], _mm256_add_ps(_mm256_maskload_ps(dst, mk[c]),
                                                                  acc[d][c]));
                }
        }
    }
}

TARGET_AVX512 static void low_avx512(const float *a, int64_t K, const float *x, int64_t xs,
                                     const int64_t *rows, int64_t n, float *low, int64_t ldl)
{
    for (int64_t i = 0; i < n; i += DOTS) {
        const int64_t m = n - i < DOTS ? n - i : DOTS;
        const float *xr[DOTS];
        __m512 acc[DOTS];
        for (int d = 0; d < DOTS; d++) {
            xr[d] = x + rows[i + (d < m ? d : 0)] * xs;
            acc[d] = _mm512_setzero_ps();
        }
        for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 mk = mask_below(K - k);
            const __m512 av = _mm512_maskz_loadu_ps(mk, a + k);
            for (int d = 0; d < DOTS; d++)
                acc[d] = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(mk, xr[d] + k), acc[d]);
        }
        for (int64_t d = 0; d < m; d++)
            low[(i + d) * ldl] = _mm512_reduce_add_ps(acc[d]);
    }
}

/* QUAD rows and CHUNK features: 16 accumulators */
TARGET_AVX512 static void add_avx512(const float *bt, int64_t N, const float *const t[],
                                     int64_t R, float *const o[], int m, int64_t n0,
                                     int64_t n1)
{
    __mmask16 mk[CHUNK / 16];
    __m512 acc[QUAD][CHUNK / 16];
    for (int c = 0; c < CHUNK / 16; c++) {
        mk[c] = mask_below(n1 - n0 - 16 * c);
        for (int d = 0; d < QUAD; d++)
            acc[d][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < R; j++) {
        __m512 b[CHUNK / 16];
        for (int c = 0; c < CHUNK / 16; c++)
            b[c] = _mm512_maskz_loadu_ps(mk[c], bt + j * N + n0 + 16 * c);
        for (int d = 0; d < QUAD; d++) { /* NOTE: rows past m redo row 0, never stored */
            const __m512 tj = _mm512_set1_ps(t[d < m ? d : 0][j]);
            for (int c = 0; c < CHUNK / 16; c++)
                acc[d][c] = _mm512_fmadd_ps(tj, b[c], acc[d][c]);
        }
    }
    for (int d = 0; d < m; d++)
        for (int c = 0; c < CHUNK / 16; c++) {
            float *dst = o[d] + n0 + 16 * c;
            _mm512_mask_storeu_ps(dst, mk[c], _mm512_add_ps(_mm512_maskz_loadu_ps(mk[c], dst),
                                                            acc[d][c]));
        }
}
#endif

static void low_rows(int isa, const float *a, int64_t K, const float *x, int64_t xs,
                     const int64_t *rows, int64_t n, float *low, int64_t ldl)
{
#if KERNELS_X86
    if (isa == ISA_AVX512) {
        low_avx512(a, K, x, xs, rows, n, low, ldl);
        return;
    }
    if (isa == ISA_AVX2) {
        low_avx2(a, K, x, xs, rows, n, low, ldl);
        return;
    }
#endif
    low_scalar(a, K, x, xs, rows, n, low, ldl);
}

static void add_rows(int isa, const float *bt, int64_t N, const float *const t[], int64_t R,
                     float *const o[], int m, int64_t n0, int64_t n1)
{
#if KERNELS_X86
    if (isa == ISA_AVX512) {
        add_avx512(bt, N, t, R, o, m, n0, n1);
        return;
    }
    if (isa == ISA_AVX2) {
        add_avx2(bt, N, t, R, o, m, n0, n1);
        return;
    }
#endif
    add_scalar(bt, N, t, R, o, m, n0, n1);
}

void lora_delta_team(const LoraGroups *g, const LoraWeights *w, const float *x, int64_t xs,
                     int64_t K, float *out, int64_t os, int64_t N, int isa)
{
    const int64_t R = w->rank, G = g->num_groups, chunks = (N + CHUNK - 1) / CHUNK;
    const int64_t steps = (R + ASTEP - 1) / ASTEP;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < g->num_blocks * steps; item++) {
        const int64_t b = item / steps, j0 = item % steps * ASTEP, j1 = j0 + ASTEP < R ? j0 + ASTEP : R;
        const int64_t grp = g->block_group[b], first = g->block[b];
        const int64_t end = g->start[grp + 1], n = end - first < LORA_BLOCK ? end - first : LORA_BLOCK;
        for (int64_t j = j0; j < j1; j++)
            low_rows(isa, w->a + (g->slot[grp] * R + j) * K, K, x, xs, g->rows + first, n,
                     g->low + first * R + j, R);
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < G * chunks; item++) {
        const int64_t grp = item / chunks, n0 = item % chunks * CHUNK;
        const int64_t n1 = n0 + CHUNK < N ? n0 + CHUNK : N;
        const float *bt = w->bt + g->slot[grp] * R * w->ldb;
        for (int64_t i = g->start[grp], end = g->start[grp + 1]; i < end; i += QUAD) {
            const int m = end - i < QUAD ? (int)(end - i) : QUAD;
            const float *t[QUAD];
            float *o[QUAD];
            for (int d = 0; d < m; d++) {
                t[d] = g->low + (i + d) * R;
                o[d] = out + g->rows[i + d] * os;
            }
            add_rows(isa, bt, w->ldb, t, R, o, m, n0, n1);
        }
    }
}

/* out [M, N] (rows os floats apart) += the delta of x [M, K] (rows xs apart) for each row
 * whose slots[row] is 0..num_slots-1 (negative: no adapter); a [num_slots, rank, K]
 * contiguous, bt [num_slots, rank, N] with rows ldb >= N floats apart. isa: ISA_AUTO (the best this CPU has) or one it has.
 * Returns 0, -1 for bad arguments or a failed allocation, -2 for a slot out of range. */
int lora_delta_f32(const float *x, int64_t xs, int64_t M, int64_t K, const int32_t *slots,
                   int64_t num_slots, const float *a, const float *bt, int64_t rank,
                   int64_t ldb, float *out, int64_t os, int64_t N, int isa, int num_threads)
{
    if (isa == ISA_AUTO)
        isa = best_isa();
    if (M < 0 || K < 1 || N < 1 || rank < 1 || num_slots < 1 || num_threads < 1 || !slots
        || ldb < N || !a || !bt || !isa_supported(isa))
        return -1;
    LoraGroups g;
    const int rc = lora_group(slots, M, num_slots, rank, &g);
    if (rc)
        return rc;
    const LoraWeights w = {a, bt, rank, ldb};
    /* NOTE: a region for small products costs more than it saves */
#pragma omp parallel num_threads(num_threads) if (g.count * rank * (K + N) >= 32768)
    lora_delta_team(&g, &w, x, xs, K, out, os, N, isa);
    lora_groups_free(&g);
    return 0;
}
