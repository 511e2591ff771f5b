/* The layouts of q6k.c's formats (Q6_K, Q3_K, Q2_K; q6k.c's header says what they hold), shared by its vector kernels
 * and amx_blocks.c's tile kernel: where a group's bytes are, and on AVX-512 how a group and its scales unpack, so that
 * both form the same values in the same way. */
#pragma once

#include "quant.h"

#define Q6K_GROUPS 16 /* groups of 16 columns a super-block */

/* A layout's traits (the dispatch passes them as constants: each layout its own inlined code): bits 6 (Q6_K), 3
 * (Q3_K: Q6_K's arithmetic, its own unpacking) or 2 (Q2_K, whose groups have a minimum, met by the exact sum of x). */
typedef struct {
    int bits;
} KLayout;

INLINE int k_mins(KLayout l) { return l.bits == 2; }
INLINE int k_centre(KLayout l) { return l.bits == 2 ? 2 : l.bits == 3 ? 4 : 32; }
INLINE int64_t k_super(KLayout l) { return l.bits == 2 ? Q2K_SUPER : l.bits == 3 ? Q3K_SUPER : Q6K_SUPER; }
INLINE int64_t k_header(KLayout l) { return (k_mins(l) ? 128 : 64) + 16 * Q6K_GROUPS; } /* d (dmin), sub-scales */
INLINE int64_t k_group_bytes(KLayout l) { return l.bits == 2 ? 64 : l.bits == 3 ? 96 : 192; }
/* The corrections a row of activations holds: per 16 columns the centre (and where k_mins, the exact sum). */
INLINE int64_t k_corrs(KLayout l, int64_t K) { return (1 + k_mins(l)) * (K / 16); }

/* Super-block s's group g of the block at p. */
INLINE const uint8_t *k_group(const uint8_t *p, KLayout l, int64_t s, int g) {
    return p + s * k_super(l) + k_header(l) + k_group_bytes(l) * g;
}

/* fn(..., layout) with the layout of format f a constant. */
#define K_LAYOUTS(f, fn, ...)            \
    if ((f).bits == 2)                   \
        fn(__VA_ARGS__, ((KLayout){2})); \
    else if ((f).bits == 3)              \
        fn(__VA_ARGS__, ((KLayout){3})); \
    else                                 \
        fn(__VA_ARGS__, ((KLayout){6}))

#ifdef LS_AVX512
/* The 4 vectors of q (16 outputs, columns 4r .. 4r + 3 in vector r) of the group at p. Q6_K: three held whole in the
 * low 6 bits of a 64-byte unit each, the fourth in their top 2 bits; Q2_K: bit pairs 2r, 2r + 1 of one unit; Q3_K:
 * two whole in a unit's bits 0-2 and 3-5, the third's low bits in its top 2 and its third bit beside the fourth in a
 * nibble (32 bytes: each half of 8 outputs the low nibbles of 16 bytes, then their high ones). */
INLINE void k_unpack(const uint8_t *p, KLayout l, __m512i q[4]) {
    if (l.bits == 2) {
        __m512i v = _mm512_loadu_si512(p);
        for (int r = 0; r < 4; r++) q[r] = _mm512_and_si512(_mm512_srli_epi16(v, 2 * r), _mm512_set1_epi8(0x03));
        return;
    }
    if (l.bits == 3) {
        const __m512i seven = _mm512_set1_epi8(0x07);
        __m256i n = _mm256_loadu_si256((const __m256i *)(p + 64));
        /* [bytes 0-15, their high nibbles, bytes 16-31, theirs] as 128-bit lanes: each lane's nibble in its low bits */
        __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(n), _mm256_srli_epi16(n, 4), 1);
        __m512i nib = _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0)), v = _mm512_loadu_si512(p);
        q[0] = _mm512_and_si512(v, seven);
        q[1] = _mm512_and_si512(_mm512_srli_epi16(v, 3), seven);
        /* bits 6-7 of v, and the nibble's bit 3 as bit 2 (vpternlogd 0xf8: A | (B & C)) */
        q[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 6), _mm512_set1_epi8(0x03)),
                                         _mm512_srli_epi16(nib, 1), _mm512_set1_epi8(0x04), 0xf8);
        q[3] = _mm512_and_si512(nib, seven);
        return;
    }
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
 /* Group g's 16 scales of the super-block at sp: Q6_K's and Q3_K's d * sc (exact in fp32); Q2_K's sc (its groups' sums
times sc  * add up to an integer below 2^24, exact in fp32 as in int32: amx_blocks.c sums them so) and in *minc what the
exact
 * sum of x is multiplied by, centre * d * sc - dmin * m. */
INLINE __m512 k_scale(const uint8_t *sp, KLayout l, int g, __m512 *minc) {
    __m512 d = _mm512_loadu_ps((const float *)sp);
    if (!k_mins(l))
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                    _mm_loadu_si128((const __m128i *)(sp + 64 + 16 * g)))));
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sp + 128 + 16 * g)));
    __m512 sc = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    __m512 m = _mm512_mul_ps(_mm512_loadu_ps((const float *)sp + 16), _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
    *minc = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps((float)k_centre(l)), _mm512_mul_ps(d, sc)), m);
    return sc;
}

/* What a row's sum t of a 64-column span is multiplied by: x's scale there (Q6_K, Q3_K, whose t holds d * sc), or d
 * times it (Q2_K, whose t holds sc). */
INLINE __m512 k_span_scale(const uint8_t *sp, KLayout l, float xs) {
    return k_mins(l) ? _mm512_mul_ps(_mm512_loadu_ps((const float *)sp), _mm512_set1_ps(xs)) : _mm512_set1_ps(xs);
}
#endif
