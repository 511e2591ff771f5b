"""`latentserve backends`: every prefill and decode backend, and whether it can run here; the dtype and the
quantized weight kernels this machine gets; the model architectures latentserve loads."""
from __future__ import annotations

import argparse

import torch

from latentserve.attention.backend import SelectorConfig
from latentserve.attention.backend_registry import BackendEnum
from latentserve.attention.decode import selector as decode_selector
from latentserve.attention.decode.registry import MLADecodeBackendEnum
from latentserve.attention.prefill import selector as prefill_selector
from latentserve.attention.prefill.registry import MLAPrefillBackendEnum
from latentserve.cli.args import HelpFormatter, dtype_name, write
from latentserve.engine.engine_config import parse_dtype
from latentserve.kernels.cpu import auto_dtype
from latentserve.kernels.policy import KernelPolicy
from latentserve.layers.quant.linear import FILE_BLOCKS, blocks_kernel, int4_kernel, int8_kernel
from latentserve.models import arch

# DeepSeek-V3's attention shape; the built-in checks depend only on device and dtype.
_V3_SHAPE = dict(num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("backends", help="list attention backends and where they run",
                              description=__doc__.split(":", 1)[1].strip(),
                              formatter_class=HelpFormatter)
    p.add_argument("--dtype", type=dtype_name, default="float32", help="the dtype to check the backends for")
    p.set_defaults(func=run)


def devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def describe(enum_cls: type[BackendEnum], priority: tuple[BackendEnum, ...], config: SelectorConfig) -> str:
    """One block per member: its class path, then per device `valid` or the reasons it is not."""
    lines = []
    defaults = {device: _first_valid(priority, device, config) for device in devices()}
    for member in enum_cls:
        try:
            cls = member.get_class()
        except ValueError:  # CUSTOM before a class is registered for it
            lines.append(f"  {member.name}: unregistered")
            continue
        except ImportError as e:
            lines.append(f"  {member.name}: {member.get_path()}\n    not importable: {e}")
            continue
        lines.append(f"  {member.name}: {member.get_path()}")
        for device in devices():
            reasons = cls.validate_configuration(device, config)
            status = "valid" if not reasons else "invalid: " + "; ".join(reasons)
            marker = " (default)" if defaults[device] is member else ""
            lines.append(f"    {device}: {status}{marker}")
    return "\n".join(lines) + "\n"


def _first_valid(priority: tuple[BackendEnum, ...], device: str, config: SelectorConfig) -> BackendEnum | None:
    """What the selector picks when the user names no backend."""
    for member in priority:
        try:
            if not member.get_class().validate_configuration(device, config):
                return member
        except (ValueError, ImportError):
            continue
    return None


def describe_weights(device: str, policy: KernelPolicy) -> str:
    """dtype="auto" and the kernels `policy` gives layers on `device`, each with why."""
    dtype, why = auto_dtype(device)
    int8, int4 = int8_kernel(policy, torch.device(device)), int4_kernel(policy, torch.device(device))
    blocks = [(layer.file_type, blocks_kernel(weight, policy, torch.device(device)))
              for weight, layer in FILE_BLOCKS.items()]
    cpu = device == "cpu"
    return "\n".join([
        f"  {device}:",
        *(f"    {line}" for line in (policy.describe().splitlines() if cpu else [])),
        f"    dtype auto: {str(dtype).removeprefix('torch.')} ({why})",
        f"    int8: {int8.kernel} ({int8.reason})",
        f"    int4: {int4.kernel} ({int4.reason}; layers it cannot take: int4pack_mm, or dequantize where the "
        "outputs are not a multiple of 16)",
        f"    lm_head under int8 and int4: {int8.kernel} (--no-lm-head-quantized keeps the compute dtype)",
        *(f"    GGUF {file_type}: {choice.kernel} ({choice.reason})" for file_type, choice in blocks),
        "    fp8 checkpoints: dequantized at load to the compute dtype (or re-quantized with --quantization)",
        f"    decode attention block: {_block(policy if cpu else None, device)}",
        f"    decode MoE block: {_moe_block(policy if cpu else None, device)}",
    ]) + "\n"


def _block(policy: KernelPolicy | None, device: str) -> str:
    """Whether a decode layer's attention runs as one native call (models/attention_block.py)."""
    if policy is None or policy.kernels is None:
        return f"the layer's modules one by one ({policy.why if policy else f'device {device}'})"
    return ("one native call per layer where its projections run latentserve's kernels (fp32/bf16, int8, int4, no "
            "bias), the NATIVE decode backend takes the step and its tokens are few enough; the modules elsewhere")


def _moe_block(policy: KernelPolicy | None, device: str) -> str:
    """Whether a decode layer's MoE runs as one native call (models/moe_block.py)."""
    if policy is None or policy.kernels is None:
        return f"the layer's modules one by one ({policy.why if policy else f'device {device}'})"
    return ("one native call per layer (router, routing, routed and shared experts, residual) at up to 3 tokens over "
            "stacked fp32/bf16 experts, up to 8 over int8 / int4 ones; the modules elsewhere (and under expert "
            "parallelism)")


def run(args: argparse.Namespace) -> int:
    config = SelectorConfig(dtype=parse_dtype(args.dtype), **_V3_SHAPE)
    dtype = str(config.dtype).removeprefix("torch.")
    write(f"prefill backends (dtype {dtype}):\n")
    write(describe(MLAPrefillBackendEnum, prefill_selector.priority(config.dtype), config))
    write(f"decode backends (dtype {dtype}):\n")
    write(describe(MLADecodeBackendEnum, decode_selector.PRIORITY, config))
    write("weights (the kernel policy each layer asks once, as its weights load):\n")
    policy = KernelPolicy.detect()
    for device in devices():
        write(describe_weights(device, policy))
    write("architectures (config.json's model_type: its architectures names):\n")
    write("".join(f"  {line}\n" for line in arch.supported()))
    return 0
