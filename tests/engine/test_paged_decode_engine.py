"""The engine with its CPU decode backends (NATIVE, the default where latentserve's kernels build, and PAGED) against
the same engine on the REFERENCE decode backend."""
from __future__ import annotations

import pytest
import torch

from latentserve import LLM, SamplingParams
from latentserve.attention.decode.native import NativeMQADecodeBackend
from latentserve.attention.decode.paged import PagedMQADecodeBackend
from tests.checkpoints import make_checkpoint

# Long prompts make runs of blocks read in place; running them together interleaves their decode blocks.
PROMPTS = [
    [i % 90 + 3 for i in range(137)], [(7 * i) % 95 + 1 for i in range(90)], [i % 40 + 50 for i in range(70)], [9, 4, 11],
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "v3")


@pytest.mark.parametrize("backend", [None, "PAGED"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_cpu_decode_backends_match_reference_engine(checkpoint, block_size, backend):
    # fp32: dtype="auto" is bf16 on a bf16 CPU, whose round-off exceeds the tolerance below.
    kwargs = dict(dtype="float32", block_size=block_size, num_kv_blocks=4096 // block_size, max_num_batched_tokens=512)
    llm = LLM(model=str(checkpoint), decode_backend=backend, **kwargs)
    layer = next(iter(llm.engine.model.static_forward_context.values()))
    default = NativeMQADecodeBackend if NativeMQADecodeBackend.unavailable_reason() is None else PagedMQADecodeBackend
    assert type(layer.decode_backend) is (default if backend is None else PagedMQADecodeBackend)
    ours = llm.generate(PROMPTS, PARAMS)
    reference = LLM(model=str(checkpoint), decode_backend="REFERENCE", **kwargs).generate(PROMPTS, PARAMS)
    for a, b in zip(ours, reference):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ours_lp = torch.tensor([lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)])
        ref_lp = torch.tensor([lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)])
        assert (ours_lp - ref_lp).abs().max().item() <= 1e-4
