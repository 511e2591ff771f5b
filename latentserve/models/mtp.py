"""DeepSeek-V3's multi-token-prediction (MTP) layer: the draft model of MTP speculative decoding.

Checkpoints store it after the main layers as `model.layers.{num_hidden_layers}.*`: `enorm`, `hnorm`, `eh_proj`,
one full decoder layer (MoE by the `first_k_dense_replace` rule), `shared_head.norm`, and optionally
`embed_tokens` and `shared_head.head`. DeepSeek-V3 ships copies of the main model's embedding and head there;
a checkpoint without them shares the main model's.

The draft for position i+1 reads the main model's output h_i (after its final norm: the hidden state vLLM and
SGLang hand DeepSeek-V3's MTP layer) and token i+1:
`head(shared_head.norm(layer(eh_proj([enorm(e_{i+1}); hnorm(h_i)]))))` with e_{i+1} = embed(t_{i+1}), except
e = 0 at position 0 (vLLM's convention for every MTP it runs), the layer attending over the MTP's own paged latent
KV cache at position i. Why this convention: docs/speculative_decoding.md. Chained drafts (k > 1) feed the MTP
its own output after `shared_head.norm` as h, the counterpart of the main model's normed output (as SGLang does).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from latentserve.config import AttentionConfig
from latentserve.forward_context import StaticForwardContext
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.linear import Linear
from latentserve.layers.moe import MoE
from latentserve.layers.norm import RMSNorm
from latentserve.layers.rotary import RotaryEmbedding
from latentserve.models.config import ModelConfig
from latentserve.models.deepseek import (
    DeepseekAttention,
    DeepseekDecoderLayer,
    DeepseekForCausalLM,
    _default_dtype,
    attention_layer_name,
    build_attention,
)
from latentserve.models.loader import (
    STORED_DTYPES,
    _materialize,
    _parameters_on_meta,
    checkpoint_files,
    checkpoint_name,
    dequantized,
    open_checkpoint,
    param_name,
    process_weights_after_loading,
)


def mtp_prefix(config: ModelConfig) -> str:
    """Checkpoint name prefix of the (first) MTP layer."""
    return f"model.layers.{config.num_hidden_layers}."


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if own_head:
            self.head = Linear(config.hidden_size, config.vocab_size, bias=False)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """A decoder layer plus the MTP input projection and output norm; parameter names follow the checkpoint."""

    def __init__(self, config: ModelConfig, attention: DeepseekAttention, own_embed: bool, own_head: bool) -> None:
        super().__init__(config, config.num_hidden_layers, attention)
        h = config.hidden_size
        self.enorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(config, own_head)
        if own_embed:
            self.embed_tokens = nn.Embedding(config.vocab_size, h)


class DeepseekMTP(nn.Module):
    """The MTP draft model: its layer and its own static forward context (so its own KV cache)."""

    def __init__(
        self,
        main: DeepseekForCausalLM,
        own_embed: bool = False,
        own_head: bool = False,
        attn_config: AttentionConfig = AttentionConfig(),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        config = main.config
        if config.num_nextn_predict_layers < 1:
            raise ValueError("config.json declares no MTP layer (num_nextn_predict_layers is 0)")
        self.config = config
        self.mla_config = config.mla_config
        self.static_forward_context = StaticForwardContext()
        idx = config.num_hidden_layers
        self.attention_layer_names = [attention_layer_name(idx)]
        with torch.device(device), _default_dtype(dtype):
            self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, config.rope, config.rope_style)
            attention = build_attention(
                config, idx, self.rotary_emb, attn_config, self.static_forward_context, dtype, device
            )
            self.layer = DeepseekMTPLayer(config, attention, own_embed, own_head)
        # Borrowed from the main model unless the checkpoint has the MTP's own; a tuple keeps them out of our
        # parameters (they are loaded, and counted, once: with the main model).
        self._shared = (
            self.layer.embed_tokens if own_embed else main.model.embed_tokens,
            self.layer.shared_head.head if own_head else main.lm_head,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor) -> torch.Tensor:
        """Token t_{i+1} `[T]`, the position i of the hidden state it pairs with `[T]`, h_i `[T, hidden]` ->
        the layer's output after `shared_head.norm` `[T, hidden]` (the h of a chained draft)."""
        embed, _ = self._shared
        layer = self.layer
        embeds = embed(input_ids).masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(previous_hidden)], dim=-1))
        cos, sin = self.rotary_emb.cos_sin(positions)
        return layer.shared_head.norm(layer(cos, sin, x))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 draft logits `[T, vocab_size]` for the tokens after the next."""
        _, head = self._shared
        return head(hidden).float()


def _checkpoint_names(model_dir: Path, prefix: str) -> set[str]:
    names: set[str] = set()
    for file in checkpoint_files(model_dir):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(name for name in f.keys() if name.startswith(prefix))
    return names


def _copy_weights(mtp: DeepseekMTP, prefix: str, tensors) -> None:
    """Strict about names, dtypes and shapes, like the main loader."""
    targets = {prefix + name: p for name, p in mtp.layer.state_dict(keep_vars=True).items()}
    loaded: set[str] = set()
    for name, tensor in tensors:
        target = targets.get(param_name(name))
        if target is None:
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint's MTP layer")
        if tensor.dtype not in STORED_DTYPES:
            raise ValueError(f"tensor {name!r} is stored as {tensor.dtype}; supported: fp32, bf16, fp16")
        if tensor.shape != target.shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the MTP layer expects "
                             f"{tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(param_name(name))
    missing = sorted(checkpoint_name(n) for n in set(targets) - loaded)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint's MTP layer is missing tensor(s) {shown}{more}")


def load_mtp(
    path: str | Path,
    main: DeepseekForCausalLM,
    attn_config: AttentionConfig = AttentionConfig(),
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    policy: KernelPolicy | None = None,
) -> DeepseekMTP:
    """The MTP layer of the checkpoint at `path`, whose main model is `main`; refuses a checkpoint without one.
    An FP8 checkpoint's layer is dequantized as the main model's is; int8/int4 quantization leaves it alone. Its
    kernels: `policy`'s (the engine's; None: the default one)."""
    model_dir = Path(path)
    config = main.config
    if config.num_nextn_predict_layers < 1:
        raise ValueError(f"{model_dir}/config.json declares no MTP layer (num_nextn_predict_layers is 0): "
                         "this checkpoint cannot draft with method 'mtp'")
    prefix = mtp_prefix(config)
    names = _checkpoint_names(model_dir, prefix)
    if not names:
        raise ValueError(f"{model_dir}/config.json declares num_nextn_predict_layers="
                         f"{config.num_nextn_predict_layers} but the checkpoint has no '{prefix}*' tensors: "
                         "its MTP weights are missing")
    with _parameters_on_meta():
        mtp = DeepseekMTP(main, prefix + "embed_tokens.weight" in names, prefix + "shared_head.head.weight" in names,
                          attn_config, dtype, device)
    for moe in (m for m in mtp.modules() if isinstance(m, MoE)):
        moe.stack_experts(device)  # two grouped GEMMs per step, as in the main model, instead of a loop
    _materialize(mtp, device, set())
    # Dequantized as the main model's weights are read (FP8, GPTQ, ...); int8/int4 leave the layer alone.
    tensors = dequantized(open_checkpoint(model_dir, config, lambda name: name.startswith(prefix)))
    _copy_weights(mtp, prefix, tensors)
    process_weights_after_loading(mtp, policy or default_policy())
    return mtp.eval()
