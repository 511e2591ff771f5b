"""Scale-out over torch.distributed: process groups, launch, expert-parallel all-to-all, link emulation."""
