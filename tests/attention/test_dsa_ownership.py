"""DSA's top-k state follows the ownership rule: each builder owns its own, DBO on equals DBO off, and a state
shared across ubatches (the seed's bug, for the indexer) is caught."""
import pytest
import torch

from latentserve.attention.dsa.state import TopKState
from latentserve.attention.prefill.base import OwnershipError
from latentserve.config import AttentionConfig
from latentserve.layers.rotary import RopeConfig, RotaryEmbedding
from latentserve.ubatch.dbo import run_forward
from latentserve.ubatch.runner import UBatchError
from latentserve.ubatch.slicing import split_ubatches
from tests.attention import dsa_case as D

BLOCK, TOPK = 4, 8
LENGTHS = [30, 26, 18]
# two decodes over long contexts, then a prefill continuing over its context: ubatch 0 takes the decodes and the
# prefill's head, ubatch 1 its tail (reading keys ubatch 0 wrote in the same layer)
PREFILL = [(29, 30), (25, 26), (4, 18)]


def setup():
    """A GLM-5 pair: a layer with an indexer, then one sharing its top-k."""
    ref = D.hf_indexer(True, TOPK, seed=0)
    config = AttentionConfig(block_size=BLOCK)
    layers, ctx = D.make_layers(config, TOPK, [D.our_indexer(ref, True, TOPK), None], num_blocks=40)
    seqs = D.make_sequences(LENGTHS, len(layers))
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(5))
    tables = perm[: 8 * len(LENGTHS)].view(len(LENGTHS), 8).int()
    return config, layers, ctx, seqs, tables


def forward_fn(layers, rotary):
    """The layers' forward over token-indexed inputs, as a model forward that run_forward can split."""
    def forward(hidden, q_resid, positions, *per_layer):
        cos, sin = rotary.cos_sin(positions)
        outs = []
        for i, layer in enumerate(layers):
            q, c, k_pe = per_layer[3 * i : 3 * i + 3]
            outs.append(layer(q, c, k_pe, D.IndexerInputs(hidden, q_resid, cos, sin)))
        return torch.cat(outs, dim=-1)
    return forward


def prefill_context(config, layers, ctx, seqs, tables, rotary):
    """Write every request's context (positions before this test's step) into both caches, unsplit."""
    builder = D.builders(layers, ctx, config)[0]
    spans = [(0, s) for s, _ in PREFILL]
    run_step([builder], layers, seqs, tables, rotary, spans, split=False)


def run_step(builders, layers, seqs, tables, rotary, spans, split: bool):
    reqs = list(range(len(spans)))
    common = D.step_common(seqs, reqs, spans, tables, BLOCK)
    inputs = []
    for i in range(len(layers)):
        q, c, k_pe, x = D.step_inputs(seqs, reqs, spans, i, rotary)
        inputs += [q, c, k_pe]
    positions = torch.cat([torch.arange(s, e) for s, e in spans])
    slices = split_ubatches(common, 1) if split else None
    return run_forward(forward_fn(layers, rotary), [x.hidden, x.q_resid, positions, *inputs], common, builders, slices)


def test_each_builder_owns_its_topk_state():
    config, layers, ctx, *_ = setup()
    b0, b1 = D.builders(layers, ctx, config, 2)
    assert b0.dsa.state is not b1.dsa.state
    with pytest.raises(OwnershipError, match="already owned"):
        b0.dsa.state.claim(b1)


def test_dbo_on_equals_off_with_a_split_request_and_shared_topk():
    config, layers, ctx, seqs, tables = setup()
    rotary = RotaryEmbedding(D.ROPE, RopeConfig(), "interleave")
    prefill_context(config, layers, ctx, seqs, tables, rotary)
    whole = run_step(D.builders(layers, ctx, config), layers, seqs, tables, rotary, PREFILL, split=False)
    split_builders = D.builders(layers, ctx, config, 2)
    common = D.step_common(seqs, [0, 1, 2], PREFILL, tables, BLOCK)
    assert len(split_ubatches(common, 1)) == 2
    split = run_step(split_builders, layers, seqs, tables, rotary, PREFILL, split=True)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_a_topk_state_shared_by_both_ubatches_is_caught():
    """As if the selection lived on the layer: ubatch 1's indexer would overwrite what ubatch 0's next layer reads."""
    config, layers, ctx, seqs, tables = setup()
    rotary = RotaryEmbedding(D.ROPE, RopeConfig(), "interleave")
    prefill_context(config, layers, ctx, seqs, tables, rotary)
    b0, b1 = D.builders(layers, ctx, config, 2)
    b1.dsa.state = b0.dsa.state  # the bug: one state reached from both builders
    with pytest.raises(UBatchError, match="top-k state .* shared across ubatches") as info:
        run_step([b0, b1], layers, seqs, tables, rotary, PREFILL, split=True)
    assert isinstance(info.value.__cause__, OwnershipError)


def test_a_fresh_state_refuses_a_store_for_another_batch():
    state = TopKState(debug=True)
    with pytest.raises(OwnershipError):
        state.store(object(), torch.zeros(1, 1), "layer.0")
