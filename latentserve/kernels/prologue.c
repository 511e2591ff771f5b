/* MLA's latent prologue for a step's tokens in one call: from the kv_a projection [T, L + R] the normed latent
 * kv_c = RMSNorm(kv[:, :L]) and the rotated k_pe = RoPE(kv[:, L:]); q's rope dims (the last R of each head of q
 * [T, H, D]) rotated in place; [kv_c ‖ k_pe] stored at each token's cache slot. Where torch takes a dozen small ops
 * (split, norm, cat, rotation, copy back, cat, index_copy_) per layer, each costing more than its arithmetic.
 *
 * The rotation is out = x * cos + partner(x) * sin with cos and the signed sin precomputed per token in the output
 * layout, each product and the sum rounded to fp32 as torch's elementwise ops round them (the build turns off
 * fused multiply-adds of separate C operations for this): the results equal the torch path's to the bit. */
#include "kv_rows.h"

/* One R-wide rope vector: x (fp32 or bf16 per xbf) -> y (per ybf). */
static void rotate(const void *x, int xbf, int64_t R, const float *cos, const float *sin, int style, void *y,
                   int ybf) {
    float in[LS_MAX_ROPE]; /* the input in the output layout: halves (interleave deinterleaves pairs) or pairs */
    int64_t half = R / 2;
    for (int64_t j = 0; j < R; j++)
        in[j] = style == LS_ROPE_INTERLEAVE ? load_act(x, xbf, j < half ? 2 * j : 2 * (j - half) + 1) : load_act(x, xbf, j);
    for (int64_t j = 0; j < R; j++) {
        float partner = style == LS_ROPE_GPTJ ? in[j ^ 1] : in[j < half ? j + half : j - half];
        float a = in[j] * cos[j], b = partner * sin[j];
        store_out(y, ybf, j, a + b);
    }
}

/* `io`: bit 0 q, kv, kv_c and k_pe are bf16, bit 1 the cache is (bit 3: fp8, bit 4: int8; kv_rows.h), bit 2 w is
 * (else fp32). cos and sin `[T, R]` fp32; slots int64, < 0 = padding (not stored), the others within the cache
 * (bad_slot); R at most LS_MAX_ROPE. */
void mla_prologue(void *q, int64_t T, int64_t H, int64_t D, const void *kv, int64_t L, int64_t R, const void *w,
                  float eps, const float *cos, const float *sin, int style, void *kv_c, void *k_pe, void *cache,
                  const int64_t *slots, int io, int threads) {
    int bf = io & 1, cf = kv_format(io), wbf = (io >> 2) & 1;
    int64_t size = bf ? 2 : 4, row_bytes = kv_row_bytes(cf, L + R);
#pragma omp parallel for num_threads(threads) if (T >= 16) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const char *row = (const char *)kv + t * (L + R) * size;
        char *c = (char *)kv_c + t * L * size, *p = (char *)k_pe + t * R * size;
        rms_norm_row(row, bf, L, w, wbf, eps, c, bf);
        rotate(row + L * size, bf, R, cos + t * R, sin + t * R, style, p, bf);
        for (int64_t h = 0; h < H; h++) {
            char *qh = (char *)q + ((t * H + h) * D + D - R) * size;
            rotate(qh, bf, R, cos + t * R, sin + t * R, style, qh, bf);
        }
        if (slots[t] < 0) continue;
        float out[L + R];
        for (int64_t j = 0; j < L; j++) out[j] = load_act(c, bf, j);
        for (int64_t j = 0; j < R; j++) out[L + j] = load_act(p, bf, j);
        store_kv_row((char *)cache + slots[t] * row_bytes, cf, out, L, R);
    }
}
