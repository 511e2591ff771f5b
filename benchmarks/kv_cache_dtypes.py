"""The latent KV cache in bf16 against fp8 (e4m3, scale 1.0) and int8 (a scale per row part): decode attention's time
at a deep context, and the embedded model's prompt perplexity when its context is read back from the cache.

decode: one decode token per request attending `--context` cached positions through the NATIVE kernel
(kernels/mla_decode.c), DeepSeek's latent dims (L=512, R=64), bf16 queries, block 64; ms per call (per layer), fastest
of `--repeats` rounds, the cache dtypes timed in turn within each round (interleaved, so load on the machine hits
all). `--layers N` gives each call N layers' caches in turn, as a model's decode step reads them: with 1 the same
cache is read again and again and stays in the last-level cache once it fits there (4096 positions: 4.7 MB in bf16),
which a model of more layers never sees. `--clock thread` (with `--threads 1`) times the CPU time of the calling
thread, which the kernel runs on alone: unlike wall time it leaves out the time other processes took the core, so
ratios hold on a busy machine.
perplexity: the embedded model (bf16 compute) scores a KJV passage with chunked prefill of `--chunk` tokens a step,
so every chunk after the first attends the cache's (quantized) latents; exp(mean negative log-likelihood).
Run: `.venv/bin/python benchmarks/kv_cache_dtypes.py [--context 4096] [--repeats 7] [--threads N] [--layers N]
[--clock thread] [--shapes 16x1,128x1]`.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latentserve import LLM, SamplingParams  # noqa: E402
from latentserve.attention.decode.native import NativeMQADecodeBackend  # noqa: E402
from latentserve.attention.kv_cache import quantize_int8_rows  # noqa: E402
from latentserve.attention.metadata import MLADecodeMetadata  # noqa: E402

LATENT, ROPE, BLOCK = 512, 64, 64
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
# Genesis 1:1-13, King James Version (public domain).
PASSAGE = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; and darkness "
    "was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God said, Let there "
    "be light: and there was light. And God saw the light, that it was good: and God divided the light from the "
    "darkness. And God called the light Day, and the darkness he called Night. And the evening and the morning were "
    "the first day. And God said, Let there be a firmament in the midst of the waters, and let it divide the waters "
    "from the waters. And God made the firmament, and divided the waters which were under the firmament from the "
    "waters which were above the firmament: and it was so. And God called the firmament Heaven. And the evening and "
    "the morning were the second day. And God said, Let the waters under the heaven be gathered together unto one "
    "place, and let the dry land appear: and it was so. And God called the dry land Earth; and the gathering "
    "together of the waters called he Seas: and God saw that it was good. And God said, Let the earth bring forth "
    "grass, the herb yielding seed, and the fruit tree yielding fruit after his kind, whose seed is in itself, upon "
    "the earth: and it was so. And the earth brought forth grass, and herb yielding seed after his kind, and the "
    "tree yielding fruit, whose seed was in itself, after his kind: and God saw that it was good. And the evening "
    "and the morning were the third day."
)


def decode_case(dtype: torch.dtype, heads: int, batch: int, context: int, layers: int = 1):
    """A callable running one decode step of `batch` requests over `context` positions each, through `layers` layers'
    caches."""
    steps = [_decode_layer(dtype, heads, batch, context, seed) for seed in range(layers)]
    return lambda: [step() for step in steps]


def _decode_layer(dtype: torch.dtype, heads: int, batch: int, context: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // BLOCK)
    cache = torch.randn(batch * blocks, BLOCK, LATENT + ROPE, generator=g) * 0.5
    if dtype == torch.int8:
        cache = quantize_int8_rows(cache[..., :LATENT].flatten(0, 1), cache[..., LATENT:].flatten(0, 1))
        cache = cache.view(batch * blocks, BLOCK, -1)
    cache = cache.to(dtype)
    table = torch.randperm(batch * blocks, generator=g).view(batch, blocks).int()
    md = MLADecodeMetadata(block_table=table, seq_lens=torch.full((batch,), context, dtype=torch.int32),
                           query_start_loc=torch.arange(batch + 1, dtype=torch.int32), max_query_len=1,
                           max_seq_len=context)
    q = torch.randn(batch, heads, LATENT + ROPE, generator=g).bfloat16()
    backend = NativeMQADecodeBackend(heads, (192) ** -0.5, LATENT, ROPE)
    assert backend.runs_natively(cache)
    return lambda: backend.forward(q, cache, md)


def time_decode(args) -> None:
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    print(f"decode attention, {args.context} positions, {torch.get_num_threads()} threads, {args.layers} layers' "
          f"caches, {args.clock} ms per layer (fastest of {args.repeats})")
    print("| heads x requests | bf16 cache | fp8 cache | int8 cache | fp8 / bf16 | int8 / bf16 |")
    print("|---|---|---|---|---|---|")
    for heads, batch in args.shapes:
        cases = {name: decode_case(dtype, heads, batch, args.context, args.layers) for name, dtype in DTYPES.items()}
        best = {name: math.inf for name in cases}
        for _ in range(args.repeats):
            for name, step in cases.items():
                step()
                start = clock()
                for _ in range(args.calls):
                    step()
                best[name] = min(best[name], (clock() - start) / args.calls / args.layers * 1e3)
        print(f"| {heads} x {batch} | {best['bf16']:.3f} | {best['fp8']:.3f} | {best['int8']:.3f} "
              f"| {best['fp8'] / best['bf16']:.2f} | {best['int8'] / best['bf16']:.2f} |")


def perplexity(args) -> None:
    print(f"embedded model, prompt perplexity over {args.chunk}-token prefill chunks")
    results = {}
    for name in ("bfloat16", "fp8", "int8"):
        llm = LLM(kv_cache_dtype=name, max_num_batched_tokens=args.chunk, enable_prefix_caching=False)
        out = llm.generate([PASSAGE], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        logprobs = [out.prompt_logprobs[p][t].logprob for p, t in enumerate(out.prompt_token_ids) if p > 0]
        results[name] = math.exp(-sum(logprobs) / len(logprobs))
        print(f"{name} cache: {len(logprobs)} tokens, perplexity {results[name]:.4f}")
    for name in ("fp8", "int8"):
        print(f"{name} / bf16: {results[name] / results['bfloat16']:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument("--shapes", default="16x1,16x8,16x32,128x1", help="heads x requests, comma-separated")
    parser.add_argument("--skip-perplexity", action="store_true")
    args = parser.parse_args()
    try:
        args.shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes {args.shapes!r}: want HEADSxREQUESTS, comma-separated (e.g. 16x1,128x1)")
    if any(len(shape) != 2 or min(shape) < 1 for shape in args.shapes):
        parser.error(f"--shapes {args.shapes}: each must be two positive integers, HEADSxREQUESTS")
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread times the calling thread alone: it needs --threads 1")
    torch.set_num_threads(args.threads)
    time_decode(args)
    if not args.skip_perplexity:
        perplexity(args)


if __name__ == "__main__":
    main()
