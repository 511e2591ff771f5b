/* int8 products: y[M, N] = x[M, K] @ dequantized(w)[N, K]^T, for linear layers with the weight in `pack_int8`'s
 * blocks of 16 outputs (int8_block_dots, driven by quant_blocks.c) and for MLA's per-head products (int8_heads over
 * plain rows, int8_heads_lanes over the same lanes as the blocks).
 *
 * The activations are quantized to int8 per row (symmetric, s = max|x| / 127; quant_acts.c) and multiplied with the
 * int8 weights in integer dot products, so each weight byte is read once and expanded in registers: at a few rows
 * the product is bound by reading the weights, and this keeps up with memory where PyTorch's kernels do not. In
 * rows, each thread walks its share of output rows one row at a time, all activation rows against it; in lanes, one
 * 64-byte load holds 4 columns of 16 outputs and feeds every activation row of the pass, so many rows read the
 * activations once per block, not once per output.
 *
 * Built by native.py with -DLS_AVX512 (AVX-512 BW + VNNI: vpdpbusd, u8 x s8), for AVX2 with AVX-VNNI (-DLS_AVXVNNI:
 * vpdpbusd on 256 bits, int8_vnni256.h) and for plain AVX2 (vpmaddubsw on the activations' nibbles, int8_nibbles.h).
 * All compute the same integer sums, sum_k (x + 128) w, so their int8 outputs are equal, in every layout.
 *
 * Rows: w int8 [H, N, K]; scale fp32 [H, N]; wsum int32 [H, N] = sum_k w[h, n, k]. Lanes: quant.h's.
 */
#include "quant.h"

/* Rows (of a pass) from which the sums, not the reads, bind the core: the AVX-512 build's sums at 3-4 rows still
 * take less time than the reads, AVX2's (2-4x slower) do not. */
#ifdef LS_AVX512
#define FETCH_ROWS 5
#else
#define FETCH_ROWS 3
#endif

/* Unit c of the block the caller reads next, `ahead` bytes past this one's (0: none), fetched into L2 while this
 * block's unit c is summed, from FETCH_ROWS rows: the core is then busy with dot products and the hardware
 * prefetchers alone let the weight's reads fall behind (lm_head at 8 rows 1.2x and at 16 rows 1.5x faster,
 * benchmarks/RESULTS.md "Fetching the next block"). Below, the loads bind, the prefetchers keep up, and software
 * prefetches measured slower (0.7-0.96x at 1-2 rows, 0.83-1.10x at 4). */
INLINE void fetch_next(const int8_t *w, int64_t c, int64_t ahead, int mb) {
    /* The address in integers: past the last block it points outside the weight (a prefetch does not fault). */
    if (mb >= FETCH_ROWS && ahead) _mm_prefetch((const char *)((uintptr_t)w + 64 * c + ahead), _MM_HINT_T1);
}

/* The line read_ahead bytes past the unit at p, fetched into L1 while this one is summed (past a block's end: the
 * next block in memory, which the drivers read next); none where read_ahead is 0 (quant.h). Two blocks' streams at
 * 1-8 rows (lanes_sums_pair): on Intel the loads wait on memory without it. Intel Xeon, 2 threads, CPU time,
 * `int8_linear_ab.py --rows 1,2,4,8` (2816 / 1408 / 102400 x 2048), before -> after: the AVX2 build 1.34-1.39x at 1
 * row, 1.58-1.70x at 2, 1.72-1.78x at 4, 1.39-1.40x at 8; the AVX-512 one 1.04-1.07x, 1.15-1.22x, 1.25-1.30x,
 * 1.01-1.06x (where fetch_next already ran). On AMD Zen 4 it slowed batch-1 decode (kernels/build.py READ_AHEAD).
 * Same sums, same bits. */
INLINE void fetch_near(const int8_t *p) {
    if (read_ahead) _mm_prefetch((const char *)((uintptr_t)p + read_ahead), _MM_HINT_T0);
}

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
#elif defined(LS_AVXVNNI)
#include "int8_vnni256.h"
#else
#include "int8_nibbles.h"
#endif

/* y[m, h, n] = x[m, h, :] . w[h, n, :] for H independent weights (H = 1: a linear layer), x quantized per
 * (m, h) row. */
int int8_heads(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
               const int32_t *wsum, int64_t N, void *y, int io, int threads) {
    ScratchMark mark = scratch_mark();
    QuantActs a = quantize_acts(x, io & 1, M * H, K, 8, 0, threads);
    if (!a.q) return scratch_release(mark), LS_NO_MEMORY;
    int64_t bytes = int8_row_bytes(K);
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
                FOR_ROWS(int8_rows, a.q + (m0 * H + h) * bytes, H * bytes, w + hn * K, K)
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
    scratch_release(mark);
    return LS_OK;
}


#ifdef LS_AVX512
/* sums[i][j] = sum_k (xq[i * xstride + k] + 128) * w[j, k] for mb activation rows and the 16 outputs of a block in
 * the lanes layout ([K / 4, 16, 4]: element [c, j, i] = w[j, 4c + i]): each 64-byte load holds 4 columns of all 16,
 * against a row's 4 bytes in every lane, and feeds every row. Few rows sum in several chains each (at one row a
 * single chain is bound by vpdpbusd's latency, not by the loads). */
INLINE void lanes_sums(const int8_t *xq, int64_t xstride, const int8_t *w, int64_t K, int64_t ahead, int mb,
                       int32_t (*out)[16]) {
    enum { CHAINS_MAX = 4 };
    const int chains = mb <= 2 ? 4 : mb <= 4 ? 2 : 1;
    __m512i acc[CHAINS_MAX][MB];
    for (int h = 0; h < chains; h++)
        for (int i = 0; i < mb; i++) acc[h][i] = _mm512_setzero_si512();
    int64_t units = K / 4, c = 0;
    for (; c + chains <= units; c += chains)
        for (int h = 0; h < chains; h++) {
            fetch_next(w, c + h, ahead, mb);
            __m512i wv = _mm512_loadu_si512(w + 64 * (c + h));
            for (int i = 0; i < mb; i++)
                acc[h][i] = _mm512_dpbusd_epi32(acc[h][i], _mm512_set1_epi32(four_bytes(xq + i * xstride + 4 * (c + h))),
                                                wv);
        }
    for (; c < units; c++) {
        __m512i wv = _mm512_loadu_si512(w + 64 * c);
        for (int i = 0; i < mb; i++)
            acc[0][i] = _mm512_dpbusd_epi32(acc[0][i], _mm512_set1_epi32(four_bytes(xq + i * xstride + 4 * c)), wv);
    }
    for (int i = 0; i < mb; i++) {
        for (int h = 1; h < chains; h++) acc[0][i] = _mm512_add_epi32(acc[0][i], acc[h][i]);
        _mm512_storeu_si512(out[i], acc[0][i]);
    }
}
#else
INLINE void store_sums(__m256i (*acc)[2], int rows, int32_t (*out)[16]) {
    for (int i = 0; i < rows; i++) {
        _mm256_storeu_si256((__m256i *)out[i], acc[i][0]);
        _mm256_storeu_si256((__m256i *)(out[i] + 8), acc[i][1]);
    }
}

/* As the AVX-512 version, each unit's 16 outputs in two registers (lanes_span: nibbles, or AVX-VNNI's bytes). */
INLINE void lanes_sums(const int8_t *xq, int64_t xstride, const int8_t *w, int64_t K, int64_t ahead, int mb,
                       int32_t (*out)[16]) {
    __m256i acc[MB][2];
    for (int i = 0; i < mb; i++) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    lanes_span((const uint8_t *)xq, xstride, w, 0, K / 4, mb >= FETCH_ROWS ? ahead : 0, 0, mb, acc);
    store_sums(acc, mb, out);
}
#endif

/* Rows of x a pass over a thread's blocks: their activations for the two streams' heads stay in L1 from block to
 * block (AVX2's nibbles at K = 128: 16 KB). All of them at once, at 128 and 512 rows, read them from L2 at every
 * block: 0.92x and 0.70x the vpsignb kernel's time on the nibbles' twice as many bytes. */
#define HEAD_ROWS 32

/* ls_int8_heads for a weight in the lanes layout [H, N / 16, K / 4, 16, 4] (element [h, b, c, j, i] = w[h, 16 b + j,
 * 4 c + i]; N % 16 == 0, K % 4 == 0): 16 outputs a block, read as one stream of 16 * K bytes. Rows as short as MLA's
 * W_UK (128 columns: 8192 of them for 16 heads) cost ls_int8_heads a fixed overhead each that dominated; here it is
 * paid once a block. The integer sums and the float epilogue are ls_int8_heads', so the outputs are equal. */
int int8_heads_lanes(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
                     const int32_t *wsum, int64_t N, void *y, int io, int threads) {
    ScratchMark mark = scratch_mark();
    QuantActs a = quantize_acts(x, io & 1, M * H, K, 8, 0, threads);
    if (!a.q) return scratch_release(mark), LS_NO_MEMORY;
    int64_t per_head = N / 16, blocks = H * per_head, bytes = int8_row_bytes(K);
#pragma omp parallel num_threads(threads)
    for (int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), begin = blocks * part / parts,
                 len = blocks * (part + 1) / parts - begin, r0 = 0; r0 < M; r0 += HEAD_ROWS)
        for (int64_t idx = 0, r1 = M - r0 < HEAD_ROWS ? M : r0 + HEAD_ROWS; idx < len; idx++) {
            int64_t b = two_streams(begin, len, idx), h = b / per_head, n0 = (b - h * per_head) * 16;
            for (int64_t m0 = r0; m0 < r1; m0 += MB) { /* the block's 16 * K bytes stay in L1 across the rows of x */
                int mb = r1 - m0 < MB ? (int)(r1 - m0) : MB;
                int32_t out[MB][16];
                FOR_ROWS(lanes_sums, a.q + (m0 * H + h) * bytes, H * bytes, w + b * 16 * K, K, 0)
                for (int i = 0; i < mb; i++)
                    for (int j = 0; j < 16; j++) {
                        int64_t hn = h * N + n0 + j, row = (m0 + i) * H + h;
                        float v = (float)(out[i][j] - INT8_OFFSET * wsum[hn]) * a.s[row] * scale[hn];
                        store_out(y, io & 2, row * N + n0 + j, v);
                    }
            }
        }
    scratch_release(mark);
    return LS_OK;
}

/* pack_int8's block: 16 fp32 scales, 16 int32 sums of q, then the 16 outputs in the lanes layout. */
INLINE void block_epilogue(const int8_t *block, QuantActs a, int64_t r, int mb, int32_t (*out)[16], float *dots) {
    const float *scale = (const float *)block;
    const int32_t *wsum = (const int32_t *)(block + 64);
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < 16; j++)
            dots[16 * i + j] = (float)(out[i][j] - INT8_OFFSET * wsum[j]) * a.s[r + i] * scale[j];
}

#ifdef LS_AMX
/* int8_block_dots on AMX tiles (amx.c) from AMX_INT8_ROWS rows, of `count` blocks (1 or 2) with the same rows, each
 * into its dots: the tiles sum the columns in whole 64s, lanes_sums the rest (K % 64, a multiple of 4), added to
 * them; integers both, so the sums and then the epilogue are the vpdpbusd path's. Rows in passes of AMX_CHUNK; a last
 * pass of fewer than 16 rows takes the 16 last (rows done twice come out the same). */
static void int8_blocks_tiles(QuantActs a, int64_t first, int64_t m, const int8_t *const block[2], int count,
                              int64_t K, float *const dots[2]) {
    int64_t whole = K & ~(int64_t)63;
    amx_begin(64);
    for (int64_t m0 = 0; m0 < m; m0 += AMX_CHUNK) {
        int64_t r0 = m - m0 < 16 ? m - 16 : m0;
        int rows = m - r0 < AMX_CHUNK ? (int)(m - r0) : AMX_CHUNK;
        const int8_t *xq = a.q + (first + r0) * K;
        int32_t sums[2][AMX_CHUNK][16];
        amx_int8_sums(xq, K, whole, block[0] + INT8_HEADER, count > 1 ? block[1] + INT8_HEADER : NULL, rows, sums);
        for (int s = 0; s < count; s++) {
            const int8_t *w = block[s] + INT8_HEADER;
            for (int i0 = 0; whole < K && i0 < rows; i0 += MB) {
                int mb = rows - i0 < MB ? rows - i0 : MB;
                int32_t out[MB][16];
                FOR_ROWS(lanes_sums, xq + i0 * K + whole, K, w + 16 * whole, K - whole, 0)
                for (int i = 0; i < mb; i++)
                    for (int j = 0; j < 16; j++) sums[s][i0 + i][j] += out[i][j];
            }
            block_epilogue(block[s], a, first + r0, rows, sums[s], dots[s] + 16 * r0);
        }
    }
    amx_end();
}
#endif

/* The integer sums and the float epilogue are ls_int8_heads', so the outputs are equal. */
void int8_block_dots(QuantActs a, int64_t first, int64_t m, const int8_t *block, int64_t K, float *dots) {
#ifdef LS_AMX
    if (m >= AMX_INT8_ROWS) return int8_blocks_tiles(a, first, m, (const int8_t *const[2]){block}, 1, K,
                                                     (float *const[2]){dots});
#endif
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        int mb = m - m0 < MB ? (int)(m - m0) : MB;
        int32_t out[MB][16];
        FOR_ROWS(lanes_sums, a.q + (first + m0) * int8_row_bytes(K), int8_row_bytes(K), block + INT8_HEADER, K,
                 INT8_HEADER + 16 * K)
        block_epilogue(block, a, first + m0, mb, out, dots + 16 * m0);
    }
}

#define PAIR_CHUNK 32 /* units (64 bytes) read from one block of a pair before the other's: 2 KB, an old row's */

#ifdef LS_AVX512
/* lanes_sums of two blocks at once, each with its own accumulators and its own activation rows (x0 for w0, x1 for
 * w1: the experts pair blocks of different experts, met by different tokens): two streams of weights in flight. One
 * or two rows (bound by the loads) take turns of PAIR_CHUNK units, two chains a block; more rows (bound by the
 * arithmetic) go unit by unit. */
INLINE void lanes_sums_pair(const int8_t *x0, const int8_t *x1, int64_t xstride, const int8_t *w0, const int8_t *w1,
                            int64_t K, int64_t ahead, int mb, int32_t (*out)[MB][16]) {
    enum { CHAINS_MAX = 2 };
    const int chains = mb <= 2 ? 2 : 1;
    const int8_t *w[2] = {w0, w1}, *xq[2] = {x0, x1};
    __m512i acc[2][CHAINS_MAX][MB];
    for (int s = 0; s < 2; s++)
        for (int h = 0; h < chains; h++)
            for (int i = 0; i < mb; i++) acc[s][h][i] = _mm512_setzero_si512();
    int64_t units = K / 4;
    if (mb > 2) {
        for (int64_t c = 0; c < units; c++) {
            fetch_next(w0, c, ahead, mb);
            fetch_next(w1, c, ahead, mb);
            fetch_near(w0 + 64 * c);
            fetch_near(w1 + 64 * c);
            __m512i wv[2] = {_mm512_loadu_si512(w0 + 64 * c), _mm512_loadu_si512(w1 + 64 * c)};
            for (int i = 0; i < mb; i++)
                for (int s = 0; s < 2; s++)
                    acc[s][0][i] = _mm512_dpbusd_epi32(
                        acc[s][0][i], _mm512_set1_epi32(four_bytes(xq[s] + i * xstride + 4 * c)), wv[s]);
        }
    } else {
        for (int64_t c0 = 0; c0 < units; c0 += PAIR_CHUNK)
            for (int s = 0; s < 2; s++) {
                int64_t end = c0 + PAIR_CHUNK < units ? c0 + PAIR_CHUNK : units, c = c0;
                for (; c + chains <= end; c += chains)
                    for (int h = 0; h < chains; h++) {
                        fetch_near(w[s] + 64 * (c + h));
                        __m512i wv = _mm512_loadu_si512(w[s] + 64 * (c + h));
                        for (int i = 0; i < mb; i++)
                            acc[s][h][i] = _mm512_dpbusd_epi32(
                                acc[s][h][i], _mm512_set1_epi32(four_bytes(xq[s] + i * xstride + 4 * (c + h))), wv);
                    }
                for (; c < end; c++) {
                    __m512i wv = _mm512_loadu_si512(w[s] + 64 * c);
                    for (int i = 0; i < mb; i++)
                        acc[s][0][i] = _mm512_dpbusd_epi32(
                            acc[s][0][i], _mm512_set1_epi32(four_bytes(xq[s] + i * xstride + 4 * c)), wv);
                }
            }
    }
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < mb; i++) {
            for (int h = 1; h < chains; h++) acc[s][0][i] = _mm512_add_epi32(acc[s][0][i], acc[s][h][i]);
            _mm512_storeu_si512(out[s][i], acc[s][0][i]);
        }
}
#else
/* As the AVX-512 version's turns of PAIR_CHUNK units (whole groups of NIBBLE_STEPS) at every row count, through
 * lanes_span as lanes_sums, each group's first rows fetching their stream's lines read_ahead bytes on. No
 * fetch_next: in these turns it measured 0.92-1.06x at 4-8 rows (the AVX2 build on Zen 4). */
INLINE void lanes_sums_pair(const int8_t *x0, const int8_t *x1, int64_t xstride, const int8_t *w0, const int8_t *w1,
                            int64_t K, int64_t ahead, int mb, int32_t (*out)[MB][16]) {
    (void)ahead;
    const int8_t *w[2] = {w0, w1}, *xq[2] = {x0, x1};
    __m256i acc[2][MB][2];
    for (int s = 0; s < 2; s++)
        for (int i = 0; i < mb; i++) acc[s][i][0] = acc[s][i][1] = _mm256_setzero_si256();
    for (int64_t units = K / 4, c0 = 0; c0 < units; c0 += PAIR_CHUNK)
        for (int s = 0; s < 2; s++)
            lanes_span((const uint8_t *)xq[s], xstride, w[s], c0, c0 + PAIR_CHUNK < units ? c0 + PAIR_CHUNK : units, 0,
                       1, mb, acc[s]);
    for (int s = 0; s < 2; s++) store_sums(acc[s], mb, out[s]);
}
#endif

/* int8_block_dots of two blocks read side by side (lanes_sums_pair), block0 with rows first0.. of a0 into dots0,
 * block1 with rows first1.. of a1 into dots1: the same sums and the same epilogue, so the same outputs. Both rows'
 * activations have K columns. */
void int8_block_pair_dots(QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m, const int8_t *block0,
                          const int8_t *block1, int64_t K, float *dots0, float *dots1) {
#ifdef LS_AMX
    if (m >= AMX_INT8_ROWS && a0.q == a1.q && a0.s == a1.s && first0 == first1) /* one load of the rows for both */
        return int8_blocks_tiles(a0, first0, m, (const int8_t *const[2]){block0, block1}, 2, K,
                                 (float *const[2]){dots0, dots1});
#endif
    for (int64_t m0 = 0; m0 < m; m0 += MB) {
        int mb = m - m0 < MB ? (int)(m - m0) : MB;
        int32_t out[2][MB][16];
        int64_t bytes = int8_row_bytes(K);
        FOR_ROWS(lanes_sums_pair, a0.q + (first0 + m0) * bytes, a1.q + (first1 + m0) * bytes, bytes,
                 block0 + INT8_HEADER, block1 + INT8_HEADER, K, INT8_HEADER + 16 * K)
        block_epilogue(block0, a0, first0 + m0, mb, out[0], dots0 + 16 * m0);
        block_epilogue(block1, a1, first1 + m0, mb, out[1], dots1 + 16 * m0);
    }
}
