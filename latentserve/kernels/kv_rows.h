/* The latent KV cache's row formats: fp32, bf16, or fp8 e4m3 (e4m3fn: no infinities, largest finite 448) at a
 * per-tensor scale of 1.0, as vLLM's MLA fp8 cache is when a checkpoint brings no scale. A kernel's `io` says which:
 * bit 1 bf16, bit 3 fp8, neither fp32. fp8 rows are dequantized in registers as they are read (no dequantized copy
 * of the cache); the encoding is built from integer operations, so the subnormals (|x| < 2^-6) come out right under
 * any denormals-are-zero setting torch may have switched on. */
#pragma once

#include "simd.h"

enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 };

INLINE int kv_format(int io) { return (io >> 3) & 1 ? KV_FP8 : (io >> 1) & 1; }
INLINE int64_t kv_size(int format) { return format == KV_FP8 ? 1 : format == KV_BF16 ? 2 : 4; }

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

#ifdef LS_BF16DOT
/* bf16 bits of k * 2^-9, e4m3's subnormals k = 0 .. 7 (the rest of the 32 entries unused). */
static const uint16_t FP8_SUBNORMAL_BF16[32] = {0x0000, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};

/* 32 columns of a cache row from column i as bf16 bits, for vdpbf16ps: e4m3 converts exactly (bf16 has its range
 * and more mantissa), by integer operations and a table for the subnormals. */
INLINE __m512i load_bf16x32(const char *row, int format, int64_t i) {
    if (format != KV_FP8) return _mm512_loadu_si512((const uint16_t *)row + i);
    __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)((const uint8_t *)row + i)));
    __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));
    __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    __m512i sub = _mm512_permutexvar_epi16(mag, _mm512_loadu_si512(FP8_SUBNORMAL_BF16));
    __m512i v = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), normal, sub);
    return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
}
#endif
