"""MLA attention throughput: prefill tokens/s and decode step time, fast backends beside the references.

Decode also reports the bytes/s it achieves reading the latent cache, as a ratio of the copy
bandwidth measured in the same run. DeepSeek-V2-Lite head dims (16 heads, L=512, R=64, P=V=128).
`--decode-backends` times the decode backends alone (no layer around them: NATIVE, latentserve's C kernel, beside
the torch ones) in bf16 and fp32 on the engine's block layout, calls alternating, CPU time of this thread (other tenants of a busy machine
only add wall time): what the decode selector's choices rest on. `--prefill-backends` times the prefill backends
alone (NATIVE beside TORCH_SDPA: one request's causal attention at DeepSeek's head dims, q and k 192, v 128 a view
of kv_b's rows, as the layer hands them), bf16 and fp32, calls alternating, wall time on the process's threads.
Run: `.venv/bin/python benchmarks/attention.py [--quick] [--decode-backends | --prefill-backends]`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import best_time, copy_bandwidth  # noqa: E402
from latentserve.attention.builder import MLAMetadataBuilder  # noqa: E402
from latentserve.attention.decode.registry import MLADecodeBackendEnum  # noqa: E402
from latentserve.attention.kv_cache import allocate_kv_caches, slots_for_positions  # noqa: E402
from latentserve.attention.metadata import CommonAttentionMetadata, MLADecodeMetadata  # noqa: E402
from latentserve.attention.mla import MLAAttention  # noqa: E402
from latentserve.attention.prefill.registry import MLAPrefillBackendEnum  # noqa: E402
from latentserve.config import AttentionConfig, MLAConfig  # noqa: E402
from latentserve.engine.cpu_malloc import keep_freed_memory  # noqa: E402
from latentserve.forward_context import ForwardContext, StaticForwardContext, set_forward_context  # noqa: E402

MLA = MLAConfig(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
BLOCK = 64


def make_runner(prefill: str, decode: str, query_lens: list[int], seq_lens: list[int]):
    config = AttentionConfig(block_size=BLOCK, prefill_backend=prefill, decode_backend=decode, workspace_tokens=8192)
    static_ctx = StaticForwardContext()
    layer = MLAAttention("bench", MLA, MLA.qk_head_dim**-0.5, config, static_ctx)
    layer.process_weights_after_loading()
    blocks = [-(-s // BLOCK) for s in seq_lens]
    cache = allocate_kv_caches(static_ctx, sum(blocks), BLOCK, torch.float32)["bench"]
    cache.normal_()
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = torch.randperm(n) + start
        start += n
    slots = torch.cat([
        slots_for_positions(table[r], torch.arange(s - q, s), BLOCK) for r, (q, s) in enumerate(zip(query_lens, seq_lens))
    ])
    common = CommonAttentionMetadata.from_lists(query_lens, seq_lens, table, slots)
    md = MLAMetadataBuilder(["bench"], static_ctx, config).build(common)
    t = common.num_actual_tokens
    q = torch.randn(t, MLA.num_heads, MLA.qk_head_dim)
    kv_c, k_pe = torch.randn(t, MLA.kv_lora_rank), torch.randn(t, MLA.qk_rope_head_dim)

    def run():
        with torch.no_grad(), set_forward_context(ForwardContext({"bench": md})):
            layer(q, kv_c, k_pe)

    return run


def bench_prefill(cases: list[tuple[int, int]]) -> None:
    print("\n## Prefill (batch x new tokens, no context): tokens/s")
    print("| batch | tokens | TORCH_SDPA tok/s | REFERENCE tok/s | ratio |")
    print("|---|---|---|---|---|")
    for batch, length in cases:
        lens = [length] * batch
        fast = best_time(make_runner("TORCH_SDPA", "TORCH", lens, lens), repeats=3)
        ref = best_time(make_runner("REFERENCE", "TORCH", lens, lens), repeats=3)
        tokens = batch * length
        print(f"| {batch} | {length} | {tokens / fast:,.0f} | {tokens / ref:,.0f} | {ref / fast:.2f}x |")


def bench_decode(cases: list[tuple[int, int]], bandwidth: float) -> None:
    print(f"\n## Decode (one token per request over a cached context); copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| batch | context | TORCH step ms | REFERENCE step ms | speedup | cache read GB/s | of copy bw |")
    print("|---|---|---|---|---|---|---|")
    for batch, context in cases:
        q_lens, s_lens = [1] * batch, [context + 1] * batch
        fast = best_time(make_runner("TORCH_SDPA", "TORCH", q_lens, s_lens))
        ref = best_time(make_runner("TORCH_SDPA", "REFERENCE", q_lens, s_lens), repeats=2)
        cache_bytes = batch * (context + 1) * MLA.kv_cache_dim * 4
        rate = cache_bytes / fast
        print(f"| {batch} | {context} | {fast * 1e3:.2f} | {ref * 1e3:.2f} | {ref / fast:.1f}x "
              f"| {rate / 1e9:.2f} | {rate / bandwidth:.0%} |")


def engine_layout(batch: int, context: int, block_size: int = 16) -> torch.Tensor:
    """Block table as the engine leaves it after a few batches: each request's context in one run of blocks,
    its newest block apart from it (allocated after the other requests' runs)."""
    seq_len = context + 1
    blocks, run = -(-seq_len // block_size), context // block_size
    table = torch.empty(batch, blocks, dtype=torch.int32)
    for r in range(batch):
        table[r, :run] = torch.arange(r * run, (r + 1) * run)
        table[r, run:] = torch.arange(batch * run + r * (blocks - run), batch * run + (r + 1) * (blocks - run))
    return table


def bench_decode_backends(cases: list[tuple[int, int]], layers: int = 8, repeats: int = 9) -> None:
    """Each decode backend alone over `layers` layers, each with its own cache (V3-94M dims), ms."""
    keep_freed_memory()  # as the engine does: gather buffers reuse warm pages
    heads, latent, rope = 16, 256, 32
    names = ["NATIVE", "TORCH", "PAGED", "PAGED in place", "REFERENCE"]
    if MLADecodeBackendEnum.NATIVE.get_class().unavailable_reason() is not None:
        names.remove("NATIVE")
    print(f"\n## Decode backends alone: {heads} heads x ({latent} + {rope}), block 16, {layers} layers, ms "
          f"(thread CPU time, fastest of {repeats}); REFERENCE (a per-token loop) up to 8 x 512 only")
    print("| dtype | batch | context | " + " | ".join(names) + " | TORCH vs PAGED in place | PAGED vs NATIVE |")
    print("|---|---|---|" + "---|" * (len(names) + 2))
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for batch, context in cases:
            table = engine_layout(batch, context)
            # One cache per layer, as in the model: a layer's latents are not in the CPU cache when it runs.
            caches = [torch.randn(int(table.max()) + 1, 16, latent + rope, generator=g).to(dtype) for _ in range(layers)]
            q = torch.randn(batch, heads, latent + rope, generator=g).to(dtype)
            backends = {n: MLADecodeBackendEnum.lookup(n.split()[0]).get_class()(heads, 0.1, latent, rope) for n in names}
            backends["PAGED in place"].max_in_place_requests = batch  # what PAGED did with every batch before
            if batch * context > 8 * 512:
                del backends["REFERENCE"]

            def run(backend) -> float:
                start = time.thread_time()
                md = MLADecodeMetadata(table, torch.full((batch,), context + 1, dtype=torch.int32),
                                       torch.arange(batch + 1, dtype=torch.int32), 1, context + 1)
                for cache in caches:  # the first layer makes the step's plan, the others reuse it
                    backend.forward(q, cache, md)
                return time.thread_time() - start

            times = {n: [] for n in backends}
            for i in range(repeats + 1):
                for n, b in backends.items():
                    t = run(b)
                    if i:
                        times[n].append(t)
            best = {n: min(t) * 1e3 for n, t in times.items()}
            cells = " | ".join(f"{best[n]:.2f}" if n in best else "−" for n in names)
            native = f"{best['PAGED'] / best['NATIVE']:.2f}x" if "NATIVE" in best else "−"
            print(f"| {str(dtype).removeprefix('torch.')} | {batch} | {context} | {cells} | "
                  f"{best['PAGED in place'] / best['TORCH']:.2f}x | {native} |", flush=True)


def bench_prefill_backends(lengths: list[int], repeats: int) -> None:
    """NATIVE and TORCH_SDPA alone on one request of each length (16 heads, q and k 192, v 128), ms."""
    heads, nope, rope, v_dim = 16, 128, 64, 128
    names = [n for n in ("NATIVE", "TORCH_SDPA")
             if MLAPrefillBackendEnum.lookup(n).get_class().unavailable_reason() is None]
    print(f"\n## Prefill backends alone: {heads} heads, q and k {nope + rope}, v {v_dim}, causal, ms (wall, fastest "
          f"of {repeats}, calls alternating); G multiply-adds/s counts the causal half of both products")
    print("| dtype | tokens | " + " | ".join(names) + " | NATIVE G/s | TORCH_SDPA vs NATIVE |")
    print("|---|---|" + "---|" * (len(names) + 2))
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in lengths:
            q = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype)
            k = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype)
            v = torch.randn(tokens, heads, nope + v_dim, generator=g).to(dtype)[..., nope:]  # kv_b's value columns
            backends = {n: MLAPrefillBackendEnum.lookup(n).get_class()(heads, 0.07, 512, nope, rope, v_dim)
                        for n in names}
            times = {n: [] for n in names}
            for i in range(repeats + 1):
                for n, b in backends.items():
                    start = time.perf_counter()
                    b._attend(q, k, v, True, 0)
                    if i:
                        times[n].append(time.perf_counter() - start)
            best = {n: min(t) * 1e3 for n, t in times.items()}
            macs = heads * tokens * tokens / 2 * (nope + rope + v_dim)
            rate = f"{macs / best['NATIVE'] / 1e6:.0f}" if "NATIVE" in best else "−"
            ratio = f"{best['TORCH_SDPA'] / best['NATIVE']:.2f}x" if len(best) == 2 else "−"
            print(f"| {str(dtype).removeprefix('torch.')} | {tokens} | " + " | ".join(f"{best[n]:.1f}" for n in names)
                  + f" | {rate} | {ratio} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    parser.add_argument("--decode-backends", action="store_true", help="only the decode backends alone")
    parser.add_argument("--prefill-backends", action="store_true", help="only the prefill backends alone")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.decode_backends:
        torch.set_num_threads(1)  # the thread's CPU time is then the backends'
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.prefill_backends:
        bench_prefill_backends([128] if args.quick else [512, 1024, 2048, 4096], repeats=2 if args.quick else 5)
        return
    if args.decode_backends:
        cases = [(1, 64), (4, 64)] if args.quick else [(1, 512), (8, 512), (32, 512), (1, 4096), (2, 4096), (8, 4096)]
        bench_decode_backends(cases, repeats=2 if args.quick else 9)
        return
    if args.quick:
        bench_prefill([(1, 128)])
        bench_decode([(4, 512)], copy_bandwidth(64 << 20))
        return
    bench_prefill([(1, 512), (4, 512), (1, 2048)])
    bench_decode([(1, 1024), (8, 1024), (32, 1024), (1, 8192), (8, 4096), (32, 4096)], copy_bandwidth())


if __name__ == "__main__":
    main()
