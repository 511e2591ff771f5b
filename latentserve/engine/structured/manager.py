"""Compiles each distinct spec once, on a worker thread, and fills the batch's token bitmask each step."""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from latentserve.engine.detokenizer import TokenizerInfo
from latentserve.engine.structured.backend import build_grammar, tokenizer_info
from latentserve.engine.structured.request import StructuredOutputRequest
from latentserve.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# Compiled grammars kept for reuse (least recently used dropped first).
_CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(self, tokenizer: TokenizerInfo, vocab_size: int) -> None:
        import xgrammar as xgr
        if tokenizer.eos_token_id is None:
            raise ValueError("structured outputs need the tokenizer's eos_token (tokenizer_config.json) to end on")
        self.vocab_size = vocab_size
        info = tokenizer_info(tokenizer.tokenizer, vocab_size, [tokenizer.eos_token_id])
        # One thread: compilation runs beside the engine's steps, not inside them; the cache below is the only one.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="latentserve-grammar")
        self.cache: OrderedDict[tuple, Future[xgr.CompiledGrammar]] = OrderedDict()

    def new_request(self, params: StructuredOutputsParams,
                    reasoning_end_token_id: int | None = None) -> StructuredOutputRequest:
        """The grammar state of one request, constrained after `reasoning_end_token_id` (from the first output token
        if None); the spec is checked now (ValueError), compiled later."""
        return StructuredOutputRequest(params, self.compiled(params), reasoning_end_token_id)

    def compiled(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        key = params.key()
        future = self.cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self.cache.move_to_end(key)
            return future
        grammar = build_grammar(params)
        future = self.executor.submit(self.compiler.compile_grammar, grammar)
        self.cache[key] = future
        if len(self.cache) > _CACHE_SIZE:
            self.cache.popitem(last=False)
        return future

    def wait_any(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Block until one of these grammars is compiled, or `timeout` seconds (nothing else could run)."""
        pending = [r.grammar for r in requests if not r.is_ready]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)


def grammar_bitmask(states: list[StructuredOutputRequest | None], vocab_size: int) -> torch.Tensor | None:
    """[B, ceil(V/32)] int32 bitmask of the tokens each row may sample (all ones on unconstrained rows); None if no
    row is constrained this step."""
    rows = [(i, s) for i, s in enumerate(states) if s is not None and s.constrains_next]
    if not rows:
        return None
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
    for row, state in rows:
        state.fill_bitmask(bitmask, row)
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens the rows' grammars do not allow.

    Unpacked with torch ops: 4.5x faster than xgrammar's CPU kernel on [32, 4107] (0.26 vs 1.2 ms), any device.
    """
    num_rows, vocab_size = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True)
    allowed = ((bitmask.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).bool().view(num_rows, -1)[:, :vocab_size]
    logits.masked_fill_(~allowed, float("-inf"))
