"""`AsyncLLMEngine`: the engine stepping on its own thread, each request's outputs fed to an asyncio queue.

Only the engine thread touches the engine: the event loop hands it requests to add and ids to abort
through a FIFO, and the engine thread hands back `RequestOutput` snapshots with
`loop.call_soon_threadsafe`. A snapshot holds the whole text so far, so a consumer that falls
behind may skip to the newest one and lose nothing.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from latentserve.distributed.dp_engine import rank_load
from latentserve.engine.llm import DPLLMEngine
from latentserve.engine.llm_engine import LLMEngine
from latentserve.engine.outputs import RequestOutput
from latentserve.engine.spec_decode.metrics import SpecDecodingStats
from latentserve.sampling_params import SamplingParams
from latentserve.server.metrics import Metrics

logger = logging.getLogger(__name__)

Engine = LLMEngine | DPLLMEngine
# How often an idle engine thread checks that the data-parallel ranks still live (a busy one learns it at its step).
HEALTH_CHECK_S = 1.0


class QueueFullError(RuntimeError):
    """Too many requests are waiting: the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine thread failed or stopped: no request can run any more (HTTP 503)."""


class RequestStream:
    """One request's outputs, in order; iterating yields the newest snapshot available."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        self.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Timing:
    """Engine-thread bookkeeping of one request, for the metrics."""

    arrival: float
    num_prompt_tokens: int
    params: SamplingParams
    num_tokens: int = 0
    last_token: float = 0.0
    num_cached_tokens: int = 0


@dataclass
class _Add:
    prompt: str | list[int]
    params: SamplingParams
    request_id: str
    arrival: float


def _max_num_seqs(engine: LLMEngine) -> int:
    return engine.scheduler.config.max_num_seqs


def engine_seats(engine: Engine) -> int:
    """Requests the engine (all its ranks) can run at once."""
    if isinstance(engine, DPLLMEngine):
        return sum(engine.dp_engine.collective_rpc(_max_num_seqs))
    return _max_num_seqs(engine)


def engine_load(engine: Engine) -> dict[str, float]:
    """Requests running and waiting in the engine, and the fraction of its KV cache in use."""
    loads = engine.dp_engine.loads if isinstance(engine, DPLLMEngine) else [rank_load(engine)]
    return {"running": sum(load.num_running for load in loads),
            "waiting": sum(load.num_waiting for load in loads),
            "kv_cache_usage": sum(load.kv_cache_usage for load in loads) / len(loads)}


def _spec_decoding_stats(engine: LLMEngine) -> SpecDecodingStats | None:
    stats = engine.spec_decoding_stats
    return dataclasses.replace(stats, num_accepted_tokens_per_pos=list(stats.num_accepted_tokens_per_pos),
                               num_drafts_per_pos=list(stats.num_drafts_per_pos)) if stats is not None else None


def engine_spec_decoding_stats(engine: Engine) -> SpecDecodingStats | None:
    """A copy of the engine's speculative-decoding totals, summed over data-parallel ranks; None when it is off."""
    if not isinstance(engine, DPLLMEngine):
        return _spec_decoding_stats(engine)
    ranks = [s for s in engine.dp_engine.collective_rpc(_spec_decoding_stats) if s is not None]
    if not ranks:
        return None
    return SpecDecodingStats(
        ranks[0].num_spec_tokens, sum(s.num_drafts for s in ranks), sum(s.num_draft_tokens for s in ranks),
        sum(s.num_accepted_tokens for s in ranks),
        [sum(pos) for pos in zip(*(s.num_accepted_tokens_per_pos for s in ranks))],
        [sum(pos) for pos in zip(*(s.num_drafts_per_pos for s in ranks))])


class AsyncLLMEngine:
    """Drives an `LLMEngine`, or a `DPLLMEngine` over data-parallel ranks, through its per-step surface."""

    def __init__(self, engine: Engine, max_waiting: int | None = None, model_name: str = "",
                 metrics_prefix: str = "latentserve") -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.seats = engine_seats(engine)
        # Refreshed by the engine thread after each step: ranks are only reachable from it, and a copy is consistent.
        self.spec_decoding_stats = engine_spec_decoding_stats(engine)
        self.metrics = Metrics(self._gauges, model_name, metrics_prefix, lambda: self.spec_decoding_stats)
        self._ops: deque[_Add | str] = deque()  # a request to add, or the id of one to abort
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}  # engine thread only: requests added and not finished
        self._lock = threading.Lock()  # guards _streams
        self._wakeup = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="latentserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None and not self._stopping

    def num_waiting(self) -> int:
        """Requests not yet running: queued for the engine thread or in the scheduler's waiting queue."""
        return self._num_queued() + int(engine_load(self.engine)["waiting"])

    def num_unadmitted(self) -> int:
        """Requests the engine could not admit: those its scheduler holds waiting, and those queued for the engine
        thread beyond the free seats (a burst on an idle engine is all admitted at its next step)."""
        load = engine_load(self.engine)
        free = self.seats - int(load["running"]) if load["waiting"] == 0 else 0
        return int(load["waiting"]) + max(self._num_queued() - free, 0)

    def _num_queued(self) -> int:
        return sum(isinstance(op, _Add) for op in list(self._ops))

    def _gauges(self) -> dict[str, float]:
        return {**engine_load(self.engine), "waiting": self.num_waiting()}

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Queue a request; must be called on the event loop. The engine's refusal (ValueError) ends its stream."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running" + (f": {self.error}" if self.error else ""))
        if self.max_waiting is not None and self.num_unadmitted() >= self.max_waiting:
            raise QueueFullError(f"the server is busy: {self.max_waiting} requests are already waiting")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._ops.append(_Add(prompt, params, request_id, time.monotonic()))
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (no-op if it already finished). Its stream gets nothing more:
        whoever aborts it has stopped reading."""
        self._ops.append(request_id)
        self._wakeup.set()

    # --- engine thread ---

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_ops()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(HEALTH_CHECK_S)
                    self._wakeup.clear()  # before the next _apply_ops: an op queued after this wakes us again
                    if isinstance(self.engine, DPLLMEngine):
                        self.engine.dp_engine.check_alive()
                    continue
                outputs = self.engine.step()
                if self.spec_decoding_stats is not None:  # before the outputs: a client sees its step counted
                    self.spec_decoding_stats = engine_spec_decoding_stats(self.engine)
                self._dispatch(outputs)
        except BaseException as e:  # the engine's state is unknown now: fail every request and refuse new ones
            logger.exception("engine step failed")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine failed: {e!r}"), "error")
            return
        self._fail_all(EngineDeadError("the server is shutting down"), "abort")

    def _apply_ops(self) -> None:
        while self._ops:
            op = self._ops.popleft()
            if isinstance(op, _Add):
                self._add(op)
            elif op in self._timings:
                self.engine.abort_request(op)
                self._close(op)
                self._finished(self._timings.pop(op), "abort", time.monotonic())

    def _add(self, op: _Add) -> None:
        try:
            self.engine.add_request(op.prompt, op.params, op.request_id)
        except (ValueError, TypeError) as e:
            self._close(op.request_id).put(e)
            return
        num_prompt_tokens = len(op.prompt) if isinstance(op.prompt, list) else 0  # a text prompt's: at its output
        if op.params.structured_outputs is not None:
            self.metrics.observe_structured(op.params.structured_outputs.kind)
        self._timings[op.request_id] = _Timing(op.arrival, num_prompt_tokens, op.params)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            self._record(output, now)
            with self._lock:
                stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
            if output.finished:
                self._close(output.request_id)

    def _record(self, output: RequestOutput, now: float) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        timing.num_prompt_tokens = len(output.prompt_token_ids)
        timing.num_cached_tokens = output.num_cached_tokens
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        if num_tokens > timing.num_tokens:
            first = timing.num_tokens == 0
            since = timing.arrival if first else timing.last_token
            self.metrics.observe_tokens(num_tokens - timing.num_tokens, first, now - since)
            timing.num_tokens, timing.last_token = num_tokens, now
        if output.finished:
            reason = "error" if output.error is not None else output.outputs[0].finish_reason or "error"
            self._finished(self._timings.pop(output.request_id), reason, now)

    def _finished(self, timing: _Timing, reason: str, now: float) -> None:
        self.metrics.observe_finished(reason, timing.num_prompt_tokens, timing.num_tokens, now - timing.arrival,
                                      timing.params.n, timing.params.max_tokens, timing.num_cached_tokens)

    def _close(self, request_id: str) -> RequestStream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    def _fail_all(self, error: BaseException, reason: str) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        now = time.monotonic()
        for timing in self._timings.values():
            self._finished(timing, reason, now)
        self._timings.clear()
        for stream in streams:
            stream.put(error)
