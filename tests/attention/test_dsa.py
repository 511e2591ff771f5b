"""DSA attention against transformers' indexer and naive fp32 masked attention: prefill, chunked prefill with
context, decode, the dense fallback, GLM-5's layers sharing a previous layer's top-k."""
import pytest
import torch

from latentserve.config import AttentionConfig
from latentserve.forward_context import ForwardContext, set_forward_context
from latentserve.layers.rotary import RopeConfig, RotaryEmbedding
from tests.attention import dsa_case as D

BLOCK = 4
LENGTHS = [41, 29, 12]
# (requests, per request the positions it computes): prefills; a decode and a chunked prefill over its context;
# a lone decode.
STEPS = [([0, 1, 2], [(0, 24), (0, 28), (0, 12)]), ([1, 0], [(28, 29), (24, 40)]), ([0], [(40, 41)])]
MLA_OUT = D.MLA.num_heads * D.MLA.v_head_dim


def block_tables(num_blocks: int) -> torch.Tensor:
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3))
    width = -(-max(LENGTHS) // BLOCK)
    return perm[: width * len(LENGTHS)].view(len(LENGTHS), width).int()


def run_steps(layers, builder, seqs, tables, rotary):
    """Every step's outputs per layer, rows scattered back per request and position; the steps' DSA metadata."""
    outs = [[torch.full((s.length, MLA_OUT), float("nan")) for s in seqs] for _ in layers]
    dense = []
    for reqs, spans in STEPS:
        md = builder.build(D.step_common(seqs, reqs, spans, tables, BLOCK))
        dense.append(md.dsa.dense)
        with set_forward_context(ForwardContext({l.layer_name: md for l in layers})):
            for i, layer in enumerate(layers):
                out = layer(*D.step_inputs(seqs, reqs, spans, i, rotary))
                start = 0
                for r, (s, e) in zip(reqs, spans):
                    outs[i][r][s:e] = out[start : start + e - s]
                    start += e - s
    return outs, dense


@pytest.mark.parametrize("interleaved", [False, True], ids=["v32_half_split", "glm5_interleaved"])
def test_sparse_steps_match_transformers_indexer_and_masked_attention(interleaved):
    topk = 8
    ref = D.hf_indexer(interleaved, topk, seed=0)
    config = AttentionConfig(block_size=BLOCK)
    layers, ctx = D.make_layers(config, topk, [D.our_indexer(ref, interleaved, topk)], num_blocks=40)
    seqs = D.make_sequences(LENGTHS, 1)
    rotary = RotaryEmbedding(D.ROPE, RopeConfig(), "interleave")
    outs, dense = run_steps(layers, D.builders(layers, ctx, config)[0], seqs, block_tables(40), rotary)
    assert dense == [False, False, False]
    for r, seq in enumerate(seqs):
        expected = D.naive_sparse(layers[0], seq, 0, D.reference_topk(ref, seq))
        torch.testing.assert_close(outs[0][r], expected, atol=1e-5, rtol=1e-5)
        # sparsity matters: the full causal attention differs past top-k positions
        assert not torch.allclose(outs[0][r][topk:], D.naive_sparse(layers[0], seq, 0, None)[topk:], atol=1e-3)


def test_contexts_within_topk_attend_densely_as_the_reference():
    topk = 64
    ref = D.hf_indexer(False, topk, seed=0)
    config = AttentionConfig(block_size=BLOCK)
    layers, ctx = D.make_layers(config, topk, [D.our_indexer(ref, False, topk)], num_blocks=40)
    seqs = D.make_sequences(LENGTHS, 1)
    outs, dense = run_steps(layers, D.builders(layers, ctx, config)[0], seqs, block_tables(40),
                            RotaryEmbedding(D.ROPE, RopeConfig(), "interleave"))
    assert dense == [True, True, True]
    for r, seq in enumerate(seqs):
        torch.testing.assert_close(outs[0][r], D.naive_sparse(layers[0], seq, 0, D.reference_topk(ref, seq)),
                                   atol=1e-5, rtol=1e-5)


def test_a_shared_layer_attends_the_previous_indexer_layers_topk():
    """GLM-5: a layer without an indexer reuses the selection of the last layer with one, in the same forward."""
    topk = 8
    ref = D.hf_indexer(True, topk, seed=0)
    config = AttentionConfig(block_size=BLOCK)
    layers, ctx = D.make_layers(config, topk, [D.our_indexer(ref, True, topk), None], num_blocks=40)
    assert list(layers[1].extra_caches) == []  # no indexer, no indexer cache
    seqs = D.make_sequences(LENGTHS, 2)
    outs, _ = run_steps(layers, D.builders(layers, ctx, config)[0], seqs, block_tables(40),
                        RotaryEmbedding(D.ROPE, RopeConfig(), "interleave"))
    for r, seq in enumerate(seqs):
        torch.testing.assert_close(outs[1][r], D.naive_sparse(layers[1], seq, 1, D.reference_topk(ref, seq)),
                                   atol=1e-5, rtol=1e-5)


def test_a_shared_layer_without_an_earlier_indexer_is_a_clear_error():
    config = AttentionConfig(block_size=BLOCK)
    layers, ctx = D.make_layers(config, 8, [None], num_blocks=40)
    seqs = D.make_sequences(LENGTHS, 1)
    reqs, spans = STEPS[0]
    md = D.builders(layers, ctx, config)[0].build(D.step_common(seqs, reqs, spans, block_tables(40), BLOCK))
    with set_forward_context(ForwardContext({"layer.0": md})), pytest.raises(RuntimeError, match="no layer before"):
        layers[0](*D.step_inputs(seqs, reqs, spans, 0, RotaryEmbedding(D.ROPE, RopeConfig(), "interleave")))


def test_settings_a_builder_cannot_serve_are_clear_errors():
    ref = D.hf_indexer(False, 8, seed=0)
    config = AttentionConfig(block_size=BLOCK, workspace_tokens=4)
    layers, ctx = D.make_layers(config, 8, [D.our_indexer(ref, False, 8)], num_blocks=8)
    with pytest.raises(ValueError, match="workspace_tokens=4 must hold one token's top-k rows"):
        D.builders(layers, ctx, config)
    config = AttentionConfig(block_size=BLOCK)
    layers, ctx = D.make_layers(config, 8, [D.our_indexer(ref, False, 8), None], num_blocks=8)
    layers[1].index_topk = 16
    with pytest.raises(ValueError, match=r"different top-k counts \[8, 16\]"):
        D.builders(layers, ctx, config)
