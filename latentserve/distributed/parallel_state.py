"""The data-parallel process group this process belongs to (one per process; None when not distributed)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


# A collective stuck longer than this raises in every rank still alive: the backstop of the 30 s failure bound
# (the spawning front end notices a dead rank sooner, and torchrun stops the other ranks itself).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("LATENTSERVE_COLLECTIVE_TIMEOUT_S", "20"))


@dataclass
class DPGroup:
    """Rank and size of the data-parallel group, and the device its collectives run on."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def group(self) -> dist.ProcessGroup:
        return dist.group.WORLD

    def all_agree(self, flag: bool) -> bool:
        """True iff `flag` is True on every rank."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def any_rank(self, flag: bool) -> bool:
        """True iff `flag` is True on some rank."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


_group: DPGroup | None = None


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_dp_group(rank: int, world_size: int, device: str, init_method: str = "env://") -> DPGroup:
    """Join the default process group (gloo on CPU, NCCL on CUDA) and make it this process's DP group."""
    global _group
    if _group is not None:
        raise RuntimeError(f"this process already belongs to a data-parallel group (rank {_group.rank})")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    backend = backend_for(device)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    _group = DPGroup(rank, world_size, dev)
    return _group


def get_dp_group() -> DPGroup | None:
    return _group


def destroy_dp_group() -> None:
    global _group
    if _group is not None and dist.is_initialized():
        dist.destroy_process_group()
    _group = None
