"""Prefill backends that attend request by request over variable-length segments."""
from __future__ import annotations

from abc import abstractmethod

import torch

from latentserve.attention.prefill.base import MLAPrefillBackend


def hidden_keys(n: int, m: int, distance: int, causal: bool, window: int | None,
                device: torch.device) -> torch.Tensor:
    """`[n, m]` bool, True where query i may not see key j: query 0 sits `distance` positions after key 0; a causal
    query sees no later key, a windowed one none `window` or more positions back."""
    behind = distance + torch.arange(n, device=device)[:, None] - torch.arange(m, device=device)[None, :]
    hidden = behind < 0 if causal else torch.zeros(n, m, dtype=torch.bool, device=device)
    if window is not None:
        hidden |= behind >= window
    return hidden


class VarlenPrefillBackend(MLAPrefillBackend):
    """Implements both prefill calls with one per-request kernel, `_attend`."""

    @abstractmethod
    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, distance: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[n, N, Dqk]`, k `[m, N, Dqk]`, v `[m, N, V]` (m >= 1) -> out `[n, N, V]`, lse `[n, N]`.

        Query 0 sits `distance` positions after key 0 (0 for a request's new tokens; what a sliding window needs).
        """

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse):
        cu = self.prefill_metadata.query_start_loc_cpu
        out, lse = self._run_segments(q, k, v, cu, cu, [0] * (len(cu) - 1), causal=True)
        return (out, lse) if return_softmax_lse else out

    def run_prefill_context_chunk(self, chunk_idx, q, k, v):
        chunked = self.prefill_metadata.chunked_context
        if chunked is None or not 0 <= chunk_idx < len(chunked.cu_seq_lens_cpu):
            raise IndexError(f"context chunk {chunk_idx} is not in the prepared plan")
        # A request's new tokens start at its context length; the chunk's keys at chunk_idx * chunk_size.
        distances = [c - chunk_idx * chunked.chunk_size for c in self.prefill_metadata.context_lens_cpu]
        return self._run_segments(
            q, k, v, self.prefill_metadata.query_start_loc_cpu, chunked.cu_seq_lens_cpu[chunk_idx], distances,
            causal=False,
        )

    def _run_segments(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_cu: list[int],
        k_cu: list[int],
        distances: list[int],
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(q_cu) == 2 and q_cu[1] > 0 and k_cu[1] > 0:  # one request: its kernel's output is the output
            return self._attend(q, k, v, causal, distances[0])
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        for i in range(len(q_cu) - 1):
            q0, q1, k0, k1 = q_cu[i], q_cu[i + 1], k_cu[i], k_cu[i + 1]
            if q1 == q0 or k1 == k0:
                continue  # no queries, or no keys: output 0 with lse -inf
            out[q0:q1], lse[q0:q1] = self._attend(q[q0:q1], k[k0:k1], v[k0:k1], causal, distances[i])
        return out, lse
