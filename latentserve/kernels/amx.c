/* AMX tiles (the avx512_amx build, -DLS_AMX): their state, and the int8 and int4 blocks' dot products at many rows
 * (prefill, the experts' groups; llama.cpp's formats' blocks: amx_blocks.c): TDPBUSD / TDPBSUD multiply-add 16 rows x
 * 16 outputs x 64 columns of bytes in one instruction, 16 times what one vpdpbusd does. The blocks need no new layout:
 * `pack_int8`'s 4 columns of 16 outputs a 64-byte unit are a B tile's row in its VNNI layout, so 16 units (64 columns)
 * load as one tile straight from the block; `pack_int4`'s units unpack into two such rows (low nibbles: columns
 * 8c..8c+3, high: 8c+4..8c+7). The activations' rows (K bytes apart) are A tiles. The integer sums are exact, so they
 * are the vpdpbusd path's, and the float work after them is done in the same order with the same operations: the
 * results are the avx512_bf16 build's, bit for bit.
 *
 * Tiles, int8, two blocks with the same rows (the drivers hand them in pairs): 0-3 sums (C) of two row tiles (32
 * rows) times the two blocks, 4 and 7 the blocks' weights (B), 5 and 6 the row tiles' activations (A). Each A tile
 * loaded serves both B tiles and each B tile both A tiles: 4 tile loads for 4 TDPBUSD. That is the most products a
 * load with 8 tiles: r row tiles times b blocks take r * b C tiles, r A and b B (r * b + r + b <= 8) and r + b loads
 * for r * b products; 2 x 2 gives 1 a load, 3 x 1 and 1 x 3 0.75, one block's 4 row tiles (A in turns) 0.8, and
 * 4 x 2 would need 8 C tiles alone. A lone block (an odd count, the experts' blocks one at a time): 0-3 sums of four
 * row tiles (64 rows), 4 its B, 5 and 6 the A tiles in turns, so that a load need not wait for the product before it
 * to have read its tile. int4: 0 and 1 sums of one row tile's spans in turns, 4 and 7 their B, 5 and 6 their A. A
 * row count that 16 does not divide ends with a row tile overlapping the one before: those rows are computed twice,
 * the same, and their results kept once.
 * Linux hands a process the tiles' state only on request (`amx_request`, the loader calls it once through
 * ls_enable_amx); the tile configuration is the calling thread's, loaded by each block's call (`amx_begin`). */
#include <cpuid.h>
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "quant.h"

#ifdef LS_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define CPUID_AMX_TILE (1u << 24) /* leaf 7, subleaf 0, edx */
#define CPUID_AMX_INT8 (1u << 25)

int amx_request(void) {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || (edx & (CPUID_AMX_TILE | CPUID_AMX_INT8)) !=
                                                                  (CPUID_AMX_TILE | CPUID_AMX_INT8))
        return refuse(LS_NO_AMX, "this CPU has no AMX-TILE and AMX-INT8 (cpuid leaf 7)");
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA))
        return refuse(LS_NO_AMX, "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM): %s",
                      strerror(errno));
    return LS_OK;
}

typedef struct { /* LDTILECFG's 64 bytes, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* gcc 12's _tile_loadconfig tells the compiler it reads 8 bytes of the configuration (it dropped the stores of the
 * rest: the instruction faulted), and _tile_loadd that it reads no memory: the configuration goes to the instruction
 * whole, and data written before tile loads read it is made visible to them by a compiler barrier (quant.h
 * `written`). */
INLINE void load_config(const TileConfig *c) { __asm__ volatile("ldtilecfg %0" ::"m"(*c)); }

void amx_begin(int span) {
    TileConfig c = {.palette = 1};
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    c.rows[4] = c.rows[7] = (uint8_t)(span / 4); /* B: a row per 4 columns */
    c.colsb[5] = c.colsb[6] = (uint16_t)span;
    load_config(&c);
}

void amx_end(void) { _tile_release(); }

/* Where row tile t of `rows` (16..AMX_CHUNK) starts: 16 t, the last one rows - 16. */
INLINE int tile_row(int t, int rows) { return 16 * t < rows - 16 ? 16 * t : rows - 16; }

/* One row tile's product on amx_begin's span of columns: A tile `a` loaded from x (K bytes a row), then C tile `c`
 * += A times B (tile 4). Tile numbers are literals: the instructions name them. */
#define TILE_PRODUCT(c, a, x, K, op)  \
    do {                              \
        _tile_loadd(a, (x), (K));     \
        op(c, a, 4);                  \
    } while (0)

/* One block: four row tiles on C 0-3, B in tile 4, A in 5 and 6 in turns. */
static void one_block(const int8_t *const x[4], int tiles, int64_t K, int64_t whole, const int8_t *w) {
    for (int64_t k = 0; k < whole; k += 64) {
        _tile_loadd(4, w + 16 * k, 64); /* units k / 4 .. k / 4 + 15 */
        TILE_PRODUCT(0, 5, x[0] + k, K, _tile_dpbusd);
        if (tiles > 1) TILE_PRODUCT(1, 6, x[1] + k, K, _tile_dpbusd);
        if (tiles > 2) TILE_PRODUCT(2, 5, x[2] + k, K, _tile_dpbusd);
        if (tiles > 3) TILE_PRODUCT(3, 6, x[3] + k, K, _tile_dpbusd);
    }
}

/* Two blocks, two row tiles (x0, and x1 where `second`): C 0 and 1 row tile 0's sums of blocks 0 and 1, C 2 and 3
 * row tile 1's; B in tiles 4 and 7, A in 5 and 6. Each tile takes the next 64 columns right after its last product
 * of these, so that the next columns' first products find their tiles loaded a product or two earlier: loading each
 * just before its products instead ran 0.9x as fast (this loop alone on 256 rows, 2816 x 2048: 1.8 against 2.0 T
 * multiply-adds/s). */
static void two_blocks(const int8_t *x0, const int8_t *x1, int second, int64_t K, int64_t whole, const int8_t *w0,
                       const int8_t *w1) {
    if (whole == 0) return; /* no tile of columns: loading one would read past the rows and the block */
    _tile_loadd(4, w0, 64);
    _tile_loadd(7, w1, 64);
    _tile_loadd(5, x0, K);
    if (second) _tile_loadd(6, x1, K);
    for (int64_t k = 0; k < whole; k += 64) {
        int more = k + 64 < whole;
        _tile_dpbusd(0, 5, 4);
        _tile_dpbusd(1, 5, 7);
        if (more) _tile_loadd(5, x0 + k + 64, K);
        if (second) _tile_dpbusd(2, 6, 4);
        if (more) _tile_loadd(4, w0 + 16 * (k + 64), 64);
        if (second) _tile_dpbusd(3, 6, 7);
        if (more) _tile_loadd(7, w1 + 16 * (k + 64), 64);
        if (more && second) _tile_loadd(6, x1 + k + 64, K);
    }
}

INLINE void zero_sums(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    written();
}

void amx_int8_sums(const int8_t *xq, int64_t K, int64_t whole, const int8_t *w0, const int8_t *w1, int rows,
                   int32_t (*sums)[AMX_CHUNK][16]) {
    int tiles = (rows + 15) / 16;
    const int8_t *x[4];
    for (int t = 0; t < 4; t++) x[t] = xq + tile_row(t < tiles ? t : 0, rows) * K;
    if (!w1) {
        zero_sums();
        one_block(x, tiles, K, whole, w0);
        _tile_stored(0, sums[0][tile_row(0, rows)], 64);
        if (tiles > 1) _tile_stored(1, sums[0][tile_row(1, rows)], 64);
        if (tiles > 2) _tile_stored(2, sums[0][tile_row(2, rows)], 64);
        if (tiles > 3) _tile_stored(3, sums[0][tile_row(3, rows)], 64);
        return;
    }
    for (int t = 0; t < tiles; t += 2) {
        zero_sums();
        two_blocks(x[t], x[t + 1], t + 1 < tiles, K, whole, w0, w1);
        _tile_stored(0, sums[0][tile_row(t, rows)], 64);
        _tile_stored(1, sums[1][tile_row(t, rows)], 64);
        if (t + 1 == tiles) break;
        _tile_stored(2, sums[0][tile_row(t + 1, rows)], 64);
        _tile_stored(3, sums[1][tile_row(t + 1, rows)], 64);
    }
}

#define INT4_CHUNK 2048 /* columns of an int4 block unpacked at a time: 32 KB of B rows, read from L1 by every row */

/* Columns k0..k1 of an int4 block (groups of G) as B rows: unit c of a group, columns 8c..8c+7, gives the rows of
 * columns 8c..8c+3 (its low nibbles) and 8c+4..8c+7 (its high ones). */
static void int4_unpack(const uint8_t *block, int64_t k0, int64_t k1, int64_t G, uint8_t *b) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int64_t g = k0 / G; g < k1 / G; g++)
        for (int64_t u = 0; u < G / 8; u++) {
            __m512i v = _mm512_loadu_si512(block + g * (64 + 8 * G) + 64 + 64 * u);
            uint8_t *row = b + 16 * (g * G + 8 * u - k0);
            _mm512_storeu_si512(row, _mm512_and_si512(v, low));
            _mm512_storeu_si512(row + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    written();
}

/* One span's products (TDPBSUD: signed activations, unsigned nibbles; int4_group's integer sums) into C tile `c`,
 * through A tile `a` and B tile `bt`: the 16 rows of xq (K bytes apart) at column k, b's B rows from column k0. */
#define INT4_SPAN(c, a, bt, xq, b, k, k0, K)          \
    do {                                              \
        _tile_zero(c);                                \
        _tile_loadd(a, (xq) + (k), K);                \
        _tile_loadd(bt, (b) + 16 * ((k) - (k0)), 64); \
        _tile_dpbsud(c, a, bt);                       \
    } while (0)

/* int4_group's float operations on the sums of the span at column k, in its order: res += (scale * xs) * sums, and
 * where the span ends group g (`shift`: log2 G), the group's two corrections. xs, corr: row 0's (`chunks` scales
 * and 2 `groups` corrections a row). A macro with its loops unrolled by the compiler's first passes (GCC unroll), so
 * that res[16] stays in registers: a function taking res's address, or loops unrolled later, kept it in memory,
 * loaded and stored every span (group 128, 2816 x 2048: 1.63x against vpdpbusd that way, 1.84x this way). */
#define INT4_SPAN_DONE(res, sums, block, k, span, G, shift, xs, corr, chunks, groups)                          \
    do {                                                                                                       \
        int64_t g_ = (k) >> (shift);                                                                           \
        __m512i pairs_ = _mm512_loadu_si512((block) + g_ * (64 + 8 * (G)));                                    \
        __m512 scale_ = _mm512_castsi512_ps(_mm512_slli_epi32(pairs_, 16));                                    \
        _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++)                                                   \
            res[i] = _mm512_fmadd_ps(_mm512_mul_ps(scale_, _mm512_set1_ps((xs)[i * (chunks) + (k) / XBLOCK])), \
                                     _mm512_cvtepi32_ps(_mm512_loadu_si512((sums)[i])), res[i]);               \
        if ((((k) + (span)) & ((G) - 1)) == 0) {                                                               \
            __m512 min_ = _mm512_castsi512_ps(_mm512_and_si512(pairs_, _mm512_set1_epi32((int)0xffff0000)));   \
            _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) {                                             \
                const float *cg_ = (corr) + i * 2 * (groups) + 2 * g_;                                         \
                res[i] = _mm512_fmadd_ps(scale_, _mm512_set1_ps(cg_[0]), res[i]);                              \
                res[i] = _mm512_fmadd_ps(min_, _mm512_set1_ps(cg_[1]), res[i]);                                \
            }                                                                                                  \
        }                                                                                                      \
    } while (0)

/* int4.c's int4_group for 16 rows at once over columns k0..k1 (whole groups), b their B rows. Spans in turns on C
 * tiles 0 and 1: the next span's product runs while the float operations take this one's sums. res starts at 0
 * (k0 = 0) or at dots (the columns before k0); rows below `skip` (done by the row tile before) are neither read nor
 * written. */
static void int4_rows(QuantActs a, int64_t row, int skip, const uint8_t *block, int64_t k0, int64_t k1, int64_t K,
                      int64_t G, const uint8_t *b, float *dots) {
    int64_t span = G < XBLOCK ? G : XBLOCK, chunks = K / XBLOCK, groups = K / G, shift = __builtin_ctzll(G);
    const int8_t *xq = a.q + row * K;
    const float *xs = a.s + row * chunks, *corr = a.corr + row * 2 * groups;
    __m512 res[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) res[i] = k0 == 0 || i < skip ? _mm512_setzero_ps() : _mm512_loadu_ps(dots + 16 * i);
    int32_t sums[16][16];
    INT4_SPAN(0, 5, 4, xq, b, k0, k0, K);
    for (int64_t k = k0; k < k1; k += 2 * span) {
        if (k + span < k1) INT4_SPAN(1, 6, 7, xq, b, k + span, k0, K);
        _tile_stored(0, sums, 64);
        INT4_SPAN_DONE(res, sums, block, k, span, G, shift, xs, corr, chunks, groups);
        if (k + span >= k1) break;
        if (k + 2 * span < k1) INT4_SPAN(0, 5, 4, xq, b, k + 2 * span, k0, K);
        _tile_stored(1, sums, 64);
        INT4_SPAN_DONE(res, sums, block, k + span, span, G, shift, xs, corr, chunks, groups);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        if (i >= skip) _mm512_storeu_ps(dots + 16 * i, res[i]);
}

void amx_int4_block_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, int64_t G,
                         float *dots) {
    uint8_t b[16 * INT4_CHUNK] __attribute__((aligned(64)));
    amx_begin(G < XBLOCK ? (int)G : XBLOCK);
    for (int64_t k0 = 0; k0 < K; k0 += INT4_CHUNK) {
        int64_t k1 = K - k0 < INT4_CHUNK ? K : k0 + INT4_CHUNK;
        int4_unpack(block, k0, k1, G, b);
        for (int64_t r0 = 0; r0 < m; r0 += 16) {
            int64_t at = r0 + 16 <= m ? r0 : m - 16; /* the last tile overlaps the one before */
            int4_rows(a, first + at, (int)(r0 - at), block, k0, k1, K, G, b, dots + 16 * at);
        }
    }
    amx_end();
}
#endif
