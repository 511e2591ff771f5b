"""DSA decode against dense MLA decode, side by side: the sparse attention reads each token's top-k rows, so its
cost is flat in the context once the context passes top-k; the indexer that picks them reads every position's
key (one head of `index_head_dim`), and grows with the context at a fraction of dense attention's cost.

One decode token per request over a cached context, DeepSeek-V3.2's attention dims (128 heads, L=512, R=64) and
indexer (64 heads of 128, top-k 2048), fp32, block 64, one thread. Columns, ms of this thread's CPU time per layer
step (other tenants of a busy machine only add wall time; fastest of `--repeats`, the variants timed in turn within
each repeat): dense = `MLAAttention` with the decode backend the selector picks; DSA =
`SparseMLAAttention` (indexer + sparse attention); of which the sparse attention alone, given the selection, and
the indexer alone.
Run: `.venv/bin/python benchmarks/dsa_decode.py [--quick]`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latentserve.attention.builder import MLAMetadataBuilder  # noqa: E402
from latentserve.attention.dsa.indexer import Indexer, IndexerConfig, IndexerInputs  # noqa: E402
from latentserve.attention.dsa.layer import INDEXER_CACHE, SparseMLAAttention  # noqa: E402
from latentserve.attention.dsa.sparse import sparse_mla_attention  # noqa: E402
from latentserve.attention.kv_cache import allocate_kv_caches, slots_for_positions  # noqa: E402
from latentserve.attention.metadata import CommonAttentionMetadata  # noqa: E402
from latentserve.attention.mla import MLAAttention  # noqa: E402
from latentserve.config import AttentionConfig, MLAConfig  # noqa: E402
from latentserve.forward_context import ForwardContext, StaticForwardContext, set_forward_context  # noqa: E402
from latentserve.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402

MLA = MLAConfig(num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
HIDDEN, Q_LORA, BLOCK = 7168, 1536, 64


def make_case(batch: int, context: int, topk: int):
    """(dense step, DSA step, sparse attention alone, indexer alone), each a callable running one decode step."""
    config = AttentionConfig(block_size=BLOCK, workspace_tokens=max(8192, topk))
    static_ctx = StaticForwardContext()
    scale = MLA.qk_head_dim**-0.5
    dense = MLAAttention("dense", MLA, scale, config, static_ctx)
    indexer = Indexer(IndexerConfig(HIDDEN, Q_LORA, 64, 128, MLA.qk_rope_head_dim, topk, False), RopeConfig())
    sparse = SparseMLAAttention("dsa", MLA, scale, config, static_ctx, topk, indexer)
    for layer in (dense, sparse):
        layer.process_weights_after_loading()
    seq = context + 1
    blocks = -(-seq // BLOCK)
    caches = allocate_kv_caches(static_ctx, batch * blocks, BLOCK, torch.float32)
    for cache in caches.values():
        cache.normal_()
    table = torch.randperm(batch * blocks).view(batch, blocks).int()
    slots = torch.cat([slots_for_positions(table[r], torch.tensor([context]), BLOCK) for r in range(batch)])
    common = CommonAttentionMetadata.from_lists([1] * batch, [seq] * batch, table, slots)
    builder = MLAMetadataBuilder(["dense", "dsa"], static_ctx, config)
    q = torch.randn(batch, MLA.num_heads, MLA.qk_head_dim)
    kv_c, k_pe = torch.randn(batch, MLA.kv_lora_rank), torch.randn(batch, MLA.qk_rope_head_dim)
    cos, sin = RotaryEmbedding(MLA.qk_rope_head_dim, RopeConfig(), "neox").cos_sin(torch.full((batch,), context))
    inputs = IndexerInputs(torch.randn(batch, HIDDEN), torch.randn(batch, Q_LORA), cos, sin)
    q_absorbed = torch.randn(batch, MLA.num_heads, MLA.kv_cache_dim)

    def in_context(fn):
        def run():
            md = builder.build(common)
            with torch.no_grad(), set_forward_context(ForwardContext({"dense": md, "dsa": md})):
                return fn(md)
        return run

    def sparse_alone(md):
        selected = torch.stack([torch.randperm(seq)[:topk] for _ in range(batch)])
        picked = torch.stack([md.dsa.req_slots[r][selected[r]] for r in range(batch)])
        start = time.thread_time()
        sparse_mla_attention(q_absorbed, sparse.kv_cache, picked, scale, MLA.kv_lora_rank, md.dsa.workspace)
        return time.thread_time() - start

    def timed(fn):
        def run(md):
            start = time.thread_time()
            fn(md)
            return time.thread_time() - start
        return run

    return {
        "dense": in_context(timed(lambda md: dense(q, kv_c, k_pe))),
        "DSA": in_context(timed(lambda md: sparse(q, kv_c, k_pe, inputs))),
        "sparse attention": in_context(sparse_alone),
        "indexer": in_context(timed(lambda md: indexer(inputs, sparse.extra_caches[INDEXER_CACHE], md.slot_mapping,
                                                       md.dsa))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="two small cases")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the thread's CPU time is then the step's
    contexts = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch {args.batch}, top-k {args.topk}")
    names = ["dense", "DSA", "sparse attention", "indexer"]
    print("| context | " + " | ".join(f"{n} ms" for n in names) + " | dense / DSA |")
    print("|---|" + "---|" * (len(names) + 1))
    for context in contexts:
        runs = make_case(args.batch, context, args.topk)
        times = {n: [] for n in names}
        for i in range(args.repeats + 1):  # interleaved: each repeat times every variant in turn; the first warms
            for n in names:
                t = runs[n]()
                if i:
                    times[n].append(t)
        best = {n: min(t) * 1e3 for n, t in times.items()}
        print(f"| {context} | " + " | ".join(f"{best[n]:.2f}" for n in names)
              + f" | {best['dense'] / best['DSA']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
