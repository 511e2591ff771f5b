/* The index of each row's first maximum, as torch.argmax gives it: a NaN counts as the maximum (the first NaN's
 * index), ties go to the first. One vectorized pass for the maximum and whether the row holds a NaN, one to the first
 * element equal to it: a few microseconds for a 102400-token row, which torch's CPU argmax walks an element at a
 * time (~90 us), after the step's weights have left the caches cold for its Python too. */
#include "simd.h"

#ifdef LS_AVX512
INLINE unsigned nan_lanes(vfloat v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }
INLINE unsigned equal_lanes(vfloat v, vfloat m) { return _mm512_cmp_ps_mask(v, m, _CMP_EQ_OQ); }
#else
INLINE unsigned nan_lanes(vfloat v) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
INLINE unsigned equal_lanes(vfloat v, vfloat m) {
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v, m, _CMP_EQ_OQ));
}
#endif

static int64_t row_argmax(const float *x, int64_t V) {
    vfloat best = vset1(-INFINITY);
    unsigned nan = 0;
    int64_t i = 0;
    for (; i + LANES <= V; i += LANES) {
        vfloat v = vload(x, 0, i);
        nan |= nan_lanes(v);
        best = vmax(best, v);
    }
    float m = vmax_reduce(best);
    for (; i < V; i++) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
    }
    if (nan) {
        for (i = 0; x[i] == x[i]; i++) continue;
        return i;
    }
    vfloat vm = vset1(m);
    for (i = 0; i + LANES <= V; i += LANES) {
        unsigned equal = equal_lanes(vload(x, 0, i), vm);
        if (equal) return i + __builtin_ctz(equal);
    }
    for (; x[i] != m; i++) continue; /* m is one of the row's values */
    return i;
}

void argmax_rows(const float *x, int64_t M, int64_t V, int64_t *out, int threads) {
#pragma omp parallel for num_threads(threads) if (M >= 8) schedule(static)
    for (int64_t r = 0; r < M; r++) out[r] = row_argmax(x + r * V, V);
}
