"""Dual batch overlap under 2-rank expert parallelism: step time with and without DBO across emulated links.

Two ranks (gloo, one process each) run the same engine step: a prefill of T tokens per rank, or a decode of
T requests per rank. First with no link emulation (t_compute, DBO off and on), then with the expert
all-to-all's link set, per step, so that its emulated transfer time t_comm is `ratio` x t_compute.
For each (step kind, T, ratio) it reports t_off and t_on (DBO off / on), the speedup t_off / t_on, and the
overlap efficiency (t_off - t_on) / min(t_comm, t_compute): 1 when DBO hides all of the shorter of the two.
DBO engages above EngineConfig.dbo_*_token_threshold tokens; the defaults come from this benchmark.
Run: `.venv/bin/python benchmarks/dbo_overlap.py [--quick] [--tokens 64 256] [--ratios 0.25 1 2]`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latentserve.distributed.expert_parallel import moe_layers  # noqa: E402
from latentserve.distributed.launch import Workers, exit_with_error  # noqa: E402
from latentserve.distributed.link_emulator import LinkEmulator, Work  # noqa: E402
from latentserve.distributed.parallel_state import init_dp_group  # noqa: E402
from latentserve.engine.engine_config import EngineConfig  # noqa: E402
from latentserve.engine.llm_engine import LLMEngine  # noqa: E402
from latentserve.sampling_params import SamplingParams  # noqa: E402

# Every layer MoE, so every layer has a dispatch and a combine to hide.
MODEL = dict(
    vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=0, max_position_embeddings=4096,
)
PROMPT_LEN = 16  # of each request in the decode steps


@dataclass(eq=False)
class MeteredLink(LinkEmulator):
    """A link emulator that also records the transfer time (on an idle link) of each transfer."""

    spent: list[float] = field(default_factory=list)

    def wrap(self, work: Work, num_bytes: int) -> Work:
        self.spent.append(self.transfer_time(num_bytes))
        return super().wrap(work, num_bytes)


def make_checkpoint(path: Path) -> None:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(**MODEL, tie_word_embeddings=False)).save_pretrained(path)


def set_link(engine: LLMEngine, link: LinkEmulator) -> None:
    for moe in moe_layers(engine.model):
        moe.expert_parallel.link = link


def set_dbo(engine: LLMEngine, enabled: bool) -> None:
    runner = engine.runner
    runner.dbo_config = dataclasses.replace(runner.dbo_config, enable_dbo=enabled)


def step_times(engine: LLMEngine, kind: str, tokens: int, repeats: int, link: LinkEmulator | None = None):
    """{dbo: (fastest step, mean emulated transfer time per step)} over `repeats` steps of `kind` with `tokens`
    tokens on this rank, DBO off and on alternating (the machine's load drifts); maxima over the ranks."""
    link = link or LinkEmulator()
    set_link(engine, link)
    gen = torch.Generator().manual_seed(tokens)
    vocab = MODEL["vocab_size"]
    times: dict[bool, list[float]] = {False: [], True: []}
    comm: dict[bool, list[float]] = {False: [], True: []}

    def timed_step(dbo: bool) -> None:
        set_dbo(engine, dbo)
        dist.barrier()
        spent = len(link.spent) if isinstance(link, MeteredLink) else 0
        start = time.perf_counter()
        engine.step()
        times[dbo].append(time.perf_counter() - start)
        comm[dbo].append(sum(link.spent[spent:]) if isinstance(link, MeteredLink) else 0.0)

    if kind == "prefill":
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for i in range(2 * repeats):
            engine.add_request(torch.randint(vocab, (tokens,), generator=gen).tolist(), params)
            timed_step(bool(i % 2))
    else:
        params = SamplingParams(temperature=0.0, max_tokens=2 * repeats + 1, ignore_eos=True)
        for _ in range(tokens):
            engine.add_request(torch.randint(vocab, (PROMPT_LEN,), generator=gen).tolist(), params)
        engine.step()  # the prefills
        for i in range(2 * repeats):
            timed_step(bool(i % 2))
    while engine.has_unfinished_requests():
        engine.step()
    return {
        dbo: (_max_over_ranks(min(times[dbo])), _max_over_ranks(sum(comm[dbo]) / len(comm[dbo])))
        for dbo in (False, True)
    }


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_rank(rank: int, world: int, init_method: str, model_dir: str, kinds: list[str], tokens: list[int],
               ratios: list[float], latency_us: float, repeats: int, conn) -> None:
    try:
        rows = measure(rank, world, init_method, model_dir, kinds, tokens, ratios, latency_us, repeats)
    except BaseException as e:  # noqa: BLE001 - the front end reports it and stops the other rank
        exit_with_error(conn, e)
    conn.send(("ok", rows))
    conn.recv()  # "stop"


def measure(rank: int, world: int, init_method: str, model_dir: str, kinds: list[str], tokens: list[int],
            ratios: list[float], latency_us: float, repeats: int) -> list[tuple]:
    torch.set_num_threads(1)
    init_dp_group(rank, world, "cpu", init_method)
    max_tokens = max(tokens)
    blocks = max_tokens * -(-(PROMPT_LEN + repeats + 2) // 16) + 2 * -(-max_tokens // 16) + 8
    engine = LLMEngine(model_dir, EngineConfig(
        data_parallel_size=world, enable_expert_parallel=True, enable_dbo=True, dbo_decode_token_threshold=2,
        dbo_prefill_token_threshold=2, enable_prefix_caching=False, max_num_batched_tokens=max(max_tokens, 256),
        max_num_seqs=max(max_tokens, 8), num_kv_blocks=blocks,
    ))
    rows = []
    for kind in kinds:
        for t in tokens:
            step_times(engine, kind, t, 1)  # warm-up
            compute = step_times(engine, kind, t, repeats)
            t_compute = compute[False][0]
            rows.append((kind, t, 0.0, 0.0, t_compute, compute[True][0], t_compute))
            # The transfers of one step over a 1 GB/s link without latency: its bytes, to size the link per ratio.
            probe_s = step_times(engine, kind, t, 1, MeteredLink(0.0, 1.0))[False][1]
            transfers = 3 * len(moe_layers(engine.model))  # counts, dispatch, combine
            for ratio in ratios:
                budget = ratio * t_compute - transfers * latency_us * 1e-6
                if budget <= 0:
                    continue
                linked = step_times(engine, kind, t, repeats, MeteredLink(latency_us, probe_s / budget))
                (t_off, t_comm), (t_on, _) = linked[False], linked[True]
                rows.append((kind, t, ratio, t_comm, t_off, t_on, t_compute))
    return rows


def report(rows) -> None:
    print(f"{'step':>7} {'tokens':>6} {'ratio':>5} {'t_comm ms':>9} {'t_off ms':>8} {'t_on ms':>8} "
          f"{'speedup':>7} {'overlap':>7}")
    for kind, tokens, ratio, t_comm, t_off, t_on, t_compute in rows:
        overlap = (t_off - t_on) / min(t_comm, t_compute) if t_comm > 0 else float("nan")
        print(f"{kind:>7} {tokens:>6} {ratio:>5.2f} {t_comm * 1e3:>9.2f} {t_off * 1e3:>8.2f} {t_on * 1e3:>8.2f} "
              f"{t_off / t_on:>7.2f} {overlap:>7.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer points and repeats")
    parser.add_argument("--kinds", nargs="+", default=None, choices=["prefill", "decode"])
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per rank per step")
    parser.add_argument("--ratios", type=float, nargs="+", default=None, help="t_comm / t_compute targets")
    parser.add_argument("--latency-us", type=float, default=5.0, help="link latency per collective")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    kinds = args.kinds or (["prefill"] if args.quick else ["prefill", "decode"])
    tokens = args.tokens or ([64, 256] if args.quick else [16, 64, 256, 1024])
    ratios = args.ratios or ([0.5, 1.0, 2.0] if args.quick else [0.25, 0.5, 1.0, 1.5, 2.0])
    repeats = args.repeats or (3 if args.quick else 5)
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp))
        from benchmarks.dbo_overlap import bench_rank as target  # importable by name in the workers

        workers = Workers(target, 2, (tmp, kinds, tokens, ratios, args.latency_us, repeats))
        try:
            rows = workers.receive()[0]
        finally:
            workers.shutdown()
    print(f"2 ranks, gloo, {os.cpu_count()} CPUs, 1 thread per rank; ratio 0 = no link emulation "
          f"(t_off, t_on = compute only)")
    report(rows)


if __name__ == "__main__":
    main()
