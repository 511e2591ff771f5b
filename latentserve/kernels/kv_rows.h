/* The latent KV cache's row formats: fp32, bf16, fp8 e4m3 (e4m3fn: no infinities, largest finite 448) at a
 * per-tensor scale of 1.0, as vLLM's MLA fp8 cache is when a checkpoint brings no scale, or int8 with a scale per
 * row part. A kernel's `io` says which: bit 1 bf16, bit 3 fp8, bit 4 int8, none fp32. fp8 rows are dequantized as
 * they are read (no dequantized copy of the cache); the encoding is built from integer operations, so the
 * subnormals (|x| < 2^-6) come out right under any denormals-are-zero setting torch may have switched on.
 *
 * An int8 row of L + R values is [c_kv: L int8][k_pe: R int8][c_kv's scale: fp32][k_pe's scale: fp32], L + R + 8
 * bytes: each part is quantized symmetrically to its own largest magnitude (scale = amax / 127, value = scale *
 * int8), as q8_0 does per 32 values; per part, not per row, because the rope keys and the normed latent differ in
 * range. */
#pragma once

#include "simd.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2, KV_INT8 = 3 };

INLINE int kv_format(int io) { return (io >> 4) & 1 ? KV_INT8 : (io >> 3) & 1 ? KV_FP8 : (io >> 1) & 1; }
INLINE int64_t kv_size(int format) { return format >= KV_FP8 ? 1 : format == KV_BF16 ? 2 : 4; }
/* Bytes of a row of D values. */
INLINE int64_t kv_row_bytes(int format, int64_t D) {
    return D * kv_size(format) + (format == KV_INT8) * LS_INT8_ROW_SCALES;
}

INLINE float fp8_to_float(uint8_t v) {
    uint32_t mag = v & 0x7fu;
    union { uint32_t u; float f; } c = { .u = (mag << 20) + (120u << 23) }; /* exponent bias 7 -> 127 */
    float f = mag < 8 ? (float)mag * (1.f / 512.f) : c.f;                    /* subnormal: mantissa * 2^-9 */
    return v & 0x80u ? -f : f;
}

/* Rounded to nearest even, saturated to +-448 (as vLLM's conversions saturate: a large latent must not turn into
 * a NaN); a NaN stays one. */
INLINE uint8_t float_to_fp8(float f) {
    union { float f; uint32_t u; } v = { .f = f };
    uint8_t sign = (uint8_t)((v.u >> 24) & 0x80u);
    float a = fabsf(f);
    if (a != a) return 0x7f;
    if (a >= 448.f) return sign | 0x7e;
    if (a < 1.f / 64.f) return sign | (uint8_t)nearbyintf(a * 512.f); /* subnormal (8 -> 2^-6, the first normal) */
    union { float f; uint32_t u; } m = { .f = a };
    uint32_t u = m.u + 0x7ffffu + ((m.u >> 20) & 1u); /* round the 23-bit mantissa to 3 bits */
    return sign | (uint8_t)((((u >> 23) - 120u) << 3) | ((u >> 20) & 7u));
}

INLINE float load_kv(const void *x, int format, int64_t i) {
    return format == KV_FP8 ? fp8_to_float(((const uint8_t *)x)[i]) : load_act(x, format, i);
}

INLINE void store_kv(void *y, int format, int64_t i, float v) {
    if (format == KV_FP8)
        ((uint8_t *)y)[i] = float_to_fp8(v);
    else
        store_out(y, format, i, v);
}

/* An int8 row's scales: [0] c_kv's (the first L values), [1] k_pe's. */
INLINE void int8_scales(const void *row, int64_t D, float scales[2]) { memcpy(scales, (const char *)row + D, 8); }

/* n values x (fp32) -> int8 at the scale of their largest magnitude, returned (0 for all zeros): each x / scale
 * rounded to nearest even, as torch.round rounds it. */
INLINE float quantize_int8(const float *x, int64_t n, int8_t *y) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    float scale = amax / 127.f;
    for (int64_t i = 0; i < n; i++) {
        float v = scale > 0.f ? nearbyintf(x[i] / scale) : 0.f;
        y[i] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
    }
    return scale;
}

/* A cache row [c ‖ pe] (L + R fp32 values) stored in `format` at dst. */
INLINE void store_kv_row(void *dst, int format, const float *row, int64_t L, int64_t R) {
    if (format == KV_INT8) {
        float scales[2] = {quantize_int8(row, L, dst), quantize_int8(row + L, R, (int8_t *)dst + L)};
        memcpy((char *)dst + L + R, scales, sizeof scales);
        return;
    }
    for (int64_t j = 0; j < L + R; j++) store_kv(dst, format, j, row[j]);
}

/* LANES values of a cache row from column i, in fp32. */
INLINE vfloat vload_kv(const void *x, int format, int64_t i) {
    if (format != KV_FP8) return vload(x, format, i);
    const uint8_t *p = (const uint8_t *)x + i;
#ifdef LS_AVX512
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
    __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.f / 512.f));
    __m512 f = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal, sub);
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
#else
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512.f));
    __m256 small = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
    __m256 f = _mm256_blendv_ps(normal, sub, small);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sign));
#endif
}


/* A quantized row (fp8 or int8, D values, the first L of them c_kv) dequantized into fp32 at dst: fp8 exactly,
 * int8 as value * its part's scale, rounded as torch's product rounds it. */
INLINE void dequantize_row_f32(const char *row, int format, int64_t D, int64_t L, float *dst) {
    if (format == KV_FP8) {
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES) vstore(dst + d, vload_kv(row, KV_FP8, d));
        for (; d < D; d++) dst[d] = fp8_to_float((uint8_t)row[d]);
        return;
    }
    float s[2];
    int8_scales(row, D, s);
    for (int64_t d = 0; d < L; d++) dst[d] = (float)((const int8_t *)row)[d] * s[0];
    for (int64_t d = L; d < D; d++) dst[d] = (float)((const int8_t *)row)[d] * s[1];
}

#ifdef LS_BF16DOT
/* 32 int8 values times `scale` rounded to bf16 (nearest even). */
INLINE __m512i int8x32_to_bf16(const int8_t *x, __m512 scale) {
    __m512i a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x));
    __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(x + 16)));
    __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(a), scale), hi = _mm512_mul_ps(_mm512_cvtepi32_ps(b), scale);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* n int8 values times `scale` rounded to bf16, 32 at a time. */
INLINE void int8_to_bf16(const int8_t *x, int64_t n, float scale, uint16_t *y) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) _mm512_storeu_si512(y + i, int8x32_to_bf16(x + i, _mm512_set1_ps(scale)));
    for (; i < n; i++) y[i] = float_to_bf16((float)x[i] * scale);
}

/* bf16 bits of each e4m3 magnitude (code & 0x7f; 0x7f, NaN, never stored), high and low bytes. */
static const uint8_t FP8_BF16_HI[128] = {
    0x00, 0x3b, 0x3b, 0x3b, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c, 0x3c,
    0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d, 0x3d,
    0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e, 0x3e,
    0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f, 0x3f,
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
    0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
    0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42, 0x42,
    0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x43, 0x7f};
static const uint8_t FP8_BF16_LO[128] = {
    0x00, 0x00, 0x80, 0xc0, 0x00, 0x20, 0x40, 0x60, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xf0,
    0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xb0, 0xc0, 0xd0, 0xe0, 0xc0};


/* The order of fp8_to_bf16_vbmi's inputs: lane k takes inputs 8k .. 8k + 7, then 32 + 8k .. 32 + 8k + 7. */
static const uint8_t FP8_BF16_ORDER[64] = {
    0, 1, 2, 3, 4, 5, 6, 7, 32, 33, 34, 35, 36, 37, 38, 39,
    8, 9, 10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,
    16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55,
    24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};

#define VBMI __attribute__((target("avx512vbmi")))

/* 64 fp8 values -> bf16 (y[0] the first 32, y[1] the others) through two 128-entry byte tables (vpermi2b,
 * AVX512-VBMI): the magnitude's bf16 high and low bytes looked up, the sign or'ed into the high one, the bytes
 * interleaved into words; exact, subnormals included. unpack{lo,hi} pair the bytes of each 128-bit lane's low (high)
 * half, so the 64 inputs are first reordered (FP8_BF16_ORDER) for the words to come out in order. */
VBMI INLINE void fp8x64_to_bf16(const uint8_t *x, __m512i y[2]) {
    const __m512i hi_table_0 = _mm512_loadu_si512(FP8_BF16_HI), hi_table_1 = _mm512_loadu_si512(FP8_BF16_HI + 64);
    const __m512i lo_table_0 = _mm512_loadu_si512(FP8_BF16_LO), lo_table_1 = _mm512_loadu_si512(FP8_BF16_LO + 64);
    __m512i b = _mm512_permutexvar_epi8(_mm512_loadu_si512(FP8_BF16_ORDER), _mm512_loadu_si512(x));
    __m512i hi = _mm512_permutex2var_epi8(hi_table_0, b, hi_table_1); /* index bits 0-6: the magnitude */
    __m512i lo = _mm512_permutex2var_epi8(lo_table_0, b, lo_table_1);
    hi = _mm512_ternarylogic_epi32(_mm512_set1_epi8((char)0x80), b, hi, 0xca); /* sign ? b : hi, bit by bit */
    y[0] = _mm512_unpacklo_epi8(lo, hi);
    y[1] = _mm512_unpackhi_epi8(lo, hi);
}

/* fp8x64_to_bf16 over x, 64 values at a time. Returns the values done (a multiple of 64). */
VBMI static int64_t fp8_to_bf16_vbmi(const uint8_t *x, int64_t n, uint16_t *y) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i v[2];
        fp8x64_to_bf16(x + i, v);
        _mm512_storeu_si512(y + i, v[0]);
        _mm512_storeu_si512(y + i + 32, v[1]);
    }
    return i;
}

/* dequantize_row_f32 into bf16 for vdpbf16ps: fp8 exactly (bf16 holds every e4m3 value), int8 rounded once. */
INLINE void dequantize_row_bf16(const char *row, int format, int64_t D, int64_t L, uint16_t *dst) {
    if (format == KV_FP8) { /* (AVX512-BF16 CPUs without VBMI, Cooper Lake, take the scalar loop) */
        int64_t d = __builtin_cpu_supports("avx512vbmi") ? fp8_to_bf16_vbmi((const uint8_t *)row, D, dst) : 0;
        for (; d < D; d++) dst[d] = float_to_bf16(fp8_to_float((uint8_t)row[d]));
        return;
    }
    float s[2];
    int8_scales(row, D, s);
    int8_to_bf16((const int8_t *)row, L, s[0], dst);
    int8_to_bf16((const int8_t *)row + L, D - L, s[1], dst + L);
}
#endif
