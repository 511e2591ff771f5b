/* A decode step's run of decoder layers in one call: for each layer its attention block (attention_block.c), then
 * its MoE block (moe_block.c) over the attention's normed output with the attention's output as the residual,
 * each called with the arguments the layers pass them one call at a time, so the hidden states and the caches
 * equal theirs to the bit. What it saves is each layer's Python around the two calls (their checks and
 * descriptors): ~150 us an attention block and ~70 an MoE block, on a step whose weights have streamed every Python
 * object out of the caches. The model's final norm may follow in the same call (its Python took ~140 us of a batch-1
 * step for a few microseconds of arithmetic, for the same reason). */
#include "simd.h"

/* The metadata checked (bounds.c) against every layer's cache by the entry point; the caches share one layout
 * (cache_io, block_size, blocks). y gets the last layer's output, or with a final norm's weight (norm, of the blocks'
 * dtype) that output normed as rms_norm does it; the layers between write the scratch arena. */
int decode_layers(const MLABlock *const *attention, const MoEBlock *const *moe, void *const *caches, int64_t layers,
                  int cache_io, int64_t block_size, int64_t blocks, const void *x, int64_t T, const float *cos,
                  const float *sin, const int32_t *block_table, int64_t bt_stride, const int32_t *qsl,
                  const int32_t *seq_lens, int64_t requests, const int64_t *slots, const void *norm, float eps,
                  void *y, int threads) {
    int64_t bytes = T * attention[0]->hidden * (attention[0]->bf ? 2 : 4);
    ScratchMark mark = scratch_mark();
    char *h = scratch(bytes), *normed = scratch(bytes), *out[2] = {scratch(bytes), scratch(bytes)};
    int bad = !h || !normed || !out[0] || !out[1] ? LS_NO_MEMORY : LS_OK;
    const void *in = x;
    for (int64_t l = 0; l < layers && !bad; l++) {
        void *next = l == layers - 1 && !norm ? y : out[l % 2];
        bad = mla_attention_block(attention[l], in, T, cos, sin, caches[l], cache_io, block_size, blocks, block_table,
                                  bt_stride, qsl, seq_lens, requests, slots, h, normed, threads);
        if (!bad) bad = moe_block(moe[l], normed, h, T, next, threads);
        in = next;
    }
    int bf = attention[0]->bf;
    if (!bad && norm) rms_norm(in, T, attention[0]->hidden, norm, eps, y, bf | bf << 2, threads);
    scratch_release(mark);
    return bad;
}
