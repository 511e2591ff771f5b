/* AMX tiles (the avx512_amx build) for llama.cpp's formats kept as their blocks at many rows: q45.c's (Q5_0, Q5_1,
 * Q5_K, Q4_K: a group of 32 columns a TDPBSSD) and q6k.c's (Q6_K, Q3_K: a group of 16; Q2_K: a span of 64, its
 * sub-scales in the B rows). Each block's groups are unpacked once into B rows of q - centre (signed: the vector
 * kernels' integer sums start at -centre times the sum of x, so the sums are theirs) and its scales, read from L1 by
 * every row tile; the float operations after the sums are the vector kernels', in their order: the same bits as the
 * avx512_bf16 build. The tile state and configuration are amx.c's (amx_begin, amx_end). */
#include "q45.h"
#include "q6k.h"

#ifdef LS_AMX
#define Q45_CHUNK 64 /* groups of a q45 block unpacked at a time (2048 columns): 32 KB of B rows, 8 KB of scales */

/* Groups g0..g1 of a q45.c block as B rows of q - centre, signed for TDPBSSD (the vector kernel's integer sum of a
 * group starts at -centre times the sum of x: the same sums), 8 rows a group (unit c's low nibbles, columns 8c..
 * 8c+3, then its high ones), and each group's scale and minc (q45_scales, as the vector kernel forms them). */
static void q45_unpack(const uint8_t *block, Q45Layout l, int64_t g0, int64_t g1, int8_t *b, float (*scale)[16],
                       float (*minc)[16]) {
    const __m512i centre = _mm512_set1_epi8((char)q45_centre(l));
    for (int64_t g = g0; g < g1; g++) {
        const float *sd;
        const uint8_t *p = q45_at(block, l, g, &sd);
        __m512i hb = q45_fifths(p, l), lo, hi;
        int8_t *rows = b + 512 * (g - g0);
        for (int c = 0; c < Q45_UNITS; c++) {
            q45_unit(p, hb, l, c, &lo, &hi);
            _mm512_storeu_si512(rows + 128 * c, _mm512_sub_epi8(lo, centre));
            _mm512_storeu_si512(rows + 128 * c + 64, _mm512_sub_epi8(hi, centre));
        }
        __m512 mc = _mm512_setzero_ps();
        _mm512_storeu_ps(scale[g - g0], q45_scales(p, sd, l, &mc));
        _mm512_storeu_ps(minc[g - g0], mc);
    }
    written();
}

/* The products of a group of `cols` columns (q45's 32, Q6_K's 16; TDPBSSD) into C tile `c`, through A tile `a` and
 * B tile `bt`: the 16 rows of xq (K bytes apart) at column cols * g, the group's cols / 4 B rows in b (unpacked from
 * group g0 on). */
#define GROUP_PRODUCT(c, a, bt, xq, b, g, g0, K, cols)         \
    do {                                                       \
        _tile_zero(c);                                         \
        _tile_loadd(a, (xq) + (cols) * (g), K);                \
        _tile_loadd(bt, (b) + 16 * (cols) * ((g) - (g0)), 64); \
        _tile_dpbssd(c, a, bt);                                \
    } while (0)

/* The vector kernel's float operations on group g's sums, in its order: res += (scale * xs) * sums, and where
 * q45_sums (the k-quants, Q5_1) res += minc * (the exact sum of x over the group). A macro with its loop unrolled for
 * res to stay in registers (INT4_SPAN_DONE's reason). xs, fx: row 0's scales (`chunks` a row) and corrections as
 * floats (`corrs`). */
#define Q45_GROUP_DONE(res, sums, g, g0, scale, minc, xs, fx, chunks, corrs, ks)                            \
    do {                                                                                                    \
        __m512 sc_ = _mm512_loadu_ps((scale)[(g) - (g0)]), mc_ = _mm512_loadu_ps((minc)[(g) - (g0)]);       \
        _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) {                                             \
            __m512 s_ = _mm512_mul_ps(sc_, _mm512_set1_ps((xs)[i * (chunks) + (g) / 2]));                   \
            res[i] = _mm512_fmadd_ps(s_, _mm512_cvtepi32_ps(_mm512_loadu_si512((sums)[i])), res[i]);        \
            if (ks) res[i] = _mm512_fmadd_ps(mc_, _mm512_set1_ps((fx)[i * (corrs) + 2 * (g) + 1]), res[i]); \
        }                                                                                                   \
    } while (0)

/* The vector kernel's q45_block for 16 rows at once over groups g0..g1, unpacked into b, scale and minc; res starts
 * at 0 (g0 = 0) or at dots. Groups take C tiles 0-3 in turns, so that a group's product is issued three groups before
 * its float operations run: with two in turns (int4_rows' spans) the products waited on each other (0.92x). */
INLINE void q45_tile_rows(QuantActs a, int64_t row, Q45Layout l, int64_t g0, int64_t g1, int64_t K,
                          const int8_t *b, float (*scale)[16], float (*minc)[16], float *dots) {
    int64_t chunks = K / XBLOCK, corrs = q45_corrs(l, K);
    const int8_t *xq = a.q + row * K;
    const float *xs = a.s + row * chunks, *fx = (const float *)a.corr + row * corrs;
    __m512 res[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) res[i] = g0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(dots + 16 * i);
    int32_t sums[16][16];
    GROUP_PRODUCT(0, 5, 4, xq, b, g0, g0, K, 32);
    if (g0 + 1 < g1) GROUP_PRODUCT(1, 6, 7, xq, b, g0 + 1, g0, K, 32);
    if (g0 + 2 < g1) GROUP_PRODUCT(2, 5, 4, xq, b, g0 + 2, g0, K, 32);
    for (int64_t g = g0; g < g1; g += 4) {
        if (g + 3 < g1) GROUP_PRODUCT(3, 6, 7, xq, b, g + 3, g0, K, 32);
        _tile_stored(0, sums, 64);
        Q45_GROUP_DONE(res, sums, g, g0, scale, minc, xs, fx, chunks, corrs, q45_sums(l));
        if (g + 1 >= g1) break;
        if (g + 4 < g1) GROUP_PRODUCT(0, 5, 4, xq, b, g + 4, g0, K, 32);
        _tile_stored(1, sums, 64);
        Q45_GROUP_DONE(res, sums, g + 1, g0, scale, minc, xs, fx, chunks, corrs, q45_sums(l));
        if (g + 2 >= g1) break;
        if (g + 5 < g1) GROUP_PRODUCT(1, 6, 7, xq, b, g + 5, g0, K, 32);
        _tile_stored(2, sums, 64);
        Q45_GROUP_DONE(res, sums, g + 2, g0, scale, minc, xs, fx, chunks, corrs, q45_sums(l));
        if (g + 3 >= g1) break;
        if (g + 6 < g1) GROUP_PRODUCT(2, 5, 4, xq, b, g + 6, g0, K, 32);
        _tile_stored(3, sums, 64);
        Q45_GROUP_DONE(res, sums, g + 3, g0, scale, minc, xs, fx, chunks, corrs, q45_sums(l));
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dots + 16 * i, res[i]);
}

/* m: a multiple of 16. */
INLINE void amx_q45_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, float *dots,
                         Q45Layout l) {
    int8_t b[512 * Q45_CHUNK] __attribute__((aligned(64)));
    float scale[Q45_CHUNK][16], minc[Q45_CHUNK][16];
    amx_begin(32);
    for (int64_t g0 = 0; g0 < K / 32; g0 += Q45_CHUNK) {
        int64_t g1 = K / 32 - g0 < Q45_CHUNK ? K / 32 : g0 + Q45_CHUNK;
        q45_unpack(block, l, g0, g1, b, scale, minc);
        for (int64_t r0 = 0; r0 < m; r0 += 16)
            q45_tile_rows(a, first + r0, l, g0, g1, K, b, scale, minc, dots + 16 * r0);
    }
    amx_end();
}

void amx_q45_block_dots(Format f, QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K,
                        float *dots) {
    Q45_LAYOUTS(f, amx_q45_dots, a, first, m, block, K, dots);
}
#define Q6K_CHUNK 128 /* groups of a block unpacked at a time (2048 columns): 32 KB of B rows, 8 KB of scales */

/* Groups g0..g1 of a Q6_K or Q3_K block (16 columns each) as B rows of q - centre, signed for TDPBSSD (the vector
 * kernel's sum starts at -centre times the sum of x: the same sums), 4 rows a group (k_unpack's vectors), and each
 * group's scales. */
static void q6k_tiles_unpack(const uint8_t *block, KLayout l, int64_t g0, int64_t g1, int8_t *b, float (*scale)[16]) {
    for (int64_t g = g0; g < g1; g++) {
        int64_t s = g / Q6K_GROUPS;
        __m512i q[4];
        __m512 no_minimum;
        k_unpack(k_group(block, l, s, (int)(g % Q6K_GROUPS)), l, q);
        for (int r = 0; r < 4; r++)
            _mm512_storeu_si512(b + 256 * (g - g0) + 64 * r, _mm512_sub_epi8(q[r], _mm512_set1_epi8(k_centre(l))));
        _mm512_storeu_ps(scale[g - g0], k_scale(block + s * k_super(l), l, (int)(g % Q6K_GROUPS), &no_minimum));
    }
    written();
}

/* The vector kernel's float operations on group g's sums (the j-th of its 64-column span), in its order: t = scale *
 * sums at the span's first group, t += scale * sums at the others, and after its last the row's sum (in dots: 32
 * registers would not hold it beside t) += xs * t. xs: row 0's scales, `chunks` a row. A macro with its loops
 * unrolled, as Q45_GROUP_DONE. */
#define Q6K_GROUP_DONE(t, sums, g, j, g0, scale, xs, chunks, dots)                                   \
    do {                                                                                             \
        __m512 sc_ = _mm512_loadu_ps((scale)[(g) - (g0)]);                                           \
        _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) {                                      \
            __m512 v_ = _mm512_cvtepi32_ps(_mm512_loadu_si512((sums)[i]));                           \
            t[i] = (j) == 0 ? _mm512_mul_ps(sc_, v_) : _mm512_fmadd_ps(sc_, v_, t[i]);               \
        }                                                                                            \
        if ((j) == 3) {                                                                              \
            _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) _mm512_storeu_ps(                  \
                (dots) + 16 * i, _mm512_fmadd_ps(_mm512_set1_ps((xs)[i * (chunks) + (g) / 4]), t[i], \
                                                 _mm512_loadu_ps((dots) + 16 * i)));                 \
        }                                                                                            \
    } while (0)

/* The vector kernel's q6k_block for 16 rows at once over groups g0..g1 (whole spans of 4), unpacked into b and
 * scale, into dots (zero before the first group). Groups take C tiles 0-3 in turns, as q45_tile_rows'. */
static void q6k_tile_rows(QuantActs a, int64_t row, int64_t g0, int64_t g1, int64_t K, const int8_t *b,
                          float (*scale)[16], float *dots) {
    int64_t chunks = K / XBLOCK;
    const int8_t *xq = a.q + row * K;
    const float *xs = a.s + row * chunks;
    __m512 t[16];
    if (g0 == 0)
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(dots + 16 * i, _mm512_setzero_ps());
    int32_t sums[16][16];
    GROUP_PRODUCT(0, 5, 4, xq, b, g0, g0, K, 16);
    GROUP_PRODUCT(1, 6, 7, xq, b, g0 + 1, g0, K, 16);
    GROUP_PRODUCT(2, 5, 4, xq, b, g0 + 2, g0, K, 16);
    for (int64_t g = g0; g < g1; g += 4) { /* g1 - g0: whole spans of 4 groups */
        GROUP_PRODUCT(3, 6, 7, xq, b, g + 3, g0, K, 16);
        _tile_stored(0, sums, 64);
        Q6K_GROUP_DONE(t, sums, g, 0, g0, scale, xs, chunks, dots);
        if (g + 4 < g1) GROUP_PRODUCT(0, 5, 4, xq, b, g + 4, g0, K, 16);
        _tile_stored(1, sums, 64);
        Q6K_GROUP_DONE(t, sums, g + 1, 1, g0, scale, xs, chunks, dots);
        if (g + 5 < g1) GROUP_PRODUCT(1, 6, 7, xq, b, g + 5, g0, K, 16);
        _tile_stored(2, sums, 64);
        Q6K_GROUP_DONE(t, sums, g + 2, 2, g0, scale, xs, chunks, dots);
        if (g + 6 < g1) GROUP_PRODUCT(2, 5, 4, xq, b, g + 6, g0, K, 16);
        _tile_stored(3, sums, 64);
        Q6K_GROUP_DONE(t, sums, g + 3, 3, g0, scale, xs, chunks, dots);
    }
}

/* Groups g0..g1 of a Q2_K block as B rows of sc * (q - 2) (at most 30 in size: a byte), so that a tile sums a whole
 * 64-column span, 4 groups, into the integer the vector kernel's t holds (the sum over the span of sc times each
 * group's sum); per span its super-block's d, per group the factor of its exact sum of x (k_scale's minc). */
static void q2k_tiles_unpack(const uint8_t *block, int64_t g0, int64_t g1, int8_t *b, float (*d)[16],
                             float (*minc)[16]) {
    const KLayout l = {2};
    for (int64_t g = g0; g < g1; g++) {
        int64_t s = g / Q6K_GROUPS;
        const uint8_t *sp = block + s * k_super(l);
        __m512i q[4];
        __m512 mc;
        k_scale(sp, l, (int)(g % Q6K_GROUPS), &mc);
        _mm512_storeu_ps(minc[g - g0], mc);
        k_unpack(k_group(block, l, s, (int)(g % Q6K_GROUPS)), l, q);
        /* sc in each output's 4 bytes; q * sc from q's two bits as masked adds, less 2 sc */
        const __m128i *sub = (const __m128i *)(sp + 128 + 16 * (g % Q6K_GROUPS));
        __m512i sc = _mm512_and_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128(sub)), _mm512_set1_epi32(15));
        sc = _mm512_mullo_epi32(sc, _mm512_set1_epi32(0x01010101));
        __m512i two = _mm512_add_epi8(sc, sc), base = _mm512_sub_epi8(_mm512_setzero_si512(), two);
        for (int r = 0; r < 4; r++) {
            __m512i v = _mm512_mask_add_epi8(base, _mm512_test_epi8_mask(q[r], _mm512_set1_epi8(1)), base, sc);
            v = _mm512_mask_add_epi8(v, _mm512_test_epi8_mask(q[r], _mm512_set1_epi8(2)), v, two);
            _mm512_storeu_si512(b + 256 * (g - g0) + 64 * r, v);
        }
        if (g % 4 == 0) _mm512_storeu_ps(d[(g - g0) / 4], _mm512_loadu_ps((const float *)sp));
    }
    written();
}

/* The vector kernel's float operations at the end of span s (of its super-block's d at d, its groups' minc from
 * minc): the row's sum += (d * xs) * t, then += minc * (the exact sum of x) for each of its 4 groups. */
#define Q2K_SPAN_DONE(sums, s, s0, d, minc, xs, fx, chunks, corrs, dots)                                     \
    do {                                                                                                     \
        __m512 d_ = _mm512_loadu_ps((d)[(s) - (s0)]), mc_[4];                                                \
        for (int j = 0; j < 4; j++) mc_[j] = _mm512_loadu_ps((minc)[4 * ((s) - (s0)) + j]);                  \
        _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) {                                              \
            __m512 r_ = _mm512_fmadd_ps(_mm512_mul_ps(d_, _mm512_set1_ps((xs)[i * (chunks) + (s)])),         \
                                        _mm512_cvtepi32_ps(_mm512_loadu_si512((sums)[i])),                   \
                                        _mm512_loadu_ps((dots) + 16 * i));                                   \
            for (int j = 0; j < 4; j++)                                                                      \
                r_ = _mm512_fmadd_ps(mc_[j], _mm512_set1_ps((fx)[i * (corrs) + 2 * (4 * (s) + j) + 1]), r_); \
            _mm512_storeu_ps((dots) + 16 * i, r_);                                                           \
        }                                                                                                    \
    } while (0)

/* The vector kernel's q6k_block of a Q2_K block for 16 rows at once over spans s0..s1 (a multiple of 4 of them),
 * unpacked into b, d and minc, into dots (zero before the first span). Spans take C tiles 0-3 in turns. */
static void q2k_tile_rows(QuantActs a, int64_t row, int64_t s0, int64_t s1, int64_t K, const int8_t *b,
                          float (*d)[16], float (*minc)[16], float *dots) {
    int64_t chunks = K / XBLOCK, corrs = k_corrs((KLayout){2}, K);
    const int8_t *xq = a.q + row * K;
    const float *xs = a.s + row * chunks, *fx = a.corr + row * corrs;
    if (s0 == 0)
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(dots + 16 * i, _mm512_setzero_ps());
    int32_t sums[16][16];
    GROUP_PRODUCT(0, 5, 4, xq, b, s0, s0, K, 64);
    GROUP_PRODUCT(1, 6, 7, xq, b, s0 + 1, s0, K, 64);
    GROUP_PRODUCT(2, 5, 4, xq, b, s0 + 2, s0, K, 64);
    for (int64_t s = s0; s < s1; s += 4) {
        GROUP_PRODUCT(3, 6, 7, xq, b, s + 3, s0, K, 64);
        _tile_stored(0, sums, 64);
        Q2K_SPAN_DONE(sums, s, s0, d, minc, xs, fx, chunks, corrs, dots);
        if (s + 4 < s1) GROUP_PRODUCT(0, 5, 4, xq, b, s + 4, s0, K, 64);
        _tile_stored(1, sums, 64);
        Q2K_SPAN_DONE(sums, s + 1, s0, d, minc, xs, fx, chunks, corrs, dots);
        if (s + 5 < s1) GROUP_PRODUCT(1, 6, 7, xq, b, s + 5, s0, K, 64);
        _tile_stored(2, sums, 64);
        Q2K_SPAN_DONE(sums, s + 2, s0, d, minc, xs, fx, chunks, corrs, dots);
        if (s + 6 < s1) GROUP_PRODUCT(2, 5, 4, xq, b, s + 6, s0, K, 64);
        _tile_stored(3, sums, 64);
        Q2K_SPAN_DONE(sums, s + 3, s0, d, minc, xs, fx, chunks, corrs, dots);
    }
}

void amx_q6k_block_dots(Format f, QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K,
                        float *dots) {
    int8_t b[256 * Q6K_CHUNK] __attribute__((aligned(64)));
    float scale[Q6K_CHUNK][16], d[Q6K_CHUNK / 4][16];
    amx_begin(f.bits == 2 ? 64 : 16);
    for (int64_t g0 = 0; g0 < K / 16; g0 += Q6K_CHUNK) {
        int64_t g1 = K / 16 - g0 < Q6K_CHUNK ? K / 16 : g0 + Q6K_CHUNK;
        if (f.bits == 2) {
            q2k_tiles_unpack(block, g0, g1, b, d, scale);
            for (int64_t r0 = 0; r0 < m; r0 += 16)
                q2k_tile_rows(a, first + r0, g0 / 4, g1 / 4, K, b, d, scale, dots + 16 * r0);
        } else {
            q6k_tiles_unpack(block, (KLayout){f.bits}, g0, g1, b, scale);
            for (int64_t r0 = 0; r0 < m; r0 += 16) q6k_tile_rows(a, first + r0, g0, g1, K, b, scale, dots + 16 * r0);
        }
    }
    amx_end();
}
#endif
