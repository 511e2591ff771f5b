/* llama.cpp's 4- and 5-bit weights in groups of 32 columns (quant_blocks.c and experts.c drive them): y[M, N] =
 * x[M, K] @ w[N, K]^T with the file's values exactly, q an output and column's integer:
 * - Q5_0 (`pack_q50`, Format (5, 32)): w = d * (q - 16), q in [0, 31], per 32 columns an fp16 d. K % 64 == 0.
 * - Q5_1 (`pack_q51`, Format (5, 32, mins)): w = d * q + m, q in [0, 31], per 32 columns fp16 d and m. K % 64 == 0.
 * - Q5_K (`pack_q5k`, Format (5, 256)): w = d * sc * q - dmin * m, q in [0, 31], per 256 columns an fp16 d and dmin,
 *   per 32 a 6-bit sc and m. K % 256 == 0.
 * - Q4_K (`pack_q4k`, Format (4, 256)): Q5_K's formula with q in [0, 15]. K % 256 == 0.
 *
 * Why their own layouts: as int8 per row a weight read 8 bits where the file holds 4.5-5.5 (Q4_K_M keeps a tensor at
 * Q5_0 where its rows are not a multiple of 256: DeepSeek-V2's experts' down projections, 1408 columns; Q5_K_M files
 * are mostly Q5_K, with Q5_1 where Q4_K_M has Q5_0), and its values were rounded again; as int4's groups (a bf16 scale
 * and minimum per 32 columns) Q4_K read 5 bits a weight and ran d * sc and dmin * m rounded to bf16.
 *
 * Layout: the outputs in blocks of 16 (N padded with zero rows), each block one stream of bytes. Per group of 32
 * columns a 32-byte header, for the 5-bit layouts 64 bytes of fifth bits (Q5_GROUP bytes a group; Q4_K: none,
 * Q4_GROUP), then four 64-byte units of nibbles as int4's: unit c byte 4j + i = low 4 bits of q[j, 8c + i] | those of
 * q[j, 8c + 4 + i] << 4. The fifth bits' byte 4j + i holds in bit 2c + h that of q[j, 8c + 4h + i]: each unit's half
 * finds its fifth bits at the same byte. One 64-byte load feeds all 16 outputs against 4 columns of x broadcast to
 * every lane, as int4's. Q5_0's header is the 16 outputs' d (fp16); Q5_1's their d then their m (fp16, a 64-byte
 * header); the k-quants' their 16 sc then 16 m (a byte each), after, per 256 columns (Q5K_SUPER, Q4K_SUPER bytes), the
 * 16 outputs' d and dmin in fp32 (the file's fp16): 5.5 bits a weight (Q5_0, as the file), 6 (Q5_1, as the file), 5.75
 * (Q5_K: the file 5.5), 4.75 (Q4_K: the file 4.5).
 *
 * The activations are int4's (int8 per 64 columns, quant_acts.c) with per 32 columns -centre * the sum of their
 * quantized x (as int32; centre 16 for 5 bits, 8 for 4), which starts a group's integer sum, so that it is the sum of
 * (q - centre) * xq with q as the unsigned operand of vpdpbusd (AVX2: vpmaddubsw); the k-quants' and Q5_1's also with
 * the group's exact sum of x. Per group the sum times the scale (Q5_0, Q5_1: d; k-quants: d * sc, in fp32 as gguf
 * computes it) times x's scale goes into the row's sums, and for the k-quants the exact sum of x times centre * scale -
 * dmin * m, for Q5_1 times centre * d + m (q = (q - centre) + centre). Same operations in the same order on every
 * build: the same bits on AVX2 and AVX-512. */
#include "q45.h"

/* Rows up to which a pair of blocks runs group by group (two streams in flight); from more, one block after the
 * other. The 5-bit layouts' pairs stop at 2 rows (the fifth bits' registers beside both blocks' sums); Q4_K's run to
 * the drivers' PAIR_ROWS (AVX-512, kernel against int4's on the same values, 2048 x 2048: 0.79x -> 0.97x at 4 rows,
 * 0.91x -> 1.24x at 8). */
INLINE int q45_pair_rows(Q45Layout l) { return l.fifth ? 2 : PAIR_ROWS; }

#ifdef LS_AVX512
#define Q45ROWS 8 /* activation rows a pass: an accumulator and a sum each */

/* res[i][j] += group g's part of output j of a block for activation row i, the group's bytes at p, its superblock's
 * d and dmin at sd (Q5_0: none). Unit c's two vectors of q are unpacked and met by every row before the next unit's. */
INLINE void q45_group(FileRows x, const uint8_t *p, const float *sd, Q45Layout l, int64_t K, int64_t g, int mb,
                      __m512 *res) {
    __m512i hb = q45_fifths(p, l), acc[Q45ROWS];
    for (int i = 0; i < mb; i++) acc[i] = _mm512_set1_epi32(x.corr[i * x.corrs + (1 + q45_sums(l)) * g]);
    for (int c = 0; c < Q45_UNITS; c++) {
        __m512i lo, hi;
        q45_unit(p, hb, l, c, &lo, &hi);
        for (int i = 0; i < mb; i++) {
            const int8_t *xi = x.xq + i * K + 32 * g + 8 * c;
            acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(four_bytes(xi)));
            acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(four_bytes(xi + 4)));
        }
    }
    __m512 minc = _mm512_setzero_ps(), scale = q45_scales(p, sd, l, &minc);
    for (int i = 0; i < mb; i++) {
        __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(x.xs[i * (K / XBLOCK) + g / 2]));
        res[i] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(acc[i]), res[i]);
        if (q45_sums(l))
            res[i] = _mm512_fmadd_ps(minc, _mm512_set1_ps(((const float *)x.corr)[i * x.corrs + 2 * g + 1]), res[i]);
    }
}

INLINE void q45_store(const __m512 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) _mm512_storeu_ps(out[i], res[i]);
}

typedef __m512 Q45Sums[Q45ROWS];
#define Q45_ZERO(res) for (int i = 0; i < mb; i++) res[i] = _mm512_setzero_ps()
#else
#define Q45ROWS 4 /* activation rows a pass (q45_halves: HALF_ROWS) */
#define Q45_HALVES_FROM 3 /* rows from which a lone Q4_K block runs q45_halves (the 5-bit layouts: 0.8-0.9x there) */
#ifdef LS_AVXVNNI
/* vpdpbusd's sums in int32, as int4's HROWS: against 4 rows, Q4_K 2816 x 2048 on an Intel Xeon's AVX-VNNI, one
 * thread, in turns: 1.09-1.12x at 16-512 rows (6 rows); with q45_halves unrolled, 8 against 6: 1.05-1.06x */
#define Q45_HALF_ROWS 8
#else
#define Q45_HALF_ROWS 4 /* a run's register and a sum's a row (6: 0.94-0.96x at 16-512 rows) */
#endif

/* As the AVX-512 q5_fifth on 256 bits: bit r of hb's byte moved to bit 4 and added in. */
INLINE __m256i q5_fifth(__m256i q, __m256i hb, int r) {
    __m256i at4 = r < 4 ? _mm256_slli_epi16(hb, 4 - r) : r > 4 ? _mm256_srli_epi16(hb, r - 4) : hb;
    return _mm256_or_si256(q, _mm256_and_si256(at4, _mm256_set1_epi8(0x10)));
}

/* res[i] += group g's part of outputs 8h .. 8h + 7 of a block for row i: the AVX-512 q45_group's arithmetic on one
 * half of each unit. Plain AVX2 multiplies with vpmaddubsw: its pairs are at most 2 * 31 * 127 = 7874 (4 bits:
 * 3810), so a run of them stays in int16 over 2 units (4 bits: all 4, 30480 < 32767), exact, then one vpmaddwd to
 * int32 a run (the integer sums in any order: the same bits). */
INLINE void q45_half(FileRows x, const uint8_t *p, const float *sd, Q45Layout l, int64_t K, int64_t g, int h, int mb,
                     __m256 *res) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const uint8_t *units = p + q45_header(l) + (l.fifth ? 64 : 0);
    __m256i hb = l.fifth ? _mm256_loadu_si256((const __m256i *)(p + q45_header(l) + 32 * h)) : _mm256_setzero_si256(),
            acc[Q45_HALF_ROWS];
#ifdef LS_AVXVNNI
    for (int i = 0; i < mb; i++) acc[i] = _mm256_set1_epi32(x.corr[i * x.corrs + (1 + q45_sums(l)) * g]);
#else
    const int run_units = l.fifth ? 2 : 4;
    __m256i run[Q45_HALF_ROWS] = {0}; /* (each run's first unit sets them: for the compiler) */
#endif
    for (int c = 0; c < Q45_UNITS; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(units + 64 * c + 32 * h));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if (l.fifth) lo = q5_fifth(lo, hb, 2 * c), hi = q5_fifth(hi, hb, 2 * c + 1);
        for (int i = 0; i < mb; i++) {
            const int8_t *xi = x.xq + i * K + 32 * g + 8 * c;
            __m256i x0 = _mm256_set1_epi32(four_bytes(xi)), x1 = _mm256_set1_epi32(four_bytes(xi + 4));
#ifdef LS_AVXVNNI
            acc[i] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc[i], lo, x0), hi, x1);
#else
            __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
            run[i] = c % run_units == 0 ? two : _mm256_add_epi16(run[i], two);
            if (!l.fifth) /* a chain per row (as int4_run's): else gcc sums 4 units as a tree, spilled (0.85x) */
                __asm__("" : "+x"(run[i]));
            if (c % run_units == run_units - 1) {
                __m256i sums = _mm256_madd_epi16(run[i], _mm256_set1_epi16(1));
                acc[i] = _mm256_add_epi32(
                    c < run_units ? _mm256_set1_epi32(x.corr[i * x.corrs + (1 + q45_sums(l)) * g]) : acc[i], sums);
            }
#endif
        }
    }
    __m256 scale, minc = _mm256_setzero_ps();
    if (l.ks) {
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))));
        __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 + 8 * h))));
        scale = _mm256_mul_ps(_mm256_loadu_ps(sd + 8 * h), sc);
        minc = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps((float)q45_centre(l)), scale),
                             _mm256_mul_ps(_mm256_loadu_ps(sd + 16 + 8 * h), m));
    } else {
        scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
        if (l.mins)
            minc = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(16.f), scale),
                                 _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * h))));
    }
    for (int i = 0; i < mb; i++) {
        __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(x.xs[i * (K / XBLOCK) + g / 2]));
        res[i] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(acc[i]), res[i]);
        if (q45_sums(l))
            res[i] = _mm256_fmadd_ps(minc, _mm256_set1_ps(((const float *)x.corr)[i * x.corrs + 2 * g + 1]), res[i]);
    }
}

typedef __m256 Q45Sums[2][Q45ROWS]; /* a block's two halves of 8 outputs, for each row of a pass */

/* As the AVX-512 q45_group, a group's halves in turn. */
INLINE void q45_group(FileRows x, const uint8_t *p, const float *sd, Q45Layout l, int64_t K, int64_t g, int mb,
                      Q45Sums res) {
    for (int h = 0; h < 2; h++) q45_half(x, p, sd, l, K, g, h, mb, res[h]);
}

INLINE void q45_store(Q45Sums res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) {
        _mm256_storeu_ps(out[i], res[0][i]);
        _mm256_storeu_ps(out[i] + 8, res[1][i]);
    }
}

#define Q45_ZERO(res) for (int i = 0; i < mb; i++) res[0][i] = res[1][i] = _mm256_setzero_ps()
#endif

#ifndef LS_AVX512
/* q45_block for more rows: the block's half h = 0, then h = 1, each over all its groups with one register of float
 * sums a row (q45_group keeps both halves': 2 registers a row, 4 rows a pass), so Q45_HALF_ROWS rows share each
 * unpacked half-unit. The same operations on each output in the same order: the same bits. */
INLINE void q45_halves(FileRows x, const uint8_t *p, Q45Layout l, int64_t K, int mb, float (*out)[16]) {
    /* Unrolled, each half's unit offsets are constants, not 4 of the 16 general registers the rows' pointers spilled
     * from (Q4_K 2816 x 2048, one core, in turns: AVX-VNNI 1.06-1.10x at 64-512 rows, plain AVX2 1.02x). */
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m256 res[Q45_HALF_ROWS];
        for (int i = 0; i < mb; i++) res[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < K / 32; g++) {
            const float *sd;
            const uint8_t *at = q45_at(p, l, g, &sd);
            if (h == 0) fetch_ahead(at, q45_group_bytes(l)); /* the second half finds the block in cache */
            q45_half(x, at, sd, l, K, g, h, mb, res);
        }
        for (int i = 0; i < mb; i++) _mm256_storeu_ps(out[i] + 8 * h, res[i]);
    }
}
#endif

/* Group g of the block at p into res, the group read_ahead bytes on fetched (int4's reason: the unpacking keeps the
 * loads from running ahead). */
INLINE void q45_block_group(FileRows x, const uint8_t *p, Q45Layout l, int64_t K, int64_t g, int mb, Q45Sums res) {
    const float *sd;
    const uint8_t *at = q45_at(p, l, g, &sd);
    fetch_ahead(at, q45_group_bytes(l));
    q45_group(x, at, sd, l, K, g, mb, res);
}

/* out[i][j] = output j of the block at p for activation row i. */
INLINE void q45_block(FileRows x, const uint8_t *p, Q45Layout l, int64_t K, int mb, float (*out)[16]) {
    Q45Sums res;
    Q45_ZERO(res);
    for (int64_t g = 0; g < K / 32; g++) q45_block_group(x, p, l, K, g, mb, res);
    q45_store(res, mb, out);
}

/* q45_block of two blocks, p0 with rows x0 (into out) and p1 with rows x1 (into out1), group by group: two streams
 * of weights in flight, each block's arithmetic as it is alone. */
INLINE void q45_block_pair(FileRows x0, FileRows x1, const uint8_t *p0, const uint8_t *p1, Q45Layout l, int64_t K,
                           float (*out1)[16], int mb, float (*out)[16]) {
    Q45Sums res0, res1;
    Q45_ZERO(res0);
    Q45_ZERO(res1);
    for (int64_t g = 0; g < K / 32; g++) {
        q45_block_group(x0, p0, l, K, g, mb, res0);
        q45_block_group(x1, p1, l, K, g, mb, res1);
    }
    q45_store(res0, mb, out);
    q45_store(res1, mb, out1);
}

INLINE void q45_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, float *dots, Q45Layout l) {
#ifndef LS_AVX512
    if (!l.fifth && m >= Q45_HALVES_FROM) {
        for (int64_t m0 = 0; m0 < m; m0 += Q45_HALF_ROWS) {
            int mb = m - m0 < Q45_HALF_ROWS ? (int)(m - m0) : Q45_HALF_ROWS;
            float(*out)[16] = (float(*)[16])(dots + 16 * m0);
            FOR_ROWS_UPTO(Q45_HALF_ROWS, q45_halves, file_rows(a, first + m0, K, q45_corrs(l, K)), block, l, K)
        }
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < m; m0 += Q45ROWS) {
        int mb = m - m0 < Q45ROWS ? (int)(m - m0) : Q45ROWS;
        float(*out)[16] = (float(*)[16])(dots + 16 * m0);
        FOR_ROWS_UPTO(Q45ROWS, q45_block, file_rows(a, first + m0, K, q45_corrs(l, K)), block, l, K)
    }
}

INLINE void q45_pair_dots(QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m,
                          const uint8_t *block0, const uint8_t *block1, int64_t K, float *dots0, float *dots1,
                          Q45Layout l) {
    if (m > q45_pair_rows(l)) {
        q45_dots(a0, first0, m, block0, K, dots0, l);
        q45_dots(a1, first1, m, block1, K, dots1, l);
        return;
    }
    for (int64_t m0 = 0; m0 < m; m0 += Q45ROWS) {
        int mb = m - m0 < Q45ROWS ? (int)(m - m0) : Q45ROWS;
        float(*out)[16] = (float(*)[16])(dots0 + 16 * m0), (*out1)[16] = (float(*)[16])(dots1 + 16 * m0);
        FOR_ROWS_UPTO(Q45ROWS, q45_block_pair, file_rows(a0, first0 + m0, K, q45_corrs(l, K)),
                      file_rows(a1, first1 + m0, K, q45_corrs(l, K)), block0, block1, l, K, out1)
    }
}

void q45_block_dots(Format f, QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, float *dots) {
#ifdef LS_AMX
    if (m >= AMX_Q45_ROWS) { /* the rows' whole 16s on tiles, the rest here (a tile for them ran 0.75-0.9x) */
        int64_t tiles = m & ~(int64_t)15;
        amx_q45_block_dots(f, a, first, tiles, block, K, dots);
        first += tiles, m -= tiles, dots += 16 * tiles;
    }
#endif
    Q45_LAYOUTS(f, q45_dots, a, first, m, block, K, dots);
}

void q45_block_pair_dots(Format f, QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m,
                         const uint8_t *block0, const uint8_t *block1, int64_t K, float *dots0, float *dots1) {
    Q45_LAYOUTS(f, q45_pair_dots, a0, first0, a1, first1, m, block0, block1, K, dots0, dots1);
}
