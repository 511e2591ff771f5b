/* Activations quantized to int8 for the integer dot products of the int8 and int4 kernels (quant.h). */
#include "quant.h"

/* Each row of x in blocks of `block` columns (block divides K): xq = round(x / s) + offset with round(...) in
 * [-127, 127], s = max(max |x| over the block, 1e-12) / 127 per block (rounding half to even, as torch does). A
 * block holding a NaN or an infinity gets s = NaN (and xq 0), so that its products come out NaN as torch's do:
 * vmax and fmaxf would drop the NaN. */
static void quantize_blocks(const void *x, int bf16, int64_t M, int64_t K, int64_t block, int offset, int8_t *xq,
                            float *s) {
    float r[block];
    for (int64_t b = 0; b < M * K / block; b++) {
        int8_t *q = xq + b * block;
        vfloat m = vset1(0.f), finite = vset1(0.f); /* finite: sums of v - v, NaN once a v is not finite */
        int64_t k = 0;
        for (; k + LANES <= block; k += LANES) {
            vfloat v = vload(x, bf16, b * block + k);
            vstore(r + k, v);
            m = vmax(m, vabs(v));
            finite = vadd(finite, vsub(v, v));
        }
        float amax = fmaxf(1e-12f, vmax_reduce(m)), check = vreduce_add(finite);
        for (; k < block; k++) {
            r[k] = load_act(x, bf16, b * block + k);
            amax = fmaxf(amax, fabsf(r[k]));
            check += r[k] - r[k];
        }
        if (check != 0.f) {
            memset(q, 0, block);
            s[b] = NAN;
            continue;
        }
        float sb = amax / 127.f;
        vfloat sv = vset1(sb);
        for (k = 0; k + LANES <= block; k += LANES) vquantize(vload(r, 0, k), sv, offset, q + k);
        for (; k < block; k++) q[k] = (int8_t)(uint8_t)((int)nearbyintf(r[k] / sb) + offset);
        s[b] = sb;
    }
}

/* x's rows for the int4 kernels: quantized per XBLOCK columns (xq, scales xs), and per group of G columns the
 * corrections (8 * (sum of x - sum of quantized x), sum of x) that int4.c's formula takes. */
static void int4_prepare(const void *x, int bf16, int64_t M, int64_t K, int64_t G, int8_t *xq, float *xs, float *corr) {
    int64_t groups = K / G, chunks = K / XBLOCK;
    quantize_blocks(x, bf16, M, K, XBLOCK, 0, xq, xs);
    int64_t span = G < XBLOCK ? G : XBLOCK; /* a group's columns under one scale of x */
    for (int64_t m = 0; m < M; m++) {
        const int8_t *q = xq + m * K;
        for (int64_t g = 0; g < groups; g++) { /* vector sums of x; integer sums of q times each block's scale */
            vfloat sum = vzero();
            float rounded = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k += LANES) sum = vadd(sum, vload(x, bf16, m * K + k));
            for (int64_t b = g * G; b < (g + 1) * G; b += span) {
                int32_t qsum = 0;
                for (int64_t k = b; k < b + span; k++) qsum += q[k];
                rounded += (float)qsum * xs[m * chunks + b / XBLOCK];
            }
            float exact = vreduce_add(sum);
            corr[(m * groups + g) * 2] = 8.f * (exact - rounded);
            corr[(m * groups + g) * 2 + 1] = exact;
        }
    }
}

/* Room in the scratch arena for M rows of K columns quantized for (bits, G); q NULL where the arena could not grow.
 * The caller holds a scratch mark. */
QuantActs take_acts(int64_t M, int64_t K, int bits, int64_t G) {
    QuantActs a = {scratch(M * K), scratch(M * (K / XBLOCK + 1) * sizeof(float)),
                   bits == 8 ? NULL : scratch(M * 2 * (K / G) * sizeof(float))};
    if (!a.s || (bits != 8 && !a.corr)) a.q = NULL;
    return a;
}

void quantize_into(const void *x, int bf16, int64_t M, int64_t K, int bits, int64_t G, QuantActs a) {
    if (bits == 8)
        quantize_blocks(x, bf16, M, K, K, INT8_OFFSET, a.q, a.s);
    else
        int4_prepare(x, bf16, M, K, G, a.q, a.s, a.corr);
}

QuantActs quantize_acts(const void *x, int bf16, int64_t M, int64_t K, int bits, int64_t G) {
    QuantActs a = take_acts(M, K, bits, G);
    if (a.q) quantize_into(x, bf16, M, K, bits, G, a);
    return a;
}

/* Rows rows[0..P) of `a` (quantized as quantize_acts did, K columns, group size G) copied in that order, into the
 * scratch arena (q NULL where it could not grow). */
QuantActs gather_acts(QuantActs a, const int64_t *rows, int64_t P, int64_t K, int bits, int64_t G) {
    int64_t scales = bits == 8 ? 1 : K / XBLOCK, corrs = bits == 8 ? 0 : 2 * (K / G);
    QuantActs g = take_acts(P, K, bits, G);
    for (int64_t i = 0; g.q && i < P; i++) {
        memcpy(g.q + i * K, a.q + rows[i] * K, K);
        memcpy(g.s + i * scales, a.s + rows[i] * scales, scales * sizeof(float));
        if (corrs) memcpy(g.corr + i * corrs, a.corr + rows[i] * corrs, corrs * sizeof(float));
    }
    return g;
}
