/* Internals of the per-row LoRA delta (lora.c) shared with the kernels that add it inside their
 * own OpenMP region (mlp.c, quant_kpacked.c): a call's rows grouped by adapter slot, and the
 * delta as worksharing loops that every thread of the caller's region runs.
 */
#ifndef PAGEDSERVE_LORA_H
#define PAGEDSERVE_LORA_H

#include <stdint.h>

#include "api.h"
#include "common.h"

/* A call's adapted rows grouped by slot (rows with a negative slot are left out). */
typedef struct {
    int64_t count;      /* adapted rows */
    int64_t num_groups; /* distinct slots among them */
    int64_t *rows;      /* [count]: row ids, group by group, ascending within a group */
    int64_t *start;     /* [num_groups + 1]: group g is rows[start[g] .. start[g + 1]) */
    int64_t *slot;      /* [num_groups] */
    float *low;         /* [count, rank]: A x of each grouped row (scratch) */
    int64_t rank;       /* the widest rank the scratch holds */
    int64_t num_blocks; /* blocks of up to LORA_BLOCK rows within one group */
    int64_t *block;     /* [num_blocks]: each block's first index into rows */
    int64_t *block_group; /* [num_blocks]: its group */
} LoraGroups;

#define LORA_BLOCK 16 /* rows per item of the first phase (their x stays in L1 across A rows) */

/* Group M rows by slots[row] < num_slots for products of rank up to `rank`; 0, -1 when an
 * allocation failed, -2 when a slot is num_slots or more. Free with lora_groups_free. */
HIDDEN int lora_group(const int32_t *slots, int64_t M, int64_t num_slots, int64_t rank,
                      LoraGroups *g);
HIDDEN void lora_groups_free(LoraGroups *g);

/* out[row, :N] += Bt[s]^T (A[s] x[row, :K]) for the grouped rows, w->rank <= g->rank.
 * Run by every thread of an enclosing parallel region (two `omp for`, each with its barrier;
 * outside a region it runs on the calling thread). isa: a resolved ISA the CPU has. */
HIDDEN void lora_delta_team(const LoraGroups *g, const LoraWeights *w, const float *x,
                            int64_t xs, int64_t K, float *out, int64_t os, int64_t N, int isa);

/* An MLP's LoRA (NULL, or slots NULL: none) grouped for its two products; 0, -1, -2 as
 * lora_group. *active says whether there is anything to add. */
HIDDEN int lora_mlp_group(const MlpLora *lora, int64_t M, LoraGroups *g, int *active);

#endif
