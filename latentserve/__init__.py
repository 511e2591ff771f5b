"""latentserve: inference and serving for Multi-head Latent Attention models."""
from latentserve.engine.llm import LLM
from latentserve.engine.outputs import CompletionOutput, RequestOutput
from latentserve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
