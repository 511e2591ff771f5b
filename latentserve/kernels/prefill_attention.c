/* Prefill attention, the MHA path (the NATIVE prefill backend): out [n, H, V] and lse [n, H] from q [n, H, D],
 * k [m, H, D] and v [m, H, V]: a prefill's new tokens over themselves (causal) or over a context chunk's
 * up-projected rows, query i sitting `distance` positions after key 0, a sliding window where one is given.
 *
 * PyTorch's CPU flash kernel ran MLA's shapes (16 heads, D 192, v padded to it) at 27-61 G multiply-adds/s on two
 * Zen 4 cores from 512 to 4096 tokens, far under what its products alone run at (a bf16 bmm of the same scores:
 * ~150 G/s), and took half of a 4096-token prefill; this kernel runs them at 130-150. Here every item (a head and QT queries) sees all its keys at once, so its
 * softmax is exact over whole rows (no online rescaling): the scores of QT rows [QT, keys] in fp32 (L2), then
 * exp, then the weighed values. Both products are register-blocked micro-kernels over 4-byte units: a bf16 pair
 * through vdpbf16ps where the build has it and q, k, v are bf16 (the probabilities rounded to bf16, as a bf16 flash
 * kernel rounds them), else one fp32 value through a multiply-add (bf16 inputs widened once). k and v are first
 * repacked per head into the units' layouts (keys in the lanes for the scores; values in the lanes, keys in pairs,
 * for the weighing): read once per head, not once per query. */
#include "simd.h"

#ifdef LS_AVX512
#define QR 4            /* query rows a micro-kernel pass: QR x NV accumulators in registers */
#define NV 4            /* vectors a micro-kernel pass */
#else
#define QR 6            /* 12 accumulators of AVX2's 16 registers: two FMA pipes of latency 4 need 8 in flight */
#define NV 2
#endif
#define QT (8 * QR)     /* queries an item: QT rows of scores, a few hundred KB at 4096 keys */
#define KB (NV * LANES) /* keys a block of packed keys (a score pass's columns); value columns a weighing pass */

typedef uint32_t Unit;  /* one fp32 value, or two bf16 values (the low half first): what one lane multiplies */

/* A unit broadcast to every lane, loaded straight from memory (a broadcast load: no shuffle on the vector pipes). */
typedef float __attribute__((may_alias)) unit_bits;
INLINE vfloat bcast_unit(const Unit *p) { return vset1(*(const unit_bits *)p); }

/* acc + b * w lane by lane (b a broadcast unit): vdpbf16ps on pairs (b's two bf16 values against each lane's two),
 * else fp32. */
INLINE vfloat unit_fma(vfloat acc, vfloat b, vfloat w, int pairs) {
#ifdef LS_BF16DOT
    if (pairs) return _mm512_dpbf16_ps(acc, (__m512bh)b, (__m512bh)w);
#endif
    (void)pairs;
    return vfma(b, w, acc);
}

INLINE vfloat load_units(const Unit *p) { return vload(p, 0, 0); }

typedef struct {
    const char *data; /* element 0 */
    int64_t token, head; /* strides in bytes */
} Rows;

INLINE const void *row_of(Rows r, int64_t t, int64_t h) { return r.data + t * r.token + h * r.head; }

/* A row of `len` values (bf16 or fp32 `xbf`) as DU units into out: pairs (bf16) two values a unit, an odd last
 * one with 0 beside it; else each value as fp32. */
static void row_units(const void *row, int xbf, int64_t len, int64_t DU, int pairs, Unit *out) {
    if (pairs) {
        memcpy(out, row, len / 2 * sizeof(Unit));
        if (len % 2) out[DU - 1] = ((const uint16_t *)row)[len - 1];
        return;
    }
    if (!xbf) {
        memcpy(out, row, len * sizeof(float));
        return;
    }
    for (int64_t c = 0; c < len; c++) out[c] = (Unit)((const uint16_t *)row)[c] << 16; /* bf16 -> fp32, exactly */
}

/* Head h's keys as blocks of KB keys [blocks][DU][KB] units (key j of a block in lane j; past m: 0). */
static void pack_keys(Rows k, int xbf, int64_t m, int64_t h, int64_t D, int64_t DU, int pairs, Unit *kp, int64_t b,
                      Unit *row) {
    Unit *block = kp + b * DU * KB;
    for (int64_t l = 0; l < KB; l++) {
        int64_t j = b * KB + l;
        if (j < m)
            row_units(row_of(k, j, h), xbf, D, DU, pairs, row);
        else
            memset(row, 0, DU * sizeof(Unit));
        for (int64_t u = 0; u < DU; u++) block[u * KB + l] = row[u];
    }
}

/* Head h's values as [JU][VP] units: unit (ju, c) holds column c of key ju (fp32), or of keys 2ju and 2ju + 1 (bf16
 * pairs, the first in the low half); keys past m and columns past V: 0. */
static void pack_values(Rows v, int xbf, int64_t m, int64_t h, int64_t V, int64_t VP, int pairs, Unit *vp,
                        int64_t ju) {
    Unit *out = vp + ju * VP;
    int64_t j = pairs ? 2 * ju : ju;
    memset(out, 0, VP * sizeof(Unit));
    if (j >= m) return;
    if (!pairs) {
        row_units(row_of(v, j, h), xbf, V, V, 0, out);
        return;
    }
    const uint16_t *a = row_of(v, j, h);
    if (j + 1 < m) {
        const uint16_t *b = row_of(v, j + 1, h);
        for (int64_t c = 0; c < V; c++) out[c] = (Unit)a[c] | (Unit)b[c] << 16;
    } else {
        for (int64_t c = 0; c < V; c++) out[c] = a[c];
    }
}

/* S[r][l] (QR rows, ldS apart) = the product of query rows qu (DU units each) with the KB keys of one block. */
INLINE void score_block(const Unit *qu, int64_t DU, const Unit *block, float *S, int64_t ldS, int pairs) {
    vfloat acc[QR][NV];
    for (int r = 0; r < QR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = vzero();
    for (int64_t u = 0; u < DU; u++) {
        vfloat w[NV];
        for (int v = 0; v < NV; v++) w[v] = load_units(block + u * KB + v * LANES);
        for (int r = 0; r < QR; r++)
            for (int v = 0; v < NV; v++) acc[r][v] = unit_fma(acc[r][v], bcast_unit(qu + r * DU + u), w[v], pairs);
    }
    for (int r = 0; r < QR; r++)
        for (int v = 0; v < NV; v++) vstore(S + r * ldS + v * LANES, acc[r][v]);
}

/* O[r][c..c + KB) (QR rows, ldO apart) += the weights P (QR rows of `units` units, ldP apart) times the packed
 * values' columns c .. c + KB of as many units (VP units a row). */
INLINE void weigh_block(const Unit *P, int64_t ldP, const Unit *vp, int64_t VP, int64_t c, int64_t units, float *O,
                        int64_t ldO, int pairs) {
    vfloat acc[QR][NV];
    for (int r = 0; r < QR; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = vload(O + r * ldO + c + v * LANES, 0, 0);
    for (int64_t u = 0; u < units; u++) {
        vfloat w[NV];
        for (int v = 0; v < NV; v++) w[v] = load_units(vp + u * VP + c + v * LANES);
        for (int r = 0; r < QR; r++)
            for (int v = 0; v < NV; v++) acc[r][v] = unit_fma(acc[r][v], bcast_unit(P + r * ldP + u), w[v], pairs);
    }
    for (int r = 0; r < QR; r++)
        for (int v = 0; v < NV; v++) vstore(O + r * ldO + c + v * LANES, acc[r][v]);
}

typedef struct {
    int64_t n, m, H, D, V, DU, VP, blocks, distance, window;
    int causal, xbf, obf;
    float scale;
} Shape;

/* The keys query i sees: [lo, hi) (empty where hi <= lo). */
INLINE int64_t keys_from(const Shape *s, int64_t i) {
    int64_t lo = s->window ? s->distance + i - s->window + 1 : 0;
    return lo < 0 ? 0 : lo;
}
INLINE int64_t keys_to(const Shape *s, int64_t i) {
    int64_t hi = s->causal ? s->distance + i + 1 : s->m;
    return hi > s->m ? s->m : hi < 0 ? 0 : hi;
}

/* A row's probabilities over keys k0 .. k1 (a multiple of LANES from k0) from its scores S (key k0 at 0) into P as
 * units (pairs: bf16 values in key order), 0 outside the keys it sees [lo, hi) (non-empty); returns the sum of what
 * was stored and sets *top to the largest scaled score. */
static float probabilities(const float *S, int64_t k0, int64_t k1, int64_t lo, int64_t hi, float scale, int pairs,
                           Unit *P, float *top) {
    int64_t j = lo;
    vfloat mv = vset1(-INFINITY);
    for (; j + LANES <= hi; j += LANES) mv = vmax(mv, vload(S, 0, j - k0));
    float mx = vmax_reduce(mv);
    for (; j < hi; j++) mx = S[j - k0] > mx ? S[j - k0] : mx;
    *top = mx *= scale;
    vfloat total = vzero();
    for (int64_t j0 = k0; j0 < k1; j0 += LANES) {
        vfloat p = vzero();
        if (j0 + LANES > lo && j0 < hi) {
            p = vexp(vsub(vmul(vload(S, 0, j0 - k0), vset1(scale)), vset1(mx)));
            if (j0 < lo || j0 + LANES > hi) { /* a vector across an end of the keys seen */
                float e[LANES];
                vstore(e, p);
                for (int l = 0; l < LANES; l++)
                    if (j0 + l < lo || j0 + l >= hi) e[l] = 0.f;
                p = vload(e, 0, 0);
            }
            if (pairs) p = vround_bf16(p); /* what the weighing multiplies, summed as it is */
            total = vadd(total, p);
        }
        vstore_out(pairs ? (void *)((uint16_t *)P + (j0 - k0)) : (void *)(P + (j0 - k0)), pairs, 0, p);
    }
    return vreduce_add(total);
}

/* Thread memory of one item: staged queries, scores, probabilities and the weighed values. */
typedef struct {
    Unit *qu, *P;
    float *S, *O;
} ItemMemory;

#define GROUPS (QT / QR)
#define UNIT_CHUNK 32 /* units of values a weighing pass: 16 KB of values in L1 while every row group takes them */

/* Head h (its packed keys kp and values vp), queries i0 .. i0 + QT (those below n). Each block of keys, and each
 * chunk of values, is read from memory once for the item's QT queries, then from L1 for each group of QR. `pairs`
 * a constant at each call: the micro-kernels' loops carry no test of it. */
INLINE void attend_item(const Shape *s, Rows q, const Unit *kp, const Unit *vp, int64_t h, int64_t i0, ItemMemory w,
                        void *out, float *lse, int pairs) {
    int64_t rows = s->n - i0 < QT ? s->n - i0 : QT, upk = pairs ? 2 : 1, ldS = s->blocks * KB, ldP = ldS / upk;
    int64_t lo = s->m, row_lo[QT], row_hi[QT], ends[GROUPS], end = 0; /* keys scored: k0 .. ends[g] (group g) */
    for (int64_t r = 0; r < QT; r++) {
        row_lo[r] = r < rows ? keys_from(s, i0 + r) : 0, row_hi[r] = r < rows ? keys_to(s, i0 + r) : 0;
        if (row_lo[r] < row_hi[r] && row_lo[r] < lo) lo = row_lo[r];
    }
    int64_t k0 = lo < s->m ? lo / KB * KB : 0;
    for (int g = 0; g < GROUPS; g++) {
        int64_t hi = 0;
        for (int r = g * QR; r < (g + 1) * QR; r++) hi = row_lo[r] < row_hi[r] && row_hi[r] > hi ? row_hi[r] : hi;
        ends[g] = hi > k0 ? k0 + (hi - k0 + KB - 1) / KB * KB : k0;
        end = ends[g] > end ? ends[g] : end;
    }
    for (int64_t r = 0; r < QT; r++)
        if (r < rows)
            row_units(row_of(q, i0 + r, h), s->xbf, s->D, s->DU, pairs, w.qu + r * s->DU);
        else
            memset(w.qu + r * s->DU, 0, s->DU * sizeof(Unit));
    for (int64_t b = k0; b < end; b += KB)
        for (int g = 0; g < GROUPS; g++)
            if (b < ends[g])
                score_block(w.qu + g * QR * s->DU, s->DU, kp + b / KB * s->DU * KB, w.S + g * QR * ldS + (b - k0), ldS,
                            pairs);
    float top[QT], sums[QT];
    for (int64_t r = 0; r < QT; r++) {
        Unit *p = w.P + r * ldP;
        int64_t units = (ends[r / QR] - k0) / upk;
        sums[r] = 0.f;
        if (row_lo[r] < row_hi[r])
            sums[r] = probabilities(w.S + r * ldS, k0, ends[r / QR], row_lo[r], row_hi[r], s->scale, pairs, p, &top[r]);
        else /* no keys (or past the last query): weights 0, not what an earlier item left */
            memset(p, 0, units * sizeof(Unit));
    }
    memset(w.O, 0, QT * s->VP * sizeof(float));
    const Unit *first = vp + k0 / upk * s->VP;
    for (int64_t u = 0; u < (end - k0) / upk; u += UNIT_CHUNK)
        for (int g = 0; g < GROUPS; g++) {
            int64_t units = (ends[g] - k0) / upk - u;
            units = units < UNIT_CHUNK ? units : UNIT_CHUNK;
            for (int64_t c = 0; units > 0 && c < s->VP; c += KB)
                weigh_block(w.P + g * QR * ldP + u, ldP, first + u * s->VP, s->VP, c, units, w.O + g * QR * s->VP,
                            s->VP, pairs);
        }
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = i0 + r;
        float inv = sums[r] > 0.f ? 1.f / sums[r] : 0.f;
        lse[i * s->H + h] = sums[r] > 0.f ? top[r] + logf(sums[r]) : -INFINITY;
        for (int64_t c = 0; c < s->V; c++) store_out(out, s->obf, (i * s->H + h) * s->V + c, w.O[r * s->VP + c] * inv);
    }
}

/* io: bit 0 q, k and v are bf16, bit 1 out is. Strides of q, k, v in elements: token, head (columns unit). */
int prefill_attention(const void *q, const int64_t qs[2], const void *k, const int64_t ks[2], const void *v,
                      const int64_t vs[2], int64_t n, int64_t m, int64_t H, int64_t D, int64_t V, int causal,
                      int64_t distance, int64_t window, float scale, void *out, float *lse, int io, int threads) {
    int xbf = io & 1, size = xbf ? 2 : 4;
    threads = threads < 1 ? 1 : threads; /* each thread's item memory is counted from it */
#ifdef LS_BF16DOT
    int pairs = xbf;
#else
    int pairs = 0;
#endif
    Shape s = {.n = n, .m = m, .H = H, .D = D, .V = V, .DU = pairs ? (D + 1) / 2 : D, .VP = (V + KB - 1) / KB * KB,
               .blocks = (m + KB - 1) / KB, .distance = distance, .window = window, .causal = causal,
               .xbf = xbf, .obf = io >> 1 & 1, .scale = scale};
    Rows qr = {q, qs[0] * size, qs[1] * size}, kr = {k, ks[0] * size, ks[1] * size}, vr = {v, vs[0] * size, vs[1] * size};
    if (n == 0) return LS_OK;
    int64_t upk = pairs ? 2 : 1, keys = s.blocks * KB, JU = keys / upk;
    int64_t key_units = s.blocks * s.DU * KB, value_units = JU * s.VP;
    ScratchMark mark = scratch_mark();
    Unit *kp = scratch((size_t)H * key_units * sizeof(Unit)), *vp = scratch((size_t)H * value_units * sizeof(Unit));
    size_t item_bytes = (QT * s.DU + QT * JU) * sizeof(Unit) + (QT * keys + QT * s.VP) * sizeof(float);
    char *items = scratch((size_t)threads * item_bytes);
    if (!kp || !vp || !items) {
        scratch_release(mark);
        return LS_NO_MEMORY;
    }
    int64_t tiles = (n + QT - 1) / QT;
#pragma omp parallel num_threads(threads)
    {
        char *mine = items + omp_get_thread_num() * item_bytes;
        ItemMemory w = {.qu = (Unit *)mine, .P = (Unit *)mine + QT * s.DU};
        w.S = (float *)(w.P + QT * JU), w.O = w.S + QT * keys;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < H * s.blocks; t++) /* a key's units staged in qu, then spread over the lanes */
            pack_keys(kr, xbf, m, t / s.blocks, D, s.DU, pairs, kp + t / s.blocks * key_units, t % s.blocks, w.qu);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < H * JU; t++)
            pack_values(vr, xbf, m, t / JU, V, s.VP, pairs, vp + t / JU * value_units, t % JU);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < H * tiles; t++) { /* the last queries first: under a causal mask they see the most */
            int64_t h = t % H, i0 = (tiles - 1 - t / H) * QT;
            if (pairs)
                attend_item(&s, qr, kp + h * key_units, vp + h * value_units, h, i0, w, out, lse, 1);
            else
                attend_item(&s, qr, kp + h * key_units, vp + h * value_units, h, i0, w, out, lse, 0);
        }
    }
    scratch_release(mark);
    return LS_OK;
}
