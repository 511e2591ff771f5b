/* MLA's absorbed decode attention, read in place from the paged latent cache.
 *
 * q [T, H, D] (D = L + R: the absorbed latent query, then the rope query), the cache [blocks, B, D] (rows
 * [c_kv ‖ k_pe]), out [T, H, L]: out[t, h] = softmax_p(scale * q[t, h] . row_p) . row_p[:L] over the positions p
 * that token t sees. One work item is a token and a block of heads: the item walks its request's rows in tiles,
 * scoring a tile's rows for all its heads, then weighing the same rows while they are in cache (an online softmax:
 * a running maximum and sum per head, the accumulators rescaled when the maximum grows), so each row is read from
 * memory once. Sums in fp32. A token's positions are split in chunks of CHUNK, each its own item, their partial
 * softmaxes combined after (as flash-decoding splits them): with one token, the threads read different rows instead
 * of the same ones for different heads. The chunks are the same whatever the batch and the threads, so a token's
 * result is too. Items are shared out among the threads; heads per item shrink so that every thread gets work. An
 * fp8 or int8 cache (kv_rows.h) is dequantized a tile at a time for all of an item's heads. bf16 queries under
 * AVX512-BF16 score 16 heads in the vector lanes (mla_lanes.h, decode_lanes_item), over bf16 rows: the cache's own or
 * a dequantized tile; the others take mla_tiles.h's fp32 tiles (decode_item, decode_quantized_item). */
#include "mla_lanes.h"

/* An item's working memory, one per thread, for a quantized cache or the lanes (mla_lanes.h): for its heads (P of
 * them: rounded up to whole lane groups) the scaled fp32 queries or the lanes' bf16 pairs, the accumulated values,
 * the running maxima and sums, an odd last query column; a tile's scores (one group of heads at a time) and the
 * lanes' weight pairs; the tile, dequantized. */
typedef struct {
    float *qs, *acc, *maxima, *sums, *q_last, *scores;
    int32_t *pairs;
    char *tile;
} ItemMemory;

INLINE int64_t lane_padded(int64_t heads) { return (heads + LANE_HEADS - 1) / LANE_HEADS * LANE_HEADS; }

/* Heads an item takes at most: decode_lanes_item keeps their lane groups on the stack (real models: up to 128). */
#define ITEM_HEADS 256

/* Floats an ItemMemory of `heads` takes (a multiple of 16: each thread's stays 64-byte aligned). */
INLINE int64_t item_floats(int64_t heads, int64_t D, int64_t L) {
    return lane_padded(heads) * (D + L + 3) + LANE_HEADS * ROW_TILE * 3 / 2 + ROW_TILE * D;
}

static ItemMemory item_memory(float *f, int64_t heads, int64_t D, int64_t L) {
    int64_t P = lane_padded(heads);
    float *scores = f + P * (D + L + 3);
    int32_t *pairs = (int32_t *)(scores + LANE_HEADS * ROW_TILE);
    return (ItemMemory){f, f + P * D, f + P * (D + L), f + P * (D + L + 1), f + P * (D + L + 2), scores, pairs,
                        (char *)(pairs + LANE_HEADS * ROW_TILE / 2)};
}

/* Rows p0 .. p1 (of n) of an fp8 or int8 cache dequantized into `tile` (bf16 for vdpbf16ps where `dot`, else fp32),
 * their addresses into tile_rows. The conversion is quick next to a row's arrival from memory, so it asks for the
 * next tile's rows, which arrive while the heads attend this one (and for the item's first tile, the rows just
 * ahead). */
static void dequantize_tile(const char *const *rows, int64_t p0, int64_t p1, int64_t n, int first, int cf, int dot,
                            int64_t D, int64_t L, char *tile, const char **tile_rows) {
    int64_t row_bytes = kv_row_bytes(cf, D);
    for (int64_t j = 0; j < p1 - p0; j++) {
        if (first) prefetch_row(rows, p0 + j + PREFETCH_ROWS, n, row_bytes);
        prefetch_row(rows, p0 + j + ROW_TILE, n, row_bytes);
        tile_rows[j] = tile + j * D * (dot ? 2 : 4);
#ifdef LS_BF16DOT
        if (dot) {
            dequantize_row_bf16(rows[p0 + j], cf, D, L, (uint16_t *)tile_rows[j]);
            continue;
        }
#endif
        dequantize_row_f32(rows[p0 + j], cf, D, L, (float *)tile_rows[j]);
    }
}

/* decode_item over an fp8 or int8 cache in fp32, for all nh heads of the item: each tile is dequantized once (no
 * copy of the cache beyond it) and attended by every head, HEADS at a time, while it is in cache, so the conversion
 * costs once per row and item rather than once per row, group of heads and pass. */
static void decode_quantized_item(const void *q, int qbf, int64_t D, int64_t L, const char *const *rows, int cf,
                                  int64_t p_begin, int64_t p_end, float scale, void *out, int obf, float *partial,
                                  int64_t nh, ItemMemory *s) {
    for (int64_t i = 0; i < nh * L; i++) s->acc[i] = 0.f;
    for (int64_t h = 0; h < nh; h++) s->maxima[h] = -INFINITY, s->sums[h] = 0.f;
    for (int64_t i = 0; i < nh * D; i++) s->qs[i] = scale * load_act(q, qbf, i);
    const char *tile[ROW_TILE];
    for (int64_t p0 = p_begin; p0 < p_end; p0 += ROW_TILE) {
        int64_t nt = p0 + ROW_TILE < p_end ? ROW_TILE : p_end - p0;
        dequantize_tile(rows, p0, p0 + nt, p_end, p0 == p_begin, cf, 0, D, L, s->tile, tile);
        for (int64_t h0 = 0; h0 < nh; h0 += HEADS) {
            float *qs = s->qs + h0 * D, *mx = s->maxima + h0, *sm = s->sums + h0, *acc = s->acc + h0 * L;
            switch (nh - h0 < HEADS ? nh - h0 : HEADS) { /* a constant head count: the accumulators in registers */
            case 1: attend_tile(qs, D, L, tile, KV_F32, 0, nt, 0, s->scores, mx, sm, acc, 1); break;
            case 2: attend_tile(qs, D, L, tile, KV_F32, 0, nt, 0, s->scores, mx, sm, acc, 2); break;
            case 3: attend_tile(qs, D, L, tile, KV_F32, 0, nt, 0, s->scores, mx, sm, acc, 3); break;
            case 4: attend_tile(qs, D, L, tile, KV_F32, 0, nt, 0, s->scores, mx, sm, acc, 4); break;
            case 5: attend_tile(qs, D, L, tile, KV_F32, 0, nt, 0, s->scores, mx, sm, acc, 5); break;
            case 6: attend_tile(qs, D, L, tile, KV_F32, 0, nt, 0, s->scores, mx, sm, acc, 6); break;
            case 7: attend_tile(qs, D, L, tile, KV_F32, 0, nt, 0, s->scores, mx, sm, acc, 7); break;
            default: attend_tile(qs, D, L, tile, KV_F32, 0, nt, 0, s->scores, mx, sm, acc, 8); break;
            }
        }
    }
    finish_heads(s->maxima, s->sums, s->acc, nh, L, out, obf, partial);
}

#ifdef LS_BF16DOT
/* An item of bf16 queries on the lanes (mla_lanes.h), its nh heads in groups of LANE_HEADS, over rows p_begin ..
 * p_end of a bf16 cache, read in place, or of an fp8 / int8 one, each tile dequantized to bf16 once for all the
 * groups (a conversion beside the products costs less than the products' wait for L2: a lone request's 16 heads ran
 * as fast over fp8 and int8 rows as over bf16 ones); results as finish_heads gives them. */
static void decode_lanes_item(const uint16_t *q, int64_t D, int64_t L, const char *const *rows, int cf,
                              int64_t p_begin, int64_t p_end, float scale, void *out, int obf, float *partial,
                              int64_t nh, ItemMemory *s) {
    LaneGroup g[lane_padded(nh) / LANE_HEADS];
    for (int64_t i = 0; i * LANE_HEADS < nh; i++) {
        int64_t h = i * LANE_HEADS;
        g[i] = (LaneGroup){(int32_t *)s->qs + h * (D / 2), s->q_last + h, s->maxima + h, s->sums + h,
                           s->acc + h * L, nh - h < LANE_HEADS ? (int)(nh - h) : LANE_HEADS};
        lane_group_start(g[i], q + h * D, D, L);
    }
    const char *tile[ROW_TILE];
    for (int64_t p0 = p_begin; p0 < p_end; p0 += ROW_TILE) {
        int64_t nt = p0 + ROW_TILE < p_end ? ROW_TILE : p_end - p0;
        if (cf == KV_BF16) {
            for (int64_t i = 0; i * LANE_HEADS < nh; i++)
                attend_tile_lanes(g[i], D, L, rows, p0, p0 + nt, p_end, scale, s->scores, s->pairs);
            continue;
        }
        /* The first group scores LANE_ROWS rows at a time as soon as they are converted, while they are in L1. */
        for (int64_t j = 0; j < nt; j += LANE_ROWS) {
            int64_t j1 = j + LANE_ROWS < nt ? j + LANE_ROWS : nt;
            dequantize_tile(rows, p0 + j, p0 + j1, p_end, p0 == p_begin, cf, 1, D, L, s->tile + j * D * 2, tile + j);
            if (g[0].nh <= 8)
                score_rows_lanes8(g[0], D, tile, j, j1, 0, scale, s->scores + j * LANE_HEADS);
            else
                score_rows_lanes(g[0], D, tile, j, j1, 0, scale, s->scores + j * LANE_HEADS);
        }
        weigh_tile_lanes(g[0], L, tile, nt, s->scores, s->pairs);
        for (int64_t i = 1; i * LANE_HEADS < nh; i++)
            attend_tile_lanes(g[i], D, L, tile, 0, nt, 0, scale, s->scores, s->pairs);
    }
    for (int64_t i = 0; i * LANE_HEADS < nh; i++) {
        int64_t h = i * LANE_HEADS;
        finish_heads(g[i].maxima, g[i].sums, g[i].acc, g[i].nh, L, (char *)out + h * L * (obf ? 2 : 4), obf,
                     partial ? partial + h * (L + 2) : NULL);
    }
}
#endif

/* One head's output from its chunks' partial softmaxes (decode_item's `partial`, `chunks` of them H heads apart),
 * rescaled to their common maximum. */
static void combine_chunks(const float *partial, int64_t chunks, int64_t H, int64_t L, void *out, int obf) {
    float m = -INFINITY, sum = 0.f, w[chunks], acc[L];
    for (int64_t c = 0; c < chunks; c++) m = fmaxf(m, partial[c * H * (L + 2)]);
    for (int64_t c = 0; c < chunks; c++) {
        w[c] = expf(partial[c * H * (L + 2)] - m);
        sum += w[c] * partial[c * H * (L + 2) + 1];
    }
    for (int64_t l = 0; l < L; l++) acc[l] = 0.f;
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t l = 0; l < L; l++) acc[l] += w[c] * partial[c * H * (L + 2) + 2 + l];
    for (int64_t l = 0; l < L; l++) store_out(out, obf, l, acc[l] / sum);
}

/* Positions query token t of request r sees: its request's earlier ones and itself. */
INLINE int64_t visible(int64_t t, int64_t r, const int32_t *qsl, const int32_t *seq_lens) {
    return seq_lens[r] - (qsl[r + 1] - qsl[r]) + (t - qsl[r]) + 1;
}

/* Requests r < R: query tokens qsl[r] .. qsl[r + 1], seq_lens[r] positions in the blocks of block_table row r
 * (row stride bt_stride); query token j of a request with n new tokens sees positions 0 .. seq_len - n + j; a token
 * that sees none (or belongs to no request) gets zeros. `io`: bit 0 q is bf16, bit 1 the cache (bit 3: fp8, bit 4:
 * int8; kv_rows.h), bit 2 out (else fp32). The metadata within the cache, the block table and the T tokens
 * (decode_metadata_error: bounds.c). Returns LS_NO_MEMORY (computing nothing) or LS_OK. */
int mla_decode(const void *q, int64_t T, int64_t H, int64_t D, int64_t L, const void *cache, int64_t B,
               const int32_t *block_table, int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens, int64_t R,
               float scale, void *out, int io, int threads) {
    int qbf = io & 1, cf = kv_format(io), obf = (io >> 2) & 1;
    int64_t row_bytes = kv_row_bytes(cf, D), max_len = 0;
    for (int64_t r = 0; r < R; r++) max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
    /* Every request's row addresses once (the items of its tokens share them). */
    ScratchMark mark = scratch_mark();
    const char **rows = scratch((R * max_len + 1) * sizeof(char *));
    int64_t *request = scratch((T + 1) * sizeof(int64_t)), *first = scratch((T + 1) * sizeof(int64_t));
    if (!rows || !request || !first) return scratch_release(mark), LS_NO_MEMORY;
    for (int64_t t = 0; t < T; t++) request[t] = -1; /* a token of no request sees nothing */
    for (int64_t r = 0; r < R; r++) {
        for (int64_t b = 0, p = 0; p < seq_lens[r]; b++) {
            const char *block = (const char *)cache + (int64_t)block_table[r * bt_stride + b] * B * row_bytes;
            for (int64_t i = 0; i < B && p < seq_lens[r]; i++, p++) rows[r * max_len + p] = block + i * row_bytes;
        }
        for (int64_t t = qsl[r]; t < qsl[r + 1]; t++) request[t] = r;
    }
    /* Token t's chunks are numbered first[t] .. first[t + 1] (token[chunk]: whose); a chunk's items split its heads
     * in blocks. */
    first[0] = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t n = request[t] < 0 ? 0 : visible(t, request[t], qsl, seq_lens);
        first[t + 1] = first[t] + (n > 0 ? (n + CHUNK - 1) / CHUNK : 0);
    }
    int64_t chunks = first[T], per = (chunks * H + threads - 1) / threads;
    int64_t *token = scratch(chunks * sizeof(int64_t));
    float *partial = scratch(chunks * H * (L + 2) * sizeof(float));
    if (!token || !partial) return scratch_release(mark), LS_NO_MEMORY;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = first[t]; c < first[t + 1]; c++) token[c] = t;
    int64_t heads = per < 1 ? 1 : per > H ? H : per;
    heads = heads > ITEM_HEADS ? ITEM_HEADS : heads;
    int64_t blocks = (H + heads - 1) / heads;
#ifdef LS_BF16DOT
    int dot = qbf && cf != KV_F32; /* bf16 products through vdpbf16ps, the heads in the lanes */
#else
    int dot = 0;
#endif
    int64_t memory = cf >= KV_FP8 || dot ? item_floats(heads, D, L) : 0; /* floats of each thread's ItemMemory */
    float *items = scratch(threads * memory * sizeof(float));
    if (!items) return scratch_release(mark), LS_NO_MEMORY;
#pragma omp parallel num_threads(threads)
    {
        ItemMemory mine = item_memory(items + omp_get_thread_num() * memory, heads, D, L);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < chunks * blocks; item++) {
            int64_t chunk = item / blocks, t = token[chunk], r = request[t], n = visible(t, r, qsl, seq_lens);
            int64_t p_begin = (chunk - first[t]) * CHUNK, p_end = p_begin + CHUNK < n ? p_begin + CHUNK : n;
            int64_t h_begin = item % blocks * heads, h_end = h_begin + heads < H ? h_begin + heads : H;
            int whole = first[t + 1] - first[t] == 1;
            const char *const *rr = rows + r * max_len;
            void *oi = (char *)out + (t * H + h_begin) * L * (obf ? 2 : 4);
            float *pi = whole ? NULL : partial + (chunk * H + h_begin) * (L + 2);
#ifdef LS_BF16DOT
            if (dot) {
                decode_lanes_item((const uint16_t *)q + (t * H + h_begin) * D, D, L, rr, cf, p_begin, p_end, scale, oi,
                                  obf, pi, h_end - h_begin, &mine);
                continue;
            }
#endif
            if (cf >= KV_FP8) {
                decode_quantized_item((const char *)q + (t * H + h_begin) * D * (qbf ? 2 : 4), qbf, D, L, rr, cf,
                                      p_begin, p_end, scale, oi, obf, pi, h_end - h_begin, &mine);
                continue;
            }
            for (int64_t h0 = h_begin; h0 < h_end; h0 += HEADS) {
                int nh = h_end - h0 < HEADS ? (int)(h_end - h0) : HEADS;
                const void *qt = (const char *)q + (t * H + h0) * D * (qbf ? 2 : 4);
                void *ot = (char *)out + (t * H + h0) * L * (obf ? 2 : 4);
                float *pt = whole ? NULL : partial + (chunk * H + h0) * (L + 2);
                switch (nh) { /* a constant head count per instance: the accumulators live in registers */
                case 1: decode_item(qt, qbf, D, L, rr, cf, p_begin, p_end, scale, ot, obf, pt, 1); break;
                case 2: decode_item(qt, qbf, D, L, rr, cf, p_begin, p_end, scale, ot, obf, pt, 2); break;
                case 3: decode_item(qt, qbf, D, L, rr, cf, p_begin, p_end, scale, ot, obf, pt, 3); break;
                case 4: decode_item(qt, qbf, D, L, rr, cf, p_begin, p_end, scale, ot, obf, pt, 4); break;
                case 5: decode_item(qt, qbf, D, L, rr, cf, p_begin, p_end, scale, ot, obf, pt, 5); break;
                case 6: decode_item(qt, qbf, D, L, rr, cf, p_begin, p_end, scale, ot, obf, pt, 6); break;
                case 7: decode_item(qt, qbf, D, L, rr, cf, p_begin, p_end, scale, ot, obf, pt, 7); break;
                default: decode_item(qt, qbf, D, L, rr, cf, p_begin, p_end, scale, ot, obf, pt, 8); break;
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t th = 0; th < T * H; th++) {
            int64_t t = th / H, h = th - t * H;
            if (first[t + 1] == first[t]) /* no position to attend: zeros, not whatever the memory held */
                for (int64_t l = 0; l < L; l++) store_out((char *)out + th * L * (obf ? 2 : 4), obf, l, 0.f);
            else if (first[t + 1] - first[t] > 1)
                combine_chunks(partial + (first[t] * H + h) * (L + 2), first[t + 1] - first[t], H, L,
                               (char *)out + th * L * (obf ? 2 : 4), obf);
        }
    }
    scratch_release(mark);
    return LS_OK;
}
