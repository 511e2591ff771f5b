"""MLA models: config, the shared network, the architecture adapters (arch/), checkpoint loading."""
from latentserve.models.config import ModelConfig
from latentserve.models.deepseek import DeepseekForCausalLM
from latentserve.models.loader import load_model

__all__ = ["ModelConfig", "DeepseekForCausalLM", "load_model"]
