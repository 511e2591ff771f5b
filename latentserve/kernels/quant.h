/* Activations quantized for the int8 and int4 kernels (quant_acts.c), shared by qgemm.c and int4.c. */
#pragma once

#include "simd.h"

#ifdef LS_AVX512
#define INT8_OFFSET 128 /* int8 activations offset into vpdpbusd's unsigned operand */
#else
#define INT8_OFFSET 0
#endif
#define XBLOCK 64 /* int4's activations are quantized per 64 columns */

/* x's 4 bytes as one int, to broadcast to every lane (the lanes layouts' activations). */
INLINE int32_t four_bytes(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

/* For int8 weights: q = round(x / s) + INT8_OFFSET per row, scale s one a row. For int4: q = round(x / s) per
 * XBLOCK columns, scales s one a block, and per group of G columns the corrections corr (see int4.c). */
typedef struct {
    int8_t *q;
    float *s, *corr;
} QuantActs;

/* All from the scratch arena (the caller holds a mark); q NULL where it could not grow. take_acts: room only, for
 * quantize_into to fill (from another thread than the arena's, e.g. inside a parallel region). */
QuantActs take_acts(int64_t M, int64_t K, int bits, int64_t G);
void quantize_into(const void *x, int bf16, int64_t M, int64_t K, int bits, int64_t G, QuantActs a);
QuantActs quantize_acts(const void *x, int bf16, int64_t M, int64_t K, int bits, int64_t G);
QuantActs gather_acts(QuantActs a, const int64_t *rows, int64_t P, int64_t K, int bits, int64_t G);

/* The quantized weight formats, both in blocks of 16 outputs, each block one stream of bytes read once and
 * self-contained (its scales inside): bits 8, `pack_int8`'s layout (qgemm.c); bits 4, `pack_int4`'s with K inputs
 * in groups of G (int4.c). A driver (quant_blocks.c) needs of a format only these traits: the bytes of a block, how
 * the activations are quantized for it, and the dot products of a block with some rows of them. */
typedef struct {
    int32_t bits;
    int64_t group; /* int4's group size G */
} Format;

#define INT8_HEADER 128 /* pack_int8's block: 16 fp32 scales and 16 int32 sums of q before the weights */

INLINE int64_t int4_block_bytes(int64_t K, int64_t G) { return K / G * (64 + 8 * G); }

INLINE int64_t block_bytes(Format f, int64_t K) {
    return f.bits == 8 ? INT8_HEADER + 16 * K : int4_block_bytes(K, f.group);
}

/* The 16 outputs of one block for rows first.. first + m of `a` (quantized for the block's format), into
 * dots[16 * i + j]. */
void int8_block_dots(QuantActs a, int64_t first, int64_t m, const int8_t *block, int64_t K, float *dots);
/* int8_block_dots of two blocks at once, into dots0 and dots1: two streams of weights in flight (a few rows). */
void int8_block_pair_dots(QuantActs a, int64_t first, int64_t m, const int8_t *block0, const int8_t *block1, int64_t K,
                          float *dots0, float *dots1);
void int4_block_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, int64_t G, float *dots);

INLINE void block_dots(Format f, QuantActs a, int64_t first, int64_t m, const void *block, int64_t K, float *dots) {
    if (f.bits == 8)
        int8_block_dots(a, first, m, (const int8_t *)block, K, dots);
    else
        int4_block_dots(a, first, m, (const uint8_t *)block, K, f.group, dots);
}

INLINE QuantActs quantize_for(Format f, const void *x, int bf16, int64_t M, int64_t K) {
    return quantize_acts(x, bf16, M, K, f.bits, f.group);
}
