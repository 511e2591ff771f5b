"""Functions the tests run on every rank through `LLM.dp_engine.collective_rpc` (module-level: picklable)."""
from __future__ import annotations

import dataclasses
import os
import signal

from latentserve.distributed.expert_parallel import RemoteExpert, moe_layers
from latentserve.distributed.parallel_state import get_dp_group
from latentserve.forward_context import get_forward_context

_steps: list[tuple[int, int]] = []  # (tokens, ubatches) of each step since the log was installed


def rank(engine) -> int:
    return get_dp_group().rank


def set_dbo(enabled: bool, engine) -> None:
    runner = engine.runner
    runner.dbo_config = dataclasses.replace(runner.dbo_config, enable_dbo=enabled)


def log_steps(engine) -> None:
    runner = engine.runner
    execute = runner.execute_model

    def spy(out):
        result = execute(out)
        _steps.append((out.num_scheduled_tokens, result.num_ubatches))
        return result

    runner.execute_model = spy


def pop_steps(engine) -> list[tuple[int, int]]:
    steps = list(_steps)
    _steps.clear()
    return steps


def local_experts(engine) -> list[list[int]]:
    """Per MoE layer, the routed experts this rank holds weights for."""
    return [
        [i for i, e in enumerate(moe.experts) if not isinstance(e, RemoteExpert)] for moe in moe_layers(engine.model)
    ]


def _fail_on_rank1(engine, action) -> None:
    if get_dp_group().rank != 1:
        return
    step = engine.step

    def faulty():
        if engine.has_unfinished_requests() and engine.scheduler.running:
            action()
        return step()

    engine.step = faulty


def die_on_rank1(engine) -> None:
    """Rank 1's process is killed (SIGKILL) in its first step with a running request."""
    _fail_on_rank1(engine, lambda: os.kill(os.getpid(), signal.SIGKILL))


def idle_worker(rank: int, world_size: int, init_method: str, conn) -> None:
    """A `Workers` target that reports ready, then waits for messages forever."""
    conn.send(("ok", os.getpid()))
    while True:
        conn.recv()


def _raise_in_ubatch1(moe_forward):
    def faulty(x):
        if get_forward_context().ubatch_id == 1:
            raise RuntimeError("injected fault in a ubatch")
        return moe_forward(x)

    return faulty


def raise_in_ubatch1_on_rank1(engine) -> None:
    """Rank 1's first MoE layer raises when ubatch 1 of a split step reaches it."""
    if get_dp_group().rank == 1:
        moe = moe_layers(engine.model)[0]
        moe.forward = _raise_in_ubatch1(moe.forward)


class TwoArgError(Exception):
    """Pickles (its args are kept) but does not unpickle: __init__ wants two arguments, args holds one."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")


def unreadable_worker(rank: int, world_size: int, init_method: str, how: str, conn) -> None:
    """A `Workers` target whose rank 1 sends what the front end cannot unpickle: an error it raised ("raise") or
    an answer ("answer")."""
    from latentserve.distributed.launch import exit_with_error

    conn.send(("ok", os.getpid()))
    conn.recv()
    if rank == 1 and how == "raise":
        try:
            raise TwoArgError("rank one", "broke")
        except TwoArgError as e:
            exit_with_error(conn, e)
    conn.send(("ok", TwoArgError("rank one", "answered") if rank == 1 else rank))
    conn.recv()
