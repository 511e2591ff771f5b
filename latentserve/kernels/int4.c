/* int4 weights (`pack_int4`; quant_blocks.c drives them): y[M, N] = x[M, K] @ dequantized(w)[N, K]^T, weight
 * q * scale + minimum per group of G input columns (q in [0, 15]; G 32, 64 or 128; K % 64 == 0).
 *
 * Layout (`pack_int4`): the outputs in blocks of 16 (N padded with zero rows), each block one stream of bytes read
 * once; per group of G columns, the 16 outputs' (scale, minimum) as bf16 pairs (64 bytes), then G / 8 units of
 * 64 bytes, unit c holding columns 8c .. 8c + 7 of the group: byte 4j + i = q[j, 8c + i] | q[j, 8c + 4 + i] << 4
 * for output j < 16, i < 4. One 64-byte load feeds all 16 outputs against 4 columns of x broadcast to every lane,
 * so the scaling and the corrections are vector multiply-adds across the outputs and no sum is horizontal: rows in
 * the weight's order paid a fixed cost each that short rows (an expert's down projection: 1408 columns) felt most.
 *
 * The activations are quantized to int8 per 64 columns (quant_acts.c). q * scale + minimum is computed as
 * (q - 8) * scale + (minimum + 8 * scale): the quantized activations meet only the centred part of the weight, the
 * rest takes the exact sums of x over each group (q * scale alone, up to twice the weight's range, would multiply
 * the activations' rounding by its large mean). With the integer products of q, the centring is a correction per
 * group: 8 * scale * (sum of x - sum of quantized x). Built for AVX-512 VNNI (vpdpbusd: nibbles u8 x activations
 * s8), AVX2 with AVX-VNNI (the same on 256 bits) and AVX2 (vpmaddubsw, the same operands). Each row's result is the
 * same whatever rows it is computed with, and whether its block is read alone or beside another
 * (int4_block_pair_dots: the same groups' arithmetic, in turns).
 *
 * At many rows the kernel is bound by its arithmetic, not by the unpacking (3 operations a 64-byte unit, shared by
 * the pass's rows): per row and group of 32 columns, 8 vpdpbusd and 4 float operations (the scale's product, its
 * multiply-add and the two corrections), which compete for the same two vector pipes on AMD Zen 4, where int8 has
 * the 8 vpdpbusd alone (2026-12-05, CPU time, one core: about 135 against int8's 175-200 G multiply-adds/s at 48
 * to 512 rows; without the two corrections 1.16x faster). Only fewer float operations a group, i.e. other numerics,
 * would close that gap.
 *
 * AVX2 (no vpdpbusd) multiplies with vpmaddubsw into int16 pairs: per row, 32-byte half-unit and 8 columns 2 of
 * those and their adds, on the same vector ports as the unpacking and the float operations. It counts every vector
 * operation: a half-unit's pair sums stay in int16 over 4 units (the bound in int4_run), so one vpmaddwd a row per
 * 32 columns instead of one vpmaddwd and one int32 add a unit; and from 3 rows (int4_halves) a pass takes one half
 * of the block at a time, 2 registers a row, so 4 rows (not 2) share each unpacking; per row, group of 32 and half,
 * about 24 vector operations instead of 31. Same sums, same float order, same bits. Intel Xeon with AMX (the VM
 * names no model), `ATEN_CPU_CAPABILITY=avx2`, 2 threads, CPU time, `benchmarks/int4_rows_ab.py --isa avx2` against
 * the code before, at 16-512 rows of 2816x2048, 2048x1408 and 3072x1536 (2026-12-06, medians of 5 rounds): group 32
 * 1.17-1.25x, 64 1.12-1.18x, 128 1.22-1.27x; at 8 rows from memory 1.07x (pairs run the halves from 6 rows; at
 * 3-5 the reads bind and the pairs keep int4_group), at 1-4 rows the same.
 *
 * At a few rows (decode) the weight's bytes bind, and int4 did read them slower than int8 (int4 / int8 weight GB/s in
 * the same rounds 0.73-0.79 at 1 row, about 0.5 at 8): its 5-6 vector operations a 64-byte unit (int8: one) keep the
 * core's loads from running as far ahead of the sums, and the hardware prefetchers alone left them waiting on memory.
 * So each group fetches the lines of the one read_ahead bytes further into L1 (quant.h fetch_ahead: on Intel); and on
 * AVX-512 a pass takes 8 rows with one integer accumulator a row (two passes of 4 unpacked and read each block twice;
 * two accumulators a row at 8 rows spilled): 8 rows are bound by the sums. Same sums, same float order, same bits.
 * Intel Xeon (AVX-512 VNNI), 2 threads, CPU time, V2-Lite/V3 shapes, `benchmarks/stream.py --clock cpu --rounds 5
 * --group 32` (and 64, alike), int4 / int8 weight GB/s before -> after: 1 row 0.73-0.79 -> 0.86-0.94, 2 rows 0.79-0.85
 * -> 0.95-1.07, 4 rows 0.80-0.87 -> 0.98-1.16, 8 rows 0.48-0.54 -> 0.72-0.85 (int4 at 1 row mostly about 90 % of the
 * copy bandwidth). The AVX2 build there (ATEN_CPU_CAPABILITY=avx2): 1-2 rows 67-76 % -> 92-93 % of copy. 4 KB ahead or
 * into L2 measured the same, 1 KB less; fetching each unit's line alone (not whole groups) leaves some lines to the
 * prefetchers, slower at 1 row; pairs in turns of 2 KB a block at 1-2 rows (as int8's) no faster. At many rows one
 * accumulator a row and 8 rows a pass: 1.08x (hot, one core).
 */
#include "quant.h"

#ifdef LS_AVX512
#define QROWS 8 /* activation rows per pass over a block: 2 vector registers each */

typedef __m512 Sums[QROWS]; /* a block's 16 outputs for each activation row of a pass */

INLINE void zero_sums(Sums res, int mb) {
    for (int i = 0; i < mb; i++) res[i] = _mm512_setzero_ps();
}

INLINE void store_sums(Sums res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) _mm512_storeu_ps(out[i], res[i]);
}

/* res[i][j] += group g's part of output j of a block for activation row i (xq, xs, corr: row 0's; rows K, K / 64,
 * 2 * K / G apart), the group's bytes at p. */
INLINE void int4_group(const int8_t *xq, const float *xs, const float *corr, const uint8_t *p, int64_t K, int64_t G,
                       int64_t g, int mb, Sums res) {
    const __m512i low = _mm512_set1_epi8(0x0f), high_half = _mm512_set1_epi32((int)0xffff0000);
    int64_t span = G < XBLOCK ? G : XBLOCK;
    fetch_ahead(p, 64 + 8 * G);
    __m512i pairs = _mm512_loadu_si512(p);
    __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
    __m512 minimum = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
    p += 64;
    for (int64_t k = g * G; k < (g + 1) * G; k += span) { /* under one scale of x */
        __m512i acc[QROWS]; /* the low and high nibbles' products alike: an integer sum in any order */
        for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_si512();
        for (int64_t c = k; c < k + span; c += 8, p += 64) {
            __m512i v = _mm512_loadu_si512(p);
            __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int i = 0; i < mb; i++) {
                acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(four_bytes(xq + i * K + c)));
                acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(four_bytes(xq + i * K + c + 4)));
            }
        }
        for (int i = 0; i < mb; i++) {
            __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(xs[i * (K / XBLOCK) + k / XBLOCK]));
            res[i] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(acc[i]), res[i]);
        }
    }
    for (int i = 0; i < mb; i++) {
        const float *cg = corr + i * 2 * (K / G) + 2 * g;
        res[i] = _mm512_fmadd_ps(scale, _mm512_set1_ps(cg[0]), res[i]);
        res[i] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(cg[1]), res[i]);
    }
}
#else
#define QROWS 2   /* rows a pass of the pairs (int4_group: a unit's two halves in turn) */
#ifdef LS_AVXVNNI
#define HROWS 6   /* vpdpbusd sums in int32 (no int16 runs): 1.2x 4 rows at 16-512 (5 to 8 alike) */
#else
#define HROWS 4   /* rows a pass of int4_halves: 2 registers a row (3 at groups of 64 and 128) */
#endif
#define HALVES_FROM 3 /* rows from which a lone block runs int4_halves */
#define PAIR_HALVES_FROM 6 /* rows from which a pair runs int4_halves on each block: below, the reads bind */

typedef __m256 Sums[2][QROWS]; /* the 16 outputs of a block as two halves of 8, for each activation row of a pass */

INLINE void zero_sums(Sums res, int mb) {
    for (int i = 0; i < mb; i++) res[0][i] = res[1][i] = _mm256_setzero_ps();
}

INLINE void store_sums(Sums res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) {
        _mm256_storeu_ps(out[i], res[0][i]);
        _mm256_storeu_ps(out[i] + 8, res[1][i]);
    }
}

/* run + the products of a unit's low nibbles with x0 and its high ones with x1. AVX-VNNI: vpdpbusd into int32 lanes.
 * Plain AVX2: vpmaddubsw sums a nibble pair's products in int16, at most 2 * 15 * 127 = 3810 (|xq| <= 127); the low
 * and high nibbles of 4 units (int4_run) are 8 of those, at most 30480 < 32767 in int16 in any order: exact, and one
 * vpmaddwd a row (int4_widen) takes them to int32, not one a unit. */
INLINE __m256i int4_step(__m256i run, __m256i lo, __m256i hi, __m256i x0, __m256i x1) {
#ifdef LS_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(run, lo, x0), hi, x1);
#else
    return _mm256_add_epi16(_mm256_add_epi16(run, _mm256_maddubs_epi16(lo, x0)), _mm256_maddubs_epi16(hi, x1));
#endif
}

INLINE __m256i int4_widen(__m256i run) {
#ifdef LS_AVXVNNI
    return run;
#else
    return _mm256_madd_epi16(run, _mm256_set1_epi16(1));
#endif
}

/* acc[i] (+)= the int32 sums of 4 units (columns c .. c + 31) of one half of a block for row i, the half-units at p,
 * 64 bytes apart; `first`: acc[i] starts there. */
INLINE void int4_run(const int8_t *xq, const uint8_t *p, int64_t K, int64_t c, int first, int mb, __m256i *acc) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i run[HROWS];
    for (int i = 0; i < mb; i++) run[i] = _mm256_setzero_si256();
    for (int u = 0; u < 4; u++, c += 8, p += 64) {
        __m256i v = _mm256_loadu_si256((const __m256i *)p);
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int i = 0; i < mb; i++) {
            run[i] = int4_step(run[i], lo, hi, _mm256_set1_epi32(four_bytes(xq + i * K + c)),
                               _mm256_set1_epi32(four_bytes(xq + i * K + c + 4)));
            /* a chain per row: else gcc sums the group's products as a tree, all of them live, spilled (0.8x) */
            __asm__("" : "+x"(run[i]));
        }
    }
    for (int i = 0; i < mb; i++) {
        __m256i sums = int4_widen(run[i]);
        acc[i] = first ? sums : _mm256_add_epi32(acc[i], sums);
    }
}

/* res[i] += group g's part of outputs 8h .. 8h + 7 of a block for activation row i: the AVX-512 int4_group's
 * arithmetic, in its order, on one half of each 64-byte unit; the group's bytes at p. */
INLINE void int4_half_group(const int8_t *xq, const float *xs, const float *corr, const uint8_t *p, int64_t K,
                            int64_t G, int64_t g, int h, int mb, __m256 *res) {
    int64_t span = G < XBLOCK ? G : XBLOCK;
    __m256i pairs = _mm256_loadu_si256((const __m256i *)(p + 32 * h));
    __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    __m256 minimum = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xffff0000)));
    p += 64 + 32 * h;
    for (int64_t k = g * G; k < (g + 1) * G; k += span) { /* under one scale of x */
        __m256i acc[HROWS];
        for (int64_t c = k; c < k + span; c += 32, p += 4 * 64) int4_run(xq, p, K, c, c == k, mb, acc);
        for (int i = 0; i < mb; i++) {
            __m256 sx = _mm256_set1_ps(xs[i * (K / XBLOCK) + k / XBLOCK]);
            res[i] = _mm256_fmadd_ps(_mm256_mul_ps(scale, sx), _mm256_cvtepi32_ps(acc[i]), res[i]);
        }
    }
    for (int i = 0; i < mb; i++) {
        const float *cg = corr + i * 2 * (K / G) + 2 * g;
        res[i] = _mm256_fmadd_ps(scale, _mm256_set1_ps(cg[0]), res[i]);
        res[i] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(cg[1]), res[i]);
    }
}

/* As the AVX-512 int4_group, each row's 16 outputs as two halves of 8, the group's halves in turn. */
INLINE void int4_group(const int8_t *xq, const float *xs, const float *corr, const uint8_t *p, int64_t K, int64_t G,
                       int64_t g, int mb, Sums res) {
    fetch_ahead(p, 64 + 8 * G);
    for (int h = 0; h < 2; h++) int4_half_group(xq, xs, corr, p, K, G, g, h, mb, res[h]);
}

/* int4_block for more rows: the block's half h = 0, then h = 1, each over all its groups with one register of float
 * sums a row (int4_group keeps both halves': 4 registers a row, 2 rows a pass), so HROWS rows share each unpacked
 * half-unit. The same operations on each output, in the same order: the same bits. */
INLINE void int4_halves(const int8_t *xq, const float *xs, const float *corr, const uint8_t *p, int64_t K, int64_t G,
                        int mb, float (*out)[16]) {
    for (int h = 0; h < 2; h++) {
        __m256 res[HROWS];
        for (int i = 0; i < mb; i++) res[i] = _mm256_setzero_ps();
        for (int64_t g = 0; g < K / G; g++) {
            if (h == 0) fetch_ahead(p + g * (64 + 8 * G), 64 + 8 * G); /* the second half finds the block in cache */
            int4_half_group(xq, xs, corr, p + g * (64 + 8 * G), K, G, g, h, mb, res);
        }
        for (int i = 0; i < mb; i++) _mm256_storeu_ps(out[i] + 8 * h, res[i]);
    }
}
#endif

/* out[i][j] = output j of the block at p for activation row i (xq, xs, corr: row 0's). */
INLINE void int4_block(const int8_t *xq, const float *xs, const float *corr, const uint8_t *p, int64_t K, int64_t G,
                       int mb, float (*out)[16]) {
    Sums res;
    zero_sums(res, mb);
    for (int64_t g = 0; g < K / G; g++) int4_group(xq, xs, corr, p + g * (64 + 8 * G), K, G, g, mb, res);
    store_sums(res, mb, out);
}

/* int4_block of two blocks, p0 with rows x0 (into out) and p1 with rows x1 (into out1), group by group: two streams
 * of weights in flight, each block's arithmetic as it is alone. */
INLINE void int4_block_pair(const int8_t *x0, const float *xs0, const float *corr0, const int8_t *x1,
                            const float *xs1, const float *corr1, const uint8_t *p0, const uint8_t *p1, int64_t K,
                            int64_t G, float (*out1)[16], int mb, float (*out)[16]) {
    Sums res0, res1;
    zero_sums(res0, mb);
    zero_sums(res1, mb);
    for (int64_t g = 0; g < K / G; g++) {
        int4_group(x0, xs0, corr0, p0 + g * (64 + 8 * G), K, G, g, mb, res0);
        int4_group(x1, xs1, corr1, p1 + g * (64 + 8 * G), K, G, g, mb, res1);
    }
    store_sums(res0, mb, out);
    store_sums(res1, mb, out1);
}

/* Row r of a's quantized rows, scales and corrections. */
#define INT4_ROW(a, r, K, G) (a).q + (r) * (K), (a).s + (r) * ((K) / XBLOCK), (a).corr + (r) * 2 * ((K) / (G))

/* fn (int4_block or int4_halves) over rows first.. first + m of a in passes of `rows`, with mb and G constants: the
 * loops over them unrolled. */
#define INT4_PASSES(rows, fn)                                                       \
    for (int64_t m0 = 0; m0 < m; m0 += rows) {                                      \
        int mb = m - m0 < rows ? (int)(m - m0) : rows;                              \
        float(*out)[16] = (float(*)[16])(dots + 16 * m0);                           \
        if (G == 128)                                                               \
            FOR_ROWS_UPTO(rows, fn, INT4_ROW(a, first + m0, K, 128), block, K, 128) \
        else if (G == 64)                                                           \
            FOR_ROWS_UPTO(rows, fn, INT4_ROW(a, first + m0, K, 64), block, K, 64)   \
        else                                                                        \
            FOR_ROWS_UPTO(rows, fn, INT4_ROW(a, first + m0, K, 32), block, K, 32)   \
    }

void int4_block_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, int64_t G, float *dots) {
#ifdef LS_AMX
    if (m >= amx_int4_rows(G)) return amx_int4_block_dots(a, first, m, block, K, G, dots);
#endif
#ifndef LS_AVX512
    if (m >= HALVES_FROM) {
        INT4_PASSES(HROWS, int4_halves)
        return;
    }
#endif
    INT4_PASSES(QROWS, int4_block)
}

void int4_block_pair_dots(QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m, const uint8_t *block0,
                          const uint8_t *block1, int64_t K, int64_t G, float *dots0, float *dots1) {
#ifndef LS_AVX512
    if (m >= PAIR_HALVES_FROM) {
        int4_block_dots(a0, first0, m, block0, K, G, dots0);
        int4_block_dots(a1, first1, m, block1, K, G, dots1);
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < m; m0 += QROWS) {
        int mb = m - m0 < QROWS ? (int)(m - m0) : QROWS;
        float(*out)[16] = (float(*)[16])(dots0 + 16 * m0), (*out1)[16] = (float(*)[16])(dots1 + 16 * m0);
        if (G == 128)
            FOR_ROWS_UPTO(QROWS, int4_block_pair, INT4_ROW(a0, first0 + m0, K, 128), INT4_ROW(a1, first1 + m0, K, 128),
                          block0, block1, K, 128, out1)
        else if (G == 64)
            FOR_ROWS_UPTO(QROWS, int4_block_pair, INT4_ROW(a0, first0 + m0, K, 64), INT4_ROW(a1, first1 + m0, K, 64),
                          block0, block1, K, 64, out1)
        else
            FOR_ROWS_UPTO(QROWS, int4_block_pair, INT4_ROW(a0, first0 + m0, K, 32), INT4_ROW(a1, first1 + m0, K, 32),
                          block0, block1, K, 32, out1)
    }
}
