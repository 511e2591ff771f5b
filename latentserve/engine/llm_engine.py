"""`LLMEngine`: requests in, one scheduled step at a time, `RequestOutput`s out."""
from __future__ import annotations

import functools
import itertools
import logging
from pathlib import Path

import torch

from latentserve.config import AttentionConfig
from latentserve.distributed.expert_parallel import shard_experts
from latentserve.distributed.link_emulator import LinkEmulator
from latentserve.distributed.parallel_state import DPGroup, get_dp_group
from latentserve.engine.block_manager import BlockManager
from latentserve.engine.cpu_malloc import keep_freed_memory
from latentserve.engine.engine_config import EngineConfig, blocks_for_memory, check_batch_invariant, check_kv_pool, \
    dbo_config, parse_dtype, parse_kv_cache_dtype, prefix_caching
from latentserve.engine.detokenizer import IncrementalDetokenizer, TokenizerInfo, bad_words_token_ids, has_tokenizer, \
    load_tokenizer
from latentserve.engine.generation_config import generation_defaults
from latentserve.engine.model_runner import ModelRunner
from latentserve.engine.reasoning import make_reasoning_parser, parser_for_prompt
from latentserve.engine.outputs import RequestOutput, request_outputs
from latentserve.engine.parallel_sampling import SampleGroup, sample_request_id
from latentserve.engine.request import Request
from latentserve.engine.state_pool import StatePool
from latentserve.engine.tokenizer_mode import apply_tokenizer_mode
from latentserve.engine.scheduler import Scheduler, SchedulerConfig
from latentserve.engine.structured import StructuredOutputManager
from latentserve.engine.spec_decode.build import build_spec_decoder, check_speculation
from latentserve.engine.spec_decode.config import DraftingPolicy
from latentserve.engine.spec_decode.metrics import SpecDecodingStats
from latentserve.layers.quant.config import resolve_quantization
from latentserve.kernels.policy import KernelPolicy
from latentserve.models.config import ModelConfig
from latentserve.models.formats import model_folder
from latentserve.models.loader import load_model
from latentserve.models.saved import load_saved, read_saved
from latentserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def tokenize_prompt(prompt: str | list[int], tokenizer: TokenizerInfo | None, vocab_size: int) -> list[int]:
    """The token ids of a prompt given as text or as ids; a ValueError names what is wrong with it."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass prompts as token id lists")
        return tokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab_size})")
    return list(prompt)


def engine_tokenizer(model_dir: Path, tokenizer: str | None, tokenizer_mode: str) -> TokenizerInfo | None:
    """The tokenizer of `tokenizer` (a folder that must hold one), else the model's if it has one, with the chat
    encoding `tokenizer_mode` gives it."""
    if tokenizer is not None:
        info = load_tokenizer(tokenizer)
    elif has_tokenizer(model_dir):
        info = load_tokenizer(model_dir)
    else:
        return None
    return apply_tokenizer_mode(info, tokenizer_mode, model_dir)


def check_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int) -> None:
    """vLLM's cap on the top-k of logprobs: each k costs a sort and a dict per token. As in vLLM, a k of -1 is the
    whole vocabulary, and so is a cap of -1 (no k may exceed the vocabulary)."""
    cap = vocab_size if max_logprobs == -1 else max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is None or (vocab_size if k == -1 else k) <= cap:
            continue
        asked = f"{name}={k}" + (f" (the whole vocabulary: {vocab_size} tokens)" if k == -1 else "")
        limit = (f"the vocabulary ({vocab_size} tokens)" if max_logprobs == -1
                 else f"this engine's max_logprobs={max_logprobs} (--max-logprobs)")
        raise ValueError(f"{asked} exceeds {limit}")


class LLMEngine:
    def __init__(self, model: str | Path, config: EngineConfig) -> None:
        model_dir = model_folder(model)  # a GGUF file: the folder of its config and tokenizer
        if not model_dir.is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist (latentserve downloads nothing: the "
                                    "model is a local checkpoint directory)")
        if torch.device(config.device).type == "cpu":
            keep_freed_memory()
        if config.num_threads is not None:
            # In a data-parallel rank this overrides the front end's even share of the cores.
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        # Every layer's kernels, chosen once from this (its threads included) as the weights are loaded.
        self.kernel_policy = KernelPolicy.detect()
        saved = read_saved(model_dir)  # None: a checkpoint to load (and maybe quantize)
        if saved is not None:
            saved.check_settings(config.dtype, config.quantization, config.quantization_group_size,
                                 config.lm_head_quantized, config.device)
        dtype = saved.dtype if saved is not None else parse_dtype(config.dtype, config.device)
        cache_dtype = parse_kv_cache_dtype(config.kv_cache_dtype, dtype, config.device)
        spec = config.speculative_config
        num_spec = spec.num_speculative_tokens if spec is not None else 0
        attn_config = AttentionConfig(
            block_size=config.block_size,
            decode_threshold=1 + num_spec,  # a verification step is a decode with k+1 new tokens
            workspace_tokens=config.workspace_tokens,
            prefill_backend=config.prefill_backend,
            decode_backend="NATIVE" if config.batch_invariant else config.decode_backend,
            batch_invariant=config.batch_invariant,
        )
        dbo = dbo_config(config)
        # Settings that cannot work fail here, before any weight is read.
        model_config = ModelConfig.from_pretrained(model_dir)
        if config.batch_invariant:
            check_batch_invariant(config, model_config, dtype, cache_dtype, self.kernel_policy)
        if spec is not None:
            check_speculation(spec, model_config, model_dir)
        quantization = saved.quantization if saved is not None else resolve_quantization(
            config.quantization, config.quantization_group_size, model_config.quantization, config.lm_head_quantized)
        self.quantization = quantization  # what save_quantized records
        model_len = model_config.max_position_embeddings
        max_model_len = config.max_model_len or model_len
        if max_model_len > model_len:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_len}")
        num_blocks = (
            config.num_kv_blocks if config.num_kv_blocks is not None
            else blocks_for_memory(config, model_config, cache_dtype)
        )
        check_kv_pool(config, num_blocks, max_model_len)
        self.tokenizer = engine_tokenizer(model_dir, config.tokenizer, config.tokenizer_mode)
        self.generation_defaults = generation_defaults(model_dir, config.generation_config)
        self.max_logprobs = config.max_logprobs
        expert_group = self._expert_parallel_group(config)
        prepare = None
        if expert_group is not None:
            # Other ranks' routed experts are dropped before loading: this rank never allocates or reads them.
            link = LinkEmulator(config.link_latency_us, config.link_bandwidth_gbps)
            prepare = functools.partial(shard_experts, group=expert_group, link=link)
        if saved is not None and prepare is not None:
            raise ValueError(f"{model_dir} is a saved quantized model: expert parallelism needs the original checkpoint")
        self.model = (load_saved(saved, attn_config, self.kernel_policy) if saved is not None
                      else load_model(model_dir, dtype, attn_config, config.device, prepare, quantization,
                                      self.kernel_policy))
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                decode_threshold=attn_config.decode_threshold,
                num_speculative_tokens=num_spec,
            ),
            BlockManager(num_blocks, config.block_size, prefix_caching(config, model_config),
                         StatePool(config.max_num_seqs) if self.model.state_layers else None),
        )
        spec_decoder = None if spec is None else build_spec_decoder(
            spec, model_dir, self.model, attn_config, dtype, config.device, self.kernel_policy, num_blocks, cache_dtype,
            max_model_len)
        self.runner = ModelRunner(
            self.model, attn_config, dbo, num_blocks, cache_dtype, config.device, expert_group, spec_decoder,
            config.max_num_seqs if self.model.state_layers else 0,
        )
        self._ids = itertools.count()
        self.reasoning_parser = make_reasoning_parser(config.reasoning_parser, self.tokenizer)
        self._structured: StructuredOutputManager | None = None

    def _expert_parallel_group(self, config: EngineConfig) -> DPGroup | None:
        """The group this rank's experts are split over (its steps then run in lockstep), or None."""
        if config.data_parallel_size == 1:
            return None
        group = get_dp_group()
        if group is None or group.world_size != config.data_parallel_size:
            raise RuntimeError(
                f"data_parallel_size={config.data_parallel_size} needs this process in a data-parallel group of that "
                "size: use LLM(...), which starts the ranks"
            )
        return group if config.enable_expert_parallel else None

    @property
    def drafting_policy(self) -> DraftingPolicy | None:
        """Up to how many requests a step drafts, and why; None when speculative decoding is off."""
        decoder = self.runner.spec_decoder
        return decoder.policy if decoder is not None else None

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Acceptance counters of speculative decoding; None when it is off."""
        decoder = self.runner.spec_decoder
        return decoder.stats if decoder is not None else None

    @property
    def max_model_len(self) -> int:
        return self.scheduler.config.max_model_len

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar compiler and cache, made on the first request with structured outputs."""
        if self._structured is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer: this checkpoint has no tokenizer.json")
            self._structured = StructuredOutputManager(self.tokenizer, self.model.config.vocab_size)
        return self._structured

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize_prompt(prompt, self.tokenizer, self.model.config.vocab_size)

    def make_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Validate and tokenize one prompt into a request (not yet scheduled).

        With n or best_of > 1 this is the first sample of a `SampleGroup`; scheduling it schedules them all.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate_for_vocab(self.model.config.vocab_size)
        check_logprobs(params, self.max_logprobs, self.model.config.vocab_size)
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer: this checkpoint has no tokenizer.json")
        if params.structured_outputs is not None:
            self.structured_outputs.compiled(params.structured_outputs)  # checks the spec, starts compiling it
        token_ids = self.tokenize(prompt)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if not token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        truncate = params.truncate_prompt_tokens
        if truncate is not None:
            token_ids = token_ids[-(self.max_model_len if truncate == -1 else truncate):]
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(token_ids)} tokens leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        text = prompt if isinstance(prompt, str) else None
        if params.num_samples == 1:
            return self._request(request_id, token_ids, params, text)
        samples = [self._request(sample_request_id(request_id, i), token_ids, params.for_sample(i), text)
                   for i in range(params.num_samples)]
        return SampleGroup(request_id, params, samples).leader

    def _request(self, request_id: str, token_ids: list[int], params: SamplingParams, prompt: str | None) -> Request:
        detokenizer = None
        if self.tokenizer is not None and params.detokenize:
            detokenizer = IncrementalDetokenizer(self.tokenizer.tokenizer, token_ids, params.skip_special_tokens,
                                                 params.stop, params.include_stop_str_in_output,
                                                 params.spaces_between_special_tokens)
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        request = Request(request_id, token_ids, params, eos, prompt, detokenizer)
        if params.structured_outputs is not None:
            reasoning = parser_for_prompt(self.reasoning_parser, token_ids)
            request.structured_output = self.structured_outputs.new_request(
                params.structured_outputs, reasoning.end_token_id if reasoning is not None else None)
        if params.bad_words:
            request.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
            vocab_size = self.model.config.vocab_size
            if any(t >= vocab_size for ids in request.bad_words_token_ids for t in ids):
                raise ValueError(f"bad_words {params.bad_words!r} tokenize to ids outside the vocabulary (size {vocab_size})")
        _check_something_to_sample(request)
        return request

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        request = self.make_request(prompt, params, request_id)
        self.scheduler.add_request(request)
        return request.request_id

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def _wait_for_grammars(self) -> None:
        """Nothing could run: if requests wait for their grammars, wait for one (briefly) instead of spinning."""
        if self._structured is not None:
            waiting = [r.structured_output for r in self.scheduler.waiting if r.structured_output is not None]
            self._structured.wait_any(waiting, timeout=0.05)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; the outputs of every request that advanced or ended."""
        out = self.scheduler.schedule()
        if not out.scheduled and self.runner.lockstep_group is None:
            self._wait_for_grammars()
            return request_outputs(self.scheduler.update(out, []))
        try:
            result = self.runner.execute_model(out)
        except BaseException:
            self.scheduler.block_manager.discard_step()  # what the step was to write, it did not
            raise
        updated = self.scheduler.update(
            out, result.sampled_token_ids, result.logprobs, result.prompt_logprobs, result.accepted_draft_ids,
            result.spec_token_ids,
        )
        return request_outputs(updated)


def _check_something_to_sample(request: Request) -> None:
    """Refuse a request whose first token has no candidate: every allowed id banned by a one-token bad word or,
    until min_tokens, as a stop token (the sampler would otherwise draw from an all -inf row)."""
    params = request.sampling_params
    if params.allowed_token_ids is None:
        return
    banned = set(request.banned_token_ids()) | {ids[0] for ids in request.bad_words_token_ids if len(ids) == 1}
    if banned.issuperset(params.allowed_token_ids):
        raise ValueError(
            f"allowed_token_ids {params.allowed_token_ids} are all banned at the first token (bad_words, or stop "
            f"tokens before min_tokens={params.min_tokens}): nothing could be sampled"
        )
