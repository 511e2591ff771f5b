"""Data parallelism behind one `LLM`: requests spread over ranks, steps in lockstep, outputs gathered.

Ranks are processes spawned here (`SpawnedDPEngine`) or started by torchrun (`ExternalDPEngine`, every rank runs
the user's script). Each rank builds its own engine through a picklable `engine_factory` (this package sits below
the engine and does not import it); the engine needs `make_request`, `add_request`, `abort_request`, `step`,
`has_unfinished_requests` and `scheduler`.

A spawned engine runs either whole `generate` calls (each rank steps on its own until no rank has work) or, for
the server, one command at a time: add a request to one rank, abort one, or run one lockstep step on every rank.
"""
from __future__ import annotations

import itertools
import os
import threading
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


@dataclass
class RankLoad:
    """What a rank reports after each per-step command: whether it has work, and how busy it is."""

    has_unfinished: bool
    num_running: int
    num_waiting: int
    kv_cache_usage: float


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


def rank_load(engine: Any) -> RankLoad:
    scheduler = engine.scheduler
    return RankLoad(engine.has_unfinished_requests(), len(scheduler.running), len(scheduler.waiting),
                    scheduler.block_manager.usage)


def _add(engine: Any, items: Sequence[Item]) -> tuple[BaseException | None, RankLoad]:
    """Add all of `items` or, if one is refused, none of them; the refusal comes back."""
    added = []
    try:
        for rid, prompt, params in items:
            added.append(engine.add_request(prompt, params, rid))
        error = None
    except (ValueError, TypeError) as e:
        for rid in added:
            engine.abort_request(rid)
        error = e
    return error, rank_load(engine)


def _abort(engine: Any, request_ids: Sequence[str]) -> RankLoad:
    for rid in request_ids:
        engine.abort_request(rid)
    return rank_load(engine)


def _step(engine: Any, group: DPGroup) -> tuple[list[Any], RankLoad]:
    """One lockstep step: every rank steps (an idle one runs an empty step) iff some rank has work."""
    outputs = engine.step() if group.any_rank(engine.has_unfinished_requests()) else []
    return outputs, rank_load(engine)


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
        commands: dict[str, Callable[[Any], Any]] = {
            "generate": lambda items: run_lockstep(engine, group, items),
            "add": lambda items: _add(engine, items),
            "abort": lambda request_ids: _abort(engine, request_ids),
            "step": lambda _: _step(engine, group),
            "rpc": lambda fn: fn(engine),
        }
        conn.send(("ok", None))
        while True:
            command, payload = conn.recv()
            if command == "stop":
                break
            conn.send(("ok", commands[command](payload)))
    except EOFError:
        os._exit(0)  # the front end is gone: nobody to answer
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which stops every rank
        exit_with_error(conn, e)
    destroy_dp_group()


class SpawnedDPEngine:
    """`world_size` ranks spawned on this machine.

    `generate` spreads a batch over the ranks and gathers the outputs; `add_request` / `abort_request` / `step`
    drive them one command at a time (what a server needs). One thread at a time talks to the ranks.
    """

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
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}  # unfinished request added by add_request -> its rank
        self._next_rank = 0  # where the next tie between equally loaded ranks goes
        self.loads = [RankLoad(False, 0, 0, 0.0) for _ in range(world_size)]

    def _call(self, messages: list[Any]) -> list[Any]:
        with self._lock:
            self.workers.send(messages)
            return self.workers.receive()

    def generate(self, prompts: Sequence[Any], params: Sequence[Any]) -> list[Any]:
        if self._owner and self.workers.error is None:
            raise RuntimeError(f"generate cannot run while {len(self._owner)} request(s) added with add_request "
                               "are unfinished")
        ids = [str(next(self._ids)) for _ in prompts]
        answers = self._call([("generate", shard) for shard in _spread(prompts, params, ids, self.world_size)])
        _raise_invalid(answers)
        outputs = {o.request_id: o for answer in answers for o in answer}
        return [outputs[i] for i in ids]

    def add_request(self, prompt: Any, params: Any, request_id: str | None = None) -> str:
        """Queue a request on the least loaded rank; its refusal (ValueError, TypeError) is raised here."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        rank = self._least_loaded()
        messages = [("add", [(request_id, prompt, params)] if r == rank else []) for r in range(self.world_size)]
        answers = self._call(messages)
        self.loads = [load for _, load in answers]
        error = answers[rank][0]
        if error is not None:
            raise error
        self._owner[request_id] = rank
        return request_id

    def _least_loaded(self) -> int:
        counts = [0] * self.world_size
        for rank in self._owner.values():
            counts[rank] += 1
        order = [(self._next_rank + i) % self.world_size for i in range(self.world_size)]
        rank = min(order, key=counts.__getitem__)
        self._next_rank = (rank + 1) % self.world_size
        return rank

    def abort_request(self, request_id: str) -> None:
        """Abort on its rank; no-op if unknown or finished."""
        rank = self._owner.pop(request_id, None)
        if rank is None:
            return
        self.loads = self._call([("abort", [request_id] if r == rank else []) for r in range(self.world_size)])

    def has_unfinished_requests(self) -> bool:
        return any(load.has_unfinished for load in self.loads)

    def step(self) -> list[Any]:
        """One lockstep step on every rank; the outputs of every rank's requests that advanced or ended."""
        if not self.has_unfinished_requests():
            return []
        answers = self._call([("step", None)] * self.world_size)
        self.loads = [load for _, load in answers]
        outputs = [o for rank_outputs, _ in answers for o in rank_outputs]
        for output in outputs:
            if output.finished:
                self._owner.pop(output.request_id, None)
        return outputs

    def collective_rpc(self, fn: Callable[[Any], Any]) -> list[Any]:
        """`fn(engine)` on every rank (fn must be picklable: a module-level function); the results by rank."""
        return self._call([("rpc", fn)] * self.world_size)

    def check_alive(self) -> None:
        """WorkerFailure (every rank stopped) if a rank's process has exited, without waiting on any rank."""
        with self._lock:
            self.workers.check_alive()

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
        # Every rank finishes its last collective before any rank tears its connections down: a rank still
        # reading the final all_gather when its peer closes has been seen to abort in gloo (rare, under load).
        dist.barrier()
        destroy_dp_group()
