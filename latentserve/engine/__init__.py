"""The engine: request state, KV block pool, scheduler, sampler, detokenizer and outputs."""
from latentserve.engine.block_manager import BlockManager
from latentserve.engine.detokenizer import IncrementalDetokenizer, TokenizerInfo, load_tokenizer
from latentserve.engine.outputs import CompletionOutput, RequestOutput
from latentserve.engine.request import Request, RequestStatus
from latentserve.engine.sampler import Sampler, SamplerOutput, SamplingMetadata, compute_prompt_logprobs
from latentserve.engine.scheduler import Scheduler, SchedulerConfig
from latentserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput

__all__ = [
    "BlockManager",
    "CompletionOutput",
    "IncrementalDetokenizer",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "TokenizerInfo",
    "compute_prompt_logprobs",
    "load_tokenizer",
]
