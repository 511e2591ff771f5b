"""Where a decode step's time goes: step time, its weight GEMMs alone (weights streamed), attention alone, the rest.

Per model, batch (1, 8, 32) and context (512, 4096): the engine's median decode step (scheduler, runner,
model, sampler); the step's weight GEMMs alone with latentserve's `linear` at the step's shapes (routed
experts each seeing their even share of the tokens), every product on its own weight and the set cycled
over copies of at least 512 MiB so that no weight is cache-hot, as in the real step; the decode attention
backend alone over the same paged caches and metadata, for every layer; and the remainder. Contexts are
written straight into the KV cache (random latents) instead of being prefilled: a 32 x 4096 prefill
would take minutes here and changes nothing in a decode step.
Models: the ~94M-parameter DeepSeek-V3-shaped config of `benchmarks/vs_transformers.py`, and a
DeepSeek-V2-Lite-shaped one cut to 2 layers (one dense, one with 64 routed experts top-6) and a 32k vocab.
Each case is measured `--repeats` times and each figure's fastest counts. The model runs at `--dtype` (default
float32, the precision llama.cpp's F32 runs; the GEMMs alone at the same dtype). `--clock cpu` times everything by
the calling thread's CPU time instead of wall time (1 torch thread only): on a shared machine it leaves out the
time the process waits descheduled, which wall time charges to whichever op was running.
Run: `.venv/bin/python benchmarks/step.py [--quick] [--threads 2] [--models v3-94m v2-lite] [--clock cpu]`.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import policy_linear  # noqa: E402
from benchmarks.vs_transformers import FULL, QUICK, Gemm, make_checkpoint, step_gemms  # noqa: E402
from latentserve import LLM, SamplingParams  # noqa: E402
from latentserve.attention.decode.paged import PagedMQADecodeBackend  # noqa: E402
from latentserve.attention.decode.torch_mqa import TorchMQADecodeBackend  # noqa: E402
from latentserve.attention.metadata import CommonAttentionMetadata, MLADecodeMetadata  # noqa: E402
from latentserve.engine.input_buffers import InputBuffers  # noqa: E402
from latentserve.engine.model_runner import ModelRunnerOutput  # noqa: E402
from latentserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput  # noqa: E402

V2_LITE = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=2,
    num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
    n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=8192,
)
STREAM_BYTES = 512 << 20
clock = time.perf_counter  # or time.thread_time under --clock cpu


def best_time(fn, repeats: int = 5, warmup: int = 1) -> float:
    """Fastest of `repeats` runs of `fn` by `clock`, in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def time_streamed_gemms(gemms: list[Gemm], dtype: torch.dtype) -> float:
    """Seconds for every GEMM once at `dtype`, weights cycled over enough copies that none is in cache when used."""
    step_bytes = sum(g.weight_bytes for g in gemms) * dtype.itemsize // 4
    copies = max(2, -(-STREAM_BYTES // step_bytes))
    sets = []
    for _ in range(copies):
        ops = []
        for g in gemms:
            if g.count > 1 and g.k * g.n < 1 << 16:  # the per-head absorbed matrices: one bmm
                ops.append((torch.bmm, torch.randn(g.count, g.rows, g.k, dtype=dtype),
                            torch.randn(g.count, g.k, g.n, dtype=dtype)))
            else:
                ops += [(policy_linear, torch.randn(g.rows, g.k, dtype=dtype), torch.randn(g.n, g.k, dtype=dtype))
                        for _ in range(g.count)]
        sets.append(ops)
    cycle = itertools.cycle(sets)

    def run() -> None:
        for fn, x, w in next(cycle):
            fn(x, w)

    return best_time(run, repeats=max(5, copies), warmup=copies)


def fill_contexts(llm: LLM, batch: int, context: int) -> list[str]:
    """Requests with `context` tokens already 'computed': prefill steps skip the model, caches hold noise.

    They may generate up to max_model_len (early ones decode while later ones fill): abort them when done.
    """
    engine = llm.engine
    params = SamplingParams(max_tokens=engine.max_model_len - context, ignore_eos=True)
    g = torch.Generator().manual_seed(batch * 7919 + context)
    vocab = engine.model.config.vocab_size
    ids = [engine.add_request(torch.randint(0, vocab, (context,), generator=g).tolist(), params)
           for _ in range(batch)]

    def skip_model(out):  # the first token comes from here; the KV cache already holds noise
        n = len(out.sampling_requests)
        return ModelRunnerOutput([0] * n, [None] * n, {}, 1)

    runner = engine.runner
    runner.execute_model = skip_model
    try:
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()
    finally:
        del runner.execute_model
    for cache in runner.kv_caches.values():
        cache.normal_(generator=g)
    return ids


def decode_metadata(llm: LLM) -> CommonAttentionMetadata:
    """The metadata of the next decode step of the running requests."""
    running = llm.engine.scheduler.running
    width = max(len(r.block_ids) for r in running)
    table = torch.zeros(len(running), width, dtype=torch.int32)
    for i, r in enumerate(running):
        table[i, : len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
    block_size = llm.engine.runner.attn_config.block_size
    # The next token's position, within the blocks the request holds (the scheduler adds a block when it decodes).
    seq_lens = [min(r.num_computed_tokens + 1, len(r.block_ids) * block_size) for r in running]
    slots = torch.zeros(len(running), dtype=torch.long)  # unused: attention alone writes nothing
    return CommonAttentionMetadata.from_lists([1] * len(running), seq_lens, table, slots)


def time_attention(llm: LLM, repeats: int = 7) -> tuple[float, float]:
    """Seconds of decode attention over every layer's cache for the running batch, with the engine's backend and
    with TORCH, alternating run by run (fastest of `repeats` each; a backend's per-step plan is included)."""
    engine = llm.engine
    builder = engine.runner.builders[0]
    common = decode_metadata(llm)
    layers = list(engine.model.static_forward_context.values())
    m = engine.model.mla_config
    q = torch.randn(common.num_reqs, m.num_heads, m.kv_cache_dim, dtype=layers[0].kv_cache.dtype)
    torch_backends = [TorchMQADecodeBackend(m.num_heads, layer.scale, m.kv_lora_rank, m.qk_rope_head_dim)
                      for layer in layers]

    def run(backends) -> float:
        start = clock()
        md = builder.build(common).decode  # fresh each time, as in a step
        for layer, backend in zip(layers, backends):
            backend.forward(q, layer.kv_cache, md)
        return clock() - start

    ours = [layer.decode_backend for layer in layers]
    run(ours), run(torch_backends)
    times = [(run(ours), run(torch_backends)) for _ in range(repeats)]
    return min(t[0] for t in times), min(t[1] for t in times)


def measure(llm: LLM, c: dict, batch: int, context: int, steps: int) -> dict[str, float]:
    engine = llm.engine
    ids = fill_contexts(llm, batch, context)
    times = []
    for i in range(steps):
        start = clock()
        engine.step()
        if i >= 2:  # the first steps after a batch change pay one-time costs
            times.append(clock() - start)
    assert len(engine.scheduler.running) == batch
    attention, attention_torch = time_attention(llm)
    for request_id in ids:
        engine.abort_request(request_id)
    # The fastest step, like every other figure here: other tenants of the machine only ever slow one down.
    products = step_gemms(c, batch, batch, decode=True)
    gemms = time_streamed_gemms(products, engine.model.lm_head.weight.dtype)
    return dict(step=min(times), gemms=gemms, attention=attention,
                attention_torch=attention_torch)


def time_input_preparation(batch: int, context: int, block_size: int = 16) -> tuple[float, float]:
    """Seconds to turn one decode step's schedule into model inputs: built from lists, and in persistent buffers."""
    num_blocks = -(-(context + 1) // block_size)
    scheduled = [ScheduledRequest(None, context, 1, [5], [r * num_blocks * block_size + context],
                                  list(range(r * num_blocks, (r + 1) * num_blocks)), True) for r in range(batch)]
    out = SchedulerOutput(scheduled, num_decodes=batch)

    def from_lists() -> None:  # what the runner did before it kept buffers
        out.common_attention_metadata()
        torch.tensor(out.input_ids, dtype=torch.long)
        torch.tensor(out.positions, dtype=torch.long)
        torch.tensor(out.logits_indices, dtype=torch.long)

    buffers = InputBuffers()
    return (best_time(from_lists, repeats=200, warmup=5),
            best_time(lambda: buffers.prepare(out), repeats=200, warmup=5))


def print_input_preparation(batches: list[int], contexts: list[int]) -> None:
    print("\n## Step input preparation (schedule -> input ids, positions, attention metadata), µs")
    print("| batch | context | from lists | persistent buffers | speedup |")
    print("|---|---|---|---|---|")
    for context, batch in itertools.product(contexts, batches):
        old, new = time_input_preparation(batch, context)
        print(f"| {batch} | {context} | {old * 1e6:.0f} | {new * 1e6:.0f} | {old / new:.1f}x |")


def compare_backends_alone(repeats: int = 9) -> None:
    """PAGED against TORCH on one layer's cache where every request's blocks form one run, alternating calls."""
    print("\n## Decode attention alone, one block run per request (one layer), ms")
    print("| heads x (latent + rope) | batch | context | TORCH | PAGED | PAGED speedup |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for heads, latent, rope in [(16, 256, 32), (16, 512, 64)]:
        for batch, context in [(1, 512), (8, 512), (32, 512), (1, 4096), (8, 4096)]:
            blocks = -(-context // 16)
            cache = torch.randn(batch * blocks, 16, latent + rope, generator=g)
            table = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
            seq_lens = torch.full((batch,), context, dtype=torch.int32)
            q = torch.randn(batch, heads, latent + rope, generator=g)
            backends = [cls(heads, 0.1, latent, rope) for cls in (TorchMQADecodeBackend, PagedMQADecodeBackend)]

            def run(backend) -> float:
                start = time.perf_counter()
                md = MLADecodeMetadata(table, seq_lens, torch.arange(batch + 1, dtype=torch.int32), 1, context)
                backend.forward(q, cache, md)
                return time.perf_counter() - start

            times = [[run(b) for b in backends] for _ in range(repeats + 1)][1:]
            ours, paged = (min(t[i] for t in times) for i in range(2))
            print(f"| {heads} x ({latent} + {rope}) | {batch} | {context} | {ours * 1e3:.2f} | {paged * 1e3:.2f} | "
                  f"{ours / paged:.2f}x |", flush=True)


def cpu_description() -> str:
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    wanted = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16"]
    have = [w for w in wanted if f" {w}" in flags]
    return (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, flags: {' '.join(have) or 'n/a'}, "
            f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads")


def run_model(
    name: str, c: dict, batches: list[int], contexts: list[int], steps: int, block_size: int, repeats: int,
    dtype: str = "float32",
) -> None:
    max_len = max(contexts) + 64  # room for the steps and the early requests' decodes while others fill
    blocks = max(batches) * -(-max_len // block_size) + 8
    c = dict(c, max_position_embeddings=max(c["max_position_embeddings"], max_len))
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), c)
        llm = LLM(model=tmp, max_num_seqs=max(batches), max_model_len=max_len, num_kv_blocks=blocks,
                  block_size=block_size, enable_prefix_caching=False, max_num_batched_tokens=8192, dtype=dtype)
    backend = type(next(iter(llm.engine.model.static_forward_context.values())).decode_backend).get_name()
    print(f"\n## {name}: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['n_routed_experts']} "
          f"experts top-{c['num_experts_per_tok']}; {dtype}; decode backend {backend}; {clock.__name__}; "
          f"load {os.getloadavg()[0]:.2f}")
    print("| batch | context | step ms | tok/s | weight GEMMs ms (streamed) | attention ms | remainder ms "
          "| GEMMs | attention | remainder | attention TORCH ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for context, batch in itertools.product(contexts, batches):
        runs = [measure(llm, c, batch, context, steps) for _ in range(repeats)]
        r = {key: min(run[key] for run in runs) for key in runs[0]}
        rest = r["step"] - r["gemms"] - r["attention"]
        print(f"| {batch} | {context} | {r['step'] * 1e3:.1f} | {batch / r['step']:,.0f} | {r['gemms'] * 1e3:.1f} | "
              f"{r['attention'] * 1e3:.2f} | {rest * 1e3:.1f} | {r['gemms'] / r['step']:.0%} | "
              f"{r['attention'] / r['step']:.0%} | {rest / r['step']:.0%} | {r['attention_torch'] * 1e3:.2f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny model, short contexts: a smoke run")
    parser.add_argument("--models", nargs="+", choices=["v3-94m", "v2-lite"], default=["v3-94m", "v2-lite"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--steps", type=int, default=8, help="decode steps per case (the first 2 untimed)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--attention-only", action="store_true",
                        help="only PAGED against TORCH on a synthetic cache (V3 and V2-Lite head dims)")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each case; each figure's fastest "
                                                               "counts (default 2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="cpu: the thread's CPU time (needs --threads 1)")
    args = parser.parse_args()
    if args.clock == "cpu":
        if args.threads != 1:
            parser.error("--clock cpu needs --threads 1 (other threads' work is not the calling thread's time)")
        global clock
        clock = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 4:
        parser.error("--steps must be at least 4 (2 untimed, 2 timed)")
    print(f"torch {torch.__version__}; {cpu_description()}")
    if args.attention_only:
        compare_backends_alone()
        return
    if args.quick:
        print_input_preparation([1, 4], [32, 64])
        run_model("quick V3-shaped", QUICK, [1, 4], [32, 64], args.steps, 16, args.repeats, args.dtype)
        return
    print_input_preparation(args.batches, args.contexts)
    models = {"v3-94m": ("DeepSeek-V3-shaped ~94M (vs_transformers FULL)", FULL),
              "v2-lite": ("V2-Lite-shaped", V2_LITE)}
    for key in args.models:
        run_model(*models[key], args.batches, args.contexts, args.steps, 16, args.repeats, args.dtype)


if __name__ == "__main__":
    main()
