/* Quantized linear layers for few rows (decode): y[M, N] = x[M, K] @ dequantized(w)[N, K]^T.
 *
 * The activations are quantized to int8 (symmetric, s = max|x| / 127: per row for int8 weights, per 32 columns for
 * int4) and multiplied with the int8 or int4 weights in integer dot products, so each weight byte is read once and
 * expanded in registers: at a few rows the product is bound by reading the weights, and this keeps up with memory
 * where PyTorch's kernels do not.
 *
 * Built twice by native.py: with -DLS_AVX512 (AVX-512 BW + VNNI: vpdpbusd, u8 x s8) and for AVX2 (vpmaddubsw).
 * Both compute the same integer sums, so their outputs are equal; only the float sums of int4 groups differ.
 *
 * Layouts (row-major, one output row after another):
 *   int8: w int8 [N, K]; scale fp32 [N]; wsum int32 [N] = sum_k w[n, k]
 *   int4: w uint8 [N, K / 2], each 64 columns as 32 bytes: byte j = q[64c + j] | q[64c + 32 + j] << 4;
 *         scale, minimum bf16 [N, K / G]: weight = q * scale + minimum over each group of G columns (G % 32 == 0)
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define NB 4 /* output rows per tile: their weights stream side by side while x stays in L1 */
#ifdef LS_AVX512
#define MB 4 /* activation rows per tile */
#else
#define MB 2 /* AVX2 has 16 vector registers */
#endif
#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } c = { .u = (uint32_t)v << 16 };
    return c.f;
}

/* Each row of x in blocks of `block` columns (block divides K): xq = round(x / s) + offset with round(...) in
 * [-127, 127], s = max(max |x| over the block, 1e-12) / 127 per block (rounding half to even, as torch does). An
 * offset of 128 makes the int8 the unsigned operand of vpdpbusd. */
static void quantize_blocks(const float *x, int64_t M, int64_t K, int64_t block, int offset, int8_t *xq, float *s) {
    for (int64_t b = 0; b < M * K / block; b++) {
        const float *r = x + b * block;
        int8_t *q = xq + b * block;
        float amax = 1e-12f;
        for (int64_t k = 0; k < block; k++) amax = fmaxf(amax, fabsf(r[k]));
        float sb = amax / 127.f;
        for (int64_t k = 0; k < block; k++) q[k] = (int8_t)(uint8_t)((int)nearbyintf(r[k] / sb) + offset);
        s[b] = sb;
    }
}

#ifdef LS_AVX512
/* dot[i][j] = sum_k (xq[i, k] + 128) * w[j, k] over mb activation rows and nb weight rows. */
INLINE void int8_tile(const int8_t *xq, const int8_t *w, int64_t K, int mb, int nb, int32_t dot[MB][NB]) {
    __m512i acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) {
        __mmask64 mask = K - k >= 64 ? ~0ULL : ~0ULL >> (64 - (K - k));
        __m512i wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm512_maskz_loadu_epi8(mask, w + j * K + k);
        for (int i = 0; i < mb; i++) {
            __m512i xv = _mm512_maskz_loadu_epi8(mask, xq + i * K + k);
            for (int j = 0; j < nb; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) dot[i][j] = _mm512_reduce_add_epi32(acc[i][j]);
}
#define INT8_OFFSET 128
#else
INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* dot[i][j] = sum_k xq[i, k] * w[j, k]: |x| times w with x's sign, so that pairs of products (at most 2 * 127 * 127)
 * fit vpmaddubsw's int16. */
INLINE void int8_tile(const int8_t *xq, const int8_t *w, int64_t K, int mb, int nb, int32_t dot[MB][NB]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i wv[NB];
        for (int j = 0; j < nb; j++) wv[j] = _mm256_loadu_si256((const __m256i *)(w + j * K + k));
        for (int i = 0; i < mb; i++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * K + k));
            __m256i ax = _mm256_abs_epi8(xv);
            for (int j = 0; j < nb; j++) {
                __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[j], xv));
                acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(p, ones));
            }
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) {
            int32_t d = hsum_epi32(acc[i][j]);
            for (int64_t t = k; t < K; t++) d += (int32_t)xq[i * K + t] * w[j * K + t];
            dot[i][j] = d;
        }
}
#define INT8_OFFSET 0
#endif

/* Tile t of a weight with `full` whole tiles: NB rows each, then the rest one row at a time. */
INLINE void tile_range(int64_t t, int64_t full, int64_t *n, int *nb) {
    *n = t < full ? t * NB : full * NB + (t - full);
    *nb = t < full ? NB : 1;
}

#define TILE_CASES(fn, MBMAX, ...)                                          \
    switch (mb * 8 + nb) {                                                  \
    case 1 * 8 + 1: fn(__VA_ARGS__, 1, 1, dot); break;                      \
    case 1 * 8 + NB: fn(__VA_ARGS__, 1, NB, dot); break;                    \
    case 2 * 8 + 1: if (MBMAX >= 2) fn(__VA_ARGS__, 2, 1, dot); break;      \
    case 2 * 8 + NB: if (MBMAX >= 2) fn(__VA_ARGS__, 2, NB, dot); break;    \
    case 3 * 8 + 1: if (MBMAX >= 3) fn(__VA_ARGS__, 3, 1, dot); break;      \
    case 3 * 8 + NB: if (MBMAX >= 3) fn(__VA_ARGS__, 3, NB, dot); break;    \
    case 4 * 8 + 1: if (MBMAX >= 4) fn(__VA_ARGS__, 4, 1, dot); break;      \
    case 4 * 8 + NB: if (MBMAX >= 4) fn(__VA_ARGS__, 4, NB, dot); break;    \
    }

void ls_int8_linear(const float *x, int64_t M, int64_t K, const int8_t *w, const float *scale, const int32_t *wsum,
                    int64_t N, float *y, int threads) {
    int8_t *xq = malloc(M * K);
    float *sx = malloc(M * sizeof(float));
    quantize_blocks(x, M, K, K, INT8_OFFSET, xq, sx);
    int64_t full = N / NB, tiles = full + N % NB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n;
        int nb;
        tile_range(t, full, &n, &nb);
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int mb = M - m0 < MB ? (int)(M - m0) : MB;
            int32_t dot[MB][NB];
            TILE_CASES(int8_tile, MB, xq + m0 * K, w + n * K, K)
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nb; j++)
                    y[(m0 + i) * N + n + j] =
                        (float)(dot[i][j] - INT8_OFFSET * wsum[n + j]) * sx[m0 + i] * scale[n + j];
        }
    }
    free(xq);
    free(sx);
}

#define XBLOCK 32 /* int4's activations are quantized per 32 columns, each half of a 64-column chunk */

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

/* dot[i][j] = sum over 32-column halves of scale(group) * xs(half) * sum_k q[j, k] * xq[i, k]. */
INLINE void int4_tile(const int8_t *xq, const float *xs, const uint8_t *w, const uint16_t *scale, int64_t K,
                      int64_t G, int mb, int nb, float dot[MB][NB]) {
    int64_t groups = K / G;
    __m512 acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
        __m512i wv[NB];
        __m512 sv[NB];
        for (int j = 0; j < nb; j++) {
            const uint16_t *sj = scale + j * groups;
            wv[j] = unpack64(w + j * (K / 2) + k / 2);
            sv[j] = halves(bf16_to_float(sj[k / G]), bf16_to_float(sj[(k + 32) / G]));
        }
        for (int i = 0; i < mb; i++) {
            __m512i xv = _mm512_loadu_si512(xq + i * K + k);
            const float *xsi = xs + i * (K / XBLOCK) + k / XBLOCK;
            __m512 xsv = halves(xsi[0], xsi[1]);
            for (int j = 0; j < nb; j++) {
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[j], xv);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv[j], xsv), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) dot[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}
#else
INLINE float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 columns: nibbles q (unsigned) times int8 x, pairs summed in int16 (at most 2 * 15 * 127), then int32, scaled. */
INLINE __m256 scaled_dot(__m256i q, const int8_t *x, float scale) {
    __m256i d = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x)),
                                  _mm256_set1_epi16(1));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(scale));
}

INLINE void int4_tile(const int8_t *xq, const float *xs, const uint8_t *w, const uint16_t *scale, int64_t K,
                      int64_t G, int mb, int nb, float dot[MB][NB]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    int64_t groups = K / G;
    __m256 acc[MB][NB];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 64) {
        for (int j = 0; j < nb; j++) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(w + j * (K / 2) + k / 2));
            __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
            float sa = bf16_to_float(scale[j * groups + k / G]), sb = bf16_to_float(scale[j * groups + (k + 32) / G]);
            for (int i = 0; i < mb; i++) {
                const int8_t *xi = xq + i * K + k;
                const float *xsi = xs + i * (K / XBLOCK) + k / XBLOCK;
                acc[i][j] = _mm256_add_ps(acc[i][j], _mm256_add_ps(scaled_dot(lo, xi, sa * xsi[0]),
                                                                   scaled_dot(hi, xi + 32, sb * xsi[1])));
            }
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nb; j++) dot[i][j] = hsum_ps(acc[i][j]);
}
#endif

/* The activations in blocks of 32 columns, as llama.cpp's Q8 blocks. q * scale + minimum is computed as
 * (q - 8) * scale + (minimum + 8 * scale): the quantized activations meet only the centred part of the weight, the
 * rest takes the exact sums of x over each group (q * scale alone, up to twice the weight's range, would multiply
 * the activations' rounding by its large mean). With the integer products of q, the centring is a correction per
 * group: 8 * scale * (sum of x - sum of quantized x). */
void ls_int4_linear(const float *x, int64_t M, int64_t K, const uint8_t *w, const uint16_t *scale,
                    const uint16_t *minimum, int64_t G, int64_t N, float *y, int threads) {
    int64_t groups = K / G;
    int8_t *xq = malloc(M * K);
    float *xs = malloc(M * (K / XBLOCK) * sizeof(float));
    float *xsum = malloc(M * groups * sizeof(float)), *centring = malloc(M * groups * sizeof(float));
    quantize_blocks(x, M, K, XBLOCK, 0, xq, xs);
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            float exact = 0.f, rounded = 0.f;
            for (int64_t b = g * G / XBLOCK; b < (g + 1) * G / XBLOCK; b++) {
                int32_t ints = 0;
                for (int64_t k = b * XBLOCK; k < (b + 1) * XBLOCK; k++) {
                    exact += x[m * K + k];
                    ints += xq[m * K + k];
                }
                rounded += (float)ints * xs[m * (K / XBLOCK) + b];
            }
            xsum[m * groups + g] = exact;
            centring[m * groups + g] = 8.f * (exact - rounded);
        }
    int64_t full = N / NB, tiles = full + N % NB;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n;
        int nb;
        tile_range(t, full, &n, &nb);
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int mb = M - m0 < MB ? (int)(M - m0) : MB;
            float dot[MB][NB];
            TILE_CASES(int4_tile, MB, xq + m0 * K, xs + m0 * (K / XBLOCK), w + n * (K / 2), scale + n * groups, K, G)
            for (int i = 0; i < mb; i++)
                for (int j = 0; j < nb; j++) {
                    const uint16_t *mn = minimum + (n + j) * groups, *sc = scale + (n + j) * groups;
                    const float *xg = xsum + (m0 + i) * groups, *cg = centring + (m0 + i) * groups;
                    float z = 0.f;
                    for (int64_t g = 0; g < groups; g++) z += bf16_to_float(mn[g]) * xg[g] + bf16_to_float(sc[g]) * cg[g];
                    y[(m0 + i) * N + n + j] = dot[i][j] + z;
                }
        }
    }
    free(xq);
    free(xs);
    free(xsum);
    free(centring);
}
