"""Speculative decoding (MTP, or n-gram lookup: `--method ngram`): acceptance per draft position and decode tok/s
with and without it.

The engines live in this process and run the same greedy requests in turns (`--repeats` rounds; medians of the
rates and of each round's ratio). Decode tok/s = generated tokens past the first / (time of the whole request -
time of a one-token request). `--clock cpu`
(the default) times this process's CPU time, which a shared machine disturbs far less than wall time (one thread:
the two agree on an idle machine). On the embedded model the prompts are KJV verse openings the model never saw
whole (held-out chapters); batch 1 runs each of them alone in turn. Every batch size drafts (`disable_by_batch_size`
None) unless `--default-disable`.

The cost model (`--cost-model`) times the forwards of one step on their own, at a context of 40 tokens: the main
model over 1 and k+1 tokens per request (plus logits), the MTP layer over k+1 tokens then k-1 chained single tokens
(plus draft logits), and predicts the step-time ratio and, for an assumed acceptance a per position, the speedup
(1 + a + ... + a^k) / ratio. It leaves out the engine's own per-step work, alike in both. It runs on the embedded
model and on a V3-shaped random checkpoint `--layers` deep (a random MTP layer accepts nothing, so its end-to-end
rate is cost only; the model's speedup is the cost model's, at the stated acceptance).
`--method ngram --prompt-repeats 3` drafts by lookup in the request's own tokens, on prompts that say their verse
opening three times over (the model then goes on repeating it: the copying an edit or a quotation does).
Run: `.venv/bin/python benchmarks/speculative.py [--quick] [--batch 1 4 16] [--k 1 2] [--cost-model]`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latentserve import LLM, SamplingParams  # noqa: E402
from latentserve.attention.metadata import CommonAttentionMetadata  # noqa: E402
from latentserve.engine.llm import default_model_dir  # noqa: E402
from latentserve.ubatch.dbo import run_forward  # noqa: E402

# Openings of verses from the held-out chapters (every 50th chapter: Genesis 1, Exodus 1, ...).
PROMPTS = [
    "In the beginning God created", "Now these are the names of the children of Israel", "And the earth was",
    "And God called the light Day", "Now there arose up a new king over Egypt", "And God saw every thing",
    "And the spirit of God moved", "And the children of Israel were fruitful", "And God made the firmament",
    "And God said, Let the earth bring forth", "And the midwives said unto Pharaoh", "And God blessed them",
    "Thus the heavens and the earth were finished", "And God set them in the firmament",
    "And Joseph died, and all his brethren", "And the evening and the morning were the third day",
]
# A V3-shaped random model: MLA, dense first layer, sigmoid-routed MoE (cost only); --layers sets its depth.
RANDOM_MODEL = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
    n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=1024, tie_word_embeddings=False,
)
CONTEXT = 40  # tokens already cached when the cost model times a step


def embedded_groups(batch: int, repeats: int = 1) -> list[list[str]]:
    """Batch 1 runs every prompt alone in turn (one prompt's greedy continuation may loop, which drafts love);
    larger batches take the first `batch` prompts together. `repeats`: each prompt said that many times."""
    prompts = [", ".join([prompt] * repeats) for prompt in PROMPTS]
    if batch == 1:
        return [[prompt] for prompt in prompts]
    return [[prompts[i % len(prompts)] for i in range(batch)]]


def random_mtp_checkpoint(path: Path, layers: int) -> Path:
    """transformers writes L+1 layers; the last becomes the MTP layer, with random MTP inputs and output norm."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(**{**RANDOM_MODEL, "num_hidden_layers": layers + 1})
    DeepseekV3ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    h = RANDOM_MODEL["hidden_size"]
    weights = load_file(path / "model.safetensors")
    prefix = f"model.layers.{layers}."
    weights.update({prefix + "enorm.weight": torch.ones(h), prefix + "hnorm.weight": torch.ones(h),
                    prefix + "shared_head.norm.weight": torch.ones(h),
                    prefix + "eh_proj.weight": torch.randn(h, 2 * h) * 0.02})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": layers, "num_nextn_predict_layers": 1}))
    return path


def decode_time(llm: LLM, prompts, max_tokens: int, clock) -> float:
    """Seconds of decoding the batch's tokens past the first (a one-token request's time taken out)."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = clock()
    llm.generate(prompts, one, use_tqdm=False)
    t_one = clock() - start
    start = clock()
    llm.generate(prompts, many, use_tqdm=False)
    return max(clock() - start - t_one, 1e-9)


def bench_model(name: str, path: Path, groups_for, args) -> None:
    """Engines with and without MTP take turns, `--repeats` rounds; medians of rates and of per-round ratios.
    `groups_for(batch)`: the batches of prompts a round runs one after another (their times add up)."""
    engine = dict(num_threads=args.threads, max_num_seqs=max(args.batch), num_kv_blocks=512)
    engines = {0: LLM(model=path, **engine)}
    for k in args.k:
        spec = {"method": args.method, "num_speculative_tokens": k}
        if args.method == "ngram":
            spec["prompt_lookup_min"], spec["prompt_lookup_max"] = 1, args.lookup_max
        if not args.default_disable:  # draft at every batch size, to find the crossover
            spec["disable_by_batch_size"] = None
        engines[k] = LLM(model=path, speculative_config=spec, **engine)
    clock = CLOCKS[args.clock]
    print(f"\n{name}: decode tok/s ({args.clock} time, median of {args.repeats} interleaved rounds), greedy, "
          f"{args.max_tokens} tokens per request, {args.threads} thread(s), drafts by {args.method}")
    columns = [f"k={k} (ratio) | k={k} acceptance per position | k={k} mean accepted length" for k in args.k]
    print("| batch | no drafts | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|---|---|" * len(args.k))
    for batch in args.batch:
        groups = groups_for(batch)
        tokens = sum(len(prompts) for prompts in groups) * (args.max_tokens - 1)
        for llm in engines.values():
            warm_up = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            llm.generate(groups[0], warm_up, use_tqdm=False)
        before = {k: _counters(engines[k]) for k in args.k}
        rates: dict[int, list[float]] = {k: [] for k in engines}
        for _ in range(args.repeats):
            for k, llm in engines.items():
                seconds = sum(decode_time(llm, prompts, args.max_tokens, clock) for prompts in groups)
                rates[k].append(tokens / seconds)
        cells = [f"{statistics.median(rates[0]):.1f}"]
        for k in args.k:
            ratio = statistics.median(s / b for s, b in zip(rates[k], rates[0]))
            drafts, accepted, per_pos, reached = (
                [x - y for x, y in zip(a, b)] if isinstance(a, list) else a - b
                for a, b in zip(_counters(engines[k]), before[k]))
            acceptance = " / ".join(f"{a / max(d, 1):.0%}" for a, d in zip(per_pos, reached))
            cells += [f"{statistics.median(rates[k]):.1f} ({ratio:.2f}x)", acceptance,
                      f"{1 + accepted / max(drafts, 1):.2f}"]
        print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)


def _counters(llm: LLM):
    s = llm.engine.spec_decoding_stats
    return s.num_drafts, s.num_accepted_tokens, list(s.num_accepted_tokens_per_pos), list(s.num_drafts_per_pos)


@torch.no_grad()
def forward_costs(llm: LLM, batch: int, k: int, repeats: int) -> dict[str, float]:
    """Median CPU seconds of each forward of a step at `batch` requests, CONTEXT tokens cached each."""
    runner = llm.engine.runner
    model, proposer = runner.model, runner.spec_decoder.proposer
    bs = runner.attn_config.block_size
    per_request = -(-(CONTEXT + k + 1) // bs)
    table = torch.arange(batch * per_request, dtype=torch.int32).view(batch, per_request)

    def step_inputs(q: int, start: int):
        slots = torch.tensor([int(table[r, p // bs]) * bs + p % bs for r in range(batch) for p in range(start, start + q)])
        common = CommonAttentionMetadata.from_lists([q] * batch, [start + q] * batch, table, slots)
        ids = torch.randint(5, model.config.vocab_size, (batch * q,))
        return ids, torch.arange(start, start + q).repeat(batch), common

    ids, positions, common = step_inputs(CONTEXT, 0)  # fill both caches
    hidden = run_forward(model, [ids, positions], common, runner.builders)
    run_forward(proposer.mtp, [ids, positions, hidden], common, [proposer.builder])
    times: dict[str, list[float]] = {}

    def timed(name: str, fn):
        start = time.process_time()
        out = fn()
        times.setdefault(name, []).append(time.process_time() - start)
        return out

    for _ in range(repeats):
        for q in sorted({1, k + 1}):
            ids, positions, common = step_inputs(q, CONTEXT)
            hidden = timed(f"main {q}", lambda: run_forward(model, [ids, positions], common, runner.builders))
            timed(f"logits {q}", lambda: model.compute_logits(hidden))
            out = timed(f"mtp {q}", lambda: run_forward(proposer.mtp, [ids, positions, hidden], common,
                                                        [proposer.builder]))
            timed("draft logits", lambda: proposer.mtp.compute_logits(out[:batch]).argmax(-1).tolist())
    return {name: statistics.median(t) for name, t in times.items()}


def cost_model(name: str, path: Path, args) -> None:
    print(f"\n{name}: cost model (CPU time of one step's forwards, median of {args.repeats * 4}; context "
          f"{CONTEXT}): step-time ratio spec / plain, and the speedup it implies at acceptance a per position")
    levels = (0.6, 0.7, 0.8, 0.9, 1.0)
    print("| batch | k | plain step ms | main over k+1 ms | MTP ms | ratio | " +
          " | ".join(f"a={a:g}" for a in levels) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(levels))
    llms = {k: LLM(model=path, num_threads=args.threads, num_kv_blocks=2048,
                   speculative_config={"method": "mtp", "num_speculative_tokens": k}) for k in args.k}
    for batch in args.batch:
        for k, llm in llms.items():
            c = forward_costs(llm, batch, k, args.repeats * 4)
            plain = c["main 1"] + c["logits 1"]
            mtp = c[f"mtp {k + 1}"] + c["draft logits"] + (k - 1) * (c["mtp 1"] + c["draft logits"])
            spec = c[f"main {k + 1}"] + c[f"logits {k + 1}"] + mtp
            ratio = spec / plain
            gains = [sum(a ** j for j in range(k + 1)) / ratio for a in levels]
            print(f"| {batch} | {k} | {plain * 1e3:.2f} | {(c[f'main {k + 1}'] + c[f'logits {k + 1}']) * 1e3:.2f} | "
                  f"{mtp * 1e3:.2f} | {ratio:.2f} | " + " | ".join(f"{g:.2f}x" for g in gains) + " |", flush=True)
        del llm


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    p.add_argument("--layers", type=int, default=24, help="depth of the V3-shaped random checkpoint")
    p.add_argument("--cost-model", action="store_true", help="also the per-forward cost model, on both models")
    p.add_argument("--default-disable", action="store_true",
                   help="keep the default disable_by_batch_size (otherwise every batch size drafts)")
    p.add_argument("--skip-random", action="store_true", help="the embedded model only")
    p.add_argument("--quick", action="store_true", help="batch 1 and 4, k=1, one repeat")
    p.add_argument("--method", choices=["mtp", "ngram"], default="mtp")
    p.add_argument("--lookup-max", type=int, default=3, help="ngram: prompt_lookup_max (prompt_lookup_min is 1)")
    p.add_argument("--prompt-repeats", type=int, default=1, help="each embedded prompt said this many times")
    args = p.parse_args()
    if args.quick:
        args.batch, args.k, args.repeats, args.max_tokens = [1, 4], [1], 1, 24
    torch.set_num_threads(args.threads)
    embedded = default_model_dir()
    bench_model("embedded model", embedded, lambda b: embedded_groups(b, args.prompt_repeats), args)
    if args.cost_model:
        cost_model("embedded model", embedded, args)
    if args.skip_random:
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = random_mtp_checkpoint(Path(tmp), args.layers)
        name = f"V3-shaped random checkpoint, {args.layers} layers"
        if args.cost_model:
            cost_model(name, path, args)
        g = torch.Generator().manual_seed(0)
        bench_model(f"{name} (cost only: its random MTP layer accepts nothing)", path,
                    lambda b: [[torch.randint(5, 8192, (32,), generator=g).tolist() for _ in range(b)]], args)


if __name__ == "__main__":
    main()
