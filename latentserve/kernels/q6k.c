/* llama.cpp's 16-column k-quants (`pack_q6k`, `pack_q3k`, `pack_q2k`; quant_blocks.c and experts.c drive them): y[M,
 * N] = x[M, K] @ w[N, K]^T with the file's values exactly, K % 256 == 0:
 * - Q6_K (Format (6, 16)): w = d * sc * (q - 32), per 256 columns an fp32 d an output (the file's fp16), per 16 columns
 *   an int8 sc, q in [0, 63].
 * - Q3_K (Format (3, 16)): w = d * sc * (q - 4), Q6_K's with sc in [-32, 31] (the file's 6 bits less 32), q in [0, 7].
 * - Q2_K (Format (2, 16)): w = d * sc * q - dmin * m, per 256 columns fp32 d and dmin (the file's fp16), per 16
 *   columns a 4-bit sc and m, q in [0, 3].
 *
 * Why their own layouts and not int4's with more bits: int4 keeps a (scale, minimum) bf16 pair an output and group,
 * 2 bits a weight at groups of 16, so a Q6_K tensor would read 8 bits a weight, as many as int8 (and lose the file's
 * values to bf16). Here Q6_K reads 6.625 (the file 6.5625), and d * sc is exact in fp32 (11 by 8 bits); Q3_K reads
 * 3.625 (the file 3.4375; as Q6_K's values it read 6.625), Q2_K 2.75 (the file 2.625) where int8 per row read 8.06
 * and rounded the values again.
 *
 * Layout: the outputs in blocks of 16 (N padded with zero rows), each block one stream of bytes; per 256 columns (a
 * super-block, Q6K_SUPER, Q3K_SUPER or Q2K_SUPER bytes) the 16 outputs' d (64 bytes of fp32; Q2_K: then their dmin),
 * their sub-scales (16 groups of 16 bytes, group-major: Q6_K's and Q3_K's int8 sc, Q2_K's sc | m << 4), then per group
 * of 16 columns its q. Q6_K: three 64-byte units, unit u (u < 3) byte 4j + i = q[j, 4u + i] | 2 bits of q[j, 12 + i] <<
 * 6 (its bits 2u, 2u + 1). Columns 0-11 come out with one AND a vector, 12-15 from the three units' top bits; as nibble
 * planes (int4's units and a plane of high bit pairs) the unpacking took 13 operations a group on AVX-512 (AVX2: 17 a
 * half) where this takes 9 (11), which bound the AVX2 build at one row. Q2_K: one 64-byte unit, byte 4j + i holding
 * q[j, 4r + i] at bits 2r, 2r + 1 (four shifts and ANDs). Q3_K: a 64-byte unit, byte 4j + i = q[j, i] | q[j, 4 + i] <<
 * 3 | the low 2 bits of q[j, 8 + i] << 6, then 32 bytes of nibbles q[j, 12 + i] | the third bit of q[j, 8 + i] << 3,
 * for position p = 4j + i in byte 16h + k's low nibble where p = 32h + k and its high one where p = 32h + 16 + k: each
 * half of 8 outputs reads its 16 bytes and their shift as one vector (12 operations a group on AVX-512, AVX2 12 a
 * half). One 64-byte vector of q feeds all 16 outputs against 4 columns of x broadcast to every lane, as int4's. *
 * The activations are int4's (int8 per 64 columns, quant_acts.c), with per 16 columns -centre * the sum of their
 * quantized x (`corr`, as int32; centre 32, Q3_K 4, Q2_K 2), Q2_K's each followed by the exact sum of x over the 16
 * columns: a group's integer sum starts there, so that it is the sum of (q - centre) * xq with q as vpdpbusd's unsigned
 * operand. Per group the sum times d * sc goes into a row's float sum of its 64 columns (t), which is scaled by x's
 * scale once per 64 columns. Q2_K's t is the sum times sc alone, an integer below 2^24 and so exact in fp32
 * (amx_blocks.c sums it in int32 on tiles, 64 columns at once: the same value), scaled by d times x's scale; after it
 * the row's sum takes each group's exact sum of x times centre * d * sc - dmin * m (q = (q - centre) + centre). Same
 * operations in the same order on every build: the same bits on AVX2, AVX-512 and AMX. */
#include "q6k.h"

/* Row i's integer start and (Q2_K) exact sum of x of the group at column c. */
INLINE int32_t k_start(FileRows x, KLayout l, int i, int64_t c) {
    return x.corr[i * x.corrs + (1 + k_mins(l)) * (c / 16)];
}
INLINE float k_sum_x(FileRows x, int i, int64_t c) { return ((const float *)x.corr)[i * x.corrs + 2 * (c / 16) + 1]; }

/* From this many rows the sums bind and the hardware prefetchers fall behind: each group then fetches its lines of the
 * block read next (`ahead` bytes on: the next one in memory) into L2, as int8's fetch_next. lm_head (102400 x 2048)
 * on Zen 4, 2 threads, against int8 in turns: 4 rows 0.62x -> 1.14x, 8 rows 0.46x -> 0.91x; fetching at 2 rows
 * slowed them (1.19x -> 1.09x). */
#define Q6K_FETCH_ROWS 3

/* The lines of `bytes` at p of the block read next, fetched into L2 from Q6K_FETCH_ROWS rows; at fewer, those
 * read_ahead bytes on into L1 (fetch_ahead, int4's: on Intel). */
INLINE void q6k_fetch(const uint8_t *p, int64_t ahead, int64_t bytes, int mb) {
    if (mb < Q6K_FETCH_ROWS) return fetch_ahead(p, bytes);
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)((uintptr_t)p + ahead + l), _MM_HINT_T1);
}

#ifdef LS_AVX512
#define Q6ROWS 8 /* activation rows a pass: 2 vector registers each */

/* res[i][j] += super-block s's part of output j of a block for activation row i, its bytes at p. */
INLINE void q6k_super(FileRows x, const uint8_t *p, int64_t ahead, int64_t K, int64_t s, KLayout l, int mb,
                      __m512 *res) {
    q6k_fetch(p, ahead, k_header(l), mb);
    __m512 t[Q6ROWS], minc[4] = {0}; /* the span's groups' (Q2_K) */
    const uint8_t *sp = p;
    p += k_header(l);
    for (int g = 0; g < Q6K_GROUPS; g++, p += k_group_bytes(l)) {
        int64_t c = 256 * s + 16 * g;
        q6k_fetch(p, ahead, k_group_bytes(l), mb);
        __m512 scale = k_scale(sp, l, g, &minc[g % 4]);
        __m512i q[4];
        k_unpack(p, l, q);
        for (int i = 0; i < mb; i++) {
            const int8_t *xi = x.xq + i * K + c;
            __m512i acc = _mm512_set1_epi32(k_start(x, l, i, c));
            for (int r = 0; r < 4; r++) acc = _mm512_dpbusd_epi32(acc, q[r], _mm512_set1_epi32(four_bytes(xi + 4 * r)));
            t[i] = g % 4 == 0 ? _mm512_mul_ps(scale, _mm512_cvtepi32_ps(acc))
                              : _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc), t[i]);
            if (g % 4 < 3) continue;
            res[i] = _mm512_fmadd_ps(k_span_scale(sp, l, x.xs[i * (K / XBLOCK) + c / XBLOCK]), t[i], res[i]);
            for (int j = 0; k_mins(l) && j < 4; j++)
                res[i] = _mm512_fmadd_ps(minc[j], _mm512_set1_ps(k_sum_x(x, i, c - 16 * (3 - j))), res[i]);
        }
    }
}

INLINE void q6k_store(const __m512 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) _mm512_storeu_ps(out[i], res[i]);
}

typedef __m512 Q6Sums[Q6ROWS];
#define Q6K_ZERO(res) for (int i = 0; i < mb; i++) res[i] = _mm512_setzero_ps()
#else
#define Q6ROWS 2    /* activation rows a pass of q6k_super: the block's two halves of 8 outputs, 2 registers each */
#define Q6K_HROWS 4 /* rows a pass of q6k_halves: one half at a time, 2 registers a row */
#define Q6K_HALVES_FROM 3 /* rows from which a block (a pair: each of its blocks) runs q6k_halves */

/* The 4 vectors of q of half h (outputs 8h .. 8h + 7) of the group at p (as the AVX-512 k_unpack). */
INLINE void k_unpack(const uint8_t *p, KLayout l, int h, __m256i q[4]) {
    p += 32 * h;
    __m256i a = _mm256_loadu_si256((const __m256i *)p);
    if (l.bits == 2) {
        for (int r = 0; r < 4; r++) q[r] = _mm256_and_si256(_mm256_srli_epi16(a, 2 * r), _mm256_set1_epi8(0x03));
        return;
    }
    if (l.bits == 3) {
        const __m256i seven = _mm256_set1_epi8(0x07);
        __m128i n = _mm_loadu_si128((const __m128i *)(p + 64 - 16 * h)); /* the half's 16 bytes of nibbles */
        __m256i nib = _mm256_inserti128_si256(_mm256_castsi128_si256(n), _mm_srli_epi16(n, 4), 1);
        q[0] = _mm256_and_si256(a, seven);
        q[1] = _mm256_and_si256(_mm256_srli_epi16(a, 3), seven);
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 6), _mm256_set1_epi8(0x03)),
                               _mm256_and_si256(_mm256_srli_epi16(nib, 1), _mm256_set1_epi8(0x04)));
        q[3] = _mm256_and_si256(nib, seven);
        return;
    }
    const __m256i six = _mm256_set1_epi8(0x3f);
    __m256i b = _mm256_loadu_si256((const __m256i *)(p + 64)), c = _mm256_loadu_si256((const __m256i *)(p + 128));
    q[0] = _mm256_and_si256(a, six);
    q[1] = _mm256_and_si256(b, six);
    q[2] = _mm256_and_si256(c, six);
    q[3] = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 6), _mm256_set1_epi8(0x03)),
                                           _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0c))),
                           _mm256_and_si256(_mm256_srli_epi16(c, 2), _mm256_set1_epi8(0x30)));
}

/* Half h of group g's scales and minimum factors (as the AVX-512 k_scale). */
INLINE __m256 k_scale(const uint8_t *sp, KLayout l, int g, int h, __m256 *minc) {
    const __m128i *sub = (const __m128i *)(sp + k_header(l) - 16 * Q6K_GROUPS + 16 * g + 8 * h);
    __m256 d = _mm256_loadu_ps((const float *)sp + 8 * h);
    if (!k_mins(l)) return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(sub))));
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sub));
    __m256 sc = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    __m256 m = _mm256_mul_ps(_mm256_loadu_ps((const float *)sp + 16 + 8 * h),
                             _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)));
    *minc = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps((float)k_centre(l)), _mm256_mul_ps(d, sc)), m);
    return sc;
}

/* Half h of the AVX-512 k_span_scale. */
INLINE __m256 k_span_scale(const uint8_t *sp, KLayout l, int h, float xs) {
    return k_mins(l) ? _mm256_mul_ps(_mm256_loadu_ps((const float *)sp + 8 * h), _mm256_set1_ps(xs))
                       : _mm256_set1_ps(xs);
}

/* acc + the products of q[2r], q[2r + 1] with x's columns 8r .. 8r + 7. Plain AVX2: vpmaddubsw's pairs are at most
 * 2 * 63 * 127 = 16002, two of them 32004 < 32767 in int16: exact, then one vpmaddwd to int32. */
INLINE __m256i q6k_step(__m256i acc, const __m256i *q, const int8_t *x) {
    __m256i x0 = _mm256_set1_epi32(four_bytes(x)), x1 = _mm256_set1_epi32(four_bytes(x + 4));
#ifdef LS_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, q[0], x0), q[1], x1);
#else
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], x0), _mm256_maddubs_epi16(q[1], x1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* Group g (at p, column c) of half h of the super-block at sp for rows i < mb: t[i] and res[i] as the AVX-512
 * q6k_super's, `stride` registers apart; minc: the half's factors of the span's 4 groups (Q2_K). */
INLINE void q6k_half_group(FileRows x, const uint8_t *sp, const uint8_t *p, int64_t K, int64_t c, int g, int h,
                           KLayout l, int mb, int stride, __m256 *t, __m256 *res, __m256 *minc) {
    __m256 scale = k_scale(sp, l, g, h, &minc[g % 4]);
    __m256i q[4];
    k_unpack(p, l, h, q);
    for (int i = 0; i < mb; i++) {
        const int8_t *xi = x.xq + i * K + c;
        __m256i acc = q6k_step(q6k_step(_mm256_set1_epi32(k_start(x, l, i, c)), q, xi), q + 2, xi + 8);
        __m256 *ti = t + stride * i, *ri = res + stride * i;
        *ti = g % 4 == 0 ? _mm256_mul_ps(scale, _mm256_cvtepi32_ps(acc))
                         : _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(acc), *ti);
        if (g % 4 < 3) continue;
        *ri = _mm256_fmadd_ps(k_span_scale(sp, l, h, x.xs[i * (K / XBLOCK) + c / XBLOCK]), *ti, *ri);
        for (int j = 0; k_mins(l) && j < 4; j++)
            *ri = _mm256_fmadd_ps(minc[j], _mm256_set1_ps(k_sum_x(x, i, c - 16 * (3 - j))), *ri);
    }
}

/* As the AVX-512 q6k_super, each row's 16 outputs as two halves of 8 (res[2 i + h]), a group's halves in turn. */
INLINE void q6k_super(FileRows x, const uint8_t *p, int64_t ahead, int64_t K, int64_t s, KLayout l, int mb,
                      __m256 *res) {
    q6k_fetch(p, ahead, k_header(l), mb);
    const uint8_t *sp = p;
    __m256 t[2 * Q6ROWS], minc[2][4] = {{0}};
    p += k_header(l);
    for (int g = 0; g < Q6K_GROUPS; g++, p += k_group_bytes(l)) {
        q6k_fetch(p, ahead, k_group_bytes(l), mb);
        for (int h = 0; h < 2; h++)
            q6k_half_group(x, sp, p, K, 256 * s + 16 * g, g, h, l, mb, 2, t + h, res + h, minc[h]);
    }
}

/* q6k_block for more rows: the block's half h = 0, then h = 1, each over all its super-blocks with one register of
 * sums a row (q6k_super keeps both halves': 4 registers a row, 2 rows a pass), so Q6K_HROWS rows share each unpacked
 * half-group; the first half fetches the next block. The same operations on each output in the same order: the same
 * bits. lm_head (102400 x 2048) on Zen 4 capped to AVX2, 2 threads, against int8 in turns: 8 rows 0.76x -> 0.96x,
 * 32 rows 0.84x; 4 rows 0.77x -> 0.95-1.3x. */
INLINE void q6k_halves(FileRows x, const uint8_t *p, int64_t K, KLayout l, int mb, float (*out)[16]) {
    const int64_t super = k_super(l), ahead = K / 256 * super;
    for (int h = 0; h < 2; h++) {
        __m256 res[Q6K_HROWS], t[Q6K_HROWS], minc[4] = {0};
        for (int i = 0; i < mb; i++) res[i] = _mm256_setzero_ps();
        for (int64_t s = 0; s < K / 256; s++) {
            const uint8_t *sp = p + s * super;
            if (h == 0) q6k_fetch(sp, ahead, k_header(l), mb);
            for (int g = 0; g < Q6K_GROUPS; g++) {
                const uint8_t *gp = sp + k_header(l) + k_group_bytes(l) * g;
                if (h == 0) q6k_fetch(gp, ahead, k_group_bytes(l), mb);
                q6k_half_group(x, sp, gp, K, 256 * s + 16 * g, g, h, l, mb, 1, t, res, minc);
            }
        }
        for (int i = 0; i < mb; i++) _mm256_storeu_ps(out[i] + 8 * h, res[i]);
    }
}

INLINE void q6k_store(const __m256 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) {
        _mm256_storeu_ps(out[i], res[2 * i]);
        _mm256_storeu_ps(out[i] + 8, res[2 * i + 1]);
    }
}

typedef __m256 Q6Sums[2 * Q6ROWS];
#define Q6K_ZERO(res) for (int i = 0; i < 2 * mb; i++) res[i] = _mm256_setzero_ps()
#endif

/* out[i][j] = output j of the block at p for activation row i. */
INLINE void q6k_block(FileRows x, const uint8_t *p, int64_t K, KLayout l, int mb, float (*out)[16]) {
    Q6Sums res;
    Q6K_ZERO(res);
    const int64_t super = k_super(l);
    for (int64_t s = 0; s < K / 256; s++) q6k_super(x, p + s * super, K / 256 * super, K, s, l, mb, res);
    q6k_store(res, mb, out);
}

/* q6k_block of two blocks, p0 with rows x0 (into out) and p1 with rows x1 (into out1), super-block by super-block:
 * two streams of weights in flight, each block's arithmetic as it is alone. */
INLINE void q6k_block_pair(FileRows x0, FileRows x1, const uint8_t *p0, const uint8_t *p1, int64_t K, float (*out1)[16],
                           KLayout l, int mb, float (*out)[16]) {
    Q6Sums res0, res1;
    Q6K_ZERO(res0);
    Q6K_ZERO(res1);
    const int64_t super = k_super(l);
    for (int64_t s = 0; s < K / 256; s++) {
        q6k_super(x0, p0 + s * super, K / 256 * super, K, s, l, mb, res0);
        q6k_super(x1, p1 + s * super, K / 256 * super, K, s, l, mb, res1);
    }
    q6k_store(res0, mb, out);
    q6k_store(res1, mb, out1);
}

INLINE void k_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, float *dots, KLayout l) {
#ifdef LS_AMX
    if (m >= AMX_Q6K_ROWS) { /* the rows' whole 16s on tiles, the rest here (as q45_block_dots) */
        int64_t tiles = m & ~(int64_t)15;
        amx_q6k_block_dots((Format){l.bits, 16, 0}, a, first, tiles, block, K, dots);
        first += tiles, m -= tiles, dots += 16 * tiles;
    }
#endif
#ifndef LS_AVX512
    if (m >= Q6K_HALVES_FROM) {
        for (int64_t m0 = 0; m0 < m; m0 += Q6K_HROWS) {
            int mb = m - m0 < Q6K_HROWS ? (int)(m - m0) : Q6K_HROWS;
            float(*out)[16] = (float(*)[16])(dots + 16 * m0);
            FOR_ROWS_UPTO(Q6K_HROWS, q6k_halves, file_rows(a, first + m0, K, k_corrs(l, K)), block, K, l)
        }
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < m; m0 += Q6ROWS) {
        int mb = m - m0 < Q6ROWS ? (int)(m - m0) : Q6ROWS;
        float(*out)[16] = (float(*)[16])(dots + 16 * m0);
        FOR_ROWS_UPTO(Q6ROWS, q6k_block, file_rows(a, first + m0, K, k_corrs(l, K)), block, K, l)
    }
}

INLINE void k_pair_dots(QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m, const uint8_t *block0,
                        const uint8_t *block1, int64_t K, float *dots0, float *dots1, KLayout l) {
#ifndef LS_AVX512
    if (m >= Q6K_HALVES_FROM) {
        k_dots(a0, first0, m, block0, K, dots0, l);
        k_dots(a1, first1, m, block1, K, dots1, l);
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < m; m0 += Q6ROWS) {
        int mb = m - m0 < Q6ROWS ? (int)(m - m0) : Q6ROWS;
        float(*out)[16] = (float(*)[16])(dots0 + 16 * m0), (*out1)[16] = (float(*)[16])(dots1 + 16 * m0);
        FOR_ROWS_UPTO(Q6ROWS, q6k_block_pair, file_rows(a0, first0 + m0, K, k_corrs(l, K)),
                      file_rows(a1, first1 + m0, K, k_corrs(l, K)), block0, block1, K, out1, l)
    }
}

void q6k_block_dots(Format f, QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, float *dots) {
    K_LAYOUTS(f, k_dots, a, first, m, block, K, dots);
}

void q6k_block_pair_dots(Format f, QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m,
                         const uint8_t *block0, const uint8_t *block1, int64_t K, float *dots0, float *dots1) {
    K_LAYOUTS(f, k_pair_dots, a0, first0, a1, first1, m, block0, block1, K, dots0, dots1);
}
