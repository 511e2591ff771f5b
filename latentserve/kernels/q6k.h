/* The layout of Q6_K blocks (q6k.c's header says what they hold), shared by its vector kernels and amx.c's tile
 * kernel: where a group's bytes are, and on AVX-512 how a group and its scales unpack, so that both form the same
 * values in the same way. */
#pragma once

#include "quant.h"

#define Q6K_GROUPS 16 /* groups of 16 columns a super-block */

/* Super-block s's group g of the block at p: its 3 units (after the super-block's 16 d and 16 x 16 sc). */
INLINE const uint8_t *q6k_group(const uint8_t *p, int64_t s, int g) {
    return p + s * Q6K_SUPER + 64 + 16 * Q6K_GROUPS + 192 * g;
}

#ifdef LS_AVX512
/* The 4 vectors of q (16 outputs, columns 4r .. 4r + 3 in vector r) of the group at p: three held whole in the low
 * 6 bits of a 64-byte unit each, the fourth in their top 2 bits. */
INLINE void q6k_unpack(const uint8_t *p, __m512i q[4]) {
    const __m512i six = _mm512_set1_epi8(0x3f);
    __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64), c = _mm512_loadu_si512(p + 128);
    q[0] = _mm512_and_si512(a, six);
    q[1] = _mm512_and_si512(b, six);
    q[2] = _mm512_and_si512(c, six);
    /* a's top bits to bits 0-1, b's to 2-3, c's to 4-5 (vpternlogd 0xf8: A | (B & C)) */
    __m512i top = _mm512_and_si512(_mm512_srli_epi16(a, 6), _mm512_set1_epi8(0x03));
    top = _mm512_ternarylogic_epi32(top, _mm512_srli_epi16(b, 4), _mm512_set1_epi8(0x0c), 0xf8);
    q[3] = _mm512_ternarylogic_epi32(top, _mm512_srli_epi16(c, 2), _mm512_set1_epi8(0x30), 0xf8);
}

/* Group g's 16 scales d * sc (exact in fp32), d the super-block's at sd and its sc at sc. */
INLINE __m512 q6k_scale(const float *sd, const int8_t *sc, int g) {
    return _mm512_mul_ps(_mm512_loadu_ps(sd),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 16 * g)))));
}
#endif
