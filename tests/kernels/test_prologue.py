"""kernels/prologue.c (MLA's latent norm, RoPE and cache write in one call) against the torch ops it replaces, to the
bit, for each build this machine runs."""
import pytest
import torch

from latentserve.attention.kv_cache import quantize_int8_rows
from latentserve.kernels import native
from latentserve.layers.rotary import ROPE_STYLES, RopeConfig, RotaryEmbedding
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build
HEADS, NOPE, LATENT, ROPE = 3, 16, 40, 32  # 40: a norm tail shorter than a vector
FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("style", ROPE_STYLES)
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16), (torch.float32, FP8),
                                                (torch.bfloat16, FP8), (torch.float32, torch.int8),
                                                (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("tokens", [1, 3, 20])  # 20: tokens shared out among threads
def test_prologue_equals_the_torch_ops(isa, style, dtype, cache_dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(ROPE, RopeConfig(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8), style)
    cos, sin = rotary.cos_sin(torch.randint(0, 5000, (tokens,), generator=g))
    q = (torch.randn(tokens, HEADS, NOPE + ROPE, generator=g) * 3).to(dtype)
    kv = (torch.randn(tokens, LATENT + ROPE, generator=g) * 3).to(dtype)
    weight = torch.randn(LATENT, generator=g).to(dtype)
    width = LATENT + ROPE + 8 * (cache_dtype == torch.int8)  # an int8 row's scales
    cache = torch.full((4, 8, width), 7.0).to(cache_dtype)
    slots = torch.randperm(32, generator=g)[:tokens]
    slots[0] = -1  # padding: not written

    expected_q = q.clone()
    q_pe = expected_q[..., NOPE:]
    q_pe.copy_(rotary.rotate(q_pe, cos[:, None], sin[:, None]))
    expected_c = native.rms_norm(kernels(isa), kv[:, :LATENT], weight, 1e-6)
    expected_pe = rotary.rotate(kv[:, LATENT:], cos, sin)
    expected_cache = cache.clone()
    rows = torch.cat([expected_c, expected_pe], dim=-1)
    if cache_dtype == FP8:  # torch's rounding (nearest even) of the rows clamped to e4m3's +-448; as bytes
        rows, expected_cache = rows.clamp(-448, 448).to(FP8).view(torch.uint8), expected_cache.view(torch.uint8)
    if cache_dtype == torch.int8:  # the torch write path's quantization, to the byte
        rows = quantize_int8_rows(expected_c, expected_pe)
    expected_cache.view(-1, width)[slots[1:]] = rows[1:].to(expected_cache.dtype)

    kv_c, k_pe = native.mla_prologue(kernels(isa), q, kv, weight, 1e-6, cos, sin, style, cache, slots)
    assert torch.equal(kv_c, expected_c) and torch.equal(k_pe, expected_pe)
    assert torch.equal(q, expected_q) and torch.equal(cache.view(expected_cache.dtype), expected_cache)


@pytest.mark.parametrize("isa", ISAS)
def test_prologue_rounds_to_fp8_as_torch_does(isa):
    """Every magnitude e4m3 spans, subnormals (below 2^-6), halfway cases and values past 448 (saturated), in
    latents of both signs: the kernel's bytes equal torch's conversion of the clamped rows. A unit norm weight and
    cos 1, sin 0 pass the latent's scale and the rope part through."""
    g = torch.Generator().manual_seed(0)
    tokens = 64
    magnitudes = torch.exp2(torch.empty(tokens, LATENT + ROPE).uniform_(-12, 10, generator=g))
    kv = magnitudes * torch.randn(tokens, LATENT + ROPE, generator=g).sign()
    kv[0, LATENT:] = torch.tensor([2.0 ** -9 * (k + 0.5) for k in range(ROPE)])  # subnormal halfway cases
    kv[1, LATENT:] = 448 + torch.arange(ROPE) * 2.0  # 448 and past it
    cos, sin = torch.ones(tokens, ROPE), torch.zeros(tokens, ROPE)
    q = torch.zeros(tokens, HEADS, NOPE + ROPE)
    cache = torch.zeros(tokens, 1, LATENT + ROPE, dtype=FP8)
    native.mla_prologue(kernels(isa), q, kv, torch.ones(LATENT), 1e-6, cos, sin, "neox", cache,
                        torch.arange(tokens))
    normed = kv[:, :LATENT] * torch.rsqrt(kv[:, :LATENT].pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = torch.cat([normed, kv[:, LATENT:]], dim=-1).clamp(-448, 448).to(FP8)
    assert torch.equal(cache[:, 0, LATENT:].view(torch.uint8), expected[:, LATENT:].view(torch.uint8))
    assert (cache[:, 0, :LATENT].float() - expected[:, :LATENT].float()).abs().le(
        expected[:, :LATENT].float().abs() * 2 ** -3 + 2 ** -10).all()  # the norm's own rounding: one fp8 step


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
