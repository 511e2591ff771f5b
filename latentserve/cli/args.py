"""Flags shared by the commands: engine settings, sampling settings, and how user mistakes are reported."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import torch

from latentserve.attention.backend_registry import BackendEnum
from latentserve.attention.decode.registry import MLADecodeBackendEnum
from latentserve.attention.prefill.registry import MLAPrefillBackendEnum
from latentserve.cli.vllm_flags import add_vllm_flags, print_notes
from latentserve.engine.generation_config import generation_defaults
from latentserve.engine.llm import LLM, default_model_dir
from latentserve.engine.engine_config import EngineConfig, parse_dtype, parse_kv_cache_dtype
from latentserve.engine.reasoning import reasoning_parser_names
from latentserve.engine.tokenizer_mode import TOKENIZER_MODES
from latentserve.layers.quant.config import QUANTIZATIONS
from latentserve.models.formats import is_gguf
from latentserve.sampling_params import SamplingParams

_ENGINE_DEFAULTS = EngineConfig()
_SAMPLING_DEFAULTS = SamplingParams()
LOAD_FORMATS = ("auto", "safetensors", "gguf")  # vLLM's --load-format values for what latentserve reads


class CLIError(Exception):
    """A user mistake found while setting up or reading input: reported as one line, exit status 1."""


class ArgumentParser(argparse.ArgumentParser):
    """Reports a usage mistake as one line (`latentserve generate: error: ...`), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default when it has a meaningful one and its help does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        meaningless = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if meaningless or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors bad input raises (a wrong path, a bad value) into a CLIError."""
    try:
        yield
    except (ValueError, OSError) as e:  # FileNotFoundError is an OSError
        raise CLIError(str(e)) from e


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


positive_int = _int_at_least(1)
non_negative_int = _int_at_least(0)


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def dtype_name(text: str) -> str:
    try:
        parse_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def device_name(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"invalid device {text!r}; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device {text!r} is not supported; use cpu or cuda[:N]")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("device cuda requested but CUDA is not available on this machine")
    return text


def kv_cache_dtype_name(text: str) -> str:
    try:
        parse_kv_cache_dtype(text, torch.float32)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_UNITS = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_count(text: str) -> int:
    """A positive size in bytes, as vLLM writes it: 2000000000, 2g (powers of 1000) or 2G (powers of 1024)."""
    scale = _UNITS.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in _UNITS else text
    try:
        value = float(digits) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in bytes like 2000000000, 2g or 2G, got {text!r}") from None
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return int(value)


def _backend_name(enum_cls: type[BackendEnum]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        try:
            return enum_cls.lookup(text).name
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = enum_cls.__name__
    return parse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The `LLM(...)` settings, with EngineConfig's defaults and vLLM's flag names."""
    d = _ENGINE_DEFAULTS
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="what --model is: auto (a .gguf file is GGUF, a folder a checkpoint), safetensors (a "
                        "checkpoint folder) or gguf (a GGUF file); checked against the path")
    g.add_argument("--dtype", type=dtype_name, default=d.dtype, help="weights and compute dtype")
    g.add_argument("--device", type=device_name, default=d.device, help="cpu or cuda[:N]")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default=d.quantization,
                   help="int8 / int4: quantize linear weights at load (experts included); fp8: the checkpoint is "
                        "DeepSeek FP8 (detected from config.json anyway)")
    g.add_argument("--quantization-group-size", type=positive_int, default=d.quantization_group_size,
                   help="int4: input columns per scale (32, 64 or 128; default: per layer, the largest that "
                        "divides its input)")
    g.add_argument("--lm-head-quantized", action=argparse.BooleanOptionalAction, default=d.lm_head_quantized,
                   help="int8 / int4: quantize lm_head too (default: yes; --no-lm-head-quantized keeps it in the "
                        "compute dtype)")
    g.add_argument("--kv-cache-dtype", type=kv_cache_dtype_name, default=d.kv_cache_dtype,
                   help="KV cache dtype (auto: the compute dtype; fp8: e4m3 at scale 1.0, half a bf16 cache's bytes; "
                        "int8 or q8_0: int8 with a scale per row part, 8 bytes a row more than fp8)")
    g.add_argument("--block-size", type=positive_int, default=d.block_size, help="tokens per KV cache block")
    g.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs, help="requests per step at most")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=d.max_num_batched_tokens,
                   help="tokens per step at most")
    g.add_argument("--max-model-len", type=positive_int, default=d.max_model_len,
                   help="prompt plus output tokens at most (default: the model's max_position_embeddings)")
    g.add_argument("--num-kv-blocks", type=positive_int, default=d.num_kv_blocks,
                   help="KV cache blocks (default: as many as --kv-cache-memory-bytes hold)")
    g.add_argument("--kv-cache-memory-bytes", type=byte_count, default=None,
                   help=f"KV cache size in bytes: 2000000000, 2g or 2G (default: {d.kv_cache_memory_bytes >> 20} MiB)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse the KV blocks of a shared prompt prefix (default: on, but off for hybrid models, "
                        "which refuse it: docs/hybrids.md)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill,
                   help="split long prompts over steps (--no-enable-chunked-prefill: a prompt must fit one step's "
                        "--max-num-batched-tokens)")
    g.add_argument("--enable-dbo", action="store_true", help="dual batch overlap: split big steps in two ubatches")
    g.add_argument("--dbo-decode-token-threshold", type=_int_at_least(2), default=d.dbo_decode_token_threshold,
                   help="DBO splits decode-only steps of at least this many tokens (default: 32 on CUDA as in "
                        "vLLM, 256 on CPU)")
    g.add_argument("--dbo-prefill-token-threshold", type=_int_at_least(2), default=d.dbo_prefill_token_threshold,
                   help="DBO splits steps with a prefill of at least this many tokens")
    g.add_argument("--prefill-backend", type=_backend_name(MLAPrefillBackendEnum), default=None,
                   help="MLA prefill backend (default: the first valid by priority; see `latentserve backends`)")
    g.add_argument("--decode-backend", type=_backend_name(MLADecodeBackendEnum), default=None,
                   help="MLA decode backend (default: the first valid by priority)")
    g.add_argument("--seed", type=non_negative_int, default=d.seed, help="random seed of the engine")
    g.add_argument("--num-threads", type=positive_int, default=d.num_threads,
                   help="torch CPU threads of the engine, of each rank under data parallelism (default: torch's "
                        "setting, split evenly over the ranks)")
    g.add_argument("--data-parallel-size", type=positive_int, default=d.data_parallel_size,
                   help="ranks, each with its own requests and KV cache (one process per rank)")
    g.add_argument("--enable-expert-parallel", action="store_true", help="shard routed experts over the ranks")
    g.add_argument("--link-latency-us", type=float, default=d.link_latency_us,
                   help="emulated collective latency, for experiments on one machine")
    g.add_argument("--link-bandwidth-gbps", type=float, default=d.link_bandwidth_gbps,
                   help="emulated collective bandwidth (GB/s)")
    g.add_argument("--reasoning-parser", choices=reasoning_parser_names(), default=None,
                   help="split a reasoning model's output into reasoning_content and content")
    g.add_argument("--speculative-config", type=json_object, default=None,
                   help='speculative decoding with the checkpoint\'s MTP layer, as JSON: '
                        '\'{"method": "mtp", "num_speculative_tokens": 2}\'')
    g.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logprobs independent of the requests batched with it (slower)")
    g.add_argument("--tokenizer", default=None,
                   help="folder with tokenizer.json and tokenizer_config.json (default: the model's)")
    g.add_argument("--tokenizer-mode", choices=TOKENIZER_MODES, default=d.tokenizer_mode,
                   help="how chats are rendered: auto (the chat template; a DeepSeek-V3.2 checkpoint without one gets "
                        "its built-in encoding) or deepseek_v32 (DeepSeek-V3.2's chat encoding, built in)")
    g.add_argument("--max-logprobs", type=_int_at_least(-1), default=d.max_logprobs,
                   help="largest logprobs / prompt_logprobs a request may ask for (-1: the vocabulary size)")
    add_vllm_flags(parser)


def json_object(text: str) -> dict:
    """vLLM's form of a settings flag (--speculative-config, --default-chat-template-kwargs): a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'expected a JSON object like {{"name": "value"}}, got {text!r}')
    return value


def add_generation_config_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--generation-config", default=_ENGINE_DEFAULTS.generation_config,
                        help="default sampling settings: auto (the model's generation_config.json), vllm (none), or "
                             "a folder holding a generation_config.json; flags and a request's own values win")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """Sampling flags; one not given takes the generation config's value (--generation-config), else the default."""
    s = _SAMPLING_DEFAULTS
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=positive_int, default=None,
                   help=f"tokens to generate at most (default: the generation config's max_new_tokens, else "
                        f"{max_tokens})")
    g.add_argument("--temperature", type=non_negative_float, default=None,
                   help=f"0 = greedy (default: the generation config's, else {s.temperature})")
    g.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus sampling mass, in (0, 1] (default: the generation config's, else {s.top_p})")
    g.add_argument("--top-k", type=int, default=None,
                   help=f"sample among the k likeliest tokens, 0: all (default: the generation config's, else "
                        f"{s.top_k})")
    add_generation_config_arg(g)
    parser.set_defaults(command_max_tokens=max_tokens)


def sampling_params_from_args(args: argparse.Namespace, **overrides) -> SamplingParams:
    with user_errors():
        model = default_model_dir() if args.model is None else args.model
        defaults = {"max_tokens": args.command_max_tokens} | generation_defaults(model, args.generation_config)
        flags = {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_p", "top_k")}
        return SamplingParams(**(defaults | {k: v for k, v in flags.items() if v is not None} | overrides))


def check_load_format(load_format: str, model: str | None) -> None:
    """A CLIError where `--load-format` names another kind of file than --model is (vLLM's names: safetensors for
    a checkpoint folder, gguf for a GGUF file; auto: either, as the path says)."""
    if load_format == "auto":
        return
    gguf = model is not None and is_gguf(Path(model))
    if (load_format == "gguf") != gguf:
        what = "a GGUF file" if gguf else f"a checkpoint folder ({model or 'the embedded model'})"
        raise CLIError(f"--load-format {load_format}: --model is {what}; give --load-format "
                       f"{'gguf' if gguf else 'safetensors'} or auto")


def build_llm(args: argparse.Namespace, **overrides) -> LLM:
    """The engine the flags of `add_engine_args` describe (`overrides`: other `LLM` settings)."""
    if args.model is None and not default_model_dir().is_dir():
        raise CLIError(f"the embedded model is missing ({default_model_dir()}); pass --model PATH")
    check_load_format(args.load_format, args.model)
    print_notes(args)
    kv_pool = {} if args.kv_cache_memory_bytes is None else {"kv_cache_memory_bytes": args.kv_cache_memory_bytes}
    if kv_pool and args.num_kv_blocks is not None:
        raise CLIError("--num-kv-blocks and --kv-cache-memory-bytes both size the KV cache: give one")
    with user_errors():
        return LLM(
            model=args.model,
            dtype=args.dtype,
            device=args.device,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
            lm_head_quantized=args.lm_head_quantized,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            num_kv_blocks=args.num_kv_blocks,
            enable_dbo=args.enable_dbo,
            dbo_decode_token_threshold=args.dbo_decode_token_threshold,
            dbo_prefill_token_threshold=args.dbo_prefill_token_threshold,
            prefill_backend=args.prefill_backend,
            decode_backend=args.decode_backend,
            seed=args.seed,
            num_threads=args.num_threads,
            data_parallel_size=args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
            link_latency_us=args.link_latency_us,
            link_bandwidth_gbps=args.link_bandwidth_gbps,
            reasoning_parser=args.reasoning_parser,
            speculative_config=args.speculative_config,
            batch_invariant=args.batch_invariant,
            kv_cache_dtype=args.kv_cache_dtype,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill,
            tokenizer=args.tokenizer,
            tokenizer_mode=args.tokenizer_mode,
            max_logprobs=args.max_logprobs,
            **kv_pool,
            **overrides,
        )


def write(text: str) -> None:
    """Print to stdout now (streamed output must not wait for a newline)."""
    sys.stdout.write(text)
    sys.stdout.flush()
