"""Speculative decoding: draft tokens from DeepSeek's MTP layer, verified exactly by rejection sampling."""
from latentserve.engine.spec_decode.config import SpeculativeConfig
from latentserve.engine.spec_decode.metrics import SpecDecodingStats
from latentserve.engine.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample

__all__ = ["PLACEHOLDER_TOKEN_ID", "SpecDecodingStats", "SpeculativeConfig", "rejection_sample"]
