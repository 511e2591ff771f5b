"""latentserve against transformers `generate` on one random DeepSeek-V3 checkpoint (fp32, CPU).

Both run the same prompts in one process: prefill tokens/s, decode step time and tokens/s at each batch
size, KV-cache bytes per token, model load time, and greedy-token agreement. Beside them, the step's
floors measured in the same run: its weight GEMMs alone with `F.linear` at the step's shapes (routed
experts each seeing their even share of the tokens), and the time to stream those weights once at the
machine's read bandwidth.
Each side and the floors run `--repeats` times per batch, alternating, and each figure's fastest time counts.
Run: `.venv/bin/python benchmarks/vs_transformers.py [--quick] [--threads 2]`.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import best_time, policy_linear  # noqa: E402
from latentserve import LLM, SamplingParams  # noqa: E402
from latentserve.layers.linear import SKINNY_ROWS, SPLIT_ROWS  # noqa: E402

# ~200M parameters: 8 layers (first dense), 16 routed experts top-4 + 1 shared, vocab 16k.
FULL = dict(
    vocab_size=16384, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=384, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
    qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=2048,
)
QUICK = dict(
    FULL, vocab_size=2048, hidden_size=256, intermediate_size=512, moe_intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
)


@dataclass
class RunResult:
    load_s: float
    prefill_s: float  # all prompts of the batch
    decode_step_s: float  # median over the timed decode steps
    kv_bytes_per_token_layer: float
    tokens: list[list[int]]  # greedy outputs, for agreement


def fastest(runs: list[RunResult]) -> RunResult:
    """Each timing at its best over repeated runs: load from other processes only ever slows a run down."""
    return RunResult(min(r.load_s for r in runs), min(r.prefill_s for r in runs), min(r.decode_step_s for r in runs),
                     runs[0].kv_bytes_per_token_layer, runs[0].tokens)


def make_checkpoint(path: Path, fields: dict) -> None:
    """A random V3 checkpoint written by transformers (non-trivial norms and correction bias)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**fields, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.1)
    model.save_pretrained(path)


def run_latentserve(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> RunResult:
    """Drives the engine of `LLM(model=...)` step by step to time prefill and decode steps apart."""
    start = time.perf_counter()
    max_len = len(prompts[0]) + new_tokens
    # fp32 as transformers runs here: dtype auto would be bf16 on a CPU with native bf16.
    llm = LLM(model=model_dir, dtype="float32", max_num_seqs=len(prompts), max_num_batched_tokens=max(4096, len(prompts[0])),
              enable_prefix_caching=False, max_model_len=max_len, num_kv_blocks=len(prompts) * -(-max_len // 16))
    load_s = time.perf_counter() - start
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs: dict[str, list[int]] = {}
    prefill_s, decode_times = 0.0, []
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.requests.values())
        decoding = decoding and not engine.scheduler.waiting
        start = time.perf_counter()
        step_outputs = engine.step()
        elapsed = time.perf_counter() - start
        if decoding:
            decode_times.append(elapsed)
        else:
            prefill_s += elapsed
        for out in step_outputs:
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    cache = next(iter(engine.runner.kv_caches.values()))
    return RunResult(load_s, prefill_s, median(decode_times), cache.element_size() * cache.shape[-1],
                     [outputs[i] for i in ids])


def run_transformers(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> RunResult:
    """`generate` (greedy, sdpa, no EOS); a logits processor stamps the end of every forward."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    load_s = time.perf_counter() - start
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    stamps: list[float] = []

    def stamp(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        stamps.append(time.perf_counter())
        return scores

    input_ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, logits_processor=LogitsProcessorList([stamp]), return_dict_in_generate=True,
        )
    cache = out.past_key_values
    cache_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    seq_len = cache.get_seq_length()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return RunResult(load_s, stamps[0] - start, median(steps),
                     cache_bytes / (len(prompts) * seq_len * len(cache.layers)),
                     out.sequences[:, input_ids.shape[1]:].tolist())


@dataclass(frozen=True)
class Gemm:
    """`count` products of `rows` x `k` activations with one `k` x `n` weight each."""

    rows: int
    k: int
    n: int
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.k * self.n * self.count

    @property
    def weight_bytes(self) -> int:
        return 4 * self.k * self.n * self.count


def step_gemms(c: dict, tokens: int, logits_rows: int, decode: bool) -> list[Gemm]:
    """The weight GEMMs of one forward over `tokens` tokens; routed experts get an even share of tokens."""
    h, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    nope, rope, v, lat = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    q_out = heads * (nope + rope)
    q = [Gemm(tokens, h, q_out)] if c["q_lora_rank"] is None else [
        Gemm(tokens, h, c["q_lora_rank"]), Gemm(tokens, c["q_lora_rank"], q_out)]
    attn = q + [Gemm(tokens, h, lat + rope), Gemm(tokens, heads * v, h)]
    if decode:  # absorbed: per head, q_nope @ W_UK and o_latent @ W_UV
        attn += [Gemm(tokens, nope, lat, heads), Gemm(tokens, lat, v, heads)]
    else:  # up-projection of the new tokens' latents
        attn += [Gemm(tokens, lat, heads * (nope + v))]
    dense = [Gemm(tokens, h, c["intermediate_size"], 2), Gemm(tokens, c["intermediate_size"], h)]
    experts, top_k, inter = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
    active = min(experts, tokens * top_k)
    share = -(-tokens * top_k // active)
    shared_inter = inter * c["n_shared_experts"]
    moe = [Gemm(tokens, h, experts), Gemm(tokens, h, shared_inter, 2), Gemm(tokens, shared_inter, h),
           Gemm(share, h, inter, 2 * active), Gemm(share, inter, h, active)]
    num_dense = c["first_k_dense_replace"]
    return (attn * layers + dense * num_dense + moe * (layers - num_dense)
            + [Gemm(logits_rows, h, c["vocab_size"])])


def time_gemms(gemms: list[Gemm], linear_fn=F.linear) -> float:
    """Seconds to run every GEMM with `linear_fn` (per-head ones as `torch.bmm`), one weight per product."""
    ops = []
    for g in gemms:
        if g.count > 1 and g.k * g.n < 1 << 16:  # the small per-head absorbed matrices
            ops.append((torch.bmm, torch.randn(g.count, g.rows, g.k), torch.randn(g.count, g.k, g.n)))
        else:
            x = torch.randn(g.rows, g.k)
            ops += [(linear_fn, x, torch.randn(g.n, g.k)) for _ in range(g.count)]

    def run() -> None:
        for fn, x, w in ops:
            fn(x, w)

    return best_time(run, repeats=5)


@dataclass
class Floors:
    """The step's weight GEMMs alone: a whole-batch prefill, and one decode step with F.linear and with `linear`."""

    prefill_s: float
    decode_s: float
    decode_linear_s: float


def measure_floors(c: dict, prompt_len: int, batch: int) -> Floors:
    decode = step_gemms(c, batch, batch, decode=True)
    return Floors(time_gemms(step_gemms(c, prompt_len, 1, decode=False)) * batch, time_gemms(decode),
                  time_gemms(decode, policy_linear))


def expert_formulations(c: dict, batch: int, compile_too: bool) -> dict[str, float]:
    """Seconds for one MoE layer's routed experts at a decode batch, written several ways (same math)."""
    experts, top_k = c["n_routed_experts"], c["num_experts_per_tok"]
    h, inter = c["hidden_size"], c["moe_intermediate_size"]
    active = min(experts, batch * top_k)
    rows = -(-batch * top_k // active)
    x = torch.randn(active, rows, h)
    w13 = torch.randn(active, 2 * inter, h)  # gate and up stacked, [out, in] as checkpoints store them
    w1, w3 = w13[:, :inter].contiguous(), w13[:, inter:].contiguous()
    w2 = torch.randn(active, h, inter)
    w13_t, w2_t = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()  # [in, out]

    # Each returns its outputs, so that torch.compile cannot drop the work as dead code.
    def plain() -> list[torch.Tensor]:  # three F.linear per expert
        return [F.linear(F.silu(F.linear(x[e], w1[e])) * F.linear(x[e], w3[e]), w2[e]) for e in range(active)]

    def ours() -> list[torch.Tensor]:  # latentserve's `linear` (layout picked by row count and threads)
        return [policy_linear(F.silu(policy_linear(x[e], w1[e])) * policy_linear(x[e], w3[e]), w2[e])
                for e in range(active)]

    def fused() -> list[torch.Tensor]:  # gate and up as one GEMM
        out = []
        for e in range(active):
            gate, up = F.linear(x[e], w13[e]).chunk(2, dim=-1)
            out.append(F.linear(F.silu(gate) * up, w2[e]))
        return out

    def transposed() -> list[torch.Tensor]:  # weights stored [in, out]: x @ W
        out = []
        for e in range(active):
            gate, up = (x[e] @ w13_t[e]).chunk(2, dim=-1)
            out.append((F.silu(gate) * up) @ w2_t[e])
        return out

    def batched() -> torch.Tensor:  # every expert in one bmm (tokens padded to the same count)
        gate, up = torch.bmm(x, w13_t).chunk(2, dim=-1)
        return torch.bmm(F.silu(gate) * up, w2_t)

    offsets = torch.arange(1, active + 1, dtype=torch.int32) * rows
    flat = x.reshape(-1, h)

    def grouped() -> torch.Tensor:  # torch._grouped_mm over the experts' token groups
        gate, up = torch._grouped_mm(flat, w13_t, offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2_t, offs=offsets)

    variants = {"plain F.linear x3": plain, "latentserve linear x3": ours, "fused gate_up": fused, "[in, out] layout": transposed,
                "padded bmm": batched, "torch._grouped_mm": grouped}
    if compile_too:
        variants["torch.compile(plain)"] = torch.compile(plain)
    times = {}
    for name, fn in variants.items():
        try:
            times[name] = best_time(fn, repeats=7, warmup=2)
        except (RuntimeError, NotImplementedError) as e:
            print(f"{name}: not available ({str(e).splitlines()[0][:80]})")
    return times


def read_bandwidth(num_bytes: int = 512 << 20) -> float:
    """Bytes per second read by a reduction over a buffer much larger than the caches."""
    src = torch.empty(num_bytes // 4).normal_()
    return num_bytes / best_time(lambda: src.sum(), repeats=5)


def print_tables(
    c: dict, prompt_len: int, results: dict[int, tuple[RunResult, RunResult, Floors]], bandwidth: float,
    compile_too: bool,
) -> None:
    params = sum(g.weight_bytes for g in step_gemms(c, 1 << 20, 1, decode=False)) // 4
    print(f"\nmodel: ~{params / 1e6:.0f}M weight-GEMM parameters, {c['num_hidden_layers']} layers, hidden "
          f"{c['hidden_size']}, {c['n_routed_experts']} experts top-{c['num_experts_per_tok']}; prompt {prompt_len}; "
          f"read bandwidth {bandwidth / 1e9:.1f} GB/s; {torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}")

    print("\n## Prefill (all prompts of the batch)")
    print("| batch | latentserve tok/s | transformers tok/s | ratio | GEMM-only tok/s | latentserve / GEMM rate |")
    print("|---|---|---|---|---|---|")
    for batch, (ls, hf, floors) in results.items():
        tokens = batch * prompt_len
        gemm_s = floors.prefill_s
        print(f"| {batch} | {tokens / ls.prefill_s:,.0f} | {tokens / hf.prefill_s:,.0f} | "
              f"{hf.prefill_s / ls.prefill_s:.2f}x | {tokens / gemm_s:,.0f} | {gemm_s / ls.prefill_s:.0%} |")

    print("\n## Decode (one token per request per step, context ~prompt)")
    print("| batch | latentserve ms/step | tok/s | transformers ms/step | tok/s | speedup | GEMM floor ms "
          "| step / GEMM floor | bandwidth floor ms | step / bw floor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, (ls, hf, floors) in results.items():
        floor = floors.decode_s
        stream = sum(g.weight_bytes for g in step_gemms(c, batch, batch, decode=True)) / bandwidth
        print(f"| {batch} | {ls.decode_step_s * 1e3:.1f} | {batch / ls.decode_step_s:,.0f} | "
              f"{hf.decode_step_s * 1e3:.1f} | {batch / hf.decode_step_s:,.0f} | "
              f"{hf.decode_step_s / ls.decode_step_s:.2f}x | {floor * 1e3:.1f} | {ls.decode_step_s / floor:.2f}x | "
              f"{stream * 1e3:.1f} | {ls.decode_step_s / stream:.2f}x |")

    print("\n## Linear layouts: the decode step's GEMMs as F.linear (x @ Wᵀ) and as latentserve's `linear` (with "
          f"several threads, fp32: {SPLIT_ROWS} rows as a bmm over row blocks of W, the others up to "
          f"{max(SKINNY_ROWS[torch.float32])} as (W @ xᵀ)ᵀ)")
    print("| batch | F.linear ms | latentserve linear ms | speedup |")
    print("|---|---|---|---|")
    for batch, (_, _, floors) in results.items():
        plain, ours = floors.decode_s, floors.decode_linear_s
        print(f"| {batch} | {plain * 1e3:.1f} | {ours * 1e3:.1f} | {plain / ours:.2f}x |")

    ls, hf, _ = next(iter(results.values()))
    minimum = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 4
    heads = c["num_attention_heads"]
    expanded = heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * 4
    print("\n## KV cache (fp32), bytes per token per layer")
    print("transformers 5 caches the latent too (keys = c_kv, values = k_pe) and re-expands it every step; "
          "expanded K/V is what a per-head cache would hold.")
    print("| latentserve | transformers | (kv_lora_rank + rope) x 4 | latentserve exact? | expanded K/V | "
          "expanded / latentserve |")
    print("|---|---|---|---|---|---|")
    print(f"| {ls.kv_bytes_per_token_layer:,.0f} | {hf.kv_bytes_per_token_layer:,.0f} | {minimum} | "
          f"{ls.kv_bytes_per_token_layer == minimum} | {expanded:,} | {expanded / ls.kv_bytes_per_token_layer:.1f}x |")

    print("\n## Routed experts of one MoE layer at the decode batches, same math written several ways (ms)")
    times = {batch: expert_formulations(c, batch, compile_too) for batch in results}
    names = list(next(iter(times.values())))
    print("| batch | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for batch, row in times.items():
        print(f"| {batch} | " + " | ".join(f"{row[n] * 1e3:.2f}" if n in row else "-" for n in names) + " |")

    print("\n## Load and agreement")
    print("| batch | latentserve load s | transformers load s | greedy tokens equal |")
    print("|---|---|---|---|")
    for batch, (ls, hf, _) in results.items():
        same = sum(a == b for x, y in zip(ls.tokens, hf.tokens) for a, b in zip(x, y))
        total = sum(len(x) for x in ls.tokens)
        print(f"| {batch} | {ls.load_s:.2f} | {hf.load_s:.2f} | {same}/{total} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a tiny model and short prompts: a smoke run")
    parser.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (default 1 8 32)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default 512)")
    parser.add_argument("--new-tokens", type=int, help="generated tokens per request (default 17)")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile on the experts (slow)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side per batch, alternating; the "
                                                               "fastest timings count (default 2)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    c = QUICK if args.quick else FULL
    batches = args.batches or ([1, 4] if args.quick else [1, 8, 32])
    prompt_len = args.prompt_len or (32 if args.quick else 512)
    new_tokens = args.new_tokens or (5 if args.quick else 17)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        make_checkpoint(model_dir, c)
        # Untimed: first calls pay one-time costs (allocator, BLAS and oneDNN setup) that neither side should carry.
        warm = torch.randint(0, c["vocab_size"], (1, 16), generator=g).tolist()
        run_latentserve(model_dir, warm, 3)
        run_transformers(model_dir, warm, 3)
        for batch in batches:
            prompts = torch.randint(0, c["vocab_size"], (batch, prompt_len), generator=g).tolist()
            # The floors are timed between the two sides, in every repeat: each figure sees the same machine.
            runs = [(run_latentserve(model_dir, prompts, new_tokens), measure_floors(c, prompt_len, batch),
                     run_transformers(model_dir, prompts, new_tokens)) for _ in range(args.repeats)]
            floors = Floors(*(min(getattr(f, name) for _, f, _ in runs) for name in Floors.__dataclass_fields__))
            results[batch] = (fastest([ls for ls, _, _ in runs]), fastest([hf for _, _, hf in runs]), floors)
            print(f"batch {batch} done", flush=True)
    print_tables(c, prompt_len, results, read_bandwidth(64 << 20 if args.quick else 512 << 20),
                 args.compile)


if __name__ == "__main__":
    main()
