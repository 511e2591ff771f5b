"""`ModelRunner`: one scheduled step through the model — metadata, (DBO) forward, logits, sampling."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from latentserve import batch_invariant
from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.kv_cache import allocate_kv_caches
from latentserve.config import AttentionConfig, DBOConfig
from latentserve.distributed.expert_parallel import run_empty_forward
from latentserve.distributed.parallel_state import DPGroup
from latentserve.engine.input_buffers import InputBuffers
from latentserve.engine.request import Logprobs
from latentserve.engine.state_pool import allocate_state_caches
from latentserve.engine.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs
from latentserve.engine.scheduler_output import SchedulerOutput
from latentserve.engine.spec_decode.decoder import SpecDecoder
from latentserve.models.deepseek import DeepseekForCausalLM
from latentserve.ubatch.dbo import run_forward
from latentserve.ubatch.slicing import should_ubatch, split_ubatches


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: list[int]  # one per sampling request, in SchedulerOutput.sampling_requests order
    logprobs: list[Logprobs | None]
    prompt_logprobs: dict[str, list[Logprobs]]  # request id -> logprobs of this step's prompt positions
    num_ubatches: int
    # Speculative decoding: per sampling request the drafts it accepted (emitted before its sampled token), and
    # per request id its drafts for the next step.
    accepted_draft_ids: list[list[int]] | None = None
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    """Owns the KV caches and one metadata builder per ubatch (two when DBO is on)."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        attn_config: AttentionConfig,
        dbo_config: DBOConfig,
        num_blocks: int,
        kv_cache_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        lockstep_group: DPGroup | None = None,
        spec_decoder: SpecDecoder | None = None,
        num_state_slots: int = 0,
    ) -> None:
        self.model = model
        self.spec_decoder = spec_decoder
        # Under expert parallelism every rank runs every step (an empty one if idle) and splits it alike.
        self.lockstep_group = lockstep_group
        self.attn_config = attn_config
        self.dbo_config = dbo_config
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_caches(
            model.static_forward_context, num_blocks, attn_config.block_size, kv_cache_dtype, device
        )
        # A hybrid model's linear-attention states, one slot per schedulable request (`num_state_slots`).
        if model.state_layers and num_state_slots < 1:
            raise ValueError("a model with linear-attention layers needs num_state_slots >= 1 (max_num_seqs)")
        self.state_caches = allocate_state_caches(model.state_layers, num_state_slots, kv_cache_dtype, device)
        num_builders = 2 if dbo_config.enable_dbo else 1
        self.builders = [
            MLAMetadataBuilder(
                model.attention_layer_names, model.static_forward_context, attn_config, device, i,
                list(model.state_layers),
            )
            for i in range(num_builders)
        ]
        self.sampler = Sampler()
        self.input_buffers = InputBuffers(device)

    @torch.no_grad()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        with batch_invariant.enabled_during(self.attn_config.batch_invariant):
            return self._execute_model(out)

    def _execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if not out.scheduled:
            num_ubatches = 2 if self._agree_on_dbo(True) else 1
            run_empty_forward(self.model, num_ubatches, self.model.model.embed_tokens.weight.dtype)
            return ModelRunnerOutput([], [], {}, num_ubatches)
        inputs = self.input_buffers.prepare(out)
        common = inputs.common
        slices = self._ubatch_slices(common)
        if self.spec_decoder is not None and self.spec_decoder.speculates(out):
            return self._execute_speculative(out, inputs.input_ids, inputs.positions, common, slices)
        hidden = run_forward(self.model, [inputs.input_ids, inputs.positions], common, self.builders, slices)

        requests = out.sampling_requests
        # Every token samples (a decode-only step): the indices are 0..T-1, and the gather a copy of `hidden`.
        sampling = inputs.logits_indices
        logits = self.model.compute_logits(hidden if len(sampling) == len(hidden) else hidden[sampling])
        metadata = SamplingMetadata.from_requests(requests, logits.shape[-1], self.device)
        sampled = self.sampler(logits, metadata)
        return ModelRunnerOutput(
            sampled_token_ids=sampled.sampled_token_ids,
            logprobs=sampled.logprobs,
            prompt_logprobs=self._prompt_logprobs(out, hidden),
            num_ubatches=len(slices) if slices else 1,
        )

    def _execute_speculative(self, out, input_ids, positions, common, slices) -> ModelRunnerOutput:
        hidden = run_forward(self.model, [input_ids, positions], common, self.builders, slices)
        result = self.spec_decoder.step(out, hidden, input_ids, positions, common)
        return ModelRunnerOutput(
            sampled_token_ids=result.sampled_token_ids,
            logprobs=result.logprobs,
            prompt_logprobs=self._prompt_logprobs(out, hidden),
            num_ubatches=len(slices) if slices else 1,
            accepted_draft_ids=result.accepted_draft_ids,
            spec_token_ids=result.spec_token_ids,
        )

    def _ubatch_slices(self, common):
        dbo = self.dbo_config
        threshold = self.attn_config.decode_threshold
        slices = None
        if dbo.enable_dbo and should_ubatch(
            common, threshold, dbo.dbo_decode_token_threshold, dbo.dbo_prefill_token_threshold
        ):
            # A linear-attention state has one owner per step: hybrid models split between requests only.
            slices = split_ubatches(common, threshold, whole_requests=bool(self.model.state_layers))
        return slices if self._agree_on_dbo(slices is not None) else None

    def _agree_on_dbo(self, wants: bool) -> bool:
        """Split this step iff DBO is on and every rank wants to (an idle rank does not object)."""
        if not self.dbo_config.enable_dbo:
            return False
        return wants if self.lockstep_group is None else self.lockstep_group.all_agree(wants)

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor) -> dict[str, list[Logprobs]]:
        result = {}
        start = 0
        for s in out.scheduled:
            request = s.request
            k = request.sampling_params.prompt_logprobs
            if k is not None and s.num_computed_tokens < request.num_prompt_tokens:
                targets = request.prompt_logprob_targets(s.num_computed_tokens, s.num_new_tokens)
                logits = self.model.compute_logits(hidden[start : start + len(targets)])
                result[request.request_id] = compute_prompt_logprobs(logits, targets, k)
            start += s.num_new_tokens
        return result
