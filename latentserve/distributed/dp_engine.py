"""Data parallelism behind one `LLM`: requests spread over ranks, steps in lockstep, outputs gathered.

Ranks are processes spawned here (`SpawnedDPEngine`) or started by torchrun (`ExternalDPEngine`, every rank runs
the user's script). Each rank builds its own engine through a picklable `engine_factory` (this package sits below
the engine and does not import it); the engine needs `make_request`, `scheduler.add_request`, `step` and
`has_unfinished_requests`.
"""
from __future__ import annotations

import itertools
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from latentserve.distributed.launch import Workers, exit_with_error
from latentserve.distributed.parallel_state import DPGroup, destroy_dp_group, init_dp_group

# (request id, prompt, sampling params) of one request
Item = tuple[str, Any, Any]


@dataclass
class Invalid:
    """A generate call refused before any step ran; `error` is set on the rank whose prompt was bad."""

    error: BaseException | None


def run_lockstep(engine: Any, group: DPGroup, items: Sequence[Item]) -> list[Any] | Invalid:
    """This rank's share of a generate call: every rank steps until no rank has work (idle ones step empty)."""
    try:
        requests = [engine.make_request(prompt, params, rid) for rid, prompt, params in items]
        error = None
    except (ValueError, TypeError) as e:
        requests, error = [], e
    if not group.all_agree(error is None):  # validate everything everywhere before anything runs
        return Invalid(error)
    for request in requests:
        engine.scheduler.add_request(request)
    finished = {}
    while group.any_rank(engine.has_unfinished_requests()):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return [finished[r.request_id] for r in requests]


def _raise_invalid(answers: Sequence[Any]) -> None:
    invalid = [a for a in answers if isinstance(a, Invalid)]
    if invalid:
        error = next((a.error for a in invalid if a.error is not None), None)
        raise error if error is not None else ValueError("a prompt was refused on another rank")


def _spread(prompts: Sequence[Any], params: Sequence[Any], ids: Sequence[str], world_size: int) -> list[list[Item]]:
    """Round-robin: request i goes to rank i % world_size."""
    shards: list[list[Item]] = [[] for _ in range(world_size)]
    for i, item in enumerate(zip(ids, prompts, params)):
        shards[i % world_size].append(item)
    return shards


def _worker_main(
    rank: int, world_size: int, init_method: str, engine_factory: Callable[[], Any], device: str, num_threads: int,
    conn,
) -> None:
    """A spawned rank: join the group, build the engine, then serve the front end's commands until "stop"."""
    torch.set_num_threads(num_threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
    try:
        group = init_dp_group(rank, world_size, device, init_method)
        engine = engine_factory()
        conn.send(("ok", None))
        while True:
            command, payload = conn.recv()
            if command == "stop":
                break
            if command == "generate":
                conn.send(("ok", run_lockstep(engine, group, payload)))
            else:  # "rpc"
                conn.send(("ok", payload(engine)))
    except EOFError:
        os._exit(0)  # the front end is gone: nobody to answer
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which stops every rank
        exit_with_error(conn, e)
    destroy_dp_group()


class SpawnedDPEngine:
    """`world_size` ranks spawned on this machine; `generate` spreads requests and gathers outputs."""

    def __init__(self, engine_factory: Callable[[], Any], world_size: int, device: str = "cpu") -> None:
        num_threads = max(1, torch.get_num_threads() // world_size)
        self.world_size = world_size
        self.workers = Workers(_worker_main, world_size, (engine_factory, device, num_threads))
        self._finalizer = weakref.finalize(self, self.workers.shutdown)
        try:
            self.workers.receive()
        except Exception as e:
            if isinstance(e.__cause__, (ValueError, FileNotFoundError, TypeError)):
                raise e.__cause__ from None  # bad arguments: the same error as one process gives
            raise
        self._ids = itertools.count()

    def generate(self, prompts: Sequence[Any], params: Sequence[Any]) -> list[Any]:
        ids = [str(next(self._ids)) for _ in prompts]
        self.workers.send([("generate", shard) for shard in _spread(prompts, params, ids, self.world_size)])
        answers = self.workers.receive()
        _raise_invalid(answers)
        outputs = {o.request_id: o for answer in answers for o in answer}
        return [outputs[i] for i in ids]

    def collective_rpc(self, fn: Callable[[Any], Any]) -> list[Any]:
        """`fn(engine)` on every rank (fn must be picklable: a module-level function); the results by rank."""
        self.workers.send([("rpc", fn)] * self.world_size)
        return self.workers.receive()

    def shutdown(self) -> None:
        self._finalizer()


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class ExternalDPEngine:
    """This process is one rank of a torchrun launch; every rank calls `generate` with the same prompts."""

    def __init__(self, engine_factory: Callable[[], Any], world_size: int, device: str = "cpu") -> None:
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise ValueError(f"data_parallel_size={world_size} but torchrun started WORLD_SIZE={env_world} ranks")
        self.world_size = world_size
        self.group = init_dp_group(int(os.environ["RANK"]), world_size, device)
        self.engine = engine_factory()
        self._ids = itertools.count()

    def generate(self, prompts: Sequence[Any], params: Sequence[Any]) -> list[Any]:
        ids = [str(next(self._ids)) for _ in prompts]
        mine = _spread(prompts, params, ids, self.world_size)[self.group.rank]
        answers: list[Any] = [None] * self.world_size
        dist.all_gather_object(answers, run_lockstep(self.engine, self.group, mine))
        _raise_invalid(answers)
        outputs = {o.request_id: o for answer in answers for o in answer}
        return [outputs[i] for i in ids]

    def collective_rpc(self, fn: Callable[[Any], Any]) -> list[Any]:
        answers: list[Any] = [None] * self.world_size
        dist.all_gather_object(answers, fn(self.engine))
        return answers

    def shutdown(self) -> None:
        destroy_dp_group()
