"""Fixtures of the model tests."""
import pytest
import torch


@pytest.fixture
def threads(request):
    """torch's intra-op threads set to the test's parameter (`indirect=True`; tests/conftest.py sets one), restored
    after: with more, `linear` lays out one-row and few-row products differently (layers/linear.py)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)
