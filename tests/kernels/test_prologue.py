"""kernels/prologue.c (MLA's latent norm, RoPE and cache write in one call) against the torch ops it replaces, to the
bit, for each build this machine runs."""
import pytest
import torch

from latentserve.kernels import native
from latentserve.layers.rotary import ROPE_STYLES, RopeConfig, RotaryEmbedding
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build
HEADS, NOPE, LATENT, ROPE = 3, 16, 40, 32  # 40: a norm tail shorter than a vector


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("style", ROPE_STYLES)
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("tokens", [1, 3, 20])  # 20: tokens shared out among threads
def test_prologue_equals_the_torch_ops(isa, style, dtype, cache_dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(ROPE, RopeConfig(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8), style)
    cos, sin = rotary.cos_sin(torch.randint(0, 5000, (tokens,), generator=g))
    q = (torch.randn(tokens, HEADS, NOPE + ROPE, generator=g) * 3).to(dtype)
    kv = (torch.randn(tokens, LATENT + ROPE, generator=g) * 3).to(dtype)
    weight = torch.randn(LATENT, generator=g).to(dtype)
    cache = torch.full((4, 8, LATENT + ROPE), 7.0, dtype=cache_dtype)
    slots = torch.randperm(32, generator=g)[:tokens]
    slots[0] = -1  # padding: not written

    expected_q = q.clone()
    q_pe = expected_q[..., NOPE:]
    q_pe.copy_(rotary.rotate(q_pe, cos[:, None], sin[:, None]))
    expected_c = native.rms_norm(kernels(isa), kv[:, :LATENT], weight, 1e-6)
    expected_pe = rotary.rotate(kv[:, LATENT:], cos, sin)
    expected_cache = cache.clone()
    rows = torch.cat([expected_c, expected_pe], dim=-1).to(cache_dtype)
    expected_cache.view(-1, LATENT + ROPE)[slots[1:]] = rows[1:]

    kv_c, k_pe = native.mla_prologue(kernels(isa), q, kv, weight, 1e-6, cos, sin, style, cache, slots)
    assert torch.equal(kv_c, expected_c) and torch.equal(k_pe, expected_pe)
    assert torch.equal(q, expected_q) and torch.equal(cache, expected_cache)


def test_prologue_refuses_what_it_cannot_read():
    q, kv, w = torch.randn(1, 2, 48), torch.randn(1, 72), torch.randn(40)
    cos = sin = torch.ones(1, 32)
    cache = torch.zeros(2, 4, 72)
    with pytest.raises(ValueError, match="q must be a CPU tensor, contiguous float32 "):
        native.mla_prologue(kernels(ISAS[0]), q.bfloat16(), kv, w, 1e-6, cos, sin, "neox", cache, torch.zeros(1).long())
    with pytest.raises(ValueError, match="rope style must be one of"):
        native.mla_prologue(kernels(ISAS[0]), q, kv, w, 1e-6, cos, sin, "yarn", cache, torch.zeros(1).long())
    with pytest.raises(ValueError, match="slot_mapping must be a CPU tensor, contiguous int64"):
        native.mla_prologue(kernels(ISAS[0]), q, kv, w, 1e-6, cos, sin, "neox", cache, torch.zeros(1).int())
