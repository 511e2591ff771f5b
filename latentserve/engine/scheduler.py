"""Continuous batching: which requests run each step, with how many new tokens."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from latentserve.attention.builder import is_decode
from latentserve.engine.block_manager import BlockManager
from latentserve.engine.parallel_sampling import SampleGroup
from latentserve.engine.request import Logprobs, Request, RequestStatus
from latentserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # token budget of one step
    max_model_len: int = 4096  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True
    # Requests with at most this many new tokens and some context are decodes (batched first).
    decode_threshold: int = 1
    # Speculative decoding: up to this many draft tokens per request and step (0: off); chained drafts write
    # this many minus one slots past a request's verified tokens.
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "decode_threshold"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        if self.num_speculative_tokens and self.decode_threshold < self.num_speculative_tokens + 1:
            raise ValueError(f"decode_threshold ({self.decode_threshold}) must cover a verification step of "
                             f"num_speculative_tokens + 1 ({self.num_speculative_tokens + 1}) tokens")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) so that every prompt fits in one step"
            )


class Scheduler:
    """FCFS continuous batching with chunked prefill, prefix caching and preemption by recompute."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first; preemption takes from the back
        self.requests: dict[str, Request] = {}  # unfinished requests (each sample of a group) by id
        self.groups: dict[str, SampleGroup] = {}  # unfinished n / best_of requests by the user's id

    def add_request(self, request: Request) -> None:
        """Queue a request; the first sample of an n / best_of request brings its whole group."""
        group = request.group
        samples = group.samples if group is not None else [request]
        for sample in samples:
            if sample.request_id in self.requests or sample.request_id in self.groups:
                raise ValueError(f"request id {sample.request_id!r} is already in use")
        if request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens is longer than "
                f"max_model_len={self.config.max_model_len}"
            )
        if request.sampling_params.stop and request.detokenizer is None:
            raise ValueError(f"request {request.request_id!r} has stop strings but no detokenizer to find them")
        for sample in samples:
            sample.status = RequestStatus.WAITING
            self.requests[sample.request_id] = sample
        # The other samples wait for the first one's prefill, then start on its blocks (see _fork).
        self.waiting.append(request)
        if group is not None:
            self.groups[group.request_id] = group

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request (every sample of an n / best_of one) as aborted, freeing its blocks;
        None if it is unknown or already finished."""
        group = self.groups.get(request_id)
        samples = group.samples if group is not None else [self.requests.get(request_id)]
        aborted = None
        for request in samples:
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:  # not there: a sample held for its leader's prefill
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted = aborted or request
        return aborted

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def _finish(self, request: Request, status: RequestStatus, error: str | None = None) -> None:
        request.status = status
        request.error = error
        self.block_manager.free(request)
        del self.requests[request.request_id]
        group = request.group
        if group is None:
            return
        if not group.forked and request is group.leader:
            self._release_samples(group)  # it ended before its prefill: the others compute their own prompt
        if group.finished:
            del self.groups[group.request_id]

    def _fork(self, group: SampleGroup) -> None:
        """The leader's prompt is computed: the other samples take its full prompt blocks and queue first."""
        leader = group.leader
        bs = self.block_manager.block_size
        # The last prompt token is not shared: each sample computes it, for its own logits. A hybrid model's samples
        # share nothing: a linear-attention state is the whole prefix's, not the shared blocks'.
        num_blocks = 0 if self.block_manager.state_pool is not None else (leader.num_prompt_tokens - 1) // bs
        for sample in group.samples[1:]:
            self.block_manager.fork(leader, sample, num_blocks)
            sample.num_computed_tokens = num_blocks * bs
        self._release_samples(group)

    def _release_samples(self, group: SampleGroup) -> None:
        group.forked = True
        self.waiting.extendleft(reversed([s for s in group.samples[1:] if not s.is_finished]))

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it recomputes prompt and outputs when it runs again."""
        self.block_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _never_fits(self, request: Request, num_tokens: int) -> str | None:
        """Why the request cannot run even with the whole pool to itself, if it cannot."""
        bm = self.block_manager
        needed = bm.num_blocks_needed(num_tokens)
        if needed <= bm.num_blocks:
            return None
        return (
            f"request {request.request_id!r} needs {needed} KV blocks for {num_tokens} tokens, but the KV cache "
            f"holds only {bm.num_blocks} blocks of {bm.block_size} tokens"
        )

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(scheduled=[], num_decodes=0)
        scheduled: list[tuple[Request, int, list[int]]] = []  # request, new tokens, drafts among them
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, out)
        if not out.preempted:  # a step that had to preempt admits nobody new
            self._schedule_waiting(budget, scheduled, out)
        batch = [self._scheduled_request(r, n, d) for r, n, d in scheduled]
        # Decodes first (stable), by the attention builder's own rule: it splits the batch there.
        batch.sort(key=lambda s: not self._is_decode(s))
        out.scheduled = batch
        out.num_decodes = sum(1 for s in batch if self._is_decode(s))
        return out

    def _schedule_running(
        self, budget: int, scheduled: list[tuple[Request, int, list[int]]], out: SchedulerOutput
    ) -> int:
        """Decodes and unfinished prefill chunks, oldest first, preempting the newest when blocks run out."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, budget - num_new) if num_new == 1 else []
            num_new += len(drafts)
            error = self._never_fits(request, request.num_computed_tokens + num_new)
            if error is not None:
                self.running.pop(i)
                self._finish(request, RequestStatus.FINISHED_ERROR, error)
                out.finished.append(request)
                continue
            lookahead = self._lookahead(request.num_computed_tokens + num_new)
            while not self.block_manager.append_slots(request, num_new + lookahead):
                if self._drop_a_waiting_fork():  # before preempting a running request
                    continue
                victim = self.running.pop()  # the newest; not yet scheduled this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                # Drafts are not the request's tokens (yet): their blocks are not offered to the prefix cache.
                self.block_manager.cache_blocks(request, request.num_computed_tokens + num_new - len(drafts))
                scheduled.append((request, num_new, drafts))
                budget -= num_new
                i += 1
        return budget

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The request's drafts that this step can verify: within the token budget, and no more than the tokens it
        may still emit after the one it samples anyway."""
        params = request.sampling_params
        room = self.config.max_model_len - request.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        return request.spec_token_ids[: max(0, min(room, budget))]

    def _lookahead(self, seq_len: int) -> int:
        """Slots past a step's last token (at seq_len - 1) for the MTP's chained drafts: k - 1, within max_model_len."""
        k = self.config.num_speculative_tokens
        return max(0, min(k - 1, self.config.max_model_len - seq_len))

    def _schedule_waiting(
        self, budget: int, scheduled: list[tuple[Request, int, list[int]]], out: SchedulerOutput
    ) -> None:
        """New and preempted requests, oldest first, while budget, sequence slots and free blocks last.

        A request whose grammar is still compiling keeps its place and is passed over for this step.
        """
        compiling: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            grammar = request.structured_output
            if grammar is not None and not grammar.is_ready:
                compiling.append(self.waiting.popleft())
                continue
            error = self._never_fits(request, request.num_tokens) or (grammar.error if grammar is not None else None)
            if error is not None:
                self.waiting.popleft()
                self._finish(request, RequestStatus.FINISHED_ERROR, error)
                out.finished.append(request)
                continue
            computed_blocks, num_cached = self._computed(request, budget)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            samples = num_cached + num_new == request.num_tokens
            lookahead = self._lookahead(num_cached + num_new) if samples else 0
            if not self.block_manager.can_allocate(request, num_new + lookahead, computed_blocks):
                if self.running or not self._drop_a_waiting_fork():
                    break
                continue
            self.block_manager.allocate(request, num_new + lookahead, computed_blocks)
            self.block_manager.cache_blocks(request, num_cached + num_new)
            self.waiting.popleft()
            request.spec_token_ids = []
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new, []))
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

    def _computed(self, request: Request, budget: int) -> tuple[list[int], int]:
        """The blocks a waiting request starts from, and how many of its tokens they hold."""
        if request.block_ids:  # forked: starts on its leader's prompt blocks
            return [], request.num_computed_tokens
        hits = self._cache_hits(request, budget)
        return hits, len(hits) * self.block_manager.block_size

    def _drop_a_waiting_fork(self) -> bool:
        """Make room: the newest waiting sample that holds forked blocks lets go of them (it will compute its
        prompt itself). False if no waiting request holds blocks.

        Waiting requests must not hold blocks that the running ones, or the queue's head, need to progress."""
        holder = next((r for r in reversed(self.waiting) if r.block_ids), None)
        if holder is None:
            return False
        self.block_manager.free(holder)
        holder.num_computed_tokens = 0
        return True

    def _cache_hits(self, request: Request, budget: int) -> list[int]:
        """Prefix-cache blocks a new request can start from.

        Blocks this step has yet to write count only if the request stays a prefill in it: a decode is moved
        ahead of the prefills and, under DBO, could run in the ubatch before the one that writes them.
        """
        # Prompt logprobs need every prompt position computed, so such requests skip the cache.
        if request.sampling_params.prompt_logprobs is not None:
            return []
        bm = self.block_manager
        hits, _ = bm.get_computed_blocks(request)
        num_new = min(request.num_tokens - len(hits) * bm.block_size, budget)
        if is_decode(num_new, len(hits), self.config.decode_threshold):
            hits = hits[: next((i for i, b in enumerate(hits) if bm.is_pending(b)), len(hits))]
        return hits

    def _is_decode(self, s: ScheduledRequest) -> bool:
        return is_decode(s.num_new_tokens, s.num_computed_tokens, self.config.decode_threshold)

    def _scheduled_request(self, request: Request, num_new: int, drafts: list[int]) -> ScheduledRequest:
        start = request.num_computed_tokens
        bs = self.block_manager.block_size
        blocks = list(request.block_ids)
        num_real = num_new - len(drafts)
        return ScheduledRequest(
            request=request,
            num_computed_tokens=start,
            num_new_tokens=num_new,
            token_ids=request.all_token_ids[start : start + num_real] + drafts,
            slot_mapping=[blocks[p // bs] * bs + p % bs for p in range(start, start + num_new)],
            block_ids=blocks,
            do_sample=start + num_real == request.num_tokens,
            spec_token_ids=list(drafts),
            state_slot=request.state_slot,
        )

    def update(
        self,
        output: SchedulerOutput,
        sampled_token_ids: list[int],
        logprobs: list[Logprobs | None] | None = None,
        prompt_logprobs: dict[str, list[Logprobs]] | None = None,
        accepted_draft_ids: list[list[int]] | None = None,
        spec_token_ids: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Record a step's results: one sampled token per sampling request (in `sampling_requests` order),
        their logprobs if asked, and per request id the prompt logprobs of its new positions. Under speculative
        decoding also, per sampling request, the drafts it accepted (emitted before its sampled token; the KV of
        the rejected ones is dropped), and per request id its drafts for the next step.

        Returns the requests with something new for the user: a token, or their end.
        """
        num_samples = sum(1 for s in output.scheduled if s.do_sample)
        if len(sampled_token_ids) != num_samples:
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {num_samples} sampling requests")
        if logprobs is not None and len(logprobs) != num_samples:
            raise ValueError(f"{len(logprobs)} logprobs entries for {num_samples} sampling requests")
        if accepted_draft_ids is not None and len(accepted_draft_ids) != num_samples:
            raise ValueError(f"{len(accepted_draft_ids)} accepted-draft lists for {num_samples} sampling requests")
        self.block_manager.commit_step()
        updated = list(output.finished)
        row = 0
        for s in output.scheduled:
            request = s.request
            accepted: list[int] = []
            if s.do_sample:
                token_id, token_logprobs = sampled_token_ids[row], logprobs[row] if logprobs is not None else None
                accepted = accepted_draft_ids[row] if accepted_draft_ids is not None else []
                row += 1
            if request.is_finished:  # aborted after this step was scheduled
                continue
            if accepted != s.spec_token_ids[: len(accepted)]:
                raise ValueError(f"request {request.request_id!r}: accepted tokens {accepted} are not a prefix of "
                                 f"its drafts {s.spec_token_ids}")
            # Rollback: the KV of rejected drafts stays in its slots, past the computed tokens, to be overwritten.
            request.num_computed_tokens += s.num_new_tokens - s.num_drafts + len(accepted)
            if prompt_logprobs is not None and request.request_id in prompt_logprobs:
                request.append_prompt_logprobs(s.num_computed_tokens + 1, prompt_logprobs[request.request_id])
            if not s.do_sample:
                continue
            emitted = [(t, None) for t in accepted] + [(token_id, token_logprobs)]
            for token, token_logprobs in emitted:
                request.append_output_token(token, token_logprobs)
                if request.group is not None and not request.group.forked:
                    self._fork(request.group)  # before the leader can finish and free its blocks
                status = self._check_grammar(request) or self._check_stop(request, token)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status, request.error)
                    break
            else:
                request.spec_token_ids = (spec_token_ids or {}).get(request.request_id, [])
            updated.append(request)
        return updated

    def _check_grammar(self, request: Request) -> RequestStatus | None:
        """Advance the request's grammar by its new token: an error if the token breaks it (another processor
        left no allowed token), stopped once the grammar has ended (even under ignore_eos)."""
        grammar = request.structured_output
        if grammar is None:
            return None
        if not grammar.sync(request.output_token_ids):
            request.error = (f"request {request.request_id!r}: token {grammar.rejected_token} does not match "
                             f"structured_outputs.{grammar.params.kind}: other sampling settings left no allowed token")
            return RequestStatus.FINISHED_ERROR
        if grammar.is_terminated:
            if request.detokenizer is not None:
                request.detokenizer.flush()
            return RequestStatus.FINISHED_STOPPED
        return None

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        """The final status the new token puts the request in, if any (sets its stop_reason)."""
        params = request.sampling_params
        may_stop = request.num_output_tokens >= params.min_tokens
        detok = request.detokenizer
        if may_stop and not params.ignore_eos and token_id == request.eos_token_id:
            status = RequestStatus.FINISHED_STOPPED
        elif may_stop and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            status = RequestStatus.FINISHED_STOPPED
        else:
            stop = detok.add_token(token_id, check_stop=may_stop) if detok is not None else None
            if stop is not None:
                request.stop_reason = stop
                return RequestStatus.FINISHED_STOPPED
            hit_max = params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
            if not hit_max and request.num_tokens < self.config.max_model_len:
                return None
            status = RequestStatus.FINISHED_LENGTH
        if detok is not None:
            if status == RequestStatus.FINISHED_STOPPED and params.include_stop_str_in_output:
                detok.add_token(token_id, check_stop=False)  # the stop token's text is kept, as asked
            detok.flush()
        return status
