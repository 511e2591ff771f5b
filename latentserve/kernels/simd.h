/* Vector helpers shared by latentserve's kernels: bf16 <-> fp32, loads of fp32 or bf16 data, exp. One set of
 * definitions per build: -DLS_AVX512 (16 lanes) or AVX2 (8 lanes). */
#pragma once

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "latentserve.h"

#define INLINE static inline __attribute__((always_inline))

INLINE float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } c = { .u = (uint32_t)v << 16 };
    return c.f;
}

INLINE uint16_t float_to_bf16(float f) { /* rounded to nearest even; a NaN stays a (quiet) NaN */
    union { float f; uint32_t u; } v = { .f = f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) /* rounding carries a NaN's payload into the sign: 0x7fffffff -> -0 */
        return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

/* Activations and outputs are fp32, or bf16 where the caller's flag says so (bit 0 of `io`: x, bit 1: y): a bf16
 * model's tensors go in and out without a conversion op on each side. */
INLINE float load_act(const void *x, int bf16, int64_t i) {
    return bf16 ? bf16_to_float(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

INLINE void store_out(void *y, int bf16, int64_t i, float v) {
    if (bf16)
        ((uint16_t *)y)[i] = float_to_bf16(v);
    else
        ((float *)y)[i] = v;
}

/* 8 fp32 lanes on every build (AVX2's vfloat): for a sum that must come out the same on AVX2 and AVX-512 CPUs, taken
 * in this order everywhere (quant_acts.c's sums of x for int4's corrections). */
INLINE __m256 vload8(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}
INLINE float vreduce8_add(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#ifdef LS_AVX512
#define LANES 16
typedef __m512 vfloat;
INLINE vfloat vload(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}
INLINE vfloat vabs(vfloat v) { return _mm512_abs_ps(v); }
INLINE float vmax_reduce(vfloat v) { return _mm512_reduce_max_ps(v); }
/* round(v / s) + offset (nearest even, the default rounding mode) as int8 bits. */
INLINE void vquantize(vfloat v, vfloat s, int offset, int8_t *q) {
    __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_div_ps(v, s)), _mm512_set1_epi32(offset));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i));
}
#define vmax _mm512_max_ps
#define vset1 _mm512_set1_ps
#define vstore _mm512_storeu_ps
/* float_to_bf16 of every lane in the high 16 bits of its 32 (the low ones zero): nearest even, a NaN quiet. */
INLINE __m512i vbf16_high(vfloat v) {
    __m512i u = _mm512_castps_si512(v), lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                           _mm512_set1_epi32(0x7f800000));
    rounded = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_and_si512(rounded, _mm512_set1_epi32((int)0xffff0000));
}
/* Each lane rounded to bf16 as float_to_bf16 rounds, as a float. */
INLINE vfloat vround_bf16(vfloat v) { return _mm512_castsi512_ps(vbf16_high(v)); }
/* store_out of LANES values. */
INLINE void vstore_out(void *y, int bf16, int64_t i, vfloat v) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)y + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(vbf16_high(v), 16)));
    else
        _mm512_storeu_ps((float *)y + i, v);
}
#else
#define LANES 8
typedef __m256 vfloat;
#define vload vload8
INLINE vfloat vabs(vfloat v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
INLINE float vmax_reduce(vfloat v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
INLINE void vquantize(vfloat v, vfloat s, int offset, int8_t *q) {
    int32_t i[8];
    _mm256_storeu_si256((__m256i *)i, _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_div_ps(v, s)),
                                                        _mm256_set1_epi32(offset)));
    for (int l = 0; l < 8; l++) q[l] = (int8_t)(uint8_t)i[l];
}
#define vmax _mm256_max_ps
#define vset1 _mm256_set1_ps
#define vstore _mm256_storeu_ps
INLINE __m256i vbf16_high(vfloat v) {
    __m256i u = _mm256_castps_si256(v), lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_and_si256(rounded, _mm256_set1_epi32((int)0xffff0000));
}
INLINE vfloat vround_bf16(vfloat v) { return _mm256_castsi256_ps(vbf16_high(v)); }
INLINE void vstore_out(void *y, int bf16, int64_t i, vfloat v) {
    if (bf16) { /* the 8 high halves packed in order: packus pairs them within each 128-bit lane */
        __m256i h = _mm256_srli_epi32(vbf16_high(v), 16);
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
        _mm_storeu_si128((__m128i *)((uint16_t *)y + i), _mm256_castsi256_si128(packed));
    } else {
        _mm256_storeu_ps((float *)y + i, v);
    }
}
#endif

/* exp(v) for |v| <= 88 (clamped beyond): 2^n * p(r) with r = v - n ln 2 in two parts, p of degree 6 (Cephes's
 * coefficients, within 2 ulp). */
INLINE vfloat vexp(vfloat v) {
#ifdef LS_AVX512
#define F(op) _mm512_##op##_ps
#else
#define F(op) _mm256_##op##_ps
#endif
    v = F(min)(F(max)(v, vset1(-88.f)), vset1(88.f));
#ifdef LS_AVX512
    vfloat n = _mm512_roundscale_ps(F(mul)(v, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
#else
    vfloat n = _mm256_round_ps(F(mul)(v, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
#endif
    vfloat r = F(sub)(F(sub)(v, F(mul)(n, vset1(0.693359375f))), F(mul)(n, vset1(-2.12194440e-4f)));
    vfloat p = vset1(1.9875691500e-4f);
    p = F(fmadd)(p, r, vset1(1.3981999507e-3f));
    p = F(fmadd)(p, r, vset1(8.3334519073e-3f));
    p = F(fmadd)(p, r, vset1(4.1665795894e-2f));
    p = F(fmadd)(p, r, vset1(1.6666665459e-1f));
    p = F(fmadd)(p, r, vset1(5.0000001201e-1f));
    p = F(fmadd)(F(mul)(p, r), r, F(add)(r, vset1(1.f)));
#ifdef LS_AVX512
    return _mm512_scalef_ps(p, n);
#else
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
#endif
#undef F
}


/* a[i] = silu(h[i]) * h[I + i] = h[i] / (1 + exp(-h[i])) * h[I + i]. */
static inline void silu_mul(const float *h, int64_t I, float *a) {
    int64_t i = 0;
    for (; i + LANES <= I; i += LANES) {
        vfloat g = vload(h, 0, i), u = vload(h, 0, I + i);
#ifdef LS_AVX512
        vfloat d = _mm512_add_ps(vset1(1.f), vexp(_mm512_sub_ps(vset1(0.f), g)));
        vstore(a + i, _mm512_mul_ps(_mm512_div_ps(g, d), u));
#else
        vfloat d = _mm256_add_ps(vset1(1.f), vexp(_mm256_sub_ps(vset1(0.f), g)));
        vstore(a + i, _mm256_mul_ps(_mm256_div_ps(g, d), u));
#endif
    }
    for (; i < I; i++) a[i] = h[i] / (1.f + expf(-h[i])) * h[I + i];
}

#ifdef LS_AVX512
#define vzero _mm512_setzero_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vsub _mm512_sub_ps
#define vadd _mm512_add_ps
#define vreduce_add _mm512_reduce_add_ps
#else
#define vzero _mm256_setzero_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vsub _mm256_sub_ps
#define vadd _mm256_add_ps
#define vreduce_add vreduce8_add
INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

#ifdef LS_AVX512
#define MB 8 /* activation rows per pass over a weight row: accumulators in registers */
#elif defined(LS_AVXVNNI)
/* AVX2's 16 registers; vpdpbusd's latency (5 cycles, 2 a cycle) wants 10 sums in flight: 6 rows of 2 (int8_vnni256.h)
 * ran 1.33x faster than 4 at 16-512 rows (2816 x 2048, one core, CPU time, Intel Xeon). */
#define MB 6
#else
#define MB 4 /* AVX2 has 16 vector registers */
#endif

/* Calls fn(..., mb, out) with mb (at most `limit`) a constant, so that the accumulators of each row count live in
 * registers. */
#define FOR_ROWS_UPTO(limit, fn, ...)                        \
    switch (mb) {                                            \
    case 1: fn(__VA_ARGS__, 1, out); break;                  \
    case 2: if (limit >= 2) fn(__VA_ARGS__, 2, out); break;  \
    case 3: if (limit >= 3) fn(__VA_ARGS__, 3, out); break;  \
    case 4: if (limit >= 4) fn(__VA_ARGS__, 4, out); break;  \
    case 5: if (limit >= 5) fn(__VA_ARGS__, 5, out); break;  \
    case 6: if (limit >= 6) fn(__VA_ARGS__, 6, out); break;  \
    case 7: if (limit >= 7) fn(__VA_ARGS__, 7, out); break;  \
    case 8: if (limit >= 8) fn(__VA_ARGS__, 8, out); break;  \
    }
#define FOR_ROWS(fn, ...) FOR_ROWS_UPTO(MB, fn, __VA_ARGS__)

/* The idx-th row a thread takes of its share [begin, begin + len): alternately from the share's first and second
 * halves, so that two streams of weights are in flight (the hardware prefetchers keep fewer misses outstanding on
 * one stream than memory can serve: one stream a thread measured up to 1.17x slower, benchmarks/RESULTS.md). */
INLINE int64_t two_streams(int64_t begin, int64_t len, int64_t idx) {
    return begin + ((idx & 1) ? (len + 1) / 2 + idx / 2 : idx / 2);
}

/* order[0..k) = the positions of a token's k expert ids e in increasing id order (insertion sort; ids distinct). */
INLINE void sort_ids(const int64_t *e, int64_t k, int64_t *order) {
    for (int64_t c = 0; c < k; c++) {
        int64_t j = c;
        for (; j > 0 && e[order[j - 1]] > e[c]; j--) order[j] = order[j - 1];
        order[j] = c;
    }
}

/* scratch.c: a call's temporaries (NULL where memory ran out: the call returns LS_NO_MEMORY). Every scratch_mark
 * is paired with a scratch_release, which frees what was taken since. */
typedef struct {
    size_t used, total;
    void *chunks;
} ScratchMark;
ScratchMark scratch_mark(void);
void *scratch(size_t bytes);
void scratch_release(ScratchMark mark);
/* The message ls_last_error returns, then `code`. */
int refuse(int code, const char *format, ...) __attribute__((format(printf, 2, 3)));

/* The kernels behind the entry points (api.c), chained by the fused blocks as they are (see each file for what it
 * computes). `io`: bit 0 the activations are bf16, bit 1 the output (or the cache: kv_rows.h), bit 2 the weight
 * (or the output where bit 1 is the cache's), bit 3 the cache is fp8. Those returning int return an ls_status. */
void rms_norm_row(const void *x, int xbf, int64_t N, const void *w, int wbf, float eps, void *y, int ybf);
void rms_norm(const void *x, int64_t M, int64_t N, const void *w, float eps, void *y, int io, int threads);
int dense_linear(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int io, int threads);
int dense_heads(const void *x, int64_t M, int64_t H, int64_t K, const void *w, int64_t N, void *y, int io,
                int threads);
int int8_heads(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
               const int32_t *wsum, int64_t N, void *y, int io, int threads);
int int8_heads_lanes(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
                     const int32_t *wsum, int64_t N, void *y, int io, int threads);
void mla_prologue(void *q, int64_t T, int64_t H, int64_t D, const void *kv, int64_t L, int64_t R, const void *w,
                  float eps, const float *cos, const float *sin, int style, void *kv_c, void *k_pe, void *cache,
                  const int64_t *slots, int io, int threads);
int mla_decode(const void *q, int64_t T, int64_t H, int64_t D, int64_t L, const void *cache, int64_t B,
               const int32_t *block_table, int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens, int64_t R,
               float scale, void *out, int io, int threads);
int prefill_attention(const void *q, const int64_t qs[2], const void *k, const int64_t ks[2], const void *v,
                      const int64_t vs[2], int64_t n, int64_t m, int64_t H, int64_t D, int64_t V, int causal,
                      int64_t distance, int64_t window, float scale, void *out, float *lse, int io, int threads);
int route(const float *logits, int64_t T, int64_t E, int64_t k, int sigmoid, int64_t groups, int64_t topk_groups,
          const float *bias, int norm, float scaling, float *weights, int64_t *ids);
int mla_attention_block(const MLABlock *w, const void *x, int64_t T, const float *cos, const float *sin, void *cache,
                        int cache_io, int64_t block_size, int64_t blocks, const int32_t *block_table,
                        int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens, int64_t requests,
                        const int64_t *slots, void *y, void *y_normed, int threads);
int moe_block(const MoEBlock *b, const void *x, const void *residual, int64_t T, void *y, int threads);
int decode_layers(const MLABlock *const *attention, const MoEBlock *const *moe, void *const *caches, int64_t layers,
                  int cache_io, int64_t block_size, int64_t blocks, const void *x, int64_t T, const float *cos,
                  const float *sin, const int32_t *block_table, int64_t bt_stride, const int32_t *qsl,
                  const int32_t *seq_lens, int64_t requests, const int64_t *slots, const void *norm, float eps,
                  void *y, int threads);
void argmax_rows(const float *x, int64_t M, int64_t V, int64_t *out, int threads);
int experts(const ExpertTable *routed, const ExpertTable *shared, const void *x, int64_t T, int64_t K, int64_t k,
            const int64_t *ids, const float *weights, void *y, int io, int threads);
/* bounds.c: the checks of the indices the kernels above follow. */
int decode_metadata_error(int64_t T, const int32_t *qsl, const int32_t *seq_lens, int64_t R,
                          const int32_t *block_table, int64_t bt_stride, int64_t bt_width, int64_t blocks, int64_t B);
int64_t bad_slot(const int64_t *slots, int64_t T, int64_t capacity);
