"""The acceptance counters against hand-counted drafts."""
import pytest

from latentserve.engine.spec_decode import SpecDecodingStats


def test_counts_rates_and_mean_length() -> None:
    stats = SpecDecodingStats(num_spec_tokens=3)
    for drafted, accepted in [(3, 3), (3, 1), (2, 0), (1, 1)]:
        stats.observe_draft(drafted, accepted)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 9, 5)
    assert stats.num_accepted_tokens_per_pos == [3, 1, 1] and stats.num_drafts_per_pos == [4, 3, 2]
    assert stats.acceptance_rate == pytest.approx(5 / 9)
    assert stats.acceptance_rate_per_pos == pytest.approx([3 / 4, 1 / 3, 1 / 2])
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 4)
    with pytest.raises(ValueError, match="accepted of"):
        stats.observe_draft(2, 3)
