/* The scratch arena: the temporaries of a call (the fused blocks' intermediate activations, the decode attention's
 * row tables, the routing's scores) come from one buffer per calling thread, reused call after call, instead of a
 * malloc and free each per layer per step. A call takes a mark, bumps a pointer, and releases to its mark; nested
 * calls (a block chaining kernels) stack. Where the buffer is too small the call's overflow is malloc'ed and the
 * buffer grows to the call's peak when the outermost call ends: after the first step no decode call allocates.
 * Needs up to SCRATCH_KEEP are kept, prefill's too: a fresh buffer of tens of MiB costs a page fault per 4 KiB
 * on every call (a few % of an int4 prefill), kept ones are warm. The cap fits a 4096-token prefill of a V3-shaped
 * MoE layer (experts() takes ~220 KB a token: top-6 of 1408-wide experts and 2 shared, hidden 2048, so ~0.9 GiB);
 * a larger need is served and freed, not kept, so that one outsized call does not pin its memory. Per calling
 * thread: DBO's ubatch threads call at once. */
#include "simd.h"

#include <stdarg.h>
#include <stdio.h>

#define SCRATCH_ALIGN 64
#define SCRATCH_KEEP ((size_t)1 << 30)

typedef struct Chunk { struct Chunk *next; } Chunk; /* an overflow allocation; its data follows, aligned */

static __thread struct {
    char *base;
    size_t cap, used, total, peak; /* total: base's used bytes and the chunks'; peak: total's highest */
    Chunk *chunks;
    int depth;
} arena;
static int64_t limit; /* ls_set_scratch_limit's; 0 none */

LS_API void ls_set_scratch_limit(int64_t bytes) { __atomic_store_n(&limit, bytes, __ATOMIC_RELAXED); }

ScratchMark scratch_mark(void) {
    arena.depth++;
    return (ScratchMark){arena.used, arena.total, arena.chunks};
}

void *scratch(size_t bytes) {
    bytes = (bytes / SCRATCH_ALIGN + 1) * SCRATCH_ALIGN; /* at least one unit: never NULL for an empty request */
    int64_t most = __atomic_load_n(&limit, __ATOMIC_RELAXED);
    if (most > 0 && arena.total + bytes > (size_t)most) return NULL;
    void *p;
    if (arena.used + bytes <= arena.cap) {
        p = arena.base + arena.used;
        arena.used += bytes;
    } else {
        Chunk *c = aligned_alloc(SCRATCH_ALIGN, SCRATCH_ALIGN + bytes);
        if (!c) return NULL;
        c->next = arena.chunks;
        arena.chunks = c;
        p = (char *)c + SCRATCH_ALIGN;
    }
    arena.total += bytes;
    if (arena.total > arena.peak) arena.peak = arena.total;
    return p;
}

void scratch_release(ScratchMark m) {
    while (arena.chunks != m.chunks) {
        Chunk *c = arena.chunks;
        arena.chunks = c->next;
        free(c);
    }
    arena.used = m.used, arena.total = m.total;
    if (--arena.depth) return;
    if (arena.peak > arena.cap && arena.peak <= SCRATCH_KEEP) { /* the outermost call ended: grow to its peak */
        free(arena.base);
        arena.base = aligned_alloc(SCRATCH_ALIGN, arena.peak);
        arena.cap = arena.base ? arena.peak : 0;
    }
    arena.peak = arena.cap;
}

static __thread char last_error[256];

int refuse(int code, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    return code;
}

LS_API const char *ls_last_error(void) { return last_error; }
