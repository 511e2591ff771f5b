/* AMX tiles (the avx512_amx build, -DLS_AMX) for the int8 and int4 blocks' dot products at many rows (prefill, the
 * experts' groups): TDPBUSD / TDPBSUD multiply-add 16 rows x 16 outputs x 64 columns of bytes in one instruction,
 * 16 times what one vpdpbusd does. The blocks need no new layout: `pack_int8`'s 4 columns of 16 outputs a 64-byte
 * unit are a B tile's row in its VNNI layout, so 16 units (64 columns) load as one tile straight from the block;
 * `pack_int4`'s units unpack into two such rows (low nibbles: columns 8c..8c+3, high: 8c+4..8c+7). The activations'
 * rows (K bytes apart) are A tiles. The integer sums are exact, so they are the vpdpbusd path's, and the float work
 * after them is done in the same order with the same operations: the results are the avx512_bf16 build's, bit for
 * bit.
 *
 * Tiles: 0-3 sums (C) of four row tiles (64 rows), 4 the weights (B), 5 and 6 the activations (A) in turns, so that
 * a load need not wait for the product before it to have read its tile. A row count that 16 does not divide ends
 * with a row tile overlapping the one before: those rows are computed twice, the same, and their results kept once.
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
 * rest), and _tile_loadd that it reads no memory: the configuration goes to the instruction whole, and data written
 * here before a tile load is made visible by a compiler barrier (`written`). */
INLINE void load_config(const TileConfig *c) { __asm__ volatile("ldtilecfg %0" ::"m"(*c)); }
INLINE void written(void) { __asm__ volatile("" ::: "memory"); }

void amx_begin(int span) {
    TileConfig c = {.palette = 1};
    for (int t = 0; t < 7; t++) c.rows[t] = 16, c.colsb[t] = 64;
    c.rows[4] = (uint8_t)(span / 4); /* B: a row per 4 columns */
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

void amx_int8_sums(const int8_t *xq, int64_t K, int64_t whole, const int8_t *w, int rows, int32_t (*sums)[16]) {
    int tiles = (rows + 15) / 16;
    const int8_t *x[4];
    for (int t = 0; t < 4; t++) x[t] = xq + tile_row(t < tiles ? t : 0, rows) * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    written();
    for (int64_t k = 0; k < whole; k += 64) {
        _tile_loadd(4, w + 16 * k, 64); /* units k / 4 .. k / 4 + 15 */
        TILE_PRODUCT(0, 5, x[0] + k, K, _tile_dpbusd);
        if (tiles > 1) TILE_PRODUCT(1, 6, x[1] + k, K, _tile_dpbusd);
        if (tiles > 2) TILE_PRODUCT(2, 5, x[2] + k, K, _tile_dpbusd);
        if (tiles > 3) TILE_PRODUCT(3, 6, x[3] + k, K, _tile_dpbusd);
    }
    _tile_stored(0, sums[tile_row(0, rows)], 64);
    if (tiles > 1) _tile_stored(1, sums[tile_row(1, rows)], 64);
    if (tiles > 2) _tile_stored(2, sums[tile_row(2, rows)], 64);
    if (tiles > 3) _tile_stored(3, sums[tile_row(3, rows)], 64);
}
#endif
