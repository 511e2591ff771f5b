"""`LLM`: the offline, vLLM-shaped entry point."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from latentserve.distributed.dp_engine import ExternalDPEngine, SpawnedDPEngine, launched_by_torchrun
from latentserve.engine.detokenizer import TokenizerInfo
from latentserve.engine.generation_config import generation_defaults
from latentserve.engine.engine_config import EngineConfig
from latentserve.engine.llm_chat import Conversation, chat_tokenizer, conversations_of, render_conversation
from latentserve.engine.llm_engine import LLMEngine, engine_tokenizer, tokenize_prompt
from latentserve.engine.outputs import RequestOutput
from latentserve.engine.prompts import Prompt, PromptType, parse_prompts
from latentserve.engine.reasoning import make_reasoning_parser
from latentserve.engine.vllm_options import split_vllm_kwargs
from latentserve.models.formats import model_folder
from latentserve.models.saved import save_quantized
from latentserve.sampling_params import SamplingParams


def default_model_dir() -> Path:
    """The small checkpoint that ships inside the package."""
    from latentserve.assets import DEFAULT_MODEL_DIR

    return DEFAULT_MODEL_DIR


def _limits(engine: LLMEngine) -> tuple[int, int]:
    """(max_model_len, vocab_size) of a rank's engine."""
    return engine.max_model_len, engine.model.config.vocab_size


class DPLLMEngine:
    """`LLMEngine`'s per-step surface over spawned data-parallel ranks (what the server drives).

    Prompts are checked here as one process checks them (`tokenize_prompt`); each request then runs on one rank.
    """

    def __init__(self, dp_engine: SpawnedDPEngine, tokenizer: TokenizerInfo | None,
                 reasoning_parser: str | None = None, generation_defaults: dict | None = None) -> None:
        self.dp_engine = dp_engine
        self.tokenizer = tokenizer
        self.generation_defaults = generation_defaults or {}
        self.reasoning_parser = make_reasoning_parser(reasoning_parser, tokenizer)
        self.max_model_len, self.vocab_size = dp_engine.collective_rpc(_limits)[0]

    def tokenize(self, prompt: Prompt) -> list[int]:
        return tokenize_prompt(prompt, self.tokenizer, self.vocab_size)

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> str:
        """Queue the request on the least loaded rank; a bad prompt raises the ValueError one process raises."""
        return self.dp_engine.add_request(prompt, params, request_id)

    def abort_request(self, request_id: str) -> None:
        self.dp_engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.dp_engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return self.dp_engine.step()


class LLM:
    """`LLM(model=path, ...)`; `generate(prompts, sampling_params)` runs them to completion."""

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        kwargs = split_vllm_kwargs(kwargs)  # vLLM's options without a counterpart: refused, or noted
        fields = EngineConfig.__dataclass_fields__
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(f"LLM() got unknown argument(s) {unknown}; accepted: {sorted(fields)}")
        self.model_dir = model_folder(model) if model is not None else default_model_dir()
        config = EngineConfig(**kwargs)
        self.dp_engine: SpawnedDPEngine | ExternalDPEngine | None = None
        # None under torchrun: every rank runs the user's script, so only whole generate calls line up.
        self.engine: LLMEngine | DPLLMEngine | None
        if config.data_parallel_size == 1:
            self.engine = LLMEngine(self.model_dir, config)
            return
        # One engine per rank, each in its own process; this object is their front end.
        if not self.model_dir.is_dir():
            raise FileNotFoundError(f"model directory {self.model_dir} does not exist (latentserve downloads nothing: "
                                    "the model is a local checkpoint directory)")
        dp_engine = ExternalDPEngine if launched_by_torchrun() else SpawnedDPEngine
        self.dp_engine = dp_engine(
            functools.partial(LLMEngine, self.model_dir, config), config.data_parallel_size, config.device
        )
        self._tokenizer = engine_tokenizer(self.model_dir, config.tokenizer, config.tokenizer_mode)
        self._generation_defaults = generation_defaults(self.model_dir, config.generation_config)
        self.engine = (DPLLMEngine(self.dp_engine, self._tokenizer, config.reasoning_parser,
                                   self._generation_defaults)
                       if dp_engine is SpawnedDPEngine else None)

    def get_tokenizer(self):
        return self.engine.tokenizer if self.dp_engine is None else self._tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams() with what the model's generation config (generation_config=...) sets."""
        defaults = self.engine.generation_defaults if self.dp_engine is None else self._generation_defaults
        return SamplingParams(**defaults)

    def save_quantized(self, output_dir: str | Path) -> Path:
        """Write the loaded int8/int4 model as it runs (packed weights included) to `output_dir`, a new folder;
        `LLM(model=output_dir)` then maps it and runs on it without quantizing again (models/saved.py)."""
        if self.dp_engine is not None:
            raise ValueError("save_quantized needs a one-process LLM (data_parallel_size=1)")
        if self.engine.quantization is None or self.engine.quantization.method not in ("int8", "int4"):
            raise ValueError("save_quantized saves an int8 or int4 model: load it with quantization='int8' or 'int4'")
        return save_quantized(self.engine.model, self.model_dir, Path(output_dir), self.engine.quantization)

    def shutdown(self) -> None:
        """Stop the data-parallel ranks (also done when the LLM is garbage-collected or at exit)."""
        if self.dp_engine is not None:
            self.dp_engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every prompt is validated before any runs. `use_tqdm`: a progress bar
        over the finished requests, on stderr."""
        prompts = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm) as progress:
            if self.dp_engine is None:
                return self._run(prompts, params, progress)
            outputs = self.dp_engine.generate(prompts, params)
            progress.update(len(outputs))  # the ranks answer once all their requests are done
            return outputs

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages) or to each of a list of them: one
        output per conversation. `chat_template` replaces the model's for this call; the other options are
        `render_chat`'s."""
        tokenizer = chat_tokenizer(self.get_tokenizer(), chat_template)
        rendered = [render_conversation(tokenizer, conversation, tools, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message,
                                        chat_template_kwargs=chat_template_kwargs)
                    for conversation in conversations_of(messages)]
        outputs = self.generate([ids for _, ids in rendered], sampling_params, use_tqdm)
        for output, (text, _) in zip(outputs, rendered):
            output.prompt = text  # as vLLM: the rendered conversation, though the engine was given its ids
        return outputs

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], progress: tqdm) -> list[RequestOutput]:
        """The one-process engine runs the requests to their end."""
        requests = [self.engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        for request in requests:
            self.engine.scheduler.add_request(request)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(requests):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update()
        except BaseException:
            # A failed step (or Ctrl-C) leaves none of this call's requests behind to haunt the next call.
            for request in requests:
                self.engine.abort_request(request.request_id)
            raise
        return [finished[r.request_id] for r in requests]
