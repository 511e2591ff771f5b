"""Tiny random V3 checkpoints with an MTP layer, and a naive fp32 MTP forward of the published formula.

transformers' generic MTP layer (`MtpLayer`) does not zero position 0's embedding as vLLM and latentserve do
(docs/speculative_decoding.md): the layer is written here as DeepSeek stores it (`model.layers.{num_hidden_layers}.*`,
per-expert tensors), and the reference runs its decoder layer through transformers' `DeepseekV3DecoderLayer`, the
rest (norms, `eh_proj`, head) by hand.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.checkpoints import load_reference, make_checkpoint


@dataclass
class ReferenceMTP:
    layer: torch.nn.Module  # transformers' DeepseekV3DecoderLayer holding the MTP layer's weights
    weights: dict[str, torch.Tensor]  # enorm, hnorm, eh_proj, shared_head.norm (+ embed_tokens, shared_head.head)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def make_mtp_checkpoint(tmp_path: Path, own_embed_head: bool = False, seed: int = 0, **overrides):
    """A `v3` checkpoint declaring one MTP layer, with random MTP weights -> (path, transformers main model,
    ReferenceMTP)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    path = make_checkpoint(tmp_path, "v3", seed=seed, num_mtp_layers=1, **overrides)
    main = load_reference(path)
    config = main.config
    n, h = config.num_hidden_layers, config.hidden_size
    layer = DeepseekV3DecoderLayer(config, n).float().eval()
    g = torch.Generator().manual_seed(seed + 7)
    weights = {"enorm.weight": torch.empty(h), "hnorm.weight": torch.empty(h),
               "shared_head.norm.weight": torch.empty(h), "eh_proj.weight": torch.empty(h, 2 * h)}
    if own_embed_head:
        weights["embed_tokens.weight"] = torch.empty(config.vocab_size, h)
        weights["shared_head.head.weight"] = torch.empty(config.vocab_size, h)
    with torch.no_grad():
        for name, tensor in [*layer.named_parameters(), *layer.named_buffers(), *weights.items()]:
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5, generator=g)
            elif name.endswith("e_score_correction_bias"):
                tensor.normal_(0.0, 0.1, generator=g)
            else:
                tensor.normal_(0.0, config.initializer_range, generator=g)
    stored = {f"model.layers.{n}.{k}": v for k, v in weights.items()}
    for name, tensor in layer.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2)
                stored[f"model.layers.{n}.mlp.experts.{e}.gate_proj.weight"] = gate
                stored[f"model.layers.{n}.mlp.experts.{e}.up_proj.weight"] = up
        elif name == "mlp.experts.down_proj":
            for e, down in enumerate(tensor):
                stored[f"model.layers.{n}.mlp.experts.{e}.down_proj.weight"] = down
        else:
            stored[f"model.layers.{n}.{name}"] = tensor
    file = path / "model.safetensors"
    save_file({**load_file(file), **{k: v.contiguous() for k, v in stored.items()}}, file, metadata={"format": "pt"})
    return path, main, ReferenceMTP(layer, weights)


@torch.no_grad()
def reference_mtp_logprobs(main, mtp: ReferenceMTP, tokens: list[int]) -> torch.Tensor:
    """Log-probs `[n-1, vocab]` of the MTP's draft for t_{i+2}, i = 0..n-2, over tokens t_0..t_{n-1}."""
    config = main.config
    eps = config.rms_norm_eps
    w = mtp.weights
    hidden = main.model(torch.tensor([tokens])).last_hidden_state[0, :-1]  # h_i after the final norm, i = 0..n-2
    embed = w.get("embed_tokens.weight", main.model.embed_tokens.weight)
    head = w.get("shared_head.head.weight", main.lm_head.weight)
    e = embed[torch.tensor(tokens[1:])].clone()
    e[0] = 0  # position 0's embedding is zeroed (vLLM's convention)
    e = _rms(e, w["enorm.weight"], eps)
    x = torch.cat([e, _rms(hidden, w["hnorm.weight"], eps)], dim=-1) @ w["eh_proj.weight"].T
    n = x.shape[0]
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    y = mtp.layer(x[None], attention_mask=mask, position_ids=positions,
                  position_embeddings=main.model.rotary_emb(x[None], positions))
    y = (y[0] if isinstance(y, tuple) else y)[0]  # GLM-5's layer also returns its top-k
    return (_rms(y, w["shared_head.norm.weight"], eps) @ head.T).log_softmax(-1)



def with_mtp_layer(checkpoint: Path, root: Path, source: int | None = None) -> Path:
    """A copy of a saved checkpoint plus an MTP layer stored as DeepSeek stores it (`model.layers.{n}`): layer
    `source`'s weights (fresh copies; by default the last layer's, its indexer included) and random MTP norms and
    projection."""
    path = root / "with_mtp"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    tensors = load_file(path / "model.safetensors")
    src = f"model.layers.{n - 1 if source is None else source}."
    g = torch.Generator().manual_seed(3)
    extra = {f"model.layers.{n}.{k[len(src):]}": v.clone() for k, v in tensors.items() if k.startswith(src)}
    for name, shape in [("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("shared_head.norm.weight", (h,)),
                        ("eh_proj.weight", (h, 2 * h))]:
        extra[f"model.layers.{n}.{name}"] = (torch.rand(shape, generator=g) + 0.5 if len(shape) == 1
                                             else torch.randn(shape, generator=g) * 0.1)
    save_file(tensors | extra, path / "model.safetensors", metadata={"format": "pt"})
    return path
