"""The kernels' boundary rule (checks.py): arguments a kernel would read or write out of bounds, or read as the wrong
thing, are a ValueError naming the argument, before any address goes to C. Each case here was an out-of-bounds read
or write, or a silently wrong result, before the checks; `make sanitize` runs these under AddressSanitizer."""
from __future__ import annotations

import ctypes

import pytest
import torch

from latentserve.kernels import native
from latentserve.layers.quant.int4 import quantize_int4
from latentserve.layers.quant.int8 import quantize_int8
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build


def _k():
    return kernels(ISAS[0])


def _int8_weight(n: int = 8, k: int = 64):
    q, scale = quantize_int8(torch.randn(n, k))
    return q, scale, q.sum(dim=1, dtype=torch.int32)


def test_dense_linear_checks_what_it_reads():
    with pytest.raises(ValueError, match=r"dense_linear: weight must be .* \[\*, 64\]; got cpu float32 \[8, 16\]"):
        native.dense_linear(_k(), torch.randn(1, 64), torch.randn(8, 16))  # a weight narrower than x
    with pytest.raises(ValueError, match=r"dense_linear: x must be a CPU tensor, contiguous .* non-contiguous"):
        native.dense_linear(_k(), torch.randn(64, 2).t(), torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"dense_linear: x must be a CPU tensor.*got meta"):
        native.dense_linear(_k(), torch.empty(1, 64, device="meta"), torch.randn(8, 64))


def test_rms_norm_checks_what_it_reads():
    with pytest.raises(ValueError, match=r"rms_norm: weight must be .* \[100\]; got cpu float32 \[50\]"):
        native.rms_norm(_k(), torch.randn(2, 100), torch.randn(50), 1e-6)  # a weight shorter than the row
    with pytest.raises(ValueError, match=r"rms_norm: x must be a CPU tensor.*got meta"):  # data_ptr 0: a segfault
        native.rms_norm(_k(), torch.empty(2, 64, device="meta"), torch.randn(64), 1e-6)
    with pytest.raises(ValueError, match=r"rms_norm: x must have at least one dimension"):
        native.rms_norm(_k(), torch.tensor(1.0), torch.randn(1), 1e-6)


def test_int8_linear_checks_what_it_reads():
    q, scale, qsum = _int8_weight()
    packed = native.pack_int8(q, scale)
    with pytest.raises(ValueError, match=r"int8_linear: x must be .*float32 or bfloat16.*got cpu float16"):
        native.int8_linear(_k(), torch.randn(1, 64).half(), packed, 8)  # fp16 read as fp32
    with pytest.raises(ValueError, match=r"int8_linear: packed \(int8 weight of 8 outputs, 128 inputs in pack_int8's "
                                         r"layout\) must be .* \[1, 2176\]; got cpu int8 \[1, 1152\]"):
        native.int8_linear(_k(), torch.randn(1, 128), packed, 8)  # x wider than the weight
    with pytest.raises(ValueError, match=r"int8_linear: packed .* \[2, 1152\]; got cpu int8 \[1, 1152\]"):
        native.int8_linear(_k(), torch.randn(1, 64), packed, 20)  # more outputs than the weight holds
    with pytest.raises(ValueError, match=r"int8_linear: x must be .* non-contiguous"):
        native.int8_linear(_k(), torch.randn(64, 2).t(), packed, 8)
    with pytest.raises(ValueError, match=r"int8_linear: the int8 kernels take K a multiple of 4; got K 66"):
        native.int8_linear(_k(), torch.randn(1, 66), packed, 8)
    with pytest.raises(ValueError, match=r"int8_heads: scale must be .* of 24 elements; got cpu float32 \[8\]"):
        native.int8_heads(_k(), torch.randn(1, 3, 64), q.expand(3, 8, 64).contiguous(), scale, qsum)


def test_experts_check_their_ids_cover_every_token():
    table = native.expert_table(list(zip(torch.randn(2, 16, 16), torch.randn(2, 16, 8))), 16, 8, ((32, 0), (32, 0)))
    with pytest.raises(ValueError, match=r"experts: ids must be .* \[4, \*\]; got cpu int64 \[1, 2\]"):
        native.experts(_k(), torch.randn(4, 16), table, torch.zeros(1, 2).long(), torch.ones(1, 2))


HEADS, NOPE, LATENT, ROPE, BLOCK = 2, 16, 32, 16, 4


def _prologue_args(tokens: int = 4):
    q = torch.randn(tokens, HEADS, NOPE + ROPE)
    kv, weight = torch.randn(tokens, LATENT + ROPE), torch.randn(LATENT)
    cos, sin = torch.ones(tokens, ROPE), torch.zeros(tokens, ROPE)
    return q, kv, weight, 1e-6, cos, sin, "neox", torch.zeros(3, BLOCK, LATENT + ROPE), torch.arange(tokens)


def test_mla_prologue_checks_what_it_reads_and_where_it_writes():
    q, kv, weight, eps, cos, sin, style, cache, slots = _prologue_args()
    with pytest.raises(ValueError, match=r"mla_prologue: cos must be .* \[4, \*\]; got cpu float32 \[1, 16\]"):
        native.mla_prologue(_k(), q, kv, weight, eps, cos[:1], sin[:1], style, cache, slots)  # one token of four
    with pytest.raises(ValueError, match=r"mla_prologue: slot_mapping must be .* \[4\]; got cpu int64 \[2\]"):
        native.mla_prologue(_k(), q, kv, weight, eps, cos, sin, style, cache, slots[:2])
    before = cache.clone()
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 12 lies past the cache's 12 slots"):
        native.mla_prologue(_k(), q, kv, weight, eps, cos, sin, style, cache, torch.tensor([0, -1, 12, 3]))
    assert torch.equal(cache, before)  # nothing written
    with pytest.raises(ValueError, match=r"even number of rope dims up to 1024, got 15"):
        native.mla_prologue(_k(), q, kv, weight, eps, cos[:, :15], sin[:, :15], style, cache, slots)
    wide = native.abi.MAX_LATENT + 1 - ROPE  # a latent whose cache row decode attention could not read
    q, kv, weight = torch.randn(4, HEADS, NOPE + ROPE), torch.randn(4, wide + ROPE), torch.randn(wide)
    with pytest.raises(ValueError, match=r"kv's rows of 2049 \(latent \+ rope\) are wider than the 2048"):
        native.mla_prologue(_k(), q, kv, weight, eps, cos, sin, style, torch.zeros(1, BLOCK, wide + ROPE), slots)


def _decode_args(seq_len: int = 6, tokens: int = 1):
    q = torch.randn(tokens, HEADS, LATENT + ROPE)
    cache = torch.randn(3, BLOCK, LATENT + ROPE)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    return q, cache, table, qsl, torch.tensor([seq_len], dtype=torch.int32), 0.1, LATENT


def test_mla_decode_checks_the_blocks_it_reads():
    q, cache, table, qsl, lens, scale, latent = _decode_args()
    with pytest.raises(ValueError, match=r"mla_decode: block_table names a block outside the cache's 3"):
        native.mla_decode(_k(), q, cache, torch.tensor([[2, 3]], dtype=torch.int32), qsl, lens, scale, latent)
    with pytest.raises(ValueError, match=r"longer than its row of the block table \(2 blocks of 4\)"):
        native.mla_decode(_k(), q, cache, table, qsl, torch.tensor([9], dtype=torch.int32), scale, latent)
    with pytest.raises(ValueError, match=r"mla_decode: latent must be in 1..48 .* got 64"):
        native.mla_decode(_k(), q, cache, table, qsl, lens, scale, 64)  # latent > dim: a wrong result before
    with pytest.raises(ValueError, match=r"mla_decode: query_start_loc must be .* \[2\]; got cpu int32 \[3\]"):
        native.mla_decode(_k(), q, cache, table, torch.tensor([0, 1, 1], dtype=torch.int32), lens, scale, latent)


def test_mla_decode_checks_the_tokens_it_writes():
    q, cache, table, _, lens, scale, latent = _decode_args()
    with pytest.raises(ValueError, match=r"query_start_loc must rise from >= 0 to at most the 1 query tokens"):
        native.mla_decode(_k(), q, cache, table, torch.tensor([0, 3], dtype=torch.int32), lens, scale, latent)


def test_mla_decode_refuses_rows_wider_than_its_stack_takes():
    """Each decode item keeps its heads' queries and sums on its thread's stack: cache rows past LS_MAX_LATENT
    (latent + rope) once overran it (a segfault at 262144), now a ValueError from the wrapper and, past it, from C."""
    width = native.abi.MAX_LATENT + 1
    q, cache = torch.randn(1, 2, width), torch.randn(1, BLOCK, width)
    table, qsl, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), torch.tensor(
        [2], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"q's rows of {width} \(latent \+ rope\) are wider than the 2048"):
        native.mla_decode(_k(), q, cache, table, qsl, lens, 0.1, 8)
    out = torch.empty(1, 2, 8)
    lib = _k().lib
    code = lib.ls_mla_decode(*(native.desc(t) for t in (q, cache, table, qsl, lens)), ctypes.c_float(0.1),
                             native.desc(out), 1)
    assert code == native.abi.BAD_TENSOR and "over the 2048 decode attention takes" in lib.ls_last_error().decode()
    at_limit = torch.randn(1, 2, native.abi.MAX_LATENT), torch.randn(1, BLOCK, native.abi.MAX_LATENT)
    assert native.mla_decode(_k(), *at_limit, table, qsl, lens, 0.1, 8).shape == (1, 2, 8)


@pytest.mark.parametrize("isa", ISAS)
def test_a_query_token_that_sees_nothing_gets_zeros(isa):
    """Token 0 of a request of 2 new tokens but 1 position sees none, token 2 belongs to no request: zeros, not the
    memory the output happened to get (poisoned first with NaNs, which the allocator hands out again)."""
    q, cache, table, _, _, scale, latent = _decode_args(tokens=3)
    qsl, lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    poison = torch.full((3 * HEADS * latent,), float("nan"))
    del poison
    out = native.mla_decode(kernels(isa), q, cache, table, qsl, lens, scale, latent)
    assert torch.equal(out[0], torch.zeros(HEADS, latent)) and torch.equal(out[2], torch.zeros(HEADS, latent))
    row = cache[2, 0, :latent]  # token 1 sees position 0 alone: its softmax weighs that row by 1
    torch.testing.assert_close(out[1], row.expand(HEADS, latent), rtol=1e-6, atol=1e-6)


def test_int4_linear_checks_its_activations():
    with pytest.raises(ValueError, match=r"int4_linear: x must be .*float32 or bfloat16.*got cpu float64"):
        native.int4_linear(_k(), torch.randn(1, 64).double(), torch.zeros(1, 128, dtype=torch.uint8), 64, 16)


def test_expert_tables_check_each_weight_in_its_projections_format():
    """Each weight against its projection's own format: an int8 down beside int4 gate_up is read as int8."""
    q, scale, _ = _int8_weight(64, 32)  # down of I = 32 to K = 64
    gate_up = native.pack_int4(*quantize_int4(torch.randn(64, 64), 64))  # gate_up of I = 32 over K = 64
    table = native.expert_table([(gate_up, native.pack_int8(q, scale))], 64, 32, ((4, 64), (8, 0)))
    native.experts(_k(), torch.randn(1, 64), table, torch.zeros(1, 1).long(), torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"expert_table: experts\[0\].down \(int8 weight of 64 outputs, 32 inputs in "
                                         r"pack_int8's layout\) must be .* \[4, 640\]; got cpu int8 \[2, 1152\]"):
        native.expert_table([(gate_up, native.pack_int8(q.t().contiguous(), scale[:32]))], 64, 32, ((4, 64), (8, 0)))
    with pytest.raises(ValueError, match=r"expert_table: int4 kernels take .* K a multiple of 64; got .* K 32"):
        native.expert_table([(gate_up, native.pack_int8(q, scale))], 64, 32, ((4, 64), (4, 32)))
