"""Build a `DeepseekForCausalLM` from a local safetensors checkpoint (single file or sharded)."""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn

from latentserve.config import AttentionConfig
from latentserve.models.config import DeepseekConfig
from latentserve.models.deepseek import DeepseekForCausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
STORED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, or every shard its index names."""
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    index = model_dir / INDEX_FILE
    if not index.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is malformed (need a JSON object with 'weight_map'): {e!r}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to shard files")
    files = [model_dir / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"shard {file.name} named in {INDEX_FILE} is missing from {model_dir}")
    return files


def iter_checkpoint_tensors(
    model_dir: Path, wanted: Callable[[str], bool] = lambda name: True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every `wanted` tensor of the checkpoint, on the CPU, in stored dtype; the others are
    never read."""
    for file in checkpoint_files(model_dir):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if wanted(name):
                    yield name, f.get_tensor(name)


def param_name(checkpoint_name: str) -> str:
    """Checkpoint tensor name -> our parameter name (kv_b_proj belongs to the attention core)."""
    return checkpoint_name.replace(".self_attn.kv_b_proj.", ".self_attn.attn.kv_b_proj.")


def checkpoint_name(param: str) -> str:
    """The inverse of `param_name`."""
    return param.replace(".self_attn.attn.kv_b_proj.", ".self_attn.kv_b_proj.")


def _is_mtp(name: str, config: DeepseekConfig) -> bool:
    """Multi-token-prediction layers are stored as extra layers after the main ones; models/mtp.py loads them."""
    match = _LAYER_INDEX.match(name)
    if match is None:
        return False
    layer = int(match.group(1))
    return config.num_hidden_layers <= layer < config.num_hidden_layers + config.num_nextn_predict_layers


def load_weights(model: DeepseekForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the model, casting to each parameter's dtype; strict about names and shapes."""
    targets = model.state_dict(keep_vars=True)
    if model.config.tie_word_embeddings:
        targets.pop("lm_head.weight")
    loaded: set[str] = set()
    for name, tensor in tensors:
        target = targets.get(param_name(name))
        if target is None:
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
        if name in loaded:
            raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
        if tensor.dtype not in STORED_DTYPES:
            raise ValueError(f"tensor {name!r} is stored as {tensor.dtype}; supported: fp32, bf16, fp16")
        if tensor.shape != target.shape:
            raise ValueError(
                f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)
    missing = sorted(checkpoint_name(p) for p in set(targets) - {param_name(n) for n in loaded})
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing tensor(s) {shown}{more}")


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get parameters without storage (their random init then costs nothing either): the
    checkpoint overwrites every weight, and parameters that `load_model`'s `prepare` drops never get memory.
    (A constructor's `torch.empty` still takes an untouched buffer for a moment, one parameter at a time.)"""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _materialize(model: nn.Module, device: torch.device | str) -> None:
    """Uninitialized storage on `device` for every parameter still on meta; tied parameters stay one."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                setattr(module, name, made[id(param)])


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    attn_config: AttentionConfig = AttentionConfig(),
    device: torch.device | str = "cpu",
    prepare: Callable[[DeepseekForCausalLM], None] | None = None,
) -> DeepseekForCausalLM:
    """Read `path/config.json` and its safetensors weights into a ready model (weights cast to `dtype`).

    `prepare(model)` runs after the model is built and before any weight is allocated or read. Parameters of the
    modules it replaces (expert parallelism swaps other ranks' routed experts for stand-ins) are then neither
    allocated nor read from the checkpoint, nor required in it."""
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config = DeepseekConfig.from_pretrained(model_dir)
    with _parameters_on_meta():
        model = DeepseekForCausalLM(config, attn_config, dtype=dtype, device=device)
    declared = set(model.state_dict())
    if prepare is not None:
        prepare(model)
    dropped = declared - set(model.state_dict())
    _materialize(model, device)

    def wanted(name: str) -> bool:
        return not _is_mtp(name, config) and param_name(name) not in dropped

    load_weights(model, iter_checkpoint_tensors(model_dir, wanted))
    for layer in model.static_forward_context.values():
        layer.process_weights_after_loading()
    return model.eval()
