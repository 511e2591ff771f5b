/* The layouts of q45.c's formats (Q5_0, Q5_1, Q5_K, Q4_K; q45.c's header says what they hold), shared by its vector
 * kernels and amx_blocks.c's tile kernel: where a group's bytes are, and on AVX-512 how a unit and a group's scales
 * unpack, so that both form the same values in the same way. */
#pragma once

#include "quant.h"

#define Q45_UNITS 4 /* 64-byte units of nibbles a group: 8 columns each */

/* A layout's traits (the dispatch passes them as constants: each layout its own inlined code). fifth: 5 bits (the
 * fifth bits' 64 bytes a group, centre 16), else 4 (centre 8); ks: a k-quant (superblocks of 256 columns, sc and m a
 * group), else Q5_0 or Q5_1; mins: Q5_1 (each group's header holds an fp16 m beside each d). */
typedef struct {
    int fifth, ks, mins;
} Q45Layout;

INLINE int64_t q45_header(Q45Layout l) { return l.mins ? 64 : 32; }
INLINE int64_t q45_group_bytes(Q45Layout l) { return l.mins ? Q51_GROUP : l.fifth ? Q5_GROUP : Q4_GROUP; }
INLINE int q45_centre(Q45Layout l) { return l.fifth ? 16 : 8; }
/* Whether a group has a minimum, met by the exact sum of x (the k-quants', Q5_1's). */
INLINE int q45_sums(Q45Layout l) { return l.ks || l.mins; }
/* The corrections a row of activations holds: per 32 columns the centre (and where q45_sums, the exact sum). */
INLINE int64_t q45_corrs(Q45Layout l, int64_t K) { return (1 + q45_sums(l)) * (K / 32); }

/* Group g of the block at p, its superblock's d and dmin into *sd (Q5_0, Q5_1: NULL): their groups follow one another;
 * the k-quants' come 8 to a superblock after its header (the 16 d, then the 16 dmin). */
INLINE const uint8_t *q45_at(const uint8_t *p, Q45Layout l, int64_t g, const float **sd) {
    int64_t bytes = q45_group_bytes(l);
    if (!l.ks) {
        *sd = NULL;
        return p + g * bytes;
    }
    const uint8_t *sp = p + g / 8 * (128 + 8 * bytes);
    *sd = (const float *)sp;
    return sp + 128 + g % 8 * bytes;
}

/* fn(..., layout) with the layout of format f a constant (each layout its own code). */
#define Q45_LAYOUTS(f, fn, ...)                                                                           \
    if ((f).bits == 4)                                                                                   \
        fn(__VA_ARGS__, ((Q45Layout){0, 1, 0}));                                                         \
    else if ((f).group == 256)                                                                           \
        fn(__VA_ARGS__, ((Q45Layout){1, 1, 0}));                                                         \
    else if ((f).mins)                                                                                   \
        fn(__VA_ARGS__, ((Q45Layout){1, 0, 1}));                                                         \
    else                                                                                                 \
        fn(__VA_ARGS__, ((Q45Layout){1, 0, 0}))

#ifdef LS_AVX512
/* q with 16 added where bit r of hb's byte is set: the fifth bits (a byte mask, then a masked add). */
INLINE __m512i q5_fifth(__m512i q, __m512i hb, int r) {
    return _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << r))), q,
                                _mm512_set1_epi8(0x10));
}

/* Unit c of the group at p as its two vectors of q (16 outputs; columns 8c .. 8c + 3 into *lo, 8c + 4 .. 8c + 7
 * into *hi), hb the group's fifth bits (4 bits: unused). */
INLINE void q45_unit(const uint8_t *p, __m512i hb, Q45Layout l, int c, __m512i *lo, __m512i *hi) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i v = _mm512_loadu_si512(p + q45_header(l) + (l.fifth ? 64 : 0) + 64 * c);
    *lo = _mm512_and_si512(v, low), *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if (l.fifth) *lo = q5_fifth(*lo, hb, 2 * c), *hi = q5_fifth(*hi, hb, 2 * c + 1);
}

INLINE __m512i q45_fifths(const uint8_t *p, Q45Layout l) {
    return l.fifth ? _mm512_loadu_si512(p + q45_header(l)) : _mm512_setzero_si512();
}

/* The group at p's 16 outputs' scales (Q5_0, Q5_1: d; k-quants: d * sc) and, where q45_sums, *minc what the exact
 * sum of x over the group is multiplied by (q = (q - centre) + centre): k-quants centre * scale - dmin * m, Q5_1
 * centre * d + m. */
INLINE __m512 q45_scales(const uint8_t *p, const float *sd, Q45Layout l, __m512 *minc) {
    if (!l.ks) {
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        if (l.mins)
            *minc = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(16.f), d),
                                  _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32))));
        return d;
    }
    __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
    __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
    __m512 scale = _mm512_mul_ps(_mm512_loadu_ps(sd), sc);
    *minc = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps((float)q45_centre(l)), scale),
                          _mm512_mul_ps(_mm512_loadu_ps(sd + 16), m));
    return scale;
}
#endif
