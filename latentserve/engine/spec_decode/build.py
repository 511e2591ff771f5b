"""The speculative decoder a `SpeculativeConfig` asks for: its settings checked against the model before any weight
is read, then its drafter built (the MTP layer loaded, or the n-gram lookup)."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from latentserve.config import AttentionConfig
from latentserve.engine.spec_decode.config import SpeculativeConfig
from latentserve.engine.spec_decode.decoder import SpecDecoder
from latentserve.engine.spec_decode.mtp_proposer import MTPProposer
from latentserve.engine.spec_decode.ngram_proposer import NgramProposer
from latentserve.engine.spec_decode.proposal import Proposer
from latentserve.kernels.cpu import last_level_cache_bytes
from latentserve.kernels.policy import KernelPolicy
from latentserve.models.config import ModelConfig
from latentserve.models.deepseek import DeepseekForCausalLM
from latentserve.models.loader import weight_bytes
from latentserve.models.mtp import load_mtp

logger = logging.getLogger(__name__)


def check_speculation(spec: SpeculativeConfig, model_config: ModelConfig, model_dir: Path) -> None:
    """ValueError where the model cannot run `spec`."""
    if spec.method == "mtp" and model_config.num_nextn_predict_layers < 1:
        raise ValueError(f"speculative_config method 'mtp' needs an MTP layer, but {model_dir}/config.json declares "
                         "none (num_nextn_predict_layers is 0): method 'ngram' drafts without one")
    if model_config.linear_attention is not None:
        raise ValueError(f"speculative_config: {model_config.model_type} has linear-attention layers, whose state "
                         "cannot roll back rejected drafts; run it without speculative decoding")


def build_spec_decoder(spec: SpeculativeConfig, model_dir: Path, model: DeepseekForCausalLM,
                       attn_config: AttentionConfig, dtype: torch.dtype, device: str, kernel_policy: KernelPolicy,
                       num_blocks: int, cache_dtype: torch.dtype, max_model_len: int) -> SpecDecoder:
    proposer: Proposer
    if spec.method == "mtp":
        mtp = load_mtp(model_dir, model, attn_config, dtype, device, kernel_policy)
        proposer = MTPProposer(mtp, attn_config, num_blocks, cache_dtype, spec.num_speculative_tokens, device)
        weights = weight_bytes(model, mtp)
    else:
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        weights = weight_bytes(model)
    policy = spec.drafting_policy(weights, device, last_level_cache_bytes())
    if policy.max_batch_size == 0:
        logger.warning("speculative decoding: %s", policy.reason)
    return SpecDecoder(model, proposer, max_model_len, policy)
