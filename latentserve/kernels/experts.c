/* The experts' one driver, for every weight format (quant.h's Format: dense fp32 or bf16 rows, `pack_int8`'s and
 * `pack_int4`'s blocks), each projection in its own (llama.cpp's Q4_K_M files keep some down projections at 8 bits
 * beside 4-bit gate and up). A few tokens' routed experts and their shared ones run in one parallel region: the
 * (token, expert) pairs grouped by expert, so that an expert several tokens chose is read once for all of them,
 * gate_up's blocks of 16 outputs of every group shared out among the threads, then down's, then the weighted sums.
 * Every pair's arithmetic is the same whatever pairs share its expert and whatever the thread count (each output is
 * one thread's dot product, each sum one thread's, in a fixed order), so a token's result is what it is alone. */
#include "quant.h"

/* Pairs a wave at most: its groups' intermediates (h, 2 I floats a pair) and down outputs (o, K floats) are written
 * and read back while still in cache, and an expert chosen by many tokens (a prefill's shared experts: all of them) is
 * split into groups of at most this many rows, each read once for them (quant_blocks.c's ROW_CHUNK alike). */
#define WAVE_PAIRS 256

/* The pairs of one table (routed or shared) in a wave: grouped order begin..end, in groups g0..g1, their rows of h
 * (2 I wide) from float offset h0 and of o from row o0, x prepared for gate_up's format (from the wave's first pair)
 * and a for down's (row i - begin for pair i). */
typedef struct {
    const ExpertTable *table;
    Format f[2];
    int64_t begin, end, g0, g1, h0, o0;
    QuantActs x, a;
} Set;

/* One expert's pairs begin..end (grouped order) of set `set`, its two weights w. */
typedef struct {
    int64_t set, begin, end;
    void *const *w;
} Group;

/* Everything the region reads: the groups, their first block of each layer (units[which][g], ending with the
 * total), the waves (wave[w]: the first group of wave w, wave[waves] = the groups), the whole sets, each grouped
 * pair's token and (routed) gate, the buffers: h and o of a wave, acc the routed sums `[T, K]`, sh the shared
 * output `[T, K]`, y. */
typedef struct {
    int64_t K, T, R, waves;
    const Group *group;
    const int64_t *units[2], *wave, *token;
    const float *gate;
    const Set *set;
    float *h, *o, *acc, *sh;
    void *y;
    int ybf, has_shared;
} Plan;

INLINE float rounded(float v, int bf) { return bf ? bf16_to_float(float_to_bf16(v)) : v; }

/* Block u of layer `which` (0 gate_up, 1 down) of group e, of set s, for m of the group's rows from row r0: its rows
 * of the activations (from `first`) and its weights. */
typedef struct {
    const Group *e;
    int64_t u, r0, m, first, in, outputs;
    const char *block;
} Unit;

/* Unit r of layer `which` of set s; *g: its group, advanced from an earlier unit's (units come in increasing r). */
static Unit find_unit(const Plan *p, const Set *s, int which, int64_t r, int64_t *g) {
    const int64_t *units = p->units[which];
    while (units[*g + 1] <= r) ++*g;
    const Group *e = p->group + *g;
    int64_t I = s->table->inter, u = r - units[*g], N = which ? p->K : 2 * I, in = which ? I : p->K;
    Unit t = {e, u, 0, e->end - e->begin, e->begin - s->begin, in, N - 16 * u < 16 ? N - 16 * u : 16,
              (const char *)e->w[which] + u * block_bytes(s->f[which], in)};
    return t;
}

/* Unit t's rows from `skip` on, or its first `keep` rows. */
INLINE Unit rows_after(Unit t, int64_t skip) {
    t.r0 += skip, t.first += skip, t.m -= skip;
    return t;
}

INLINE Unit first_rows(Unit t, int64_t keep) {
    t.m = keep;
    return t;
}

/* The unit's pair i's outputs dots[16 * i + j] to h (gate_up) or o (down). */
static void store_unit(const Plan *p, const Set *s, int which, Unit t, const float *dots) {
    int64_t I = s->table->inter;
    for (int64_t i = 0; i < t.m; i++) {
        float *dst = which ? p->o + (s->o0 + t.first + i) * p->K : p->h + (s->h0 + (t.first + i) * 2 * I);
        for (int64_t j = 0; j < t.outputs; j++) dst[16 * t.u + j] = dots[16 * i + j];
    }
}

static void unit_dots(const Plan *p, const Set *s, int which, Unit t, float *dots) {
    format_dots(s->f[which], which ? s->a : s->x, t.first, t.m, t.block, t.in, t.outputs, dots);
    store_unit(p, s, which, t, dots);
}

/* Whether units t and t2 (`both` rows in common) go to block_pair_dots together: up to PAIR_ROWS rows, or more
 * where the two meet the same rows and the format reads them once for both (pairs(): int8 on AMX tiles; the shared
 * experts' blocks at prefill). */
INLINE int paired(Format f, Unit t, Unit t2, int64_t both) {
    return both <= PAIR_ROWS || (pairs(f, both) && t.first == t2.first && t.m == both && t2.m == both);
}

/* Where the threads split a set's blocks: a block costs its rows plus READ_ROWS (reading it), so that the few groups
 * of a wave, of different row counts, load the threads evenly (an even count of blocks left one thread waiting for the
 * other at each wave's barriers). */
#define READ_ROWS 16

/* The first of set s's units (layer `which`) whose cost so far is at least `at`. */
static int64_t unit_at(const Plan *p, const Set *s, int which, int64_t at) {
    const int64_t *units = p->units[which];
    for (int64_t g = s->g0; g < s->g1; g++) {
        int64_t n = units[g + 1] - units[g], cost = p->group[g].end - p->group[g].begin + READ_ROWS;
        if (at < n * cost) return units[g] + (at + cost - 1) / cost;
        at -= n * cost;
    }
    return units[s->g1];
}

/* This thread's share of set s's units of layer `which`: *begin, *len. */
static void my_units(const Plan *p, const Set *s, int which, int64_t *begin, int64_t *len) {
    int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), total = 0;
    for (int64_t g = s->g0; g < s->g1; g++)
        total += (p->units[which][g + 1] - p->units[which][g]) * (p->group[g].end - p->group[g].begin + READ_ROWS);
    *begin = unit_at(p, s, which, total * part / parts);
    *len = unit_at(p, s, which, total * (part + 1) / parts) - *begin;
}

/* This thread's share of layer `which` of a wave's sets `ws`, in blocks of 16 outputs. Each set shared out on its
 * own: the shared experts' blocks meet every token, the routed ones' a few, so one split of both would load the
 * threads unevenly. int8 and int4 read two blocks at once, the i-th of each half of the share, for the rows both
 * have where that is few (as quant_linear does: one stream a thread keeps too few reads in flight); the blocks may be
 * different experts', met by different tokens, so each block takes its own rows. A block with more rows than its
 * partner then reads them alone, from cache: in a batch of 8 most experts meet one token and some two or three, and
 * pairing only equal counts left about half the blocks to one stream. `dots`: room for 16 * 2 * WAVE_PAIRS floats. */
static void layer(const Plan *p, const Set *ws, int which, float *dots) {
    for (int set = 0; set < 2; set++) {
        const Set *s = ws + set;
        QuantActs acts = which ? s->a : s->x;
        int64_t g = s->g0, g2 = s->g0, begin, len;
        my_units(p, s, which, &begin, &len);
        if (dense(s->f[which])) {
            for (int64_t r = begin; r < begin + len; r++) unit_dots(p, s, which, find_unit(p, s, which, r, &g), dots);
            continue;
        }
        for (int64_t half = (len + 1) / 2, r = begin; r < begin + half; r++) {
            Unit t = find_unit(p, s, which, r, &g);
            if (r + half >= begin + len) {
                unit_dots(p, s, which, t, dots);
                continue;
            }
            Unit t2 = find_unit(p, s, which, r + half, &g2);
            int64_t both = t.m < t2.m ? t.m : t2.m;
            if (!paired(s->f[which], t, t2, both)) {
                unit_dots(p, s, which, t, dots);
                unit_dots(p, s, which, t2, dots);
                continue;
            }
            block_pair_dots(s->f[which], acts, t.first, acts, t2.first, both, t.block, t2.block, t.in, dots,
                            dots + 16 * both);
            store_unit(p, s, which, first_rows(t, both), dots);
            store_unit(p, s, which, first_rows(t2, both), dots + 16 * both);
            if (t.m > both) unit_dots(p, s, which, rows_after(t, both), dots);
            if (t2.m > both) unit_dots(p, s, which, rows_after(t2, both), dots);
        }
    }
}

/* Wave w's part of each set: its pairs, groups, rows of h and o, and its first pair's row of x. */
static void wave_sets(const Plan *p, int64_t w, Set *ws) {
    int64_t lo = p->wave[w], hi = p->wave[w + 1], first = p->group[lo].begin, h0 = 0;
    for (int s = 0; s < 2; s++) {
        const Set *whole = p->set + s;
        Set *part = ws + s;
        *part = *whole;
        part->g0 = lo > whole->g0 ? lo : whole->g0;
        part->g1 = hi < whole->g1 ? hi : whole->g1;
        if (part->g0 >= part->g1) { /* none of this set's pairs */
            part->g1 = part->g0, part->begin = part->end = first;
            continue;
        }
        part->begin = p->group[part->g0].begin, part->end = p->group[part->g1 - 1].end;
        part->x = acts_row(whole->f[0], whole->x, part->begin - whole->begin, p->K);
        part->h0 = h0, part->o0 = part->begin - first;
        h0 += (part->end - part->begin) * 2 * whole->table->inter;
    }
}

/* Pair i's a = silu(gate) * up (through `row`, I floats), prepared for down's format. */
static void activate(const Plan *p, const Set *ws, int64_t i, float *row) {
    const Set *s = ws + (i >= p->R);
    int64_t I = s->table->inter, at = i - s->begin;
    silu_mul(p->h + s->h0 + at * 2 * I, I, row);
    quantize_into(s->f[1], row, 0, 1, I, acts_row(s->f[1], s->a, at, I));
}

/* The wave's pairs begin..end into columns c0..c1 of the sums: a routed pair adds its gated output to its token's
 * (pairs in grouped order: a token's experts in id order, as the modules sum them), a shared one is its token's. */
static void accumulate(const Plan *p, int64_t begin, int64_t end, int64_t c0, int64_t c1) {
    for (int64_t i = begin; i < end; i++) {
        const float *o = p->o + (i - begin) * p->K;
        if (i < p->R) {
            float *sum = p->acc + p->token[i] * p->K, g = p->gate[i];
            for (int64_t c = c0; c < c1; c++) sum[c] += g * o[c];
        } else {
            memcpy(p->sh + p->token[i] * p->K + c0, o + c0, (c1 - c0) * sizeof(float));
        }
    }
}

/* Columns c0..c1 of y: the routed sums rounded to y's dtype, plus the shared output rounded too (as torch adds the
 * routed and the shared experts' outputs). */
static void finish(const Plan *p, int64_t c0, int64_t c1) {
    for (int64_t t = 0; t < p->T; t++)
        for (int64_t c = c0; c < c1; c++) {
            int64_t at = t * p->K + c;
            float sum = p->acc[at];
            if (p->has_shared) sum = rounded(sum, p->ybf) + rounded(p->sh[at], p->ybf);
            store_out(p->y, p->ybf, at, sum);
        }
}

/* Each thread's columns of the sums, whole vectors of 16 (the same split every wave: a column's sums are one
 * thread's, in the pairs' order). */
static void my_columns(int64_t K, int64_t *c0, int64_t *c1) {
    int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), vectors = (K + 15) / 16;
    *c0 = 16 * (vectors * part / parts), *c1 = 16 * (vectors * (part + 1) / parts);
    if (*c0 > K) *c0 = K;
    if (*c1 > K) *c1 = K;
}

/* The region: per wave, its gate_up blocks, each pair's activation, its down blocks, then its pairs into the sums;
 * y after the last. `dots` and `rows`: each thread's 16 * 2 * WAVE_PAIRS and `width` floats. */
static void run(const Plan *p, float *dots, float *rows, int64_t width) {
    int64_t c0, c1, K = p->K;
    float *mine = dots + omp_get_thread_num() * 16 * 2 * WAVE_PAIRS, *row = rows + omp_get_thread_num() * width;
    my_columns(K, &c0, &c1);
    for (int64_t t = 0; t < p->T; t++) memset(p->acc + t * K + c0, 0, (c1 - c0) * sizeof(float));
    for (int64_t w = 0; w < p->waves; w++) {
        Set ws[2];
        wave_sets(p, w, ws);
        int64_t begin = p->group[p->wave[w]].begin, end = p->group[p->wave[w + 1] - 1].end;
        layer(p, ws, 0, mine);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = begin; i < end; i++) activate(p, ws, i, row);
        layer(p, ws, 1, mine); /* o: the last wave's sums were taken before the barrier above */
#pragma omp barrier
        accumulate(p, begin, end, c0, c1);
    }
    finish(p, c0, c1);
}

static Set make_set(const ExpertTable *t, int64_t begin, int64_t end, int64_t g0, int64_t g1) {
    Set s = {t, {{t->bits[0], t->group[0], t->mins[0]}, {t->bits[1], t->group[1], t->mins[1]}}, begin, end, g0, g1,
             0, 0, {0}, {0}};
    return s;
}

/* order[0..P): the pairs in grouped order, the routed ones by expert (a counting sort, stable: count[E] its room),
 * then the shared ones; w[p]: pair p's two weights, e[p] its routed expert. Groups hold at most WAVE_PAIRS pairs.
 * Returns the number of groups written to `group`. */
static int64_t group_pairs(int64_t R, int64_t P, int64_t E, const int64_t *e, void *const **w, int64_t *count,
                           int64_t *order, Group *group) {
    memset(count, 0, (E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < R; p++) count[e[p] + 1]++;
    for (int64_t i = 0; i < E; i++) count[i + 1] += count[i];
    for (int64_t p = 0; p < R; p++) order[count[e[p]]++] = p;
    for (int64_t p = R; p < P; p++) order[p] = p;
    int64_t groups = 0;
    for (int64_t i = 0; i < P; i++) {
        int64_t set = i >= R;
        if (i == 0 || set != group[groups - 1].set || w[order[i]] != group[groups - 1].w ||
            i - group[groups - 1].begin == WAVE_PAIRS)
            group[groups++] = (Group){set, i, i, w[order[i]]};
        group[groups - 1].end = i + 1;
    }
    return groups;
}

/* wave[0..]: the first group of each wave, consecutive groups of at most WAVE_PAIRS pairs in all; returns how many. */
static int64_t make_waves(const Group *group, int64_t groups, int64_t *wave) {
    int64_t waves = 0;
    for (int64_t g = 0; g < groups; g++)
        if (g == 0 || group[g].end - group[wave[waves - 1]].begin > WAVE_PAIRS) wave[waves++] = g;
    wave[waves] = groups;
    return waves;
}

int experts(const ExpertTable *routed, const ExpertTable *shared, const void *x, int64_t T, int64_t K, int64_t k,
            const int64_t *ids, const float *weights, void *y, int io, int threads) {
    for (int64_t i = 0; i < T * k; i++)
        if (ids[i] < 0 || ids[i] >= routed->experts) return LS_BAD_EXPERT;
    int has_shared = shared && shared->experts > 0;
    int64_t R = T * k, P = R + (has_shared ? T : 0), I = routed->inter, S = has_shared ? shared->inter : 0;
    int64_t W = P < WAVE_PAIRS ? P : WAVE_PAIRS, width = I > S ? I : S;
    ScratchMark mark = scratch_mark();
    int64_t *order = scratch(P * sizeof(int64_t)), *token = scratch(P * sizeof(int64_t));
    int64_t *sorted = scratch(k * sizeof(int64_t)), *expert = scratch(R * sizeof(int64_t));
    int64_t *count = scratch((routed->experts + 1) * sizeof(int64_t)), *units = scratch(2 * (P + 1) * sizeof(int64_t));
    int64_t *wave = scratch((P + 1) * sizeof(int64_t));
    void *const **w = scratch(P * sizeof(void *const *));
    float *gate = scratch(R * sizeof(float)), *gp = scratch(R * sizeof(float));
    Group *group = scratch(P * sizeof(Group));
    float *h = scratch(W * 2 * width * sizeof(float)), *o = scratch(W * K * sizeof(float));
    float *acc = scratch(T * K * sizeof(float)), *sh = has_shared ? scratch(T * K * sizeof(float)) : acc;
    float *dots = scratch(threads * 16 * 2 * WAVE_PAIRS * sizeof(float)), *rows = scratch(threads * width * sizeof(float));
    if (!order || !token || !sorted || !expert || !count || !units || !wave || !w || !gate || !gp || !group || !h ||
        !o || !acc || !sh || !dots || !rows)
        return scratch_release(mark), LS_NO_MEMORY;
    for (int64_t t = 0; t < T; t++) { /* each token's experts in id order, as the modules sum them */
        sort_ids(ids + t * k, k, sorted);
        for (int64_t c = 0; c < k; c++) {
            expert[t * k + c] = ids[t * k + sorted[c]];
            w[t * k + c] = routed->weights + 2 * expert[t * k + c];
            gate[t * k + c] = weights[t * k + sorted[c]];
        }
        if (has_shared) w[R + t] = shared->weights;
    }
    int64_t groups = group_pairs(R, P, routed->experts, expert, w, count, order, group);
    for (int64_t i = 0; i < P; i++) {
        token[i] = order[i] < R ? order[i] / k : order[i] - R;
        if (i < R) gp[i] = gate[order[i]];
    }
    int64_t routed_groups = 0;
    while (routed_groups < groups && group[routed_groups].set == 0) routed_groups++;
    Set set[2] = {make_set(routed, 0, R, 0, routed_groups),
                  make_set(has_shared ? shared : routed, R, P, routed_groups, groups)};
    /* x prepared once per format: the shared pairs are the tokens in order, so they read it as it is; the routed
     * pairs take their tokens' rows, gathered in grouped order. */
    Format fr = set[0].f[0], fs = set[1].f[0];
    QuantActs xr = quantize_for(fr, x, io & 1, T, K, threads);
    int same = fs.bits == fr.bits && fs.group == fr.group && fs.mins == fr.mins;
    set[0].x = xr.q ? gather_acts(fr, xr, token, R, K) : xr;
    set[1].x = same ? xr : quantize_for(fs, x, io & 1, T, K, threads); /* no shared experts: set 1 is routed's */
    int missing = !set[0].x.q || !set[1].x.q;
    for (int s = 0; s < 1 + has_shared; s++) {
        int64_t pairs = set[s].end - set[s].begin;
        set[s].a = take_acts(set[s].f[1], 0, pairs < W ? pairs : W, set[s].table->inter);
        missing |= !set[s].a.q;
    }
    if (missing) return scratch_release(mark), LS_NO_MEMORY;
    units[0] = units[P + 1] = 0;
    for (int64_t g = 0; g < groups; g++) {
        int64_t width_g = set[group[g].set].table->inter;
        units[g + 1] = units[g] + (2 * width_g + 15) / 16;
        units[P + 1 + g + 1] = units[P + 1 + g] + (K + 15) / 16;
    }
    Plan plan = {K, T, R, make_waves(group, groups, wave), group, {units, units + P + 1}, wave, token, gp, set,
                 h, o, acc, sh, y, (io >> 1) & 1, has_shared};
#pragma omp parallel num_threads(threads)
    run(&plan, dots, rows, width);
    scratch_release(mark);
    return LS_OK;
}
