"""latentserve: inference and serving for Multi-head Latent Attention models."""
from latentserve.engine.llm import LLM
from latentserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from latentserve.engine.prompts import TextPrompt, TokensPrompt
from latentserve.sampling_params import SamplingParams
from latentserve.structured_params import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "TextPrompt", "TokensPrompt"]
