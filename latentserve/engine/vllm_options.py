"""vLLM's engine options that have no counterpart here, as `vllm serve` flags (cli/vllm_flags.py) and as `LLM(...)`
keywords, so that a vLLM command line or script gets a clear answer: an option is refused with the reason (and what
to use instead), accepted at the values that mean what latentserve does anyway (`tensor_parallel_size=1`), or
accepted with a note saying why it changes nothing (`trust_remote_code`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VLLMOption:
    names: tuple[str, ...]  # its flags; the first, as a Python name, is LLM()'s keyword
    reason: str
    takes_value: bool = True  # False: a switch (`--trust-remote-code`), True or False in Python
    accepted: tuple[Any, ...] = ()  # values that mean what latentserve does anyway
    note: bool = False  # a switch accepted as a no-op, with `reason` as the note

    @property
    def keyword(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


_NOT_SPLIT = ("latentserve does not split layers over devices; on one machine use --data-parallel-size N "
              "--enable-expert-parallel (attention data-parallel, routed experts split over the ranks)")
_LOCAL = "nothing is downloaded: MODEL is a local checkpoint directory"

OPTIONS = (
    VLLMOption(("--tensor-parallel-size", "-tp"), _NOT_SPLIT, accepted=(1,)),
    VLLMOption(("--pipeline-parallel-size", "-pp"), _NOT_SPLIT, accepted=(1,)),
    VLLMOption(("--gpu-memory-utilization",), "the KV cache is not sized as a share of GPU memory: give its size with "
               "--kv-cache-memory-bytes (or --num-kv-blocks)"),
    VLLMOption(("--num-gpu-blocks-override",), "use --num-kv-blocks"),
    VLLMOption(("--swap-space",), "preempted requests are recomputed, never swapped out", accepted=(0,)),
    VLLMOption(("--cpu-offload-gb",), "weights are not offloaded: --quantization int8 or int4 makes them smaller",
               accepted=(0,)),
    VLLMOption(("--distributed-executor-backend",), "latentserve spawns its ranks itself (--data-parallel-size N) "
               "or runs under torchrun"),
    VLLMOption(("--download-dir",), _LOCAL),
    VLLMOption(("--revision",), _LOCAL),
    VLLMOption(("--tokenizer-revision",), _LOCAL),
    VLLMOption(("--trust-remote-code",), "latentserve runs its own model code and never executes a checkpoint's, "
               "so there is nothing to trust: the flag changes nothing", takes_value=False, accepted=(True, False),
               note=True),
    VLLMOption(("--enforce-eager",), "the model always runs eagerly (there are no CUDA graphs): the flag changes "
               "nothing", takes_value=False, accepted=(True, False), note=True),
    VLLMOption(("--disable-log-requests",), "requests are never logged: the flag changes nothing",
               takes_value=False, accepted=(True,), note=True),
    VLLMOption(("--disable-log-stats",), "no periodic stats are logged (see /metrics): the flag changes nothing",
               takes_value=False, accepted=(True,), note=True),
    VLLMOption(("--disable-custom-all-reduce",), "there are no custom all-reduce kernels (ranks reduce through "
               "torch.distributed): the flag changes nothing", takes_value=False, accepted=(True, False), note=True),
    VLLMOption(("--task",), "latentserve runs generative models only", accepted=("auto", "generate")),
    VLLMOption(("--runner",), "latentserve runs generative models only", accepted=("auto", "generate")),
    VLLMOption(("--enable-lora",), "LoRA adapters are not supported", takes_value=False, accepted=(False,)),
    VLLMOption(("--hf-overrides",), "config.json is read as it is: change a copy of the checkpoint folder"),
)
_BY_KEYWORD = {option.keyword: option for option in OPTIONS}


def split_vllm_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`LLM(...)`'s keywords less vLLM's options, each checked: a refused one or value is a ValueError with the
    reason; an accepted switch set to True logs its note."""
    for keyword in sorted(kwargs.keys() & _BY_KEYWORD.keys()):
        option, value = _BY_KEYWORD[keyword], kwargs[keyword]
        # A switch takes True or False, the others a number: True == 1 must not pass as tensor_parallel_size=1.
        if isinstance(value, bool) != (not option.takes_value) or value not in option.accepted:
            raise ValueError(f"LLM({keyword}={value!r}): {option.reason}")
        if option.note and value:
            logger.warning("LLM(%s=%r): %s", keyword, value, option.reason)
    return {k: v for k, v in kwargs.items() if k not in _BY_KEYWORD}
