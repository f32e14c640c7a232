/* The scalar reference of the quantized products: every type's groups decoded one weight at a
 * time, the A8 activations' rounding, and the row loop both numerics use where no SIMD path
 * runs (or a caller forces ISA_SCALAR). The SIMD paths are tested against this one.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

/* Scales of group g of a row (quant_blocks.h's Scales) and its integers, read from the raw
 * block. */
static inline Scales group_scales(int type, const uint8_t *row, int64_t g)
{
    Scales s;
    if (type == T_Q4_K || type == T_Q5_K || type == T_Q6_K) {
        const uint8_t *blk = row + (g >> 3) * block_bytes(type);
        const int j = (int)(g & 7);
        if (type == T_Q6_K) {
            const float d = half_bits_to_float(rd16(blk + 208));
            const int8_t *sc = (const int8_t *)(blk + 192);
            s.a0 = d * sc[2 * j];
            s.a1 = d * sc[2 * j + 1];
            s.b = 0.0f;
        } else {
            int sc, m;
            k_scale_min(blk + 4, j, &sc, &m);
            s.a0 = s.a1 = half_bits_to_float(rd16(blk)) * (float)sc;
            s.b = -half_bits_to_float(rd16(blk + 2)) * (float)m;
        }
        return s;
    }
    const uint8_t *blk = row + g * block_bytes(type);
    const float d = half_bits_to_float(rd16(blk));
    s.a0 = s.a1 = d;
    switch (type) {
    case T_Q4_0: s.b = -8.0f * d; break;
    case T_Q5_0: s.b = -16.0f * d; break;
    case T_Q4_1: case T_Q5_1: s.b = half_bits_to_float(rd16(blk + 2)); break;
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

void quantize_row(const float *x, int64_t K, int8_t *q, float *dx, float *sx)
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

void rows_scalar(int type, int numerics, const uint8_t *w, int64_t row_bytes, int64_t n0,
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

/* out[0, K): the float32 weights of one row */
void dequant_scalar(int type, const uint8_t *row, int64_t K, float *out)
{
    for (int64_t g = 0; g < K / 32; g++)
        group_f32_scalar(type, row, g, out + g * 32);
}
