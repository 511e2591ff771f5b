// Batched greedy decode through the llama.h C API of mainline llama.cpp or ik_llama.cpp (built with -DPEER_IK), fed
// the prompts latentserve's batched benchmark gets: llama-batched-bench feeds its own tokens (ik: token 0 everywhere,
// mainline: random ids), so its MoE layers read different experts than ours would for the same requests.
// benchmarks/peer_batched.py compiles this against a build and runs it.
//
//   peer_batched MODEL PROMPTS --threads T --ctx N --vocab V --decode D --batches 8,8,32 [--no-repack]
//
// PROMPTS holds one sequence's token ids a line; a batch of B runs the first B lines. Per batch size: clear the KV
// cache, decode every sequence's prompt in chunks of n_batch tokens (each sequence's last token gives its first
// greedy token), then D steps of one token a sequence, each sequence fed its own argmax. One JSON line a batch:
// prompt seconds, decode tokens/s (B * D tokens over the D steps' wall time, as llama-batched-bench's S_TG; the
// argmaxes' share of it in sample_s), and a checksum of the greedy tokens with the number of distinct token streams
// (1 when the prompts are alike).
#include "llama.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_BATCHES 32
#define N_BATCH 2048  // llama-batched-bench's -b 2048 -ub 512, as benchmarks/llama_cpp_ik.py ran it
#define N_UBATCH 512
#define HEAD 8        // greedy tokens of sequence 0 printed
#define WARMUP 16     // llama-batched-bench's warm-up: 16 tokens of token 0

typedef struct {
    const char *model, *prompts;
    int threads, n_ctx, n_vocab, decode, no_repack;
    int n_batch, n_ubatch;  // N_BATCH and N_UBATCH clamped as ik's common.cpp does (get_batch_ubatch)
    int batches[MAX_BATCHES], n_batches, max_batch;
} options;

typedef struct {
    int32_t *ids;
    int n;
} prompt;

static void die(const char *what, const char *detail) {
    fprintf(stderr, "peer_batched: %s%s\n", what, detail ? detail : "");
    exit(2);
}

static int positive(const char *flag, const char *text) {
    char *end;
    long v = strtol(text, &end, 10);
    if (*text == '\0' || *end != '\0' || v <= 0 || v > (1L << 30)) die("want a positive integer after ", flag);
    return (int)v;
}

static void parse_batches(options *o, char *text) {
    for (char *tok = strtok(text, ","); tok; tok = strtok(NULL, ",")) {
        if (o->n_batches == MAX_BATCHES) die("too many --batches", NULL);
        int b = positive("--batches", tok);
        o->batches[o->n_batches++] = b;
        if (b > o->max_batch) o->max_batch = b;
    }
}

static options parse(int argc, char **argv) {
    options o = {0};
    if (argc < 3)
        die("usage: peer_batched MODEL PROMPTS --threads T --ctx N --vocab V --decode D --batches B,...", NULL);
    o.model = argv[1];
    o.prompts = argv[2];
    for (int i = 3; i < argc; i++) {
        const char *flag = argv[i];
#ifndef PEER_IK  // mainline's --no-repack: no extra (repacking, AMX) buffer types
        if (!strcmp(flag, "--no-repack")) { o.no_repack = 1; continue; }
#endif
        int *field = !strcmp(flag, "--threads") ? &o.threads
                     : !strcmp(flag, "--ctx")     ? &o.n_ctx
                     : !strcmp(flag, "--vocab")   ? &o.n_vocab
                     : !strcmp(flag, "--decode")  ? &o.decode
                                                  : NULL;
        if (!field && strcmp(flag, "--batches")) die("unknown option ", flag);
        if (i + 1 == argc) die("no value after ", flag);
        if (field) *field = positive(flag, argv[++i]);
        else parse_batches(&o, argv[++i]);
    }
    if (!o.threads || !o.n_ctx || !o.n_vocab || !o.decode || !o.n_batches)
        die("--threads, --ctx, --vocab, --decode and --batches are all required", NULL);
    o.n_batch = o.n_ctx < N_BATCH ? o.n_ctx : N_BATCH;
    o.n_ubatch = o.n_batch < N_UBATCH ? o.n_batch : N_UBATCH;
    return o;
}

// The first `want` lines of the prompts file, each a non-empty list of token ids in [0, n_vocab).
static prompt *read_prompts(const options *o, int want) {
    FILE *f = fopen(o->prompts, "r");
    if (!f) die("cannot open the prompts file ", o->prompts);
    prompt *out = calloc((size_t)want, sizeof *out);
    char *line = NULL;
    size_t cap = 0;
    for (int s = 0; s < want; s++) {
        if (getline(&line, &cap, f) < 0) die("the prompts file has fewer lines than the largest batch: ", o->prompts);
        out[s].ids = malloc((strlen(line) / 2 + 1) * sizeof(int32_t));
        char *p = line, *end;
        for (long id = strtol(p, &end, 10); end != p; id = strtol(p, &end, 10)) {
            if (id < 0 || id >= o->n_vocab) die("a prompt token id outside [0, --vocab) in ", o->prompts);
            out[s].ids[out[s].n++] = (int32_t)id;
            p = end;
        }
        if (out[s].n == 0) die("an empty prompt line in ", o->prompts);
    }
    free(line);
    fclose(f);
    return out;
}

static struct llama_model *load_model(const options *o) {
    struct llama_model_params mp = llama_model_default_params();
#ifdef PEER_IK
    // What ik's llama-batched-bench -mla 3 -fa on -rtr sets (common.cpp, common_model_params_to_llama): -rtr repacks
    // the tensors row-interleaved at load and, to do so, reads the file without mmap.
    mp.mla = 3;
    mp.flash_attn = true;
    mp.repack_tensors = true;
    mp.use_mmap = false;
    mp.max_ctx_size = o->n_ctx;
    mp.n_ubatch = o->n_ubatch;
#else
    mp.use_extra_bufts = !o->no_repack;
#endif
    struct llama_model *model = llama_model_load_from_file(o->model, mp);
    if (!model) die("cannot load the model ", o->model);
    return model;
}

static struct llama_context *new_context(struct llama_model *model, const options *o) {
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)o->n_ctx;
    cp.n_batch = (uint32_t)o->n_batch;
    cp.n_ubatch = (uint32_t)o->n_ubatch;
    cp.n_seq_max = (uint32_t)o->max_batch;
    cp.n_threads = cp.n_threads_batch = o->threads;
#ifdef PEER_IK
    // common_context_params_to_llama with -mla 3 -fa on (fused MoE and only_active_experts are its defaults there)
    cp.mla_attn = 3;
    cp.flash_attn = true;
    cp.fused_moe_up_gate = true;
    cp.only_active_experts = true;
#else
    // common_context_params_to_llama's values where they differ from the library's defaults; no -fa: auto
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
    cp.no_perf = false;
    cp.swa_full = false;
#endif
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) die("cannot create a context (is --ctx too large?)", NULL);
    return ctx;
}

static void clear_cache(struct llama_context *ctx) {
#ifdef PEER_IK
    llama_kv_cache_clear(ctx);
#else
    llama_memory_clear(llama_get_memory(ctx), true);
#endif
}

static void add(struct llama_batch *b, llama_token id, llama_pos pos, llama_seq_id seq, int8_t logits) {
    int32_t i = b->n_tokens++;
    b->token[i] = id;
    b->pos[i] = pos;
    b->n_seq_id[i] = 1;
    b->seq_id[i][0] = seq;
    b->logits[i] = logits;
}

static llama_token argmax(const float *logits, int n) {  // the first maximum
    int best = 0;
    float most = logits[0];  // in a register: comparing against logits[best] reloads it, 5x the time
    for (int i = 1; i < n; i++)
        if (logits[i] > most) {
            most = logits[i];
            best = i;
        }
    return best;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// Decode `b` in views of n_batch tokens; each token with logits sets its sequence's next[] to its argmax. Returns the
// seconds the argmaxes took (part of the step, as sampling is part of ours).
static double decode(struct llama_context *ctx, struct llama_batch b, int n_vocab, llama_token *next) {
    double sampling = 0;
    const int32_t n_batch = (int32_t)llama_n_batch(ctx);
    for (int32_t i = 0; i < b.n_tokens; i += n_batch) {
        struct llama_batch view = b;  // field by field: the forks' structs differ past `logits`
        view.n_tokens = b.n_tokens - i < n_batch ? b.n_tokens - i : n_batch;
        view.token += i;
        view.pos += i;
        view.n_seq_id += i;
        view.seq_id += i;
        view.logits += i;
        int rc = llama_decode(ctx, view);
        if (rc != 0) {
            fprintf(stderr, "peer_batched: llama_decode returned %d\n", rc);
            exit(1);
        }
        llama_synchronize(ctx);
        double start = now();
        for (int32_t k = 0; k < view.n_tokens; k++)
            if (view.logits[k]) next[view.seq_id[k][0]] = argmax(llama_get_logits_ith(ctx, k), n_vocab);
        sampling += now() - start;
    }
    return sampling;
}

static uint64_t fnv(uint64_t h, uint64_t v) {  // FNV-1a over the value's 8 bytes
    for (int i = 0; i < 8; i++) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ULL;
    return h;
}

static void run_batch(struct llama_context *ctx, struct llama_batch b, const options *o, const prompt *prompts,
                      int n_seq) {
    llama_token *next = calloc((size_t)n_seq, sizeof *next);
    uint64_t *stream = malloc((size_t)n_seq * sizeof *stream);
    llama_token head[HEAD];
    clear_cache(ctx);
    b.n_tokens = 0;
    for (int s = 0; s < n_seq; s++)
        for (int i = 0; i < prompts[s].n; i++) add(&b, prompts[s].ids[i], i, s, i == prompts[s].n - 1);
    int prompt_tokens = b.n_tokens;
    double start = now();
    decode(ctx, b, o->n_vocab, next);
    double prompt_s = now() - start;
    for (int s = 0; s < n_seq; s++) stream[s] = fnv(14695981039346656037ULL, (uint64_t)next[s]);
    head[0] = next[0];
    double sample_s = 0;
    start = now();
    for (int step = 0; step < o->decode; step++) {
        b.n_tokens = 0;
        for (int s = 0; s < n_seq; s++) add(&b, next[s], prompts[s].n + step, s, 1);
        sample_s += decode(ctx, b, o->n_vocab, next);
        for (int s = 0; s < n_seq; s++) stream[s] = fnv(stream[s], (uint64_t)next[s]);
        if (step + 1 < HEAD) head[step + 1] = next[0];
    }
    double decode_s = now() - start;
    uint64_t checksum = 14695981039346656037ULL;
    int streams = 0;
    for (int s = 0; s < n_seq; s++) {
        checksum = fnv(checksum, stream[s]);
        int seen = 0;
        for (int r = 0; r < s && !seen; r++) seen = stream[r] == stream[s];
        streams += !seen;
    }
    printf("{\"batch\": %d, \"prompt_tokens\": %d, \"prompt_s\": %.6f, \"decode_steps\": %d, \"decode_s\": %.6f, "
           "\"decode_tok_s\": %.3f, \"sample_s\": %.6f, \"streams\": %d, \"checksum\": \"%016" PRIx64 "\", "
           "\"head\": [",
           n_seq, prompt_tokens, prompt_s, o->decode, decode_s, n_seq * o->decode / decode_s, sample_s, streams,
           checksum);
    int shown = o->decode + 1 < HEAD ? o->decode + 1 : HEAD;
    for (int i = 0; i < shown; i++) printf("%s%d", i ? ", " : "", head[i]);
    printf("]}\n");
    fflush(stdout);
    free(next);
    free(stream);
}

int main(int argc, char **argv) {
    options o = parse(argc, argv);
    prompt *prompts = read_prompts(&o, o.max_batch);
    int most = WARMUP;  // the llama_batch's capacity: the warm-up or the largest batch's prompts
    for (int s = 0, all = 0; s < o.max_batch; s++) {
        all += prompts[s].n;
        if (all > most) most = all;
    }
    llama_backend_init();
    struct llama_model *model = load_model(&o);
    struct llama_context *ctx = new_context(model, &o);
    struct llama_batch b = llama_batch_init(most, 0, 1);
    llama_token ignored[1];
    for (int i = 0; i < WARMUP; i++) add(&b, 0, i, 0, i == WARMUP - 1);
    decode(ctx, b, o.n_vocab, ignored);
    for (int i = 0; i < o.n_batches; i++) run_batch(ctx, b, &o, prompts, o.batches[i]);
    llama_batch_free(b);
    llama_free(ctx);
#ifdef PEER_IK
    llama_free_model(model);
#else
    llama_model_free(model);
#endif
    llama_backend_free();
    return 0;
}
