"""Saved quantized models: a loaded int8/int4 model written as it runs, and mapped back without converting or
copying anything.

`save_quantized` writes every weight in its final form (the kernels' packed layouts, fused gate_up layers, MLA's
absorbed decode weights and their int8 copies) to one safetensors file, each tensor 64-byte aligned (padding entries
keep the file a valid safetensors file), beside a manifest naming the format, its version, the quantization and the
kernel layout. `load_saved` maps the file (private, copy-on-write: nothing is read until a weight is used) and makes
every tensor a view of the mapping. Its config.json declares no MTP layer: speculative decoding needs the original
checkpoint.
"""
from __future__ import annotations

import json
import mmap
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from latentserve.attention.mla import MLAAttention
from latentserve.config import DTYPES, AttentionConfig
from latentserve.kernels.native import NativeKernels
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.quant.config import QuantConfig
from latentserve.layers.quant.heads import Int8HeadProducts
from latentserve.layers.quant.int4 import Int4Linear, Int4PackLinear, NativeInt4Linear, int4pack_block_n
from latentserve.layers.quant.int8 import Int8Linear, IntMMInt8Linear, NativeInt8Linear, int_mm_parts
from latentserve.layers.quant.q45 import NativeQ4KLinear, NativeQ5KLinear, NativeQ50Linear, NativeQ51Linear
from latentserve.layers.quant.q6k import NativeQ2KLinear, NativeQ3KLinear, NativeQ6KLinear
from latentserve.models.config import ModelConfig
from latentserve.models.deepseek import DeepseekForCausalLM
from latentserve.models.loader import empty_model, process_weights_after_loading

FORMAT = "latentserve-quantized"
VERSION = 2  # 2: int8 layers in `pack_int8`'s blocks of 16 outputs (1: plain rows)
MANIFEST = "latentserve_quantized.json"
WEIGHTS = "model.quantized.safetensors"
ALIGN = 64  # every tensor starts on a cache line, as torch's own allocations do (the kernels load whole lines)
COPIED = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json", "chat_template.jinja",
          "generation_config.json")
# The quantized layers, whose state is plain tensors and plain attributes.
SAVABLE = {cls.__name__: cls for cls in (Int8Linear, IntMMInt8Linear, NativeInt8Linear, Int4Linear, Int4PackLinear,
                                         NativeInt4Linear, NativeQ6KLinear, NativeQ3KLinear, NativeQ2KLinear,
                                         NativeQ50Linear, NativeQ51Linear, NativeQ5KLinear, NativeQ4KLinear)}
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                       torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
                       torch.bool: "BOOL"}
_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}
_DTYPE_NAMES = {str(dtype).removeprefix("torch."): dtype for dtype in _SAFETENSORS_DTYPES}


class SavedModelError(ValueError):
    """A saved model this build cannot run; the message says what to do."""


def kernel_layout(modules: set[str]) -> dict[str, Any]:
    """What the packed weights' layout depends on: the kernels' instruction set; where int4pack_mm runs, its block of
    output rows on this CPU; where torch._int_mm runs, the parts it takes an int8 weight in (`int_mm_parts`)."""
    kernels = default_policy().kernels
    layout = {"kernels": kernels.layout if kernels is not None else None}
    if Int4PackLinear.__name__ in modules:
        layout["int4pack_block_n"] = int4pack_block_n()
    if IntMMInt8Linear.__name__ in modules:
        layout["int_mm_parts"] = int_mm_parts()
    return layout


def _encode(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, NativeKernels):
        return {"kernels": value.isa}
    raise SavedModelError(f"{where} is a {type(value).__name__}, which a saved model cannot hold")


def _decode(value: Any, kernels: NativeKernels | None) -> Any:
    if isinstance(value, dict) and "dtype" in value:
        if value["dtype"] not in _DTYPE_NAMES:
            raise SavedModelError(f"unknown dtype {value['dtype']!r} in the manifest: save the model again")
        return _DTYPE_NAMES[value["dtype"]]
    if isinstance(value, dict) and "kernels" in value:
        return kernels
    return value


def _attributes(obj: object, where: str) -> dict[str, Any]:
    """An object's plain attributes (what its constructor derived), encoded; its tensors are saved apart."""
    return {k: _encode(v, f"{where}.{k}") for k, v in vars(obj).items()
            if not k.startswith("_") and k != "training" and not isinstance(v, torch.Tensor)}


def _quantized_modules(model: nn.Module) -> dict[str, dict]:
    specs = {}
    for name, module in model.named_modules():
        if not hasattr(module, "kernel"):
            continue
        specs[name] = {"class": type(module).__name__, "attributes": _attributes(module, name),
                       "buffers": list(module._buffers), "parameters": list(module._parameters)}
    return specs


def _derived(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """What loading derived beyond parameters and buffers: tensors kept as plain attributes (MLA's absorbed decode
    weights W_UK_T and W_UV) and the absorbed int8 products."""
    tensors, products = {}, {}
    for name, module in model.named_modules():
        tensors.update({f"{name}.{k}": v for k, v in vars(module).items() if isinstance(v, torch.Tensor)})
        if not isinstance(module, MLAAttention):
            continue
        for i, product in enumerate(module.int8_absorbed or ()):
            key = f"{name}.int8_absorbed.{i}"
            products[key] = _attributes(product, key)
            tensors.update({f"{key}.{k}": v for k, v in vars(product).items() if isinstance(v, torch.Tensor)})
    return tensors, products


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    """safetensors with each tensor's data 64-byte aligned (`__pad.N` entries fill the gaps); returns the size."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset, pads = 0, 0
    for name, t in tensors.items():
        if offset % ALIGN:
            gap = ALIGN - offset % ALIGN
            header[f"__pad.{pads}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            offset, pads = offset + gap, pads + 1
        if t.dtype not in _SAFETENSORS_DTYPES:
            raise SavedModelError(f"{name} is a {t.dtype} tensor, which a saved model cannot hold")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)  # the data starts aligned too
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name, t in tensors.items():
            f.seek(8 + len(text) + header[name]["data_offsets"][0])
            f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        f.truncate(8 + len(text) + offset)
    return 8 + len(text) + offset


def save_quantized(model: DeepseekForCausalLM, source_dir: Path, output_dir: Path, quantization: QuantConfig) -> Path:
    """Write `model` (loaded from `source_dir` with `quantization`) to `output_dir`, which must not exist yet or be
    empty; the tokenizer and generation config come along."""
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()):
        raise FileExistsError(f"{output_dir} is not empty: save to a new folder")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise SavedModelError("only a model on the CPU can be saved")
    modules = _quantized_modules(model)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = (t.data_ptr(), t.dtype.itemsize, tuple(t.shape))
        if key in seen:  # a tied weight: stored once
            aliases[name] = seen[key]
            continue
        if not t.is_contiguous():
            raise SavedModelError(f"{name} is not contiguous, which a saved model cannot hold")
        seen[key] = name
        tensors[name] = t
    derived, products = _derived(model)
    tensors.update(derived)
    output_dir.mkdir(parents=True, exist_ok=True)
    file_bytes = _write_safetensors(output_dir / WEIGHTS, tensors, {"format": FORMAT, "version": str(VERSION)})
    config = json.loads((source_dir / "config.json").read_text())
    config.pop("quantization_config", None)  # the weights are no longer the source's FP8 ones
    config["num_nextn_predict_layers"] = 0  # the MTP layer is not saved
    (output_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in COPIED:
        if (source_dir / name).is_file():
            shutil.copy(source_dir / name, output_dir / name)
    manifest = {
        "format": FORMAT, "version": VERSION, "weights": WEIGHTS, "file_bytes": file_bytes,
        "dtype": str(model.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "quantization": {"method": quantization.method, "group_size": quantization.group_size,
                         "lm_head": quantization.lm_head},
        "layout": kernel_layout({spec["class"] for spec in modules.values()}),
        "modules": modules, "absorbed_products": products, "aliases": aliases,
        "tensor_attributes": [name for name in derived if ".int8_absorbed." not in name],
    }
    (output_dir / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return output_dir


@dataclass(frozen=True)
class SavedModel:
    """A saved model's manifest, checked to be one this build can run."""

    path: Path
    manifest: dict

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest["dtype"]]

    @property
    def quantization(self) -> QuantConfig:
        q = self.manifest["quantization"]
        return QuantConfig(q["method"], q["group_size"], q["lm_head"])

    def check_settings(self, dtype: str | torch.dtype, quantization: str | None, group_size: int | None,
                       lm_head: bool | None, device: str) -> None:
        """Refuse engine settings that contradict what was saved (None / "auto": take the saved ones)."""
        saved = self.quantization
        wrong = []
        if dtype != "auto" and DTYPES.get(dtype, dtype) != self.dtype:
            wrong.append(f"dtype={dtype} (saved: {self.manifest['dtype']})")
        if quantization is not None and quantization != saved.method:
            wrong.append(f"quantization={quantization} (saved: {saved.method})")
        if group_size is not None and group_size != saved.group_size:
            wrong.append(f"quantization_group_size={group_size} (saved: {saved.group_size})")
        if lm_head is not None and lm_head != saved.lm_head:
            wrong.append(f"lm_head_quantized={lm_head} (saved: {saved.lm_head})")
        if torch.device(device).type != "cpu":
            wrong.append(f"device={device} (saved models run on the CPU)")
        if wrong:
            raise SavedModelError(f"{self.path} is a saved {saved.method} model; these settings contradict it: "
                                  f"{', '.join(wrong)}. Drop them, or quantize the original checkpoint again")


def read_saved(model_dir: Path) -> SavedModel | None:
    """The saved model in `model_dir`, or None for a plain checkpoint; SavedModelError for one this build cannot
    run (an older or newer format, another CPU's kernel layout)."""
    path = Path(model_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        version, fmt, layout = manifest["version"], manifest["format"], manifest["layout"]
        classes = {spec["class"] for spec in manifest["modules"].values()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise SavedModelError(f"{path} is malformed ({e!r}): save the model again") from None
    if fmt != FORMAT:
        raise SavedModelError(f"{path} names format {fmt!r}, not {FORMAT!r}")
    if not isinstance(version, int) or version > VERSION:
        raise SavedModelError(f"{model_dir} was saved in format version {version}, newer than this latentserve reads "
                              f"({VERSION}): upgrade latentserve, or quantize the original checkpoint with this one")
    if version < VERSION:
        raise SavedModelError(f"{model_dir} was saved in format version {version}, whose packed weights this latentserve "
                              f"no longer reads (it writes {VERSION}): quantize the original checkpoint again "
                              "(`latentserve quantize`)")
    here = kernel_layout(classes)
    if here != layout:
        raise SavedModelError(f"{model_dir} was saved for kernel layout {layout}, and this machine uses "
                              f"{here}: quantize the original checkpoint here (`latentserve quantize`)")
    return SavedModel(Path(model_dir), manifest)


def _map(path: Path, expected_bytes: int) -> tuple[mmap.mmap, dict, int]:
    """The file mapped private (copy-on-write: written pages are the process's own), its header and data start."""
    size = path.stat().st_size if path.is_file() else 0
    if size != expected_bytes:
        raise SavedModelError(f"{path} has {size} bytes, its manifest says {expected_bytes}: the file is truncated or "
                              "was replaced; save the model again")
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header_len = int.from_bytes(mapped[:8], "little")
    header = json.loads(mapped[8:8 + header_len])
    return mapped, header, 8 + header_len


def _views(path: Path, expected_bytes: int) -> dict[str, torch.Tensor]:
    mapped, header, start = _map(path, expected_bytes)
    views = {}
    for name, entry in header.items():
        if name == "__metadata__" or name.startswith("__pad."):
            continue
        begin, end = entry["data_offsets"]
        dtype = _TORCH_DTYPES[entry["dtype"]]
        count = (end - begin) // dtype.itemsize
        flat = (torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + begin) if count
                else torch.empty(0, dtype=dtype))
        views[name] = flat.view(entry["shape"])
    return views


def _new(cls: type, attributes: dict, kernels: NativeKernels | None) -> Any:
    """An instance of `cls` with these attributes, its constructor (which would quantize) not run."""
    obj = cls.__new__(cls)
    if isinstance(obj, nn.Module):
        nn.Module.__init__(obj)
    for key, value in attributes.items():
        setattr(obj, key, _decode(value, kernels))
    return obj


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if attr in parent._parameters:
        setattr(parent, attr, nn.Parameter(tensor, requires_grad=False))
    elif attr in parent._buffers:
        parent._buffers[attr] = tensor
    else:
        raise SavedModelError(f"the saved file has {name!r}, which the model does not")


def load_saved(saved: SavedModel, attn_config: AttentionConfig = AttentionConfig(),
               policy: KernelPolicy | None = None) -> DeepseekForCausalLM:
    """The model of a saved folder, every weight a view of the mapped file; its layers' kernels chosen by `policy`
    (the engine's; None: the default one)."""
    manifest = saved.manifest
    policy = policy or default_policy()
    kernels = policy.kernels
    views = _views(saved.path / manifest["weights"], manifest["file_bytes"])
    model = empty_model(ModelConfig.from_pretrained(saved.path), attn_config, saved.dtype, "cpu")
    for name, spec in manifest["modules"].items():
        layer = _new(SAVABLE[spec["class"]], spec["attributes"], kernels)
        for buffer in spec["buffers"]:
            layer.register_buffer(buffer, views.pop(f"{name}.{buffer}"))
        for param in spec["parameters"]:
            tensor = views.pop(f"{name}.{param}", None)
            setattr(layer, param, None if tensor is None else nn.Parameter(tensor, requires_grad=False))
        parent_name, _, child = name.rpartition(".")
        if child == "gate_up_proj":
            model.get_submodule(parent_name).fuse_gate_up(layer)
        else:
            setattr(model.get_submodule(parent_name), child, layer)
    for name in manifest["tensor_attributes"]:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, views.pop(name))
    for name, module in model.named_modules():
        if isinstance(module, MLAAttention):
            products = [manifest["absorbed_products"].get(f"{name}.int8_absorbed.{i}") for i in range(2)]
            if products[0] is not None:
                module.int8_absorbed = tuple(_product(views, f"{name}.int8_absorbed.{i}", attrs, kernels)
                                             for i, attrs in enumerate(products))
    for name, tensor in views.items():
        _set_tensor(model, name, tensor)
    state = model.state_dict(keep_vars=True)
    for alias, target in manifest["aliases"].items():
        _set_tensor(model, alias, state[target])
    missing = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if missing:
        raise SavedModelError(f"the saved file lacks {missing[:5]}: save the model again")
    process_weights_after_loading(model, policy)  # (the absorbed weights are mapped: nothing is split again)
    return model.eval()


def _product(views: dict[str, torch.Tensor], key: str, attributes: dict, kernels) -> Int8HeadProducts:
    product = _new(Int8HeadProducts, attributes, kernels)
    for name in ("q", "scale", "qsum"):
        setattr(product, name, views.pop(f"{key}.{name}"))
    return product
