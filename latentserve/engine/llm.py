"""`LLM`: the offline, vLLM-shaped entry point."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

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
        self.engine = LLMEngine(self.model_dir, EngineConfig(**kwargs))

    def get_tokenizer(self):
        return self.engine.tokenizer

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
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        for request in requests:
            self.engine.scheduler.add_request(request)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(requests):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[r.request_id] for r in requests]
