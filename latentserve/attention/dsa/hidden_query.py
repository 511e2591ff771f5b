"""The lightning indexer of Mistral Large 4, whose attention has no q LoRA: its queries come from the layer's normed
input instead of q's LoRA residual, through their own LayerNorm, and are scaled per head by the learned
log-position scaling (layers/query_scaling.py) before RoPE. Keys, weights and selection are DeepSeek-V3.2's."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.attention.dsa.indexer import Indexer, IndexerConfig, IndexerInputs
from latentserve.attention.dsa.metadata import DSAMetadata
from latentserve.layers.query_scaling import LogPositionQueryScaling, log_positions
from latentserve.layers.rotary import RopeConfig


class HiddenQueryIndexer(Indexer):
    def __init__(self, config: IndexerConfig, rope: RopeConfig) -> None:
        if config.q_lora_rank != config.hidden_size:
            raise ValueError(f"a hidden-query indexer reads the hidden state: its q input ({config.q_lora_rank}) "
                             f"must be hidden_size ({config.hidden_size})")
        super().__init__(config, rope)
        self.q_input_norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.softmax_scaling = LogPositionQueryScaling(config.n_heads)

    def queries(self, x: IndexerInputs, md: DSAMetadata) -> torch.Tensor:
        c = self.config
        q = self.wq_b(self.q_input_norm(x.hidden)).view(-1, c.n_heads, c.head_dim)
        return q * self.softmax_scaling(log_positions(_positions(md, q.device))).to(q.dtype)[:, :, None]


def _positions(md: DSAMetadata, device: torch.device) -> torch.Tensor:
    """Each of the ubatch's tokens' position `[T]`: request r's new tokens follow its computed context."""
    qsl = md.query_start_loc_cpu
    return torch.cat([torch.arange(md.context_lens_cpu[r], md.context_lens_cpu[r] + qsl[r + 1] - qsl[r])
                      for r in range(len(qsl) - 1)]).to(device)
