"""What the data-parallel tests ask of a multi-rank `LLM` and of the processes behind it."""
from __future__ import annotations

from tests.distributed import rpc


def rank_steps(llm) -> list[list[tuple[int, int]]]:
    """Per rank, (tokens, ubatches) of each step since the last call (after `rpc.log_steps` is installed)."""
    return llm.dp_engine.collective_rpc(rpc.pop_steps)


def process_gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped by its new parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
