"""Build a `DeepseekForCausalLM` from a local safetensors checkpoint (single file or sharded), streamed: each tensor
is read, converted (FP8 dequantized, cast, or quantized to int8/int4) and freed before the next."""
from __future__ import annotations

import itertools
import json
import re
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from latentserve.attention.mla import MLAAttention
from latentserve.config import AttentionConfig
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.linear import Linear
from latentserve.layers.mlp import GatedMLP
from latentserve.layers.moe import MoE
from latentserve.layers.quant.config import Fp8Config, PrequantizedConfig, QuantConfig
from latentserve.layers.quant.fp8 import dequantize_block_fp8
from latentserve.layers.quant.linear import quantize_linear
from latentserve.layers.quant.prequantized import QuantizedWeight, concat
from latentserve.models.arch import ARCHITECTURES
from latentserve.models.config import ModelConfig
from latentserve.models.deepseek import DeepseekForCausalLM
from latentserve.models.formats import gguf, hf_quant, model_folder
from latentserve.models.safetensors_reader import read_header, read_tensors

SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's block scales: `{weight name}_scale_inv`
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
STORED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_GATE_UP = re.compile(r"^(.+)\.(gate|up)_proj$")
# Each quantizes ~200 M weights/s, so a few outrun reading the checkpoint; more would only hold more tensors in flight.
MAX_QUANTIZE_WORKERS = 8


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
    return read_tensors(checkpoint_files(model_dir), wanted)


def open_checkpoint(
    model_dir: Path, config: ModelConfig, wanted: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The `wanted` tensors of a checkpoint as the model takes them: FP8 weights dequantized, a GPTQ / AWQ /
    compressed-tensors layer's parts unpacked into one int4 / int8 weight, a GGUF's tensors under their Hugging Face
    names."""
    quant = config.quantization
    if gguf.is_gguf_folder(model_dir):
        return gguf.read_tensors(model_dir, wanted)
    if isinstance(quant, hf_quant.HfQuantConfig):
        files = checkpoint_files(model_dir)
        names = {entry.name for file in files for entry in read_header(file)}
        tensors = read_tensors(files, lambda name: wanted(hf_quant.layer_of(name, quant)))
        return hf_quant.unpack(tensors, quant, names)
    tensors = iter_checkpoint_tensors(model_dir, wanted)
    return dequantize_fp8(tensors, quant) if isinstance(quant, Fp8Config) else tensors


def dequantized(
    tensors: Iterator[tuple[str, torch.Tensor | QuantizedWeight]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in full precision: a quantized checkpoint loaded into another quantization than its own."""
    for name, tensor in tensors:
        yield name, tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize()


def dequantize_fp8(
    tensors: Iterator[tuple[str, torch.Tensor]], config: Fp8Config
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each float8 weight of an FP8 checkpoint, dequantized to fp32 with its `weight_scale_inv` as soon as both are
    read (in either order); every other tensor passes through."""
    weights: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(SCALE_SUFFIX):
            name = name.removesuffix(SCALE_SUFFIX)
            scales[name] = tensor
        elif tensor.dtype == torch.float8_e4m3fn:
            weights[name] = tensor
        else:
            yield name, tensor
            continue
        if name in weights and name in scales:
            yield name, dequantize_block_fp8(weights.pop(name), scales.pop(name), config.weight_block_size, name)
    if weights:
        name = next(iter(weights))
        raise ValueError(f"FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r} in the checkpoint")
    if scales:
        name = next(iter(scales))
        raise ValueError(f"checkpoint has {name + SCALE_SUFFIX!r} but {name!r} is not a float8_e4m3fn tensor in it")


_CORE_PARTS = ("kv_b_proj", "indexer")  # the checkpoint's attention modules that live in the attention core


def param_name(checkpoint_name: str) -> str:
    """Checkpoint tensor name -> our parameter name (kv_b_proj and DSA's indexer belong to the attention core)."""
    for part in _CORE_PARTS:
        checkpoint_name = checkpoint_name.replace(f".self_attn.{part}.", f".self_attn.attn.{part}.")
    return checkpoint_name


def checkpoint_name(param: str) -> str:
    """The inverse of `param_name`."""
    for part in _CORE_PARTS:
        param = param.replace(f".self_attn.attn.{part}.", f".self_attn.{part}.")
    return param


def _is_mtp(name: str, config: ModelConfig) -> bool:
    """Multi-token-prediction layers are stored as extra layers after the main ones; models/mtp.py loads them."""
    match = _LAYER_INDEX.match(name)
    if match is None:
        return False
    layer = int(match.group(1))
    return config.num_hidden_layers <= layer < config.num_hidden_layers + config.num_nextn_predict_layers


def quantizable_linears(model: DeepseekForCausalLM, lm_head: bool = False) -> list[str]:
    """The linear layers that int8/int4 quantize: attention projections and every MLP, routed experts included, and
    `lm_head` if asked (unless tied to the embedding, a lookup table that stays as it is). Never `kv_b_proj`, which
    decode reads as absorbed weight matrices."""
    head = lm_head and not model.config.tie_word_embeddings
    return [
        name for name, module in model.named_modules()
        if type(module) is Linear and (name != "lm_head" or head) and not name.endswith(".attn.kv_b_proj")
    ]


def _is_view(param: torch.Tensor) -> bool:
    """A parameter that is part of a larger tensor (a routed expert's weight in its layer's stack) or stored in
    another layout than the checkpoint's."""
    return param.untyped_storage().nbytes() != param.nbytes or not param.is_contiguous()


def _quantization_job(
    model: nn.Module, name: str, weight: torch.Tensor, halves: dict[str, dict]
) -> tuple[str, list[torch.Tensor], nn.Parameter | None, Callable[[nn.Module], None]] | None:
    """(layer name, weight parts, bias, install) to quantize the linear layer `name` and swap in its stand-in; its
    bias parameter carries over. A bias-free MLP's gate and up become one quantized layer once both are read
    (`halves` holds the first; None until then): int8 and int4 scale each output row on its own, so the fused
    weight quantizes exactly as the two would."""
    match = _GATE_UP.match(name)
    mlp = model.get_submodule(match[1]) if match else None
    if isinstance(mlp, GatedMLP) and mlp.gate_proj.bias is None:
        halves.setdefault(match[1], {})[match[2]] = weight
        if len(halves[match[1]]) < 2:
            return None
        parts = halves.pop(match[1])
        return f"{match[1]}.gate_up_proj", [parts["gate"], parts["up"]], None, mlp.fuse_gate_up
    parent, _, child = name.rpartition(".")
    return name, [weight], model.get_submodule(name).bias, partial(setattr, model.get_submodule(parent), child)


def _quantize(name: str, parts: list[torch.Tensor], bias, config: QuantConfig, device,
              policy: KernelPolicy) -> nn.Module:
    return quantize_linear(name, concat(parts) if len(parts) > 1 else parts[0], bias, config, device, policy)


class _Quantizer:
    """Quantizes linear weights on worker threads (one per torch thread, up to MAX_QUANTIZE_WORKERS, each running
    torch on one) while the loader reads the next tensors; at most two jobs per worker wait, so a few tensors are
    in flight at a time."""

    def __init__(self, config: QuantConfig, device, policy: KernelPolicy) -> None:
        self.config, self.device, self.policy = config, device, policy
        self.threads = torch.get_num_threads()
        self.workers = min(MAX_QUANTIZE_WORKERS, max(1, self.threads))
        self.pool = ThreadPoolExecutor(self.workers, initializer=torch.set_num_threads, initargs=(1,))
        self.pending: deque[tuple[Future, Callable[[nn.Module], None]]] = deque()

    def submit(self, name: str, parts: list[torch.Tensor], bias, install: Callable[[nn.Module], None]) -> None:
        job = self.pool.submit(_quantize, name, parts, bias, self.config, self.device, self.policy)
        self.pending.append((job, install))
        while len(self.pending) > 2 * self.workers:
            self._install_oldest()

    def finish(self) -> None:
        while self.pending:
            self._install_oldest()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)
        # The workers' one thread is their own under OpenMP, but would be everyone's under torch's native pool.
        torch.set_num_threads(self.threads)

    def _install_oldest(self) -> None:
        job, install = self.pending.popleft()
        install(job.result())


def _check_tensor(name: str, tensor: torch.Tensor, target: torch.Tensor | None, loaded: set[str]) -> None:
    """A clear error for a checkpoint tensor the model has no place for."""
    if target is None:
        scale = name.endswith(SCALE_SUFFIX)
        fp8 = " (an FP8 block scale, but config.json has no quantization_config)" if scale else ""
        raise ValueError(f"unexpected tensor {name!r} in the checkpoint{fp8}")
    if name in loaded:
        raise ValueError(f"tensor {name!r} appears twice in the checkpoint")
    if isinstance(tensor, QuantizedWeight):
        pass  # unpacked from the checkpoint's quantized format (models/formats/)
    elif tensor.dtype not in STORED_DTYPES:
        fp8 = " (FP8 weights need config.json's quantization_config)" if tensor.dtype.itemsize == 1 else ""
        raise ValueError(f"tensor {name!r} is stored as {tensor.dtype}; supported: fp32, bf16, fp16{fp8}")
    if tensor.shape != target.shape:
        raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")


def load_weights(
    model: DeepseekForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]], quantization: QuantConfig | None = None,
    device: torch.device | str = "cpu", policy: KernelPolicy | None = None,
) -> None:
    """Copy checkpoint tensors into the model, casting to each parameter's dtype, or quantize them into their layer
    with the kernels `policy` (None: the default one) chooses; strict about names and shapes."""
    targets = model.state_dict(keep_vars=True)
    quantized = ({f"{name}.weight": name for name in quantizable_linears(model, quantization.lm_head)}
                 if quantization else {})
    # A tensor shared under several names loads once, by its first: the tied lm_head's, the shared rotary
    # embedding's learned alpha under every attention layer.
    first: dict[int, str] = {}
    for name in list(targets):
        if first.setdefault(id(targets[name]), name) != name:
            targets.pop(name)
    loaded: set[str] = set()
    halves: dict[str, dict] = {}  # gate or up weights waiting for the other half
    quantizer = _Quantizer(quantization, device, policy or default_policy()) if quantized else None
    try:
        for name, tensor in tensors:
            _check_tensor(name, tensor, targets.get(param_name(name)), loaded)
            target = targets[param_name(name)]
            if isinstance(tensor, QuantizedWeight) and param_name(name) not in quantized:
                tensor = tensor.dequantize()  # embeddings, kv_b_proj (decode absorbs it), layers kept unquantized
            if param_name(name) in quantized:
                job = _quantization_job(model, quantized[param_name(name)], tensor, halves)
                if job is not None:
                    quantizer.submit(*job)
            elif tensor.dtype == target.dtype and tensor.device == target.device and not _is_view(target):
                target.data = tensor  # the read buffer becomes the parameter (its own storage is never touched)
            else:
                with torch.no_grad():
                    target.copy_(tensor)
            loaded.add(name)
        if quantizer is not None:
            quantizer.finish()
    finally:
        if quantizer is not None:
            quantizer.close()
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
    # nn.Embedding's random init on a meta tensor runs through torch._refs, whose first use imports torch._dynamo
    # (~1 s of a start): the weights are overwritten anyway.
    embedding_init = nn.Embedding.reset_parameters

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Module.register_parameter = register
        nn.Embedding.reset_parameters = embedding_init


def _materialize(model: nn.Module, device: torch.device | str, skip: set[str]) -> None:
    """Uninitialized storage on `device` for every parameter still on meta but those in `skip`; tied parameters
    stay one."""
    made: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta and f"{prefix}.{name}" not in skip:
                if id(param) not in made:
                    # Not empty_like: on a meta tensor it runs through torch._refs, which imports sympy (~1 s).
                    empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                    made[id(param)] = nn.Parameter(empty, param.requires_grad)
                setattr(module, name, made[id(param)])


def empty_model(config: ModelConfig, attn_config: AttentionConfig, dtype: torch.dtype,
                device: torch.device | str) -> DeepseekForCausalLM:
    """The model with every parameter on meta, for the weights to be installed."""
    with _parameters_on_meta():
        return DeepseekForCausalLM(config, attn_config, dtype=dtype, device=device)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    attn_config: AttentionConfig = AttentionConfig(),
    device: torch.device | str = "cpu",
    prepare: Callable[[DeepseekForCausalLM], None] | None = None,
    quantization: QuantConfig | None = None,
    policy: KernelPolicy | None = None,
) -> DeepseekForCausalLM:
    """Read `path/config.json` and its safetensors weights (or the GGUF file `path`) into a ready model (weights
    cast to `dtype`, an FP8 checkpoint's dequantized as published, a GPTQ / AWQ / compressed-tensors / GGUF one's
    unpacked, linear layers quantized as `quantization` says: None keeps every weight in `dtype`).

    `prepare(model)` runs after the model is built and before any weight is allocated or read. Parameters of the
    modules it replaces (expert parallelism swaps other ranks' routed experts for stand-ins) are then neither
    allocated nor read from the checkpoint, nor required in it. `policy` (the engine's; None: the default one) chooses
    every layer's kernels, once, as its weights are in place (`process_weights_after_loading`)."""
    model_dir = model_folder(path)
    policy = policy or default_policy()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config = ModelConfig.from_pretrained(model_dir)
    model = empty_model(config, attn_config, dtype, device)
    declared = set(model.state_dict())
    if prepare is not None:
        prepare(model)
    dropped = declared - set(model.state_dict())
    if quantization is None:
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            moe.stack_experts(device)  # the checkpoint's expert weights then load straight into the stacks
    # Weights to be quantized never exist in full precision beyond the one being converted.
    _materialize(model, device,
                 {f"{n}.weight" for n in quantizable_linears(model, quantization.lm_head)} if quantization else set())

    def wanted(name: str) -> bool:
        return not _is_mtp(name, config) and param_name(name.removesuffix(SCALE_SUFFIX)) not in dropped

    tensors = ARCHITECTURES[config.model_type].checkpoint_tensors(config, open_checkpoint(model_dir, config, wanted))
    stored = config.quantization
    if isinstance(stored, PrequantizedConfig) and (quantization is None or quantization.method != stored.method):
        tensors = dequantized(tensors)
    if dropped:  # a converted tensor may hold dropped parameters too (Mistral 4's experts, stored as one)
        tensors = ((name, tensor) for name, tensor in tensors if param_name(name) not in dropped)
    load_weights(model, tensors, quantization, device, policy)
    process_weights_after_loading(model, policy, quantization is not None and quantization.method in ("int8", "int4"))
    return model.eval()


def process_weights_after_loading(model: nn.Module, policy: KernelPolicy, int8_absorbed: bool = False) -> None:
    """Each layer of `model` that has a `process_weights_after_loading` asks `policy` which kernels it runs, once,
    its weights in place; children before their parents, whose native blocks chain the children's choices. The
    attention layers split their absorbed weights too, in int8 where `int8_absorbed` (int8 / int4 models)."""
    for module in reversed(list(model.modules())):
        if isinstance(module, MLAAttention):
            module.process_weights_after_loading(policy, int8_absorbed)
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading(policy)


def weight_bytes(*modules: nn.Module) -> int:
    """Bytes of the modules' parameters and buffers, each storage counted once (tied weights, shared heads)."""
    storages = {}
    for module in modules:
        for t in itertools.chain(module.parameters(), module.buffers()):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
