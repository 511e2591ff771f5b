"""`EngineConfig`: what `LLM(...)` accepts besides the model path, and the checks that refuse settings which cannot
work (before any weight is read) or derive what the engine builds from them (KV blocks, DBO thresholds)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from latentserve.config import (DTYPES, FP8_KV_CACHE_DTYPES, INT8_KV_CACHE_DTYPES, INT8_KV_SCALE_BYTES, DBOConfig)
from latentserve.distributed.link_emulator import LinkEmulator
from latentserve.engine.spec_decode.config import SpeculativeConfig
from latentserve.engine.tokenizer_mode import check_tokenizer_mode
from latentserve.kernels import native
from latentserve.kernels.cpu import auto_dtype
from latentserve.kernels.policy import KernelPolicy
from latentserve.models.config import ModelConfig

logger = logging.getLogger(__name__)


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """A dtype name, or "auto": bf16 where `device` computes it natively, else fp32 (`auto_dtype`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)[0]
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_kv_cache_dtype(name: str | torch.dtype, dtype: torch.dtype, device: str = "cpu") -> torch.dtype:
    """The KV cache's dtype: "auto" the compute `dtype`, a dtype name, fp8 / fp8_e4m3 (e4m3, scale 1.0), or int8 /
    q8_0 (int8 with a scale per row part)."""
    if name in INT8_KV_CACHE_DTYPES:
        return INT8_KV_CACHE_DTYPES[name]
    if isinstance(name, str) and name.startswith("fp8"):
        if name not in FP8_KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {name!r} is not supported; the fp8 cache is e4m3: use fp8 or fp8_e4m3")
        return FP8_KV_CACHE_DTYPES[name]
    return dtype if name == "auto" else parse_dtype(name, device)


# Measured by benchmarks/dbo_overlap.py (2-rank expert parallelism, CPU): below 256 decode tokens per rank the
# split costs more than it hides (each ubatch pays the step's fixed cost again); vLLM's 32 assumes GPU kernels.
CPU_DBO_DECODE_TOKEN_THRESHOLD = 256


def _is_int_at_least(value: object, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


@dataclass
class EngineConfig:
    """Everything `LLM(...)` accepts besides the model path (vLLM's names)."""

    dtype: str | torch.dtype = "auto"
    kv_cache_dtype: str | torch.dtype = "auto"  # auto: the model dtype
    quantization: str | None = None  # "int8" / "int4" at load; "fp8" (or None) for a DeepSeek FP8 checkpoint
    # int4's group of input columns: 32, 64 or 128 (None: per layer, the largest that divides its input)
    quantization_group_size: int | None = None
    lm_head_quantized: bool | None = None  # int8/int4: quantize lm_head too (None: yes, as llama.cpp does)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30  # used when num_kv_blocks is None
    enable_prefix_caching: bool | None = None  # None: on, unless the model has linear-attention layers (hybrids)
    enable_chunked_prefill: bool = True
    enable_dbo: bool = False
    dbo_decode_token_threshold: int | None = None  # None: vLLM's 32 on CUDA, CPU_DBO_DECODE_TOKEN_THRESHOLD on CPU
    dbo_prefill_token_threshold: int = 512
    prefill_backend: str | None = None
    decode_backend: str | None = None
    workspace_tokens: int = 8192
    seed: int = 0
    device: str = "cpu"
    num_threads: int | None = None  # torch's CPU threads in this engine (each rank's); None: leave torch's setting
    # Scale-out (latentserve.distributed): attention data-parallel over ranks, routed experts split over them.
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    link_latency_us: float = 0.0  # link emulation of the expert all-to-all: 0 / None leave it real
    link_bandwidth_gbps: float | None = None
    reasoning_parser: str | None = None  # e.g. deepseek_r1: structured outputs constrain only the answer after it
    # {"method": "mtp", "num_speculative_tokens": k}: draft with the checkpoint's MTP layer, verify exactly.
    speculative_config: SpeculativeConfig | dict | None = None
    # A request's tokens and logprobs independent of what else its steps hold (latentserve.batch_invariant).
    batch_invariant: bool = False
    tokenizer: str | None = None  # folder with tokenizer.json (and tokenizer_config.json); None: the model's
    # How chats are rendered: "auto" the chat template, "deepseek_v32" DeepSeek-V3.2's encoding (tokenizer_mode.py)
    tokenizer_mode: str = "auto"
    max_logprobs: int = 20  # largest logprobs / prompt_logprobs a request may ask for (vLLM's default); -1: the vocabulary size
    # Default sampling settings: "auto" from the model's generation_config.json, "vllm" none, or a folder holding one
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
        if not _is_int_at_least(self.data_parallel_size, 1):
            raise ValueError(f"data_parallel_size must be an int >= 1, got {self.data_parallel_size!r}")
        for name in ("num_threads", "num_kv_blocks"):
            value = getattr(self, name)
            if value is not None and not _is_int_at_least(value, 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {value!r}")
        LinkEmulator(self.link_latency_us, self.link_bandwidth_gbps)  # validates
        check_tokenizer_mode(self.tokenizer_mode)
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if not _is_int_at_least(self.max_logprobs, -1):
            raise ValueError(f"max_logprobs must be an int >= -1 (-1: the vocabulary size), got {self.max_logprobs!r}")


def prefix_caching(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Whether the block manager caches prefixes: not for a hybrid model, whose linear-attention state exists only at
    the end of what a request computed, never at an arbitrary block boundary (an explicit True is refused)."""
    if model_config.linear_attention is None:
        return config.enable_prefix_caching is not False
    if config.enable_prefix_caching:
        raise ValueError(f"enable_prefix_caching=True: {model_config.model_type} has linear-attention layers, whose "
                         "per-request state cannot be resumed from a cached block boundary; leave it unset or False")
    logger.info("prefix caching is off: %s has linear-attention layers (a cached prefix has no state to resume)",
                model_config.model_type)
    return False


def dbo_config(config: EngineConfig) -> DBOConfig:
    """The DBO settings of `config`, with the decode threshold's default for its device."""
    decode_threshold = config.dbo_decode_token_threshold
    if decode_threshold is None:
        cuda = torch.device(config.device).type == "cuda"
        decode_threshold = DBOConfig.dbo_decode_token_threshold if cuda else CPU_DBO_DECODE_TOKEN_THRESHOLD
    return DBOConfig(config.enable_dbo, decode_threshold, config.dbo_prefill_token_threshold)


def check_batch_invariant(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                          cache_dtype: torch.dtype, policy: KernelPolicy) -> None:
    """Batch-invariant mode runs on latentserve's CPU kernels; a setting that would take another path fails here."""
    problems = []
    if torch.device(config.device).type != "cpu":
        problems.append(f"device {config.device!r} (it needs the CPU)")
    elif policy.kernels is None:
        problems.append(f"latentserve's CPU kernels ({policy.why})")
    for name, value in (("dtype", dtype), ("kv_cache_dtype", cache_dtype)):
        if value not in native.KERNEL_DTYPES:
            problems.append(f"{name} {value} (it needs float32 or bfloat16)")
    if config.decode_backend not in (None, "NATIVE"):
        problems.append(f"decode_backend {config.decode_backend!r} (it needs NATIVE)")
    if config.speculative_config is not None:
        problems.append("speculative decoding (whether a step drafts depends on its batch size)")
    if model_config.dsa is not None:
        problems.append("DeepSeek Sparse Attention (its indexer and sparse attention batch tokens together)")
    if model_config.linear_attention is not None:
        problems.append(f"{model_config.model_type}'s linear-attention layers (not yet checked to the bit: "
                        "docs/hybrids.md)")
    if problems:
        raise ValueError(f"batch_invariant=True cannot run with: {'; '.join(problems)}")


def blocks_for_memory(config: EngineConfig, model_config: ModelConfig, cache_dtype: torch.dtype) -> int:
    # the MLA layers' caches (ModelConfig.num_attention_layers) and the MTP layer's
    num_layers = model_config.num_attention_layers + (config.speculative_config is not None)
    values = model_config.kv_cache_values(num_layers)
    if cache_dtype == torch.int8:  # each latent row's scales
        values += INT8_KV_SCALE_BYTES * sum(map(model_config.owns_kv, range(num_layers)))
    if model_config.dsa is not None:  # the indexers' caches
        values += model_config.dsa.cache_dim * model_config.dsa.num_indexer_layers(num_layers)
    per_block = config.block_size * values * cache_dtype.itemsize
    blocks = config.kv_cache_memory_bytes // per_block
    if blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no block ({per_block} bytes)")
    return blocks


def check_kv_pool(config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
    """The KV pool must hold one request of max_model_len tokens, or such a request could never finish."""
    needed = -(-max_model_len // config.block_size)
    if num_blocks >= needed:
        return
    pool = (
        f"num_kv_blocks={num_blocks}" if config.num_kv_blocks is not None
        else f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} ({num_blocks} blocks)"
    )
    raise ValueError(
        f"{pool} of block_size={config.block_size} cannot hold one request of max_model_len={max_model_len} tokens, "
        f"which needs {needed} blocks: raise num_kv_blocks or kv_cache_memory_bytes, or lower max_model_len to at "
        f"most {num_blocks * config.block_size}"
    )
