"""Test-wide settings and fixtures."""
import pytest
import torch

# Test models are tiny: one intra-op thread avoids thread hand-off costs that dwarf the math
# (and the spin-waits that slow everything when other processes share the cores).
torch.set_num_threads(1)


@pytest.fixture
def threads(request):
    """torch's intra-op threads (and so the kernels') set to the test's parameter (`indirect=True`), restored after:
    with more, `linear` lays out one-row and few-row products differently (layers/linear.py), and the kernels split
    their work otherwise."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)
