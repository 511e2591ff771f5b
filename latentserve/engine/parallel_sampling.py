"""n / best_of: one request fans out into samples that share its prompt's KV blocks (vLLM: ParentRequest)."""
from __future__ import annotations

from dataclasses import dataclass

from latentserve.engine.request import Request
from latentserve.sampling_params import SamplingParams


def sample_request_id(request_id: str, index: int) -> str:
    """The id of a request's sample: the first keeps the request's id, the others are `{index}_{id}` (vLLM's)."""
    return request_id if index == 0 else f"{index}_{request_id}"


@dataclass(eq=False)
class SampleGroup:
    """The samples of one request. The first (the leader) computes the prompt; when its prefill is done the
    others fork its full prompt blocks and compute only the rest of the prompt."""

    request_id: str
    params: SamplingParams  # the user's: n, best_of, whether logprobs were asked
    samples: list[Request]
    forked: bool = False

    def __post_init__(self) -> None:
        for sample in self.samples:
            sample.group = self

    @property
    def leader(self) -> Request:
        return self.samples[0]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.samples)

    @property
    def reports_partial(self) -> bool:
        """Whether outputs stream before the end: not when best_of > n (the n kept are known only at the end)."""
        return self.params.num_samples == self.params.n
