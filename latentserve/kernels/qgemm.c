/* int8 linear layers for few rows (decode): y[M, N] = x[M, K] @ dequantized(w)[N, K]^T, and a few tokens' routed
 * experts in one call, in int8 or int4 (int4.c has that format's kernels).
 *
 * The activations are quantized to int8 per row (symmetric, s = max|x| / 127; quant_acts.c) and multiplied with the
 * int8 weights in integer dot products, so each weight byte is read once and expanded in registers: at a few rows
 * the product is bound by reading the weights, and this keeps up with memory where PyTorch's kernels do not. Each
 * thread walks its share of output rows one row at a time, all activation rows against it: one stream of weights
 * per thread (tiles of 2-4 rows, four streams, measured 1.3-1.5x slower).
 *
 * Built twice by native.py: with -DLS_AVX512 (AVX-512 BW + VNNI: vpdpbusd, u8 x s8) and for AVX2 (vpmaddubsw).
 * Both compute the same integer sums, so their int8 outputs are equal.
 *
 * Layout: w int8 [H, N, K] (H = 1 but for MLA's per-head products); scale fp32 [H, N]; wsum int32 [H, N] =
 * sum_k w[h, n, k].
 */
#include "quant.h"

#ifdef LS_AVX512
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
INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* dot[i] = sum_k xq[i * xstride + k] * w[k]: |w| (unsigned) times x with w's sign, so that pairs of products (at
 * most 2 * 128 * 127) fit vpmaddubsw's int16. Not |x| times w with x's sign: negating a weight of -128 overflows. */
INLINE void int8_rows(const int8_t *xq, int64_t xstride, const int8_t *w, int64_t K, int mb, int32_t dot[MB]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k)), aw = _mm256_abs_epi8(wv);
        for (int i = 0; i < mb; i++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * xstride + k));
            __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv));
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
void int8_heads(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
                const int32_t *wsum, int64_t N, void *y, int io, int threads) {
    QuantActs a = quantize_acts(x, io & 1, M * H, K, 8, 0);
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
                FOR_ROWS(int8_rows, a.q + (m0 * H + h) * K, H * K, w + hn * K, K)
                for (int i = 0; i < mb; i++) {
                    int64_t row = (m0 + i) * H + h;
                    store_out(y, io & 2, row * N + n, (float)(out[i] - INT8_OFFSET * wsum[hn]) * a.s[row] * scale[hn]);
                }
            }
            if (++cursor[1] == N) {
                cursor[1] = 0;
                cursor[0]++;
            }
        }
    }
    free_acts(a);
}

#ifdef LS_AVX512
/* dots[j] = sum_k (xq[k] + 128) * w[j, k] for the 16 outputs of a block in the lanes layout (ls_int8_heads_lanes):
 * each 64-byte load holds 4 columns of all 16, against x's 4 bytes in every lane. */
INLINE void lanes_dot(const int8_t *xq, const int8_t *w, int64_t K, int32_t dots[16]) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int64_t c = 0; c < K / 4; c++) { /* four chains: long rows are not bound by vpdpbusd's latency */
        __m512i xv = _mm512_set1_epi32(four_bytes(xq + 4 * c));
        acc[c & 3] = _mm512_dpbusd_epi32(acc[c & 3], xv, _mm512_loadu_si512(w + 64 * c));
    }
    _mm512_storeu_si512(dots, _mm512_add_epi32(_mm512_add_epi32(acc[0], acc[1]), _mm512_add_epi32(acc[2], acc[3])));
}
#else
/* As the AVX-512 version with x signed (vpmaddubsw's |w| times x with w's sign, as int8_rows does). */
INLINE void lanes_dot(const int8_t *xq, const int8_t *w, int64_t K, int32_t dots[16]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int64_t c = 0; c < K / 4; c++) {
        __m256i xv = _mm256_set1_epi32(four_bytes(xq + 4 * c));
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32));
        lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(xv, w0)),
                                                    ones));
        hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(xv, w1)),
                                                    ones));
    }
    _mm256_storeu_si256((__m256i *)dots, lo);
    _mm256_storeu_si256((__m256i *)(dots + 8), hi);
}
#endif

/* ls_int8_heads for a weight in the lanes layout [H, N / 16, K / 4, 16, 4] (element [h, b, c, j, i] = w[h, 16 b + j,
 * 4 c + i]; N % 16 == 0, K % 4 == 0): 16 outputs a block, read as one stream of 16 * K bytes. Rows as short as MLA's
 * W_UK (128 columns: 8192 of them for 16 heads) cost ls_int8_heads a fixed overhead each that dominated; here it is
 * paid once a block. The integer sums and the float epilogue are ls_int8_heads', so the outputs are equal. */
void int8_heads_lanes(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
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

/* Output n of an int8 weight `w` (q, scale, qsum) for the m activation rows first.. of `a`, into dots[0..m). */
static void int8_dots(QuantActs a, int64_t first, int64_t m, void *const *w, int64_t n, int64_t K, float *dots) {
    const float scale = ((const float *)w[1])[n];
    const int32_t wsum = ((const int32_t *)w[2])[n];
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        int mb = m - m0 < MB ? (int)(m - m0) : MB;
        int64_t r = first + m0;
        int32_t out[MB];
        FOR_ROWS(int8_rows, a.q + r * K, K, (const int8_t *)w[0] + n * K, K)
        for (int i = 0; i < mb; i++) dots[m0 + i] = (float)(out[i] - INT8_OFFSET * wsum) * a.s[r + i] * scale;
    }
}

/* The experts' pairs grouped by expert (groups of them, pairs start[g] .. start[g + 1]; order[i]: the i-th pair's
 * position in `weights`, `per` pointers each). */
typedef struct {
    int64_t groups, per;
    const int64_t *start, *order;
    void *const *weights;
} ExpertGroups;

/* This thread's share of one layer (which: 0 gate_up, 1 down) of every group: `rows` outputs from K inputs, walked
 * in units of one row (int8) or one block of 16 (int4's layout), dst[pair, rows] = the pair's outputs. Each pair's
 * arithmetic is the same whatever pairs share its expert. */
static void expert_layer(ExpertGroups e, int which, QuantActs a, int64_t rows, int64_t K, int bits, int64_t G,
                         float *dots, float *dst) {
    int64_t unit = bits == 8 ? 1 : 16, units = (rows + unit - 1) / unit, total = e.groups * units;
    int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
    for (int64_t begin = total * part / parts, len = total * (part + 1) / parts - begin, idx = 0; idx < len; idx++) {
        int64_t r = two_streams(begin, len, idx), g = r / units, u = r - g * units;
        int64_t first = e.start[g], m = e.start[g + 1] - first, outputs = rows - u * unit < unit ? rows - u * unit : unit;
        void *const *w = e.weights + e.order[first] * e.per + which * e.per / 2;
        if (bits == 8)
            int8_dots(a, first, m, w, u, K, dots);
        else
            int4_block_dots(a, first, m, (const uint8_t *)w[0] + u * int4_block_bytes(K, G), K, G, dots);
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < outputs; j++) dst[(first + i) * rows + u * unit + j] = dots[i * unit + j];
    }
}

/* T tokens, each through `count` routed experts: y[t] = sum_j gates[t, j] * down_j(silu(gate_j(x[t])) * up_j(x[t]))
 * in the order given, in one parallel region. Per expert, `weights` in pairs (gate_up, down): int8 ones as (q, scale,
 * qsum) pointer triples (bits 8), int4 ones as the packed rows (bits 4, group sizes G for gate_up, GD for down);
 * an expert's gate and up are one fused weight of 2 * I rows (gate's first). x is quantized once per token. The
 * (token, expert) pairs are grouped by expert, so an expert that several tokens chose is read once for all of them;
 * every pair's arithmetic is the same as for its token alone, so each token's result does not depend on the batch
 * around it. */
LS_API void ls_experts_tokens(const void *x, int64_t T, int64_t K, int64_t I, int64_t count, void *const *weights,
                              const float *gates, int bits, int64_t G, int64_t GD, void *y, int io, int threads) {
    int per = bits == 8 ? 6 : 2;
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
    ExpertGroups e = {groups, per, start, order, weights};
#pragma omp parallel num_threads(threads)
    {
        float dots[16 * P]; /* an expert's pairs (at most one per token), a unit of outputs each */
        expert_layer(e, 0, xa, 2 * I, K, bits, G, dots, h);
#pragma omp barrier
#pragma omp single
        {
            for (int64_t i = 0; i < P; i++) silu_mul(h + i * 2 * I, I, a + i * I);
            aa = quantize_acts(a, 0, P, I, bits, GD);
        }
        expert_layer(e, 1, aa, K, I, bits, GD, dots, o);
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
