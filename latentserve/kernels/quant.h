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

QuantActs quantize_acts(const void *x, int bf16, int64_t M, int64_t K, int bits, int64_t G);
QuantActs gather_acts(QuantActs a, const int64_t *rows, int64_t P, int64_t K, int bits, int64_t G);
void free_acts(QuantActs a);

/* int4.c: bytes of one block of 16 outputs in `pack_int4`'s layout, K inputs in groups of G. */
INLINE int64_t int4_block_bytes(int64_t K, int64_t G) { return K / G * (64 + 8 * G); }

/* int4.c: the 16 outputs of one block of `pack_int4`'s layout for rows first.. first + m of `a`, into
 * dots[16 * i + j]. */
void int4_block_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, int64_t G, float *dots);
