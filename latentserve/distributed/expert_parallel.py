"""Expert parallelism: each rank owns 1/N of the routed experts; tokens go to their experts' ranks and come back.

Dispatch and combine are `all_to_all_single` collectives issued asynchronously (counts first, then tokens).
Each ubatch yields while its tokens are in flight, so under DBO the other ubatch computes meanwhile: ubatch 1's
attention hides ubatch 0's dispatch, ubatch 0's experts ubatch 1's dispatch, and so on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from latentserve.distributed.link_emulator import LinkEmulator, Work
from latentserve.distributed.parallel_state import DPGroup
from latentserve.forward_context import ForwardContext, dbo_yield, get_forward_context, set_forward_context
from latentserve.layers.moe import MoE
from latentserve.ubatch.runner import run_ubatches


class RemoteExpert(nn.Module):
    """Stands in for a routed expert another rank owns; tokens never reach it here."""

    def __init__(self, owner: int) -> None:
        super().__init__()
        self.owner = owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"this expert lives on rank {self.owner}; its tokens must be dispatched there")


@dataclass
class _Transfer:
    work: Work
    output: torch.Tensor


class ExpertParallel:
    """`MoE.expert_parallel` for one layer: (x, weights, ids) -> routed output, over all ranks' experts."""

    def __init__(self, moe: MoE, group: DPGroup, link: LinkEmulator) -> None:
        self.moe = moe
        self.group = group
        self.link = link
        self.experts_per_rank = len(moe.experts) // group.world_size
        # In-flight transfer of each ubatch (key: the forward context's ubatch_id; None without DBO).
        self._inflight: dict[int | None, _Transfer] = {}

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        hidden = x.shape[1]
        top_k = ids.shape[1]
        flat_ids = ids.flatten()
        # The order run_experts uses, so partial sums accumulate exactly as on one process.
        order = torch.argsort(flat_ids, stable=True)
        pair_tokens = order // top_k
        pair_ids = flat_ids[order]
        pair_weights = weights.flatten()[order]

        send_counts = torch.bincount(pair_ids // self.experts_per_rank, minlength=self.group.world_size)
        recv_counts = torch.empty_like(send_counts)
        # Blocking: a few bytes, and yielding here would leave the other ubatch's dispatch with nothing to hide it.
        self._start(recv_counts, send_counts, None, None, 0)
        recv_counts = self._finish(overlap=False)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

        # One message per token: its hidden row and its expert id, bit-cast into the row's dtype.
        id_cols = torch.empty(0, dtype=torch.int32).element_size() // x.element_size()
        packed_ids = pair_ids.to(torch.int32).view(x.dtype).view(len(pair_ids), id_cols)
        send = torch.cat([x[pair_tokens], packed_ids], dim=1)
        recv = send.new_empty(sum(recv_splits), hidden + id_cols)
        self._start(recv, send, recv_splits, send_splits, x.element_size() * hidden)
        recv = self._finish()

        expert_out = self._run_local_experts(recv, hidden, weights.dtype)

        back = x.new_empty(len(pair_ids), hidden)
        self._start(back, expert_out, send_splits, recv_splits, x.element_size() * hidden)
        back = self._finish()
        return torch.zeros_like(x).index_add_(0, pair_tokens, (back * pair_weights[:, None]).to(x.dtype))

    def _run_local_experts(self, recv: torch.Tensor, hidden: int, weight_dtype: torch.dtype) -> torch.Tensor:
        """Each received token through its (local) expert, unweighted: the sender applies the routing weight."""
        expert_ids = recv[:, hidden:].contiguous().view(torch.int32).view(-1, 1).long()
        unit = torch.ones(expert_ids.shape, dtype=weight_dtype, device=recv.device)
        return self.moe.run_experts(recv[:, :hidden].contiguous(), unit, expert_ids)

    def _start(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int] | None,
        input_splits: list[int] | None,
        row_bytes: int,
    ) -> None:
        ubatch = get_forward_context().ubatch_id
        if ubatch in self._inflight:
            raise RuntimeError(f"ubatch {ubatch} started a transfer while its previous one is in flight")
        work = dist.all_to_all_single(
            output, input, output_splits, input_splits, group=self.group.group, async_op=True
        )
        num_bytes = self._link_bytes(output_splits, input_splits, row_bytes)
        self._inflight[ubatch] = _Transfer(self.link.wrap(work, num_bytes), output)

    def _finish(self, overlap: bool = True) -> torch.Tensor:
        """Wait for this ubatch's transfer, with `overlap` first letting the other ubatch run meanwhile.

        Every call of a layer overlaps or not alike in each ubatch (the counts never do, dispatch and combine always
        do), so both ubatches yield equally often per layer, as DBO requires (`latentserve.ubatch.runner`).
        """
        try:
            if overlap:
                dbo_yield()
        finally:  # a ubatch unwound at the yield (the other one failed) leaves no stale transfer
            transfer = self._inflight.pop(get_forward_context().ubatch_id)
        transfer.work.wait()
        return transfer.output

    def _link_bytes(self, output_splits: list[int] | None, input_splits: list[int] | None, row_bytes: int) -> int:
        """Bytes this rank moves over the link: the larger of what it sends and receives, its own share excluded."""
        if output_splits is None:
            return 0
        rank = self.group.rank
        sent = sum(input_splits) - input_splits[rank]
        received = sum(output_splits) - output_splits[rank]
        return max(sent, received) * row_bytes


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def shard_experts(model: nn.Module, group: DPGroup, link: LinkEmulator | None = None) -> None:
    """Keep this rank's routed experts ([r*E/N, (r+1)*E/N)), drop the others, and route through all-to-all.

    All layers share `link` (this rank's emulated link; None: the real one). Run it as `load_model`'s `prepare`, so
    the dropped experts never get memory nor are read from the checkpoint."""
    link = link or LinkEmulator()
    for moe in moe_layers(model):
        num_experts = len(moe.experts)
        if num_experts % group.world_size:
            raise ValueError(
                f"expert parallelism needs n_routed_experts ({num_experts}) divisible by data_parallel_size "
                f"({group.world_size})"
            )
        per_rank = num_experts // group.world_size
        for i in range(num_experts):
            if i // per_rank != group.rank:
                moe.experts[i] = RemoteExpert(i // per_rank)
        moe.expert_parallel = ExpertParallel(moe, group, link)


def run_empty_forward(model: nn.Module, num_ubatches: int, dtype: torch.dtype) -> None:
    """The collectives of a forward over zero tokens (model dtype `dtype`), so an idle rank keeps step."""
    layers = [m.expert_parallel for m in moe_layers(model) if m.expert_parallel is not None]
    if not layers:
        return
    moe = moe_layers(model)[0]
    hidden = moe.gate.weight.shape[1]
    top_k = moe.gate.cfg.num_experts_per_tok
    device = moe.gate.weight.device

    def run(ubatch_id: int | None) -> None:
        x = torch.empty(0, hidden, dtype=dtype, device=device)
        weights = torch.empty(0, top_k, dtype=torch.float32, device=device)
        ids = torch.empty(0, top_k, dtype=torch.long, device=device)
        with set_forward_context(ForwardContext(ubatch_id=ubatch_id)):
            for layer in layers:
                layer(x, weights, ids)

    if num_ubatches == 1:
        run(None)
    else:
        run_ubatches([lambda i=i: run(i) for i in range(num_ubatches)])
