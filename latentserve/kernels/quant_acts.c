/* Activations prepared for each weight format (quant.h): quantized to int8 for the integer dot products of the int8
 * and int4 kernels, fp32 or bf16 rows for the dense ones. */
#include "q6k.h" /* the 16-column k-quants' centres and corrections (their layout traits) */
#include "quant.h"

/* Each row of x in blocks of `block` columns (block divides K): xq = round(x / s) + offset with round(...) in
 * [-127, 127], s = max(max |x| over the block, 1e-12) / 127 per block (rounding half to even, as torch does). A
 * block holding a NaN or an infinity gets s = NaN (and xq 0), so that its products come out NaN as torch's do:
 * vmax and fmaxf would drop the NaN. */
static void quantize_blocks(const void *x, int bf16, int64_t M, int64_t K, int64_t block, int offset, int8_t *xq,
                            float *s) {
    for (int64_t b = 0; b < M * K / block; b++) { /* two passes over the block's x: the second reads it from L1 */
        int8_t *q = xq + b * block;
        int64_t at = b * block;
        vfloat m = vset1(0.f), finite = vset1(0.f); /* finite: sums of v - v, NaN once a v is not finite */
        int64_t k = 0;
        for (; k + LANES <= block; k += LANES) {
            vfloat v = vload(x, bf16, at + k);
            m = vmax(m, vabs(v));
            finite = vadd(finite, vsub(v, v));
        }
        float amax = fmaxf(1e-12f, vmax_reduce(m)), check = vreduce_add(finite);
        for (; k < block; k++) {
            float v = load_act(x, bf16, at + k);
            amax = fmaxf(amax, fabsf(v));
            check += v - v;
        }
        if (check != 0.f) {
            memset(q, 0, block);
            s[b] = NAN;
            continue;
        }
        float sb = amax / 127.f;
        vfloat sv = vset1(sb);
        for (k = 0; k + LANES <= block; k += LANES) vquantize(vload(x, bf16, at + k), sv, offset, q + k);
        for (; k < block; k++) q[k] = (int8_t)(uint8_t)((int)nearbyintf(load_act(x, bf16, at + k) / sb) + offset);
        s[b] = sb;
    }
}

#ifndef LS_DPBUSD
/* An AVX2 int8 row in place: u = x + 128 as quantize_blocks wrote it at row + int8_row_bytes(K) / 2, split into
 * int8_row_bytes' nibbles from the row's start. Each 32 columns are read before their 64 bytes are written, and those
 * bytes lie below the columns still to read. */
static void split_nibbles(uint8_t *row, int64_t K) {
    const uint8_t *u = row + int8_row_bytes(K) / 2;
    const __m256i low = _mm256_set1_epi8(15);
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(u + k));
        _mm256_storeu_si256((__m256i *)(row + 2 * k), _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
        _mm256_storeu_si256((__m256i *)(row + 2 * k + 32), _mm256_and_si256(v, low));
    }
    for (int64_t t = k; t < K; t++) {
        uint8_t v = u[t];
        row[k + t] = v >> 4;
        row[k + t + 32] = v & 15;
    }
}
#endif

/* int8 rows: u = x + INT8_OFFSET in int8_row_bytes' layout, one scale a row. */
static void quantize_int8(const void *x, int bf16, int64_t M, int64_t K, int8_t *q, float *s) {
#ifdef LS_DPBUSD
    quantize_blocks(x, bf16, M, K, K, INT8_OFFSET, q, s);
#else
    int64_t bytes = int8_row_bytes(K);
    for (int64_t m = 0; m < M; m++) {
        uint8_t *row = (uint8_t *)q + m * bytes;
        quantize_blocks((const char *)x + m * K * (bf16 ? 2 : 4), bf16, 1, K, K, INT8_OFFSET,
                        (int8_t *)row + bytes / 2, s + m);
        split_nibbles(row, K);
    }
#endif
}

/* x's rows for the int4 kernels: quantized per XBLOCK columns (xq, scales xs), and per group of G columns the
 * corrections (8 * (sum of x - sum of quantized x), sum of x) that int4.c's formula takes. The sums of x run on 8
 * lanes in every build, so the corrections, and int4's outputs, are the same on AVX2 and AVX-512 CPUs. */
static void int4_prepare(const void *x, int bf16, int64_t M, int64_t K, int64_t G, int8_t *xq, float *xs, float *corr) {
    int64_t groups = K / G, chunks = K / XBLOCK;
    quantize_blocks(x, bf16, M, K, XBLOCK, 0, xq, xs);
    int64_t span = G < XBLOCK ? G : XBLOCK; /* a group's columns under one scale of x */
    for (int64_t m = 0; m < M; m++) {
        const int8_t *q = xq + m * K;
        for (int64_t g = 0; g < groups; g++) { /* vector sums of x; integer sums of q times each block's scale */
            __m256 sum = _mm256_setzero_ps(); /* 8 lanes on every build: the same bits on AVX2 and AVX-512 */
            float rounded = 0.f;
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) sum = _mm256_add_ps(sum, vload8(x, bf16, m * K + k));
            for (int64_t b = g * G; b < (g + 1) * G; b += span) {
                int32_t qsum = 0;
                for (int64_t k = b; k < b + span; k++) qsum += q[k];
                rounded += (float)qsum * xs[m * chunks + b / XBLOCK];
            }
            float exact = vreduce8_add(sum);
            corr[(m * groups + g) * 2] = 8.f * (exact - rounded);
            corr[(m * groups + g) * 2 + 1] = exact;
        }
    }
}

/* x's rows for the Q6_K, Q3_K and Q5_0 kernels (q6k.c, q45.c): int4's quantization per XBLOCK columns, and per `span`
 * columns (Q6_K's and Q3_K's 16, Q5_0's 32) -centre * the sum of the quantized x (centre: the weights' offset, 32, 4
 * and 16), the integer sums' start (int32, in corr's room). */
static void centred_prepare(const void *x, int bf16, int64_t M, int64_t K, int64_t span, int32_t centre, int8_t *xq,
                            float *xs, int32_t *cen) {
    quantize_blocks(x, bf16, M, K, XBLOCK, 0, xq, xs);
    for (int64_t g = 0; g < M * K / span; g++) {
        int32_t sum = 0;
        for (int64_t k = 0; k < span; k++) sum += xq[span * g + k];
        cen[g] = -centre * sum;
    }
}

/* x's rows for the Q5_K, Q4_K and Q5_1 kernels (q45.c) and Q2_K's (q6k.c): centred_prepare's per `span` columns (32:
 * centre 16 or 8; Q2_K's 16: centre 2), each centre followed by the exact sum of x over its columns (on 8 lanes, as
 * int4_prepare's: the same bits on every build). */
static void kquant_prepare(const void *x, int bf16, int64_t M, int64_t K, int64_t span, int32_t centre, int8_t *xq,
                           float *xs, float *corr) {
    quantize_blocks(x, bf16, M, K, XBLOCK, 0, xq, xs);
    for (int64_t g = 0; g < M * K / span; g++) {
        int32_t qsum = 0;
        __m256 sum = _mm256_setzero_ps();
        for (int64_t k = span * g; k < span * g + span; k += 8) sum = _mm256_add_ps(sum, vload8(x, bf16, k));
        for (int64_t k = span * g; k < span * g + span; k++) qsum += xq[k];
        ((int32_t *)corr)[2 * g] = -centre * qsum;
        corr[2 * g + 1] = vreduce8_add(sum);
    }
}

/* Dense weights: bf16 rows for vdpbf16ps where x and the weights are bf16 and the build has it, else fp32. */
static int dense_bf16(Format f, int bf16) {
#ifdef LS_BF16DOT
    return f.bits == 16 && bf16;
#else
    (void)f, (void)bf16;
    return 0;
#endif
}

/* The bytes, scales and corrections one row holds (quantized formats). */
static int64_t row_bytes(Format f, int64_t K) { return f.bits == 8 ? int8_row_bytes(K) : K; }
static int64_t row_scales(Format f, int64_t K) { return f.bits == 8 ? 1 : K / XBLOCK; }
static int64_t row_corrs(Format f, int64_t K) {
    if (q45(f)) return (sums_x(f) ? 2 : 1) * (K / 32);
    if (kq16(f)) return k_corrs((KLayout){f.bits}, K);
    return f.bits == 4 ? 2 * (K / f.group) : 0;
}

QuantActs take_acts(Format f, int bf16, int64_t M, int64_t K) {
    QuantActs a = {0};
    if (dense(f)) {
        a.bf16 = dense_bf16(f, bf16);
        a.rows = scratch(M * K * (a.bf16 ? 2 : 4));
        a.q = a.rows; /* q non-NULL: the room was taken */
        return a;
    }
    a.q = scratch(M * row_bytes(f, K));
    a.s = scratch(M * (K / XBLOCK + 1) * sizeof(float));
    a.corr = f.bits == 8 ? NULL : scratch(M * row_corrs(f, K) * sizeof(float));
    if (!a.s || (f.bits != 8 && !a.corr)) a.q = NULL;
    return a;
}

void quantize_into(Format f, const void *x, int bf16, int64_t M, int64_t K, QuantActs a) {
    if (dense(f) && a.bf16)
        memcpy(a.rows, x, M * K * 2);
    else if (dense(f))
        for (int64_t i = 0; i < M * K; i++) ((float *)a.rows)[i] = load_act(x, bf16, i);
    else if (f.bits == 8)
        quantize_int8(x, bf16, M, K, a.q, a.s);
    else if (kq16(f) && k_mins((KLayout){f.bits}))
        kquant_prepare(x, bf16, M, K, 16, k_centre((KLayout){f.bits}), a.q, a.s, a.corr);
    else if (kq16(f))
        centred_prepare(x, bf16, M, K, 16, k_centre((KLayout){f.bits}), a.q, a.s, (int32_t *)a.corr);
    else if (q45(f) && sums_x(f))
        kquant_prepare(x, bf16, M, K, 32, f.bits == 5 ? 16 : 8, a.q, a.s, a.corr);
    else if (f.bits == 5)
        centred_prepare(x, bf16, M, K, 32, 16, a.q, a.s, (int32_t *)a.corr);
    else
        int4_prepare(x, bf16, M, K, f.group, a.q, a.s, a.corr);
}

/* Below this many rows x is prepared on the calling thread: a row takes about a microsecond, a parallel region a few. */
#define PARALLEL_ROWS 32

/* Each thread prepares a contiguous share of the rows; every row's bytes are the same whatever share it is in. */
QuantActs quantize_for(Format f, const void *x, int bf16, int64_t M, int64_t K, int threads) {
    QuantActs a = take_acts(f, bf16, M, K);
    if (!a.q) return a;
#pragma omp parallel num_threads(threads) if (M >= PARALLEL_ROWS)
    {
        int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
        int64_t begin = M * part / parts, end = M * (part + 1) / parts;
        const char *rows = (const char *)x + begin * K * (bf16 ? 2 : 4);
        if (end > begin) quantize_into(f, rows, bf16, end - begin, K, acts_row(f, a, begin, K));
    }
    return a;
}

QuantActs quantize_acts(const void *x, int bf16, int64_t M, int64_t K, int bits, int64_t G, int threads) {
    return quantize_for((Format){bits, G, 0}, x, bf16, M, K, threads);
}

QuantActs acts_row(Format f, QuantActs a, int64_t row, int64_t K) {
    QuantActs r = a;
    if (dense(f)) {
        r.rows = (char *)a.rows + row * K * (a.bf16 ? 2 : 4);
        r.q = r.rows;
        return r;
    }
    r.q = a.q + row * row_bytes(f, K);
    r.s = a.s + row * row_scales(f, K);
    r.corr = a.corr ? a.corr + row * row_corrs(f, K) : NULL;
    return r;
}

/* Rows rows[0..P) of `a` (prepared as quantize_for did, K columns) copied in that order, into the scratch arena (q
 * NULL where it could not grow). */
QuantActs gather_acts(Format f, QuantActs a, const int64_t *rows, int64_t P, int64_t K) {
    int64_t bytes = dense(f) ? K * (a.bf16 ? 2 : 4) : row_bytes(f, K);
    int64_t scales = row_scales(f, K), corrs = row_corrs(f, K);
    QuantActs g = take_acts(f, a.bf16, P, K);
    for (int64_t i = 0; g.q && i < P; i++) {
        QuantActs to = acts_row(f, g, i, K), from = acts_row(f, a, rows[i], K);
        memcpy(to.q, from.q, bytes);
        if (dense(f)) continue;
        memcpy(to.s, from.s, scales * sizeof(float));
        if (corrs) memcpy(to.corr, from.corr, corrs * sizeof(float));
    }
    return g;
}
