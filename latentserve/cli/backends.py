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
from latentserve.engine.llm_engine import parse_dtype
from latentserve.kernels import native
from latentserve.kernels.cpu import auto_dtype, cpu_features
from latentserve.layers.linear import NATIVE_HEAD_TOKENS, native_rows
from latentserve.layers.quant.linear import int4_kernel, int8_kernel
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


def describe_weights(device: str) -> str:
    """dtype="auto" and the int8 / int4 kernels on `device`, each with why."""
    features = cpu_features()
    dtype, why = auto_dtype(device)
    int8, int4 = int8_kernel(torch.device(device), features), int4_kernel(torch.device(device), features)
    return "\n".join([
        f"  {device}: {features.describe() if device == 'cpu' else ''}".rstrip(),
        f"    dtype auto: {str(dtype).removeprefix('torch.')} ({why})",
        f"    int8: {int8.kernel} ({int8.reason})",
        f"    int4: {int4.kernel} ({int4.reason}; layers it cannot take: int4pack_mm, or dequantize where the "
        "outputs are not a multiple of 16)",
        f"    lm_head under int8 and int4: {int8.kernel} (--no-lm-head-quantized keeps the compute dtype)",
        "    fp8 checkpoints: dequantized at load to the compute dtype (or re-quantized with --quantization)",
        f"    fp32 / bf16 linears: {_dense(device)}",
        f"    decode attention block: {_block(device)}",
        f"    decode MoE block: {_moe_block(device)}",
    ]) + "\n"


def _block(device: str) -> str:
    """Whether a decode layer's attention runs as one native call (models/attention_block.py)."""
    kernels, why = native.native_kernels(cpu_features()) if device == "cpu" else (None, f"device {device}")
    if kernels is None:
        return f"the layer's modules one by one ({why})"
    return ("one native call per layer where its projections run latentserve's kernels (fp32/bf16, int8, int4, no "
            "bias), the NATIVE decode backend takes the step and its tokens are few enough; the modules elsewhere")


def _moe_block(device: str) -> str:
    """Whether a decode layer's MoE runs as one native call (models/moe_block.py)."""
    kernels, why = native.native_kernels(cpu_features()) if device == "cpu" else (None, f"device {device}")
    if kernels is None:
        return f"the layer's modules one by one ({why})"
    return ("one native call per layer (router, routing, routed and shared experts, residual) at up to 3 tokens over "
            "stacked fp32/bf16 experts, up to 8 over int8 / int4 ones; the modules elsewhere (and under expert "
            "parallelism)")


def _dense(device: str) -> str:
    """Which kernel the skinny fp32/bf16 products of a decode step take, and up to how many rows."""
    if device != "cpu":
        return "PyTorch's"
    kernels, why = native.native_kernels(cpu_features())
    if kernels is None:
        return f"PyTorch's (latentserve's kernels: {why})"
    threads = torch.get_num_threads()
    fp32, bf16, short = (native_rows(dtype, width, threads, kernels)
                         for dtype, width in ((torch.float32, 2048), (torch.bfloat16, 2048), (torch.bfloat16, 512)))
    return (f"latentserve's (built for {kernels.isa}) up to {fp32} fp32 rows and {bf16} bf16 rows at {threads} "
            f"thread(s) ({short} over inputs of <= 512), MLA's absorbed per-head products up to {NATIVE_HEAD_TOKENS} "
            "tokens; MKL / oneDNN above")


def run(args: argparse.Namespace) -> int:
    config = SelectorConfig(dtype=parse_dtype(args.dtype), **_V3_SHAPE)
    dtype = str(config.dtype).removeprefix("torch.")
    write(f"prefill backends (dtype {dtype}):\n")
    write(describe(MLAPrefillBackendEnum, prefill_selector.PRIORITY, config))
    write(f"decode backends (dtype {dtype}):\n")
    write(describe(MLADecodeBackendEnum, decode_selector.PRIORITY, config))
    write("weights:\n")
    for device in devices():
        write(describe_weights(device))
    write("architectures (config.json's model_type: its architectures names):\n")
    write("".join(f"  {line}\n" for line in arch.supported()))
    return 0
