/* Checks of the index arguments the kernels follow as addresses: cheap loops over a step's metadata, run by the
 * kernels that take them before they read or write through them (native.py's boundary rule: the wrappers check
 * shapes, these the values). Each returns 0 (-1 for slots) where the arguments are in range, else a code native.py
 * turns into a ValueError naming what is wrong. */
#include "simd.h"

/* Decode metadata (ls_mla_decode's): 1 query_start_loc not increasing from >= 0 to <= T tokens, 2 a negative
 * sequence length, 3 a sequence longer than its block-table row (bt_width blocks of B), 4 a block id outside the
 * cache's `blocks`. */
int decode_metadata_error(int64_t T, const int32_t *qsl, const int32_t *seq_lens, int64_t R,
                            const int32_t *block_table, int64_t bt_stride, int64_t bt_width, int64_t blocks,
                            int64_t B) {
    if (qsl[0] < 0 || qsl[R] > T) return 1;
    for (int64_t r = 0; r < R; r++) {
        if (qsl[r + 1] < qsl[r]) return 1;
        if (seq_lens[r] < 0) return 2;
        int64_t used = (seq_lens[r] + B - 1) / B;
        if (used > bt_width) return 3;
        for (int64_t b = 0; b < used; b++) {
            int32_t id = block_table[r * bt_stride + b];
            if (id < 0 || id >= blocks) return 4;
        }
    }
    return 0;
}

/* The index of the first slot past the cache's `capacity` rows (negative slots are padding, not written), or -1
 * where all are in range. */
int64_t bad_slot(const int64_t *slots, int64_t T, int64_t capacity) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= capacity) return t;
    return -1;
}
