/* The experts' and quantized linears' weight formats and their activations (quant_acts.c), shared by qgemm.c,
 * int4.c, gemv.c's dense blocks and the drivers (quant_blocks.c, experts.c). */
#pragma once

#include "simd.h"

/* int8 activations' offset into vpdpbusd's (AVX-512, AVX-VNNI) and vpmaddubsw's (AVX2) unsigned operand */
#define INT8_OFFSET 128
#define XBLOCK 64 /* int4's activations are quantized per 64 columns */

/* Where int8 products run through vpdpbusd, which sums u8 x s8 products into int32 with no intermediate: AVX-512 VNNI,
 * and AVX-VNNI (the avx2_vnni build: AVX2's registers, Intel's client CPUs without AVX-512). Plain AVX2 has only
 * vpmaddubsw, whose int16 pairs would overflow on whole bytes: its activations are kept as nibbles. */
#if defined(LS_AVX512) || defined(LS_AVXVNNI)
#define LS_DPBUSD
#endif

/* x's 4 bytes as one int, to broadcast to every lane (the lanes layouts' activations). */
INLINE int32_t four_bytes(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

/* Bytes of a row of int8 activations, u = x + INT8_OFFSET (unsigned): vpdpbusd's builds keep u whole; plain AVX2 keeps
 * its nibbles, u = 16 hi + lo, per 32 columns 32 bytes of hi then 32 of lo (the last 32 padded), so that vpmaddubsw
 * takes each nibble as its unsigned operand with no vpsignb and its pairs of products add up in int16 (qgemm.c). */
INLINE int64_t int8_row_bytes(int64_t K) {
#ifdef LS_DPBUSD
    return K;
#else
    return 2 * ((K + 31) & ~(int64_t)31);
#endif
}

/* For int8 weights: q = round(x / s) + INT8_OFFSET per row (int8_row_bytes' layout), scale s one a row. For int4:
 * q = round(x / s) per XBLOCK columns, scales s one a block, and per group of G columns the corrections corr (see
 * int4.c). For Q6_K: int4's q and s, and in corr's room per 16 columns -32 * the sum of q, as int32 (q6k.c; Q2_K:
 * -2 * it, each followed by the exact sum of x over the 16 columns; Q3_K: -4 * it); for
 * Q5_0 the same per 32 columns with -16, and for Q5_K (Q4_K: -8) each followed by the exact sum of x over them
 * (q45.c). For dense weights: `rows`, the rows themselves, fp32, or bf16 (`bf16`) where the weights are and vdpbf16ps
 * takes both. */
typedef struct {
    int8_t *q;
    float *s, *corr;
    void *rows;
    int32_t bf16;
} QuantActs;

/* The weight formats, all in blocks of 16 outputs, each block one stream of bytes read once and self-contained (its
 * scales inside): bits 32 or 16, dense fp32 or bf16 rows `[N, K]`, a block 16 consecutive rows (the last one N % 16
 * where 16 does not divide N); 8, `pack_int8`'s layout (qgemm.c); 4, `pack_int4`'s with K inputs in groups of G
 * (int4.c); 6 (group 16), `pack_q6k`'s: llama.cpp's Q6_K values (q6k.c); 3 (group 16), `pack_q3k`'s: its Q3_K values
 * (q6k.c); 2 (group 16), `pack_q2k`'s: its Q2_K values (q6k.c); 5 (group 32), `pack_q50`'s: its Q5_0 values
 * (q45.c); 5 (group 32, mins), `pack_q51`'s: its Q5_1 values; 5 (group 256), `pack_q5k`'s: its Q5_K values; 4 (group
 * 256), `pack_q4k`'s: its Q4_K values (q45.c; int4's groups are at most 128). A driver (quant_blocks.c, experts.c)
 * needs of a format only these traits: the bytes of a block, how the activations are prepared for it, and the dot
 * products of a block with some rows of them. */
typedef struct {
    int32_t bits;
    int64_t group; /* int4's group size G; Q6_K's 16 */
    int32_t mins;  /* 1: Q5_1, whose groups hold an fp16 minimum beside each d (bits and group are Q5_0's); else 0 */
} Format;

INLINE int dense(Format f) { return f.bits == 32 || f.bits == 16; }

/* All from the scratch arena (the caller holds a mark); q (dense: rows) NULL where it could not grow. quantize_acts:
 * the quantized formats' (bits, G); it and quantize_for prepare many rows on `threads` threads. take_acts: room
 * only, for quantize_into to fill (from another thread than the arena's, e.g. inside a parallel region); `bf16`:
 * whether the rows quantize_into will read are bf16. acts_row: row `row` of `a` as acts of its own (quantize_into
 * with M = 1 fills it). */
QuantActs quantize_acts(const void *x, int bf16, int64_t M, int64_t K, int bits, int64_t G, int threads);
QuantActs take_acts(Format f, int bf16, int64_t M, int64_t K);
void quantize_into(Format f, const void *x, int bf16, int64_t M, int64_t K, QuantActs a);
QuantActs quantize_for(Format f, const void *x, int bf16, int64_t M, int64_t K, int threads);
QuantActs gather_acts(Format f, QuantActs a, const int64_t *rows, int64_t P, int64_t K);
QuantActs acts_row(Format f, QuantActs a, int64_t row, int64_t K);

#define INT8_HEADER 128 /* pack_int8's block: 16 fp32 scales and 16 int32 sums of q before the weights */

INLINE int64_t int4_block_bytes(int64_t K, int64_t G) { return K / G * (64 + 8 * G); }

/* pack_q6k's bytes of 256 columns of a block (q6k.c): 16 fp32 d, 16 x 16 int8 sc, 16 groups of 192 bytes of q;
 * pack_q3k's: the same with groups of 96 bytes; pack_q2k's: 16 fp32 d, 16 dmin, 16 x 16 bytes of sc | m << 4, 16
 * groups of 64 bytes of q. */
#define Q6K_SUPER (64 + 16 * 16 + 16 * 192)
#define Q3K_SUPER (64 + 16 * 16 + 16 * 96)
#define Q2K_SUPER (128 + 16 * 16 + 16 * 64)
/* pack_q50's and pack_q5k's bytes of 32 columns of a block (q45.c): a 32-byte header (Q5_0: 16 fp16 d; Q5_K: 16 sc,
 * 16 m), 64 bytes of fifth bits, 4 units of 64 of nibbles; pack_q51's with a 64-byte header (16 fp16 d, 16 fp16 m);
 * pack_q4k's without the fifth bits; the k-quants' of 256 columns: 16 fp32 d, 16 dmin, 8 groups. */
#define Q5_GROUP (32 + 64 + 4 * 64)
#define Q51_GROUP (64 + 64 + 4 * 64)
#define Q4_GROUP (32 + 4 * 64)
#define Q5K_SUPER (128 + 8 * Q5_GROUP)
#define Q4K_SUPER (128 + 8 * Q4_GROUP)

/* The Format a one-call block's Weight (latentserve.h) of a blocked kind is read as; bits 0 for the other kinds. */
INLINE Format weight_format(int32_t kind, int64_t group) {
    int32_t bits = kind == LS_INT8_BLOCKS                               ? 8
                   : kind == LS_INT4 || kind == LS_Q4K                  ? 4
                   : kind == LS_Q6K                                     ? 6
                   : kind == LS_Q50 || kind == LS_Q51 || kind == LS_Q5K ? 5
                   : kind == LS_Q2K                                     ? 2
                   : kind == LS_Q3K                                     ? 3
                                                                        : 0;
    return (Format){bits, group, kind == LS_Q51};
}

/* Formats of q45.c: Q5_0 (5, 32), Q5_1 (5, 32, mins), Q5_K (5, 256), Q4_K (4, 256). */
INLINE int q45(Format f) { return f.bits == 5 || (f.bits == 4 && f.group == 256); }
/* Whether q45.c's format f needs each group's exact sum of x beside its centre (a minimum a group: the k-quants',
 * Q5_1's). */
INLINE int sums_x(Format f) { return f.group == 256 || f.mins; }
/* Formats of q6k.c: Q6_K (6, 16), Q3_K (3, 16), Q2_K (2, 16). */
INLINE int kq16(Format f) { return f.bits == 6 || f.bits == 3 || f.bits == 2; }

INLINE int64_t block_bytes(Format f, int64_t K) {
    if (dense(f)) return 16 * K * (f.bits / 8);
    if (kq16(f)) return K / 256 * (f.bits == 6 ? Q6K_SUPER : f.bits == 3 ? Q3K_SUPER : Q2K_SUPER);
    if (q45(f) && f.group == 32) return K / 32 * (f.mins ? Q51_GROUP : Q5_GROUP);
    if (q45(f)) return K / 256 * (f.bits == 5 ? Q5K_SUPER : Q4K_SUPER);
    return f.bits == 8 ? INT8_HEADER + 16 * K : int4_block_bytes(K, f.group);
}

/* A pass's activations for the file formats' kernels (q6k.c, q45.c): row 0's quantized x, scales and corrections
 * (rows K, K / 64 and `corrs` apart; per group the centre, and where the format has minimums then the exact sum as a
 * float). */
typedef struct {
    const int8_t *xq;
    const float *xs;
    const int32_t *corr;
    int64_t corrs;
} FileRows;

INLINE FileRows file_rows(QuantActs a, int64_t r, int64_t K, int64_t corrs) {
    return (FileRows){a.q + r * K, a.s + r * (K / XBLOCK), (const int32_t *)a.corr + r * corrs, corrs};
}

/* The quantized formats' linear layers (quant_blocks.c), io as simd.h's kernels'. */
int quant_linear(const void *x, int64_t M, int64_t K, const void *w, Format f, int64_t N, void *y, int io,
                 int threads);

/* The 16 outputs of one block for rows first.. first + m of `a` (prepared for the block's format), into
 * dots[16 * i + j]; dense blocks: their first `outputs` rows. */
void int8_block_dots(QuantActs a, int64_t first, int64_t m, const int8_t *block, int64_t K, float *dots);
/* How far ahead of what is being summed the few-row kernels fetch their weight stream into L1, in bytes (int4.c
 * fetch_ahead, rounded up to whole groups; qgemm.c fetch_near, a pair's streams); 0: not at all, the hardware
 * prefetchers alone. Set once at load by the CPU's maker (ls_set_read_ahead, kernels/build.py READ_AHEAD): it is the
 * memory system's business, not the instruction set's, and the same build ran faster with it on an Intel Xeon and
 * slower on AMD Zen 4. */
extern int64_t read_ahead;

/* The 64-byte lines of a group of `bytes` at p (a few-row kernel's unit of its weight stream: int4's group of 64 +
 * 8 G bytes, q45.c's) read_ahead bytes further on (rounded up to whole groups; none where read_ahead is 0), fetched
 * into L1 while this one is summed. Past a block's end it fetches the next block in memory: the one the drivers read
 * next (a share's blocks and both halves of a pair walk forward; the experts walk an expert's blocks in order). A
 * prefetch does not fault, so the address is formed in integers. */
INLINE void fetch_ahead(const void *p, int64_t bytes) {
    if (!read_ahead) return;
    const int64_t ahead = (read_ahead + bytes - 1) / bytes * bytes;
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)((uintptr_t)p + ahead + l), _MM_HINT_T0);
}

/* int8_block_dots of two blocks at once, each with its own rows (m of each), into dots0 and dots1: two streams of
 * weights in flight; on AMX tiles (from AMX_INT8_ROWS rows), the same rows of both read once for the two. The drivers
 * use it where pairs() says. */
#define PAIR_ROWS 8
void int8_block_pair_dots(QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m, const int8_t *block0,
                          const int8_t *block1, int64_t K, float *dots0, float *dots1);
void int4_block_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, int64_t G, float *dots);
void int4_block_pair_dots(QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m, const uint8_t *block0,
                          const uint8_t *block1, int64_t K, int64_t G, float *dots0, float *dots1);
/* f: one of kq16()'s formats. */
void q6k_block_dots(Format f, QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, float *dots);
void q6k_block_pair_dots(Format f, QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m,
                         const uint8_t *block0, const uint8_t *block1, int64_t K, float *dots0, float *dots1);
/* f: one of q45()'s formats. */
void q45_block_dots(Format f, QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, float *dots);
void q45_block_pair_dots(Format f, QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m,
                         const uint8_t *block0, const uint8_t *block1, int64_t K, float *dots0, float *dots1);
void dense_block_dots(QuantActs a, int64_t first, int64_t m, const void *block, int wbf, int64_t K, int64_t outputs,
                      float *dots);

#ifdef LS_AMX
/* amx.c: AMX tiles for the int8 and int4 blocks from the rows below (at least 16: a row tile). amx_request: the
 * process's permission (once); amx_begin / amx_end around a block's tile work on the calling thread, `span` columns
 * a product (64; int4's groups of 32: 32). amx_int8_sums: sums[s][i][j] = the int32 sum of rows i < rows
 * (16..AMX_CHUNK) of xq (K bytes apart) with output j of the lanes-layout weight w0 (s = 0) and, where w1 is not
 * NULL, w1 (s = 1) over their first `whole` columns (a multiple of 64).
 *
 * From how many rows the tiles beat vpdpbusd (one core, 2816 x 2048, CPU time, the builds in turns;
 * docs/kernels.md "AMX tiles"): int8 from 16 (1.6x at 16 rows, 2.5x at 48). int4 pays per span of 64 columns
 * (group 32: 32) and row tile a tile store and int4_group's float operations, which the tiles do not shorten: groups
 * of 64 and 128 win from 16 rows (1.11-1.35x and 1.26x there), group 32 from 32 (0.98-1.02x at 16, 0.88-1.01x at
 * 24: a second row tile, overlapping, for 8 rows; 1.16-1.23x at 32). */
#define AMX_INT8_ROWS 16
INLINE int64_t amx_int4_rows(int64_t G) { return G == 32 ? 32 : 16; }
#define AMX_CHUNK 64 /* rows a pass: four row tiles of sums */
/* A compiler barrier after writing what tile loads read: the compiler takes _tile_loadd to read no memory. */
INLINE void written(void) { __asm__ volatile("" ::: "memory"); }
int amx_request(void);
void amx_begin(int span);
void amx_end(void);
void amx_int8_sums(const int8_t *xq, int64_t K, int64_t whole, const int8_t *w0, const int8_t *w1, int rows,
                   int32_t (*sums)[AMX_CHUNK][16]);
/* int4_block_dots on tiles (m >= 16), the same bits. */
void amx_int4_block_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, int64_t G,
                         float *dots);
/* q45_block_dots on tiles for m rows, a multiple of 16, the same bits; q45_block_dots takes them from AMX_Q45_ROWS. */
#define AMX_Q45_ROWS 32
void amx_q45_block_dots(Format f, QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K,
                        float *dots);
/* q6k_block_dots on tiles for m rows, a multiple of 16, the same bits; q6k_block_dots takes them from AMX_Q6K_ROWS. */
#define AMX_Q6K_ROWS 32
void amx_q6k_block_dots(Format f, QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K,
                        float *dots);
#endif

/* Whether the drivers hand two blocks of format f at once (block_pair_dots) for m rows: up to PAIR_ROWS, two streams
 * of weights where one keeps too few reads in flight; on AMX tiles, int8 from AMX_INT8_ROWS rows, the rows' A tiles
 * loaded once for both blocks where the two blocks meet the same rows. */
INLINE int pairs(Format f, int64_t m) {
#ifdef LS_AMX
    if (f.bits == 8 && m >= AMX_INT8_ROWS) return 1;
#endif
    return m <= PAIR_ROWS;
}

/* The quantized formats' blocks (every block 16 outputs, padded). */
INLINE void block_dots(Format f, QuantActs a, int64_t first, int64_t m, const void *block, int64_t K, float *dots) {
    if (f.bits == 8)
        int8_block_dots(a, first, m, (const int8_t *)block, K, dots);
    else if (kq16(f))
        q6k_block_dots(f, a, first, m, (const uint8_t *)block, K, dots);
    else if (q45(f))
        q45_block_dots(f, a, first, m, (const uint8_t *)block, K, dots);
    else
        int4_block_dots(a, first, m, (const uint8_t *)block, K, f.group, dots);
}

/* The quantized formats' two blocks at once, each with its own rows (m of each; the drivers: where pairs()). */
INLINE void block_pair_dots(Format f, QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m,
                            const void *block0, const void *block1, int64_t K, float *dots0, float *dots1) {
    if (f.bits == 8)
        int8_block_pair_dots(a0, first0, a1, first1, m, (const int8_t *)block0, (const int8_t *)block1, K, dots0,
                             dots1);
    else if (kq16(f))
        q6k_block_pair_dots(f, a0, first0, a1, first1, m, (const uint8_t *)block0, (const uint8_t *)block1, K, dots0,
                            dots1);
    else if (q45(f))
        q45_block_pair_dots(f, a0, first0, a1, first1, m, (const uint8_t *)block0, (const uint8_t *)block1, K, dots0,
                            dots1);
    else
        int4_block_pair_dots(a0, first0, a1, first1, m, (const uint8_t *)block0, (const uint8_t *)block1, K, f.group,
                             dots0, dots1);
}

/* Any format's block: `outputs` of its rows hold weights (dense blocks end with the weight). */
INLINE void format_dots(Format f, QuantActs a, int64_t first, int64_t m, const void *block, int64_t K,
                        int64_t outputs, float *dots) {
    if (dense(f))
        dense_block_dots(a, first, m, block, f.bits == 16, K, outputs, dots);
    else
        block_dots(f, a, first, m, block, K, dots);
}
