/* Paged decode attention for the CPU, float32: reads K/V straight through the block table.
 *
 * One task per (sequence, KV head, split): the task's GQA group of query rows walks its share
 * of the sequence's blocks with an online softmax (running max, running sum, rescaled
 * accumulator), so no K/V is gathered or copied. When sequences x KV heads are too few to
 * give every thread two tasks, each sequence's blocks are split and the partial results merged
 * (split-KV). Built and loaded at run time by kernels/cpu_backend.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_ROWS 4096 /* group x head_dim floats per task, on the stack */
#define MAX_SPLITS 256
#define MIN_SPLIT_BLOCKS 32

typedef struct {
    const float *k_cache, *v_cache;
    const int64_t *table;
    int64_t tok_stride;
    int group, head_dim, block_size, kv_heads;
} Shape;

/* Attend one KV head's group of (pre-scaled) query rows over tokens [first, last):
 * acc gets sum p * v, m the running max and l the sum of p per row (not yet divided). */
static void attend(const Shape *c, int h, const float *qs, int first, int last,
                   float *acc, float *m, float *l)
{
    const int group = c->group, head_dim = c->head_dim, block_size = c->block_size;
    const int64_t tok_stride = c->tok_stride;
    const int kv_heads = c->kv_heads;
    const float *k_cache = c->k_cache, *v_cache = c->v_cache;
    const int64_t *table = c->table;
    float p[64 * 64];
    for (int i = 0; i < group * head_dim; i++)
        acc[i] = 0.0f;
    for (int g = 0; g < group; g++) {
        m[g] = -1e30f; /* not -inf: finite math below */
        l[g] = 0.0f;
    }
    for (int start = first; start < last; start += block_size) {
        const int n = last - start < block_size ? last - start : block_size;
        const int64_t base = (table[start / block_size] * block_size
                              * kv_heads + h) * head_dim;
        const float *kb = k_cache + base, *vb = v_cache + base;
        /* scores: each K row is loaded once for the whole group */
        for (int t = 0; t < n; t++) {
            const float *kt = kb + t * tok_stride;
            for (int g = 0; g < group; g++) {
                const float *qg = qs + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; d++)
                    dot += qg[d] * kt[d];
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
            const float *vt = vb + t * tok_stride;
            for (int g = 0; g < group; g++) {
                const float w = p[g * block_size + t];
                float *ag = acc + g * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; d++)
                    ag[d] += w * vt[d];
            }
        }
    }
}

void paged_decode_f32(
    const float *q, int64_t q_stride,      /* [num_seqs, heads, head_dim]; token stride */
    const float *k_cache, const float *v_cache, /* [blocks, block_size, kv_heads, head_dim] */
    const int64_t *tables, int64_t table_stride, /* [num_seqs, max_blocks] */
    const int32_t *seq_lens,                /* [num_seqs] */
    float *out, int64_t out_stride,         /* [num_seqs, heads, head_dim]; token stride */
    int num_seqs, int heads, int kv_heads, int head_dim, int block_size, float scale,
    int num_threads)
{
    const int group = heads / kv_heads;
    const int rows = group * head_dim;
    int max_blocks = 1;
    for (int s = 0; s < num_seqs; s++) {
        const int nb = (seq_lens[s] + block_size - 1) / block_size;
        max_blocks = nb > max_blocks ? nb : max_blocks;
    }
    int splits = (2 * num_threads + num_seqs * kv_heads - 1) / (num_seqs * kv_heads);
    /* NOTE: a split must be worth its merge and second parallel region: 32+ blocks each */
    splits = splits < max_blocks / MIN_SPLIT_BLOCKS ? splits : max_blocks / MIN_SPLIT_BLOCKS;
    splits = splits > 1 ? splits : 1;
    splits = splits < MAX_SPLITS ? splits : MAX_SPLITS;
    /* per (seq, head, split): acc [rows], then m and l [group] each */
    const int64_t part = rows + 2 * group;
    float *parts = splits > 1 ? malloc(sizeof(float) * num_seqs * kv_heads * splits * part) : 0;
    if (splits > 1 && !parts)
        splits = 1;
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        for (int h = 0; h < kv_heads; h++) {
            for (int j = 0; j < splits; j++) {
                const int len = seq_lens[s];
                const int nb = (len + block_size - 1) / block_size;
                const int per = (nb + splits - 1) / splits;
                const int first = j * per * block_size;
                const int end = (j + 1) * per * block_size;
                const int last = end < len ? end : len;
                Shape c = {k_cache, v_cache, tables + s * table_stride,
                           (int64_t)kv_heads * head_dim, group, head_dim, block_size, kv_heads};
                float qs[MAX_ROWS], acc[MAX_ROWS], m[64], l[64];
                const float *qh = q + s * q_stride + (int64_t)h * rows;
                for (int i = 0; i < rows; i++)
                    qs[i] = qh[i] * scale;
                float *oh = out + s * out_stride + (int64_t)h * rows;
                if (splits == 1) {
                    attend(&c, h, qs, 0, len, acc, m, l);
                    for (int g = 0; g < group; g++)
                        for (int d = 0; d < head_dim; d++)
                            oh[g * head_dim + d] = acc[g * head_dim + d] / l[g];
                    continue;
                }
                float *pp = parts + ((int64_t)(s * kv_heads + h) * splits + j) * part;
                if (first >= last) { /* a short sequence: this split has no blocks */
                    for (int g = 0; g < group; g++) {
                        pp[rows + g] = -1e30f;
                        pp[rows + group + g] = 0.0f;
                    }
                    for (int i = 0; i < rows; i++)
                        pp[i] = 0.0f;
                    continue;
                }
                attend(&c, h, qs, first, last, pp, pp + rows, pp + rows + group);
            }
        }
    }
    if (splits == 1)
        return;
#pragma omp parallel for collapse(2) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        for (int h = 0; h < kv_heads; h++) {
            const float *pp = parts + (int64_t)(s * kv_heads + h) * splits * part;
            float *oh = out + s * out_stride + (int64_t)h * rows;
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
    }
    free(parts);
}
