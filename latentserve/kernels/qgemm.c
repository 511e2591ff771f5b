/* Quantized linear layers for few rows (decode): y[M, N] = x[M, K] @ dequantized(w)[N, K]^T.
 *
 * The activations are quantized to int8 (symmetric, s = max|x| / 127: per row for int8 weights, per 64 columns for
 * int4) and multiplied with the int8 or int4 weights in integer dot products, so each weight byte is read once and
 * expanded in registers: at a few rows the product is bound by reading the weights, and this keeps up with memory
 * where PyTorch's kernels do not. Each thread walks its share of output rows one row at a time, all activation rows
 * against it: one stream of weights per thread (tiles of 2-4 rows, four streams, measured 1.3-1.5x slower).
 *
 * Built twice by native.py: with -DLS_AVX512 (AVX-512 BW + VNNI: vpdpbusd, u8 x s8) and for AVX2 (vpmaddubsw).
 * Both compute the same integer sums, so their int8 outputs are equal; only int4's float sums may differ.
 *
 * Layouts (row-major, one output row after another):
 *   int8: w int8 [H, N, K] (H = 1 but for MLA's per-head products); scale fp32 [H, N]; wsum int32 [H, N] =
 *         sum_k w[h, n, k]
 *   int4: per output row, (scale, minimum) as bf16 pairs [K / G][2], then the nibbles [K / 2], each 64 columns as
 *         32 bytes: byte j = q[64c + j] | q[64c + 32 + j] << 4; weight = q * scale + minimum over each group of G
 *         columns (G % 32 == 0, K % 64 == 0)
 */
#include "simd.h"

#define XBLOCK 64 /* int4's activations are quantized per 64 columns: one scale per chunk of nibbles */

/* Each row of x in blocks of `block` columns (block divides K): xq = round(x / s) + offset with round(...) in
 * [-127, 127], s = max(max |x| over the block, 1e-12) / 127 per block (rounding half to even, as torch does). An
 * offset of 128 makes the int8 the unsigned operand of vpdpbusd. */
static void quantize_blocks(const void *x, int bf16, int64_t M, int64_t K, int64_t block, int offset, int8_t *xq,
                            float *s) {
    float r[block];
    for (int64_t b = 0; b < M * K / block; b++) {
        int8_t *q = xq + b * block;
        vfloat m = vset1(0.f);
        int64_t k = 0;
        for (; k + LANES <= block; k += LANES) {
            vfloat v = vload(x, bf16, b * block + k);
            vstore(r + k, v);
            m = vmax(m, vabs(v));
        }
        float amax = fmaxf(1e-12f, vmax_reduce(m));
        for (; k < block; k++) {
            r[k] = load_act(x, bf16, b * block + k);
            amax = fmaxf(amax, fabsf(r[k]));
        }
        float sb = amax / 127.f;
        vfloat sv = vset1(sb);
        for (k = 0; k + LANES <= block; k += LANES) vquantize(vload(r, 0, k), sv, offset, q + k);
        for (; k < block; k++) q[k] = (int8_t)(uint8_t)((int)nearbyintf(r[k] / sb) + offset);
        s[b] = sb;
    }
}

#ifdef LS_AVX512
#define INT8_OFFSET 128

/* dot[i] = sum_k (xq[i * xstride + k] + 128) * w[k] over mb activation rows. */
INLINE void int8_rows(const int8_t *xq, int64_t xstride, const int8_t *w, int64_t K, int mb, int32_t dot[MB]) {
    __m512i acc[MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512i wv = _mm512_loadu_si512(w + k);
        for (int i = 0; i < mb; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_loadu_si512(xq + i * xstride + k), wv);
    }
    if (k < K) {
        __mmask64 mask = ~0ULL >> (64 - (K - k));
        __m512i wv = _mm512_maskz_loadu_epi8(mask, w + k);
        for (int i = 0; i < mb; i++)
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_maskz_loadu_epi8(mask, xq + i * xstride + k), wv);
    }
    for (int i = 0; i < mb; i++) dot[i] = _mm512_reduce_add_epi32(acc[i]);
}
#else
#define INT8_OFFSET 0

INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* dot[i] = sum_k xq[i * xstride + k] * w[k]: |x| times w with x's sign, so that pairs of products (at most
 * 2 * 127 * 127) fit vpmaddubsw's int16. */
INLINE void int8_rows(const int8_t *xq, int64_t xstride, const int8_t *w, int64_t K, int mb, int32_t dot[MB]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
        for (int i = 0; i < mb; i++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * xstride + k));
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xv), _mm256_sign_epi8(wv, xv));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(p, ones));
        }
    }
    for (int i = 0; i < mb; i++) {
        int32_t d = hsum_epi32(acc[i]);
        for (int64_t t = k; t < K; t++) d += (int32_t)xq[i * xstride + t] * w[t];
        dot[i] = d;
    }
}
#endif

/* y[m, h, n] = x[m, h, :] . w[h, n, :] for H independent weights (H = 1: a linear layer), x quantized per
 * (m, h) row. */
void ls_int8_heads(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
                   const int32_t *wsum, int64_t N, void *y, int io, int threads) {
    int8_t *xq = malloc(M * H * K);
    float *sx = malloc(M * H * sizeof(float));
    quantize_blocks(x, io & 1, M * H, K, K, INT8_OFFSET, xq, sx);
#pragma omp parallel num_threads(threads)
    {
        /* Each thread a contiguous share of the H * N weight rows, read as two streams (`two_streams`): a cursor
         * (head, row) on each half, advanced without a division per row (short rows: MLA's per-head products have
         * 128 or 512 columns). */
        int64_t rows = H * N, parts = omp_get_num_threads(), part = omp_get_thread_num();
        int64_t begin = rows * part / parts, len = rows * (part + 1) / parts - begin, mid = (len + 1) / 2;
        int64_t cursors[2][2] = {{begin / N, begin % N}, {(begin + mid) / N, (begin + mid) % N}};
        for (int64_t idx = 0; idx < len; idx++) {
            int64_t hn = two_streams(begin, len, idx), *cursor = cursors[idx & 1], h = cursor[0], n = cursor[1];
            for (int64_t m0 = 0; m0 < M; m0 += MB) {
                int mb = M - m0 < MB ? (int)(M - m0) : MB;
                int32_t out[MB];
                FOR_ROWS(int8_rows, xq + (m0 * H + h) * K, H * K, w + hn * K, K)
                for (int i = 0; i < mb; i++) {
                    int64_t row = (m0 + i) * H + h;
                    store_out(y, io & 2, row * N + n, (float)(out[i] - INT8_OFFSET * wsum[hn]) * sx[row] * scale[hn]);
                }
            }
            if (++cursor[1] == N) {
                cursor[1] = 0;
                cursor[0]++;
            }
        }
    }
    free(xq);
    free(sx);
}

#ifdef LS_AVX512
/* dots[j] = sum_k (xq[k] + 128) * w[j, k] for the 16 outputs of a block in the lanes layout (ls_int8_heads_lanes):
 * each 64-byte load holds 4 columns of all 16, against x's 4 bytes in every lane. */
INLINE void lanes_dot(const int8_t *xq, const int8_t *w, int64_t K, int32_t dots[16]) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t c = 0; c < K / 4; c++) {
        int32_t x4;
        memcpy(&x4, xq + 4 * c, 4);
        acc = _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(x4), _mm512_loadu_si512(w + 64 * c));
    }
    _mm512_storeu_si512(dots, acc);
}
#else
/* As the AVX-512 version with x signed (vpmaddubsw's |x| times w with x's sign, as int8_rows does). */
INLINE void lanes_dot(const int8_t *xq, const int8_t *w, int64_t K, int32_t dots[16]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int64_t c = 0; c < K / 4; c++) {
        int32_t x4;
        memcpy(&x4, xq + 4 * c, 4);
        __m256i xv = _mm256_set1_epi32(x4), ax = _mm256_abs_epi8(xv);
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32));
        lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv)), ones));
        hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv)), ones));
    }
    _mm256_storeu_si256((__m256i *)dots, lo);
    _mm256_storeu_si256((__m256i *)(dots + 8), hi);
}
#endif

#ifdef LS_AVX512
/* 64 weights from 32 bytes: low nibbles are columns 0-31, high nibbles 32-63, as the packing put them. */
INLINE __m512i unpack64(const uint8_t *p) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i b = _mm256_loadu_si256((const __m256i *)p);
    __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* 16 lanes: a for lanes 0-7 (columns 0-31 of a chunk in vpdpbusd's sums), b for lanes 8-15 (columns 32-63). */
INLINE __m512 halves(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

/* sum_j bf16 p[j] * f[j] over j < n. */
INLINE float bf16_dot(const uint16_t *p, const float *f, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        __mmask16 mask = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p + j));
        acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), _mm512_maskz_loadu_ps(mask, f + j), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* The group scales of a weight row (the first of each bf16 (scale, minimum) pair) as floats. */
INLINE void row_scales(const uint16_t *pairs, int64_t groups, float *sf) {
    for (int64_t g = 0; g < groups; g += 16) {
        __mmask16 mask = groups - g >= 16 ? 0xffff : (__mmask16)((1u << (groups - g)) - 1);
        __m512i p = _mm512_maskz_loadu_epi32(mask, pairs + 2 * g);
        _mm512_mask_storeu_ps(sf + g, mask, _mm512_castsi512_ps(_mm512_slli_epi32(p, 16)));
    }
}

/* Lanes 0-7 from f[lo], 8-15 from f[hi] (f holds 4 floats). */
INLINE __m512 spread(__m128 f, int lo, int hi) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi),
                                 _mm512_castps128_ps512(f));
}

INLINE __m128 load2(const float *f) { return _mm_castpd_ps(_mm_load_sd((const double *)f)); }

/* dot[i] = sum over 64-column chunks of xs(chunk) * scale(group) * sum_k q[k] * xq[i, k], two chunks a pass: one
 * 64-byte load of nibbles, whose low halves meet x's columns 0-31 of both chunks and high halves columns 32-63
 * (`int4_prepare` stores x in that order). vpdpbusd's lanes 0-7 sum the first chunk, 8-15 the second. Groups of
 * 64 columns or more share a scale over a chunk, so both halves sum in integers; groups of 32 scale each half.
 * The scales come as vectors from the row's floats (`row_scales`), no scalar work in the loop. */
INLINE void int4_rows(const int8_t *xq, const float *xs, const float *sf, const uint8_t *nibbles, int64_t K,
                      int gshift, int mb, float dot[MB]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[MB], acc2[MB];
    for (int i = 0; i < mb; i++) acc[i] = acc2[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        __m512i b = _mm512_loadu_si512(nibbles + k / 2);
        __m512i lo = _mm512_and_si512(b, low), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
        if (gshift >= 6) {
            __m512 ws = gshift == 6 ? spread(load2(sf + k / 64), 0, 1) : _mm512_set1_ps(sf[k >> 7]);
            for (int i = 0; i < mb; i++) {
                const int8_t *x = xq + i * K + k;
                __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x)),
                                                hi, _mm512_loadu_si512(x + 64));
                __m512 scale = _mm512_mul_ps(ws, spread(load2(xs + i * (K / 64) + k / 64), 0, 1));
                if (k & 128)
                    acc2[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc2[i]);
                else
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), scale, acc[i]);
            }
        } else {
            __m128 w4 = _mm_loadu_ps(sf + k / 32);
            __m512 wl = spread(w4, 0, 2), wh = spread(w4, 1, 3);
            for (int i = 0; i < mb; i++) {
                const int8_t *x = xq + i * K + k;
                __m512 sx = spread(load2(xs + i * (K / 64) + k / 64), 0, 1);
                __m512i dl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(x));
                __m512i dh = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(x + 64));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dl), _mm512_mul_ps(wl, sx), acc[i]);
                acc2[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dh), _mm512_mul_ps(wh, sx), acc2[i]);
            }
        }
    }
    if (k < K) { /* an odd last chunk, in plain column order */
        __m512i wv = unpack64(nibbles + k / 2);
        float sa = sf[k >> gshift], sb = sf[(k + 32) >> gshift];
        for (int i = 0; i < mb; i++) {
            __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, _mm512_loadu_si512(xq + i * K + k));
            float sx = xs[i * (K / 64) + k / 64];
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), halves(sa * sx, sb * sx), acc[i]);
        }
    }
    for (int i = 0; i < mb; i++) dot[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc2[i]));
}
#else
INLINE float bf16_dot(const uint16_t *p, const float *f, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + j)));
        acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)), _mm256_loadu_ps(f + j), acc);
    }
    float s = vreduce_add(acc);
    for (; j < n; j++) s += bf16_to_float(p[j]) * f[j];
    return s;
}

/* 32 columns: nibbles q (unsigned) times int8 x, pairs summed in int16 (at most 2 * 15 * 127), then int32, scaled. */
INLINE __m256 scaled_dot(__m256i q, const int8_t *x, float scale) {
    __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x)),
                                  _mm256_set1_epi16(1));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(scale));
}

/* As the AVX-512 version, on `int4_prepare`'s column order: chunk c of a pair meets x's columns 0-31 at 32 * c and
 * 32-63 at 64 + 32 * c. */
INLINE void row_scales(const uint16_t *pairs, int64_t groups, float *sf) {
    for (int64_t g = 0; g < groups; g++) sf[g] = bf16_to_float(pairs[2 * g]);
}

INLINE void int4_rows(const int8_t *xq, const float *xs, const float *sf, const uint8_t *nibbles, int64_t K,
                      int gshift, int mb, float dot[MB]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 acc[MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(nibbles + k / 2));
        __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        float sa = sf[k >> gshift], sb = sf[(k + 32) >> gshift];
        int paired = (k & 64) || k + 128 <= K; /* in a pair of chunks, else a plain last one */
        int64_t base = k & ~(int64_t)127, first = (k & 64) ? 32 : 0;
        for (int i = 0; i < mb; i++) {
            const int8_t *xl = paired ? xq + i * K + base + first : xq + i * K + k;
            const int8_t *xh = paired ? xl + 64 : xl + 32;
            float sx = xs[i * (K / 64) + k / 64];
            acc[i] = _mm256_add_ps(acc[i], _mm256_add_ps(scaled_dot(lo, xl, sa * sx), scaled_dot(hi, xh, sb * sx)));
        }
    }
    for (int i = 0; i < mb; i++) dot[i] = vreduce_add(acc[i]);
}
#endif

INLINE int log2_group(int64_t G) { return G == 32 ? 5 : G == 64 ? 6 : 7; } /* G is 32, 64 or 128 */

/* x's rows as int4_rows takes them: quantized in blocks of 64 columns (xq, scales xs), each pair of chunks reordered
 * to (columns 0-31 of both, then 32-63 of both), and per group of G columns the corrections (centring, sum of x) as
 * the weight's (scale, minimum) pairs (see ls_int4_linear). */
static void int4_prepare(const void *x, int bf16, int64_t M, int64_t K, int64_t G, int8_t *xq, float *xs, float *corr) {
    int64_t groups = K / G, chunks = K / 64;
    quantize_blocks(x, bf16, M, K, XBLOCK, 0, xq, xs);
    int64_t span = G < XBLOCK ? G : XBLOCK; /* a group's columns under one scale of x */
    for (int64_t m = 0; m < M; m++) {
        int8_t *q = xq + m * K;
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
        for (int64_t k = 0; k + 128 <= K; k += 128) { /* swap columns 32-63 with 64-95 */
            int8_t t[32];
            memcpy(t, q + k + 32, 32);
            memcpy(q + k + 32, q + k + 64, 32);
            memcpy(q + k + 64, t, 32);
        }
    }
}

/* Rows of `int4_row_bytes(K, G)`: (scale, minimum) bf16 pairs per group, then the nibbles (layout above): one stream
 * of bytes per row, read once. The activations are quantized in blocks of 64 columns (llama.cpp's Q8 blocks: 32).
 * q * scale + minimum is computed as (q - 8) * scale + (minimum + 8 * scale): the quantized activations meet only
 * the centred part of the weight, the rest takes the exact sums of x over each group (q * scale alone, up to twice
 * the weight's range, would multiply the activations' rounding by its large mean). With the integer products of
 * q, the centring is a correction per group: 8 * scale * (sum of x - sum of quantized x). */
void ls_int4_linear(const void *x, int64_t M, int64_t K, const uint8_t *w, int64_t G, int64_t N, void *y, int io,
                    int threads) {
    int64_t groups = K / G, chunks = K / 64, row_bytes = 4 * groups + K / 2;
    int8_t *xq = malloc(M * K);
    float *xs = malloc(M * chunks * sizeof(float));
    float *corrections = malloc(M * 2 * groups * sizeof(float));
    int4_prepare(x, io & 1, M, K, G, xq, xs, corrections);
    int gshift = log2_group(G);
#pragma omp parallel num_threads(threads)
    for (int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), begin = N * part / parts,
                 len = N * (part + 1) / parts - begin, idx = 0; idx < len; idx++) {
        int64_t n = two_streams(begin, len, idx);
        const uint16_t *pairs = (const uint16_t *)(w + n * row_bytes);
        const uint8_t *nibbles = w + n * row_bytes + 4 * groups;
        float sf[groups];
        row_scales(pairs, groups, sf);
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int mb = M - m0 < MB ? (int)(M - m0) : MB;
            float out[MB];
            FOR_ROWS(int4_rows, xq + m0 * K, xs + m0 * chunks, sf, nibbles, K, gshift)
            for (int i = 0; i < mb; i++)
                store_out(y, io & 2, (m0 + i) * N + n,
                          out[i] + bf16_dot(pairs, corrections + (m0 + i) * 2 * groups, 2 * groups));
        }
    }
    free(xq);
    free(xs);
    free(corrections);
}

/* The int4 weight of `ls_int4_linear`'s layout as q * scale + minimum, in fp32 or (bf16 != 0) bf16 rounded to
 * nearest even: one pass, for the many-row path's GEMM. */
void ls_int4_dequantize(const uint8_t *w, int64_t K, int64_t G, int64_t N, void *out, int bf16, int threads) {
    int64_t groups = K / G, row_bytes = 4 * groups + K / 2;
#pragma omp parallel num_threads(threads)
    for (int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), begin = N * part / parts,
                 len = N * (part + 1) / parts - begin, idx = 0; idx < len; idx++) {
        int64_t n = two_streams(begin, len, idx);
        const uint16_t *pairs = (const uint16_t *)(w + n * row_bytes);
        const uint8_t *nibbles = w + n * row_bytes + 4 * groups;
        float row[64];
        for (int64_t c = 0; c < K / 64; c++) {
            const uint16_t *a = pairs + 2 * (c * 64 / G), *b = pairs + 2 * ((c * 64 + 32) / G);
            float sa = bf16_to_float(a[0]), ma = bf16_to_float(a[1]), sb = bf16_to_float(b[0]), mb = bf16_to_float(b[1]);
            for (int j = 0; j < 32; j++) {
                uint8_t byte = nibbles[c * 32 + j];
                row[j] = (float)(byte & 15) * sa + ma;
                row[j + 32] = (float)(byte >> 4) * sb + mb;
            }
            if (bf16) {
                uint16_t *o = (uint16_t *)out + n * K + c * 64;
                for (int j = 0; j < 64; j++) o[j] = float_to_bf16(row[j]);
            } else {
                float *o = (float *)out + n * K + c * 64;
                for (int j = 0; j < 64; j++) o[j] = row[j];
            }
        }
    }
}

/* Activations quantized for one weight format: int8 per row (scales s, one a row), int4 by int4_prepare. */
typedef struct {
    int8_t *q;
    float *s, *corr;
} QuantActs;

static QuantActs quantize_acts(const void *x, int bf16, int64_t M, int64_t K, int bits, int64_t G) {
    QuantActs a = {malloc(M * K), malloc(M * (K / 64 + 1) * sizeof(float)), NULL};
    if (bits == 8) {
        quantize_blocks(x, bf16, M, K, K, INT8_OFFSET, a.q, a.s);
    } else {
        a.corr = malloc(M * 2 * (K / G) * sizeof(float));
        int4_prepare(x, bf16, M, K, G, a.q, a.s, a.corr);
    }
    return a;
}

/* Rows rows[0..P) of `a` (quantized as quantize_acts did, K columns, group size G) copied in that order. */
static QuantActs gather_acts(QuantActs a, const int64_t *rows, int64_t P, int64_t K, int bits, int64_t G) {
    int64_t scales = bits == 8 ? 1 : K / 64, corrs = bits == 8 ? 0 : 2 * (K / G);
    QuantActs g = {malloc(P * K), malloc(P * (K / 64 + 1) * sizeof(float)), corrs ? malloc(P * corrs * sizeof(float))
                                                                                 : NULL};
    for (int64_t i = 0; i < P; i++) {
        memcpy(g.q + i * K, a.q + rows[i] * K, K);
        memcpy(g.s + i * scales, a.s + rows[i] * scales, scales * sizeof(float));
        if (corrs) memcpy(g.corr + i * corrs, a.corr + rows[i] * corrs, corrs * sizeof(float));
    }
    return g;
}

static void free_acts(QuantActs a) {
    free(a.q);
    free(a.s);
    free(a.corr);
}

/* ls_int8_heads for a weight in the lanes layout [H, N / 16, K / 4, 16, 4] (element [h, b, c, j, i] = w[h, 16 b + j,
 * 4 c + i]; N % 16 == 0, K % 4 == 0): 16 outputs a block, read as one stream of 16 * K bytes. Rows as short as MLA's
 * W_UK (128 columns: 8192 of them for 16 heads) cost ls_int8_heads a fixed overhead each that dominated; here it is
 * paid once a block. The integer sums and the float epilogue are ls_int8_heads', so the outputs are equal. */
void ls_int8_heads_lanes(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
                         const int32_t *wsum, int64_t N, void *y, int io, int threads) {
    QuantActs a = quantize_acts(x, io & 1, M * H, K, 8, 0);
    int64_t per_head = N / 16, blocks = H * per_head;
#pragma omp parallel num_threads(threads)
    for (int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), begin = blocks * part / parts,
                 len = blocks * (part + 1) / parts - begin, idx = 0; idx < len; idx++) {
        int64_t b = two_streams(begin, len, idx), h = b / per_head, n0 = (b - h * per_head) * 16;
        for (int64_t m = 0; m < M; m++) { /* the block's 16 * K bytes stay in L1 across the rows of x */
            int32_t dots[16];
            int64_t row = m * H + h;
            lanes_dot(a.q + row * K, w + b * 16 * K, K, dots);
            for (int j = 0; j < 16; j++) {
                int64_t hn = h * N + n0 + j;
                float v = (float)(dots[j] - INT8_OFFSET * wsum[hn]) * a.s[row] * scale[hn];
                store_out(y, io & 2, row * N + n0 + j, v);
            }
        }
    }
    free_acts(a);
}

/* Output n of weight `w` (an expert's pointers: int8 (q, scale, qsum), int4 the packed rows) for the m activation
 * rows first.. of `a`, into out[0..m): each row's value whatever m is (integer sums; int4's float sums per row). */
static void group_dots(QuantActs a, int64_t first, int64_t m, void *const *w, int64_t n, int64_t K, int bits,
                       int64_t G, float *dots) {
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        int mb = m - m0 < MB ? (int)(m - m0) : MB;
        int64_t r = first + m0;
        if (bits == 8) {
            int32_t out[MB];
            const float scale = ((const float *)w[1])[n];
            const int32_t wsum = ((const int32_t *)w[2])[n];
            FOR_ROWS(int8_rows, a.q + r * K, K, (const int8_t *)w[0] + n * K, K)
            for (int i = 0; i < mb; i++) dots[m0 + i] = (float)(out[i] - INT8_OFFSET * wsum) * a.s[r + i] * scale;
        } else {
            int64_t groups = K / G;
            const uint8_t *row = (const uint8_t *)w[0] + n * (4 * groups + K / 2);
            float out[MB], sf[groups];
            row_scales((const uint16_t *)row, groups, sf);
            FOR_ROWS(int4_rows, a.q + r * K, a.s + r * (K / 64), sf, row + 4 * groups, K, log2_group(G))
            for (int i = 0; i < mb; i++)
                dots[m0 + i] = out[i] + bf16_dot((const uint16_t *)row, a.corr + (r + i) * 2 * groups, 2 * groups);
        }
    }
}

/* T tokens, each through `count` routed experts: y[t] = sum_j gates[t, j] * down_j(silu(gate_j(x[t])) * up_j(x[t]))
 * in the order given, in one parallel region. Per expert, `weights` in pairs (gate_up, down): int8 ones as (q, scale,
 * qsum) pointer triples (bits 8), int4 ones as the packed rows (bits 4, group sizes G for gate_up, GD for down);
 * an expert's gate and up are one fused weight of 2 * I rows (gate's first). x is quantized once per token. The
 * (token, expert) pairs are grouped by expert, so an expert that several tokens chose is read once for all of them;
 * every pair's arithmetic is the same as for its token alone, so each token's result does not depend on the batch
 * around it. */
void ls_experts_tokens(const void *x, int64_t T, int64_t K, int64_t I, int64_t count, void *const *weights,
                       const float *gates, int bits, int64_t G, int64_t GD, void *y, int io, int threads) {
    int per = bits == 8 ? 6 : 2, half = per / 2;
    int64_t P = T * count, groups = 0;
    int64_t *order = malloc(P * sizeof(int64_t)), *slot = malloc(P * sizeof(int64_t));
    int64_t *start = malloc((P + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) { /* insertion sort of the pairs by expert, stable */
        int64_t j = p;
        for (; j > 0 && (uintptr_t)weights[order[j - 1] * per] > (uintptr_t)weights[p * per]; j--)
            order[j] = order[j - 1];
        order[j] = p;
    }
    for (int64_t i = 0; i < P; i++) {
        slot[order[i]] = i;
        if (i == 0 || weights[order[i] * per] != weights[order[i - 1] * per]) start[groups++] = i;
    }
    start[groups] = P;
    int64_t *token = malloc(P * sizeof(int64_t)); /* each pair's token, in grouped order */
    for (int64_t i = 0; i < P; i++) token[i] = order[i] / count;
    float *h = malloc(P * 2 * I * sizeof(float)), *a = malloc(P * I * sizeof(float));
    float *o = malloc(P * K * sizeof(float));
    QuantActs xt = quantize_acts(x, io & 1, T, K, bits, G), xa = gather_acts(xt, token, P, K, bits, G);
    QuantActs aa = {NULL, NULL, NULL};
#pragma omp parallel num_threads(threads)
    {
        int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), rows = groups * 2 * I;
        float dots[P]; /* an expert's pairs: at most one per token */
        int64_t begin = rows * part / parts, len = rows * (part + 1) / parts - begin;
        for (int64_t idx = 0; idx < len; idx++) {
            int64_t r = two_streams(begin, len, idx);
            int64_t g = r / (2 * I), n = r - g * 2 * I, first = start[g], m = start[g + 1] - first;
            group_dots(xa, first, m, weights + order[first] * per, n, K, bits, G, dots);
            for (int64_t i = 0; i < m; i++) h[(first + i) * 2 * I + n] = dots[i];
        }
#pragma omp barrier
#pragma omp single
        {
            for (int64_t i = 0; i < P; i++) silu_mul(h + i * 2 * I, I, a + i * I);
            aa = quantize_acts(a, 0, P, I, bits, GD);
        }
        rows = groups * K;
        begin = rows * part / parts, len = rows * (part + 1) / parts - begin;
        for (int64_t idx = 0; idx < len; idx++) {
            int64_t r = two_streams(begin, len, idx);
            int64_t g = r / K, n = r - g * K, first = start[g], m = start[g + 1] - first;
            group_dots(aa, first, m, weights + order[first] * per + half, n, I, bits, GD, dots);
            for (int64_t i = 0; i < m; i++) o[(first + i) * K + n] = dots[i];
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t tk = 0; tk < T * K; tk++) {
            int64_t t = tk / K, k = tk - t * K;
            float sum = 0.f;
            for (int64_t j = 0; j < count; j++) sum += gates[t * count + j] * o[slot[t * count + j] * K + k];
            store_out(y, io & 2, tk, sum);
        }
    }
    free_acts(xt);
    free_acts(xa);
    free_acts(aa);
    free(order), free(slot), free(start), free(token), free(h), free(a), free(o);
}
