"""`LLM`: the offline, vLLM-shaped entry point."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Sequence

from latentserve.distributed.dp_engine import ExternalDPEngine, SpawnedDPEngine, launched_by_torchrun
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.llm_engine import EngineConfig, LLMEngine
from latentserve.engine.outputs import RequestOutput
from latentserve.sampling_params import SamplingParams

Prompt = str | list[int]


def default_model_dir() -> Path:
    """The small checkpoint that ships inside the package."""
    from latentserve.assets import DEFAULT_MODEL_DIR

    return DEFAULT_MODEL_DIR


class LLM:
    """`LLM(model=path, ...)`; `generate(prompts, sampling_params)` runs them to completion."""

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        fields = EngineConfig.__dataclass_fields__
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {unknown}; accepted: {sorted(fields)}")
        self.model_dir = Path(model) if model is not None else default_model_dir()
        config = EngineConfig(**kwargs)
        self.dp_engine: SpawnedDPEngine | ExternalDPEngine | None = None
        if config.data_parallel_size == 1:
            self.engine = LLMEngine(self.model_dir, config)
            return
        # One engine per rank, each in its own process; this object is their front end.
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model directory {self.model_dir} does not exist")
        dp_engine = ExternalDPEngine if launched_by_torchrun() else SpawnedDPEngine
        self.dp_engine = dp_engine(
            functools.partial(LLMEngine, self.model_dir, config), config.data_parallel_size, config.device
        )
        has_tokenizer = (self.model_dir / "tokenizer.json").is_file()
        self._tokenizer = load_tokenizer(self.model_dir) if has_tokenizer else None

    def get_tokenizer(self):
        return self.engine.tokenizer if self.dp_engine is None else self._tokenizer

    def shutdown(self) -> None:
        """Stop the data-parallel ranks (also done when the LLM is garbage-collected or at exit)."""
        if self.dp_engine is not None:
            self.dp_engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every prompt is validated before any runs."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if self.dp_engine is not None:
            return self.dp_engine.generate(prompts, params)
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        for request in requests:
            self.engine.scheduler.add_request(request)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(requests):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[r.request_id] for r in requests]
