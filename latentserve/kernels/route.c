/* DeepSeek's MoE routing for a few tokens in one call, from fp32 router logits: softmax (V2) or sigmoid plus the
 * learned correction bias (V3's noaux_tc) scores, groups limited to the best topk_groups where asked, the top k
 * experts, their weights normalized and scaled. What layers/moe.py's `select_experts` does in a dozen torch ops;
 * the same choices (ties go to the lower index) and weights to an ulp or two (expf for torch's vectorized exp). */
#include "simd.h"

/* The largest v[i] not yet taken, over n values (ties: the lower i). */
static int64_t best_free(const float *v, int64_t n, const uint8_t *taken) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
    return best;
}

/* logits [T, E]; weights [T, k] fp32 and ids [T, k] int64 out, in order of choice. bias: E values or NULL. */
int route(const float *logits, int64_t T, int64_t E, int64_t k, int sigmoid, int64_t groups, int64_t topk_groups,
          const float *bias, int norm, float scaling, float *weights, int64_t *ids) {
    ScratchMark mark = scratch_mark();
    float *scores = scratch(E * sizeof(float)), *choice = scratch(E * sizeof(float));
    float *group_score = scratch(groups * sizeof(float));
    uint8_t *taken = scratch(E + groups);
    if (!scores || !choice || !group_score || !taken) return scratch_release(mark), LS_NO_MEMORY;
    uint8_t *group_taken = taken + E;
    int64_t size = E / groups;
    for (int64_t t = 0; t < T; t++) {
        const float *l = logits + t * E;
        if (sigmoid) {
            for (int64_t i = 0; i < E; i++) {
                scores[i] = 1.f / (1.f + expf(-l[i]));
                choice[i] = bias ? scores[i] + bias[i] : scores[i];
            }
        } else {
            float m = l[0], sum = 0.f;
            for (int64_t i = 1; i < E; i++) m = l[i] > m ? l[i] : m;
            for (int64_t i = 0; i < E; i++) sum += scores[i] = expf(l[i] - m);
            for (int64_t i = 0; i < E; i++) {
                scores[i] /= sum;
                choice[i] = bias ? scores[i] + bias[i] : scores[i];
            }
        }
        if (topk_groups < groups) { /* a group's score: its best expert (softmax) or its best two (sigmoid) */
            for (int64_t g = 0; g < groups; g++) {
                const float *c = choice + g * size;
                float first = c[0], second = -INFINITY;
                for (int64_t i = 1; i < size; i++) {
                    if (c[i] > first) second = first, first = c[i];
                    else if (c[i] > second) second = c[i];
                }
                group_score[g] = sigmoid ? first + second : first;
            }
            memset(group_taken, 0, groups);
            for (int64_t r = 0; r < topk_groups; r++) group_taken[best_free(group_score, groups, group_taken)] = 1;
            for (int64_t i = 0; i < E; i++)
                if (!group_taken[i / size]) choice[i] = -INFINITY; /* with a bias, a kept choice may be < 0 */
        }
        memset(taken, 0, E);
        float sum = 0.f;
        for (int64_t j = 0; j < k; j++) {
            int64_t i = best_free(choice, E, taken);
            taken[i] = 1;
            ids[t * k + j] = i;
            sum += weights[t * k + j] = scores[i];
        }
        for (int64_t j = 0; j < k; j++) {
            if (norm) weights[t * k + j] /= sum + 1e-20f;
            if (scaling != 1.f) weights[t * k + j] *= scaling;
        }
    }
    scratch_release(mark);
    return LS_OK;
}
