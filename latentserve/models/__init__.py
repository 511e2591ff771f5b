"""DeepSeek-V2/V3 models: config, network, checkpoint loading."""
from latentserve.models.config import DeepseekConfig
from latentserve.models.deepseek import DeepseekForCausalLM
from latentserve.models.loader import load_model

__all__ = ["DeepseekConfig", "DeepseekForCausalLM", "load_model"]
