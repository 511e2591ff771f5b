"""The k-pool indexer (attention/dsa/kpool.py) against transformers' GLM-5 next indexer: each token's selected
positions (pools and tail), for a whole prompt and for the same prompt in chunks over the cache."""
import pytest
import torch
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

from latentserve.attention.dsa.indexer import IndexerConfig, IndexerInputs
from latentserve.attention.dsa.kpool import PooledIndexer, kpool_width
from latentserve.attention.dsa.metadata import DSAMetadata
from latentserve.layers.rotary import RopeConfig

HIDDEN, Q_LORA, HEADS, DIM, TOPK, KPOOL, LENGTH = 24, 20, 16, 16, 8, 4, 37


def _pair(seed: int = 0) -> tuple[Glm5NextTextIndexer, PooledIndexer]:
    config = Glm5NextTextConfig(hidden_size=HIDDEN, q_lora_rank=Q_LORA, index_n_heads=HEADS, index_head_dim=DIM,
                                index_topk=TOPK, index_kpool=KPOOL, num_hidden_layers=4)
    torch.manual_seed(seed)
    ref = Glm5NextTextIndexer(config, 0).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) * (0.5 if p.dim() > 1 else 0.3) + (1.0 if p.dim() == 1 else 0.0))
    ours = PooledIndexer(IndexerConfig(HIDDEN, Q_LORA, HEADS, DIM, 0, kpool_width(TOPK, KPOOL), True),
                         RopeConfig(), KPOOL)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _select(ours: PooledIndexer, hidden, q_resid, cache, start: int, end: int, slots: torch.Tensor) -> torch.Tensor:
    none = torch.empty(end - start, 0)
    md = DSAMetadata(topk=ours.config.topk, dense=False, req_slots=[slots[:end]], query_start_loc_cpu=[0, end - start],
                     context_lens_cpu=[start], workspace=torch.empty(0), state=None)
    return ours(IndexerInputs(hidden[start:end], q_resid[start:end], none, none), cache, slots[start:end], md)


# Whole; in chunks; a prefill then one token a step (decode).
@pytest.mark.parametrize("chunks", [(LENGTH,), (5, 14, LENGTH), tuple(range(29, LENGTH + 1))])
def test_pooled_selection_matches_transformers(chunks: tuple[int, ...]) -> None:
    ref, ours = _pair()
    hidden, q_resid = torch.randn(LENGTH, HIDDEN), torch.randn(LENGTH, Q_LORA)
    with torch.no_grad():
        expected = ref(hidden[None], q_resid[None], torch.ones(1, LENGTH, dtype=torch.bool), None)[0]
    # Positions live at scattered cache slots (a shuffled block table).
    slots = torch.randperm(64)[:LENGTH]
    cache = torch.full((8, 8, 2 * DIM), float("nan"))
    with torch.no_grad():
        got = torch.cat([_select(ours, hidden, q_resid, cache, s, e, slots)
                         for s, e in zip((0,) + chunks[:-1], chunks)])
    assert got.shape == (LENGTH, TOPK + KPOOL - 1)
    position_of = {int(s): i for i, s in enumerate(slots)}
    for t in range(LENGTH):
        mine = sorted(position_of[int(s)] for s in got[t] if s >= 0)
        theirs = sorted(int(i) for i in expected[t] if i >= 0)
        assert mine == theirs, t
    # A late token attends top-k / kpool whole pools and its tail, within its causal past.
    assert len([s for s in got[-1] if s >= 0]) == TOPK + (LENGTH % KPOOL)


def test_width_needs_topk_a_multiple_of_kpool() -> None:
    assert kpool_width(2048, 16) == 2063
    with pytest.raises(ValueError, match="index_kpool"):
        kpool_width(10, 4)
