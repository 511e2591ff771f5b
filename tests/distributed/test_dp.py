"""Two ranks on gloo (attention data-parallel, experts split) against the single-process engine."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from latentserve import LLM, SamplingParams
from latentserve.distributed.expert_parallel import moe_layers
from latentserve.distributed.launch import WorkerFailure, free_port
from tests.checkpoints import make_checkpoint
from tests.distributed import rpc
from tests.distributed.helpers import process_gone, rank_steps

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 60], [3, 88], list(range(10, 40)), [70, 71, 72, 73, 74], [1, 2, 3, 4, 5, 6]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
# max_num_seqs=2: each rank gets 3 of the 5 prompts, more than run at once.
CONFIG = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=2,
              enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "v3")


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Single-process outputs, DBO off."""
    return LLM(model=str(checkpoint), **{**CONFIG, "enable_dbo": False}).generate(PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def dp_llm(checkpoint):
    # The front end would give each rank half of its 4 threads; the engine's num_threads=1 must win.
    torch.set_num_threads(4)
    try:
        llm = LLM(model=str(checkpoint), data_parallel_size=2, enable_expert_parallel=True, num_threads=1, **CONFIG)
    finally:
        torch.set_num_threads(1)
    llm.dp_engine.collective_rpc(rpc.log_steps)
    yield llm
    llm.shutdown()


def _assert_same(outputs, expected) -> None:
    for out, ref in zip(outputs, expected, strict=True):
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for pos in range(1, len(ref.prompt_token_ids)):
            token = ref.prompt_token_ids[pos]
            assert abs(out.prompt_logprobs[pos][token].logprob - ref.prompt_logprobs[pos][token].logprob) <= 1e-4, pos




def routed_expert_numel(engine) -> int:
    """Elements of the routed-expert weights this rank holds (a collective_rpc function)."""
    return sum(p.numel() for moe in moe_layers(engine.model) for p in moe.experts.parameters())


def num_threads(engine) -> int:
    return torch.get_num_threads()


def test_each_rank_holds_its_half_of_the_experts(dp_llm, checkpoint):
    assert dp_llm.dp_engine.collective_rpc(rpc.local_experts) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    stored = load_file(checkpoint / "model.safetensors")
    total = sum(t.numel() for name, t in stored.items() if ".mlp.experts." in name)
    assert total > 0
    assert dp_llm.dp_engine.collective_rpc(routed_expert_numel) == [total // 2, total // 2]


def test_num_threads_wins_in_every_rank(dp_llm):
    assert dp_llm.dp_engine.collective_rpc(num_threads) == [1, 1]


@pytest.mark.parametrize("dbo", [True, False])
def test_matches_single_process(dp_llm, reference, dbo):
    dp_llm.dp_engine.collective_rpc(functools.partial(rpc.set_dbo, dbo))
    rank_steps(dp_llm)
    _assert_same(dp_llm.generate(PROMPTS, PARAMS), reference)
    rank0, rank1 = rank_steps(dp_llm)
    assert len(rank0) == len(rank1)  # lockstep
    # The ranks split a step together, exactly when DBO is on and no rank has a single token (which cannot split).
    expected = [2 if dbo and 1 not in (t0, t1) else 1 for (t0, _), (t1, _) in zip(rank0, rank1)]
    assert [n for _, n in rank0] == [n for _, n in rank1] == expected
    assert 2 in expected or not dbo


def test_one_rank_idle(dp_llm, reference):
    """One prompt: rank 1 has nothing to do but runs an empty step, split like rank 0's, for each of rank 0's."""
    dp_llm.dp_engine.collective_rpc(functools.partial(rpc.set_dbo, True))
    rank_steps(dp_llm)
    _assert_same(dp_llm.generate(PROMPTS[:1], PARAMS), reference[:1])
    rank0, rank1 = rank_steps(dp_llm)
    assert all(tokens > 0 for tokens, _ in rank0) and all(tokens == 0 for tokens, _ in rank1)
    assert [n for _, n in rank1] == [n for _, n in rank0] and 2 in [n for _, n in rank0]


def test_bad_prompt_is_refused_and_the_engine_goes_on(dp_llm, reference):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dp_llm.generate(PROMPTS[:3] + [[1, 10_000]], PARAMS)  # the bad prompt goes to rank 1
    _assert_same(dp_llm.generate(PROMPTS[:2], PARAMS), reference[:2])


def test_a_rank_that_raises_in_a_ubatch_stops_every_rank(dp_llm):
    """Rank 1 raises inside ubatch 1: the error crosses the pipe (it pickles both ways), names both, and stops
    every rank. Last test of the shared engine: it ends it."""
    pids = dp_llm.dp_engine.workers.pids
    dp_llm.dp_engine.collective_rpc(functools.partial(rpc.set_dbo, True))
    dp_llm.dp_engine.collective_rpc(rpc.raise_in_ubatch1_on_rank1)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=r"rank 1 raised .*UBatchError: ubatch 1 failed: RuntimeError: injected"):
        dp_llm.generate(PROMPTS, PARAMS)
    assert time.monotonic() - start < 30
    assert all(process_gone(pid) for pid in pids)
    with pytest.raises(WorkerFailure, match="already stopped"):
        dp_llm.generate(PROMPTS, PARAMS)


def test_a_killed_rank_stops_every_rank(checkpoint):
    llm = LLM(model=str(checkpoint), data_parallel_size=2, enable_expert_parallel=True, **CONFIG)
    pids = llm.dp_engine.workers.pids
    llm.dp_engine.collective_rpc(rpc.die_on_rank1)
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match="rank 1 died: its process was killed by signal 9"):
        llm.generate(PROMPTS, PARAMS)
    assert time.monotonic() - start < 30
    assert all(process_gone(pid) for pid in pids)
    shm = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    assert not [name for name in shm if any(str(pid) in name for pid in pids)]


def test_bad_arguments(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="data_parallel_size must be an int >= 1"):
        LLM(model=str(checkpoint), data_parallel_size=0)
    with pytest.raises(ValueError, match="link_bandwidth_gbps must be positive"):
        LLM(model=str(checkpoint), link_bandwidth_gbps=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"), data_parallel_size=2)


def test_torchrun_launch(checkpoint, reference, tmp_path):
    """Every rank of a torchrun launch runs the script; each sees all outputs, as one process would."""
    out = tmp_path / "out.json"
    script = Path(__file__).with_name("torchrun_script.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
               str(free_port()), str(script), str(checkpoint), json.dumps(PROMPTS), str(out), json.dumps(CONFIG)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(Path(__file__).parents[2]),
           "PYTHONFAULTHANDLER": "1"}  # a rank that aborts prints its Python stack
    done = subprocess.run(command, env=env, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]  # once seen failing in a full run, passing alone: keep why
    for rank in range(2):
        outputs = json.loads(Path(f"{out}.{rank}").read_text())
        for (tokens, logprobs), ref in zip(outputs, reference, strict=True):
            assert tokens == ref.outputs[0].token_ids
            for pos, entry in enumerate(logprobs, start=1):
                token = ref.prompt_token_ids[pos]
                assert abs(entry[str(token)] - ref.prompt_logprobs[pos][token].logprob) <= 1e-4


def test_workers_exit_when_the_front_end_is_killed():
    front_end = (
        "import sys, time; from latentserve.distributed.launch import Workers; from tests.distributed import rpc; "
        "w = Workers(rpc.idle_worker, 2, ()); print(*w.receive(), flush=True); time.sleep(600)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", front_end], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not all(process_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(process_gone(pid) for pid in pids)
