"""Rotary position embedding with DeepSeek's YaRN scaling, or LongRoPE (MiniCPM3).

DeepSeek checkpoints store each head's rope dims as interleaved pairs (x0, x1), (x2, x3), ..., pair i
rotating at frequency i. Three layouts reach the engine:

- ``gptj``: pairs in, pairs out (DeepSeek-V2's reference rotates complex pairs in place).
- ``interleave``: pairs in, halves out (transformers' DeepSeek-V3 with ``rope_interleave``: the
  rotated even elements, then the rotated odd ones).
- ``neox``: halves in, halves out (DeepSeek-V3 with ``rope_interleave=False``).

q and k always share one layout, so attention scores do not depend on which one the cache holds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from latentserve.kernels.native import ROPE_STYLES  # the styles, in the order the kernels number them



@dataclass(frozen=True)
class RopeConfig:
    """RoPE parameters, already validated and defaulted by the model config."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default", "yarn" or "longrope"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    # LongRoPE: per frequency divisors, short ones for positions within the original context, long ones past it
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "yarn", "longrope"):
            raise ValueError(f"rope_type must be 'default', 'yarn' or 'longrope', got {self.rope_type!r}")
        if (self.rope_type == "longrope") != (self.short_factor is not None and self.long_factor is not None):
            raise ValueError("short_factor and long_factor go with rope_type 'longrope', and only with it")


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extended by `factor`."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN when the config sets it."""
    scale = qk_head_dim**-0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        mscale = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def _yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_get_mscale(rope.factor, rope.mscale) / yarn_get_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_get_mscale(rope.factor)


def _yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    """Dims [low, high] over which YaRN blends extrapolated into interpolated frequencies."""

    def dim_for(num_rotations: float) -> float:
        wavelengths = rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(rope.theta))

    low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _longrope_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))


def rope_frequencies(dim: int, rope: RopeConfig, long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim // 2] fp32, factor on cos/sin) for a `dim`-wide rotary embedding (LongRoPE's: at positions
    within the original context, or past it if `long`)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if len(factors) != dim // 2:
            raise ValueError(f"LongRoPE needs {dim // 2} factors for {dim} rope dims, got {len(factors)}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * pos_freqs), _longrope_attention_factor(rope)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rope.factor * pos_freqs)
    low, high = _yarn_correction_range(rope, dim)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # share of the extrapolated (unscaled) frequency per dim pair
    return interpolated * (1 - keep) + extrapolated * keep, _yarn_attention_factor(rope)


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...): pairs to halves."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _partner(x: torch.Tensor, style: str) -> torch.Tensor:
    """Each element's rotation partner: the other half (halves layout) or the other of its pair (gptj)."""
    if style == "gptj":
        return x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return x.roll(x.shape[-1] // 2, dims=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q_pe [T, N, R] and k_pe [T, R] at flat token positions [T]."""

    def __init__(self, rope_dim: int, rope: RopeConfig, style: str, learned_freq_scale: bool = False) -> None:
        super().__init__()
        if rope_dim < 0 or rope_dim % 2:  # (0: no rope dims, every rotation empty)
            raise ValueError(f"rope dim must be an even number >= 0, got {rope_dim}")
        if style not in ROPE_STYLES:
            raise ValueError(f"rope style must be one of {ROPE_STYLES}, got {style!r}")
        self.rope_dim = rope_dim
        self.style = style
        inv_freq, self.attention_scaling = rope_frequencies(rope_dim, rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Mistral Large 4: every frequency times exp(alpha), alpha learned per frequency (the checkpoint's
        # `lerope.alpha`, fp32); None: the frequencies as they are.
        self.alpha = nn.Parameter(torch.zeros_like(inv_freq)) if learned_freq_scale else None
        # LongRoPE: a token past the original context takes the long factors. (transformers picks one set per
        # forward, by its longest sequence; per token, a request's result does not depend on its batch.)
        self.long_from = rope.original_max_position_embeddings if rope.rope_type == "longrope" else None
        self.register_buffer("long_inv_freq", rope_frequencies(rope_dim, rope, long=True)[0]
                             if self.long_from is not None else None, persistent=False)
        self._table: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (its sources, cos, sin): `cos_sin`

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, R] in fp32 in the output layout, with YaRN's attention factor folded in:
        `rotate` is then x * cos + partner(x) * sin, three elementwise ops per call for every layer.

        Rows of a table of every position up to the largest seen (grown by doubling): a decode step indexes it
        instead of computing its angles (two ops, not a dozen)."""
        needed = int(positions.max()) + 1 if positions.numel() else 0
        sources = self._angle_sources()
        if self._table is None or self._table[0] != sources or self._table[1].shape[0] < needed:
            size = max(needed, 2 * self._table[1].shape[0] if self._table is not None else 0, 256)
            self._table = (sources, *self._angles(torch.arange(size, device=self.inv_freq.device)))
        return self._table[1].index_select(0, positions), self._table[2].index_select(0, positions)

    def _angle_sources(self) -> tuple[tuple[int, int], ...]:
        """The tensors the angles come from, as (address, version): a loaded or replaced alpha, or a move to another
        device, rebuilds the table."""
        return tuple((t.data_ptr(), t._version) for t in (self.inv_freq, self.long_inv_freq, self.alpha)
                     if t is not None)

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` computed for `positions`."""
        # fp32 whatever the model dtype: angles at large positions need the precision.
        inv_freq = self.inv_freq.float()
        if self.long_from is not None:
            inv_freq = torch.where(positions[:, None] >= self.long_from, self.long_inv_freq.float(), inv_freq)
        if self.alpha is not None:
            inv_freq = inv_freq * self.alpha.detach().float().exp()
        freqs = positions.float()[:, None] * inv_freq
        cos, sin = freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling
        if self.style == "gptj":  # (c0, c0, c1, c1, ...), (-s0, s0, -s1, s1, ...)
            return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [..., R]; cos/sin (from `cos_sin`) broadcast against x's leading dims."""
        x32 = x if x.dtype == torch.float32 else x.float()
        if self.style == "interleave":
            x32 = _deinterleave(x32)
        # x1 * cos - x2 * sin is x1 * cos + x2 * (-sin) to the last bit: negation is exact.
        out = (x32 * cos).add_(_partner(x32, self.style) * sin)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def forward(
        self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return self.rotate(q_pe, cos[:, None], sin[:, None]), self.rotate(k_pe, cos, sin)
