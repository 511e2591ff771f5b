"""DeepSeek-V3.2's MTP layer (its own indexer, sparse attention) against the published MTP formula run through
transformers' DeepseekV32DecoderLayer, over a paged cache whose unwritten slots hold NaN."""
from __future__ import annotations

import torch

from latentserve.config import AttentionConfig
from latentserve.models import load_model
from latentserve.models.mtp import load_mtp
from tests.checkpoints import load_reference
from tests.models.arch_harness import make_arch_checkpoint
from tests.models.mtp_checkpoint import ReferenceMTP, reference_mtp_logprobs, with_mtp_layer
from tests.models.paged import PagedRunner
from tests.models import test_arch_deepseek_v32 as v32  # (its suite class imported by name would run again here)

LENS = (12, 10)  # beyond top-k (8)


def test_v32_mtp_layer_matches_the_formula(tmp_path) -> None:
    from safetensors.torch import load_file
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer

    path = with_mtp_layer(make_arch_checkpoint(tmp_path, v32.TestDeepseekV32.case), tmp_path)
    reference = load_reference(path)
    n = reference.config.num_hidden_layers
    stored = load_file(path / "model.safetensors")
    # with_mtp_layer copies the last layer (its index decides only its kind: MoE, with an indexer)
    layer = DeepseekV32DecoderLayer(reference.config, n - 1).float().eval()
    layer.load_state_dict(reference.model.layers[n - 1].state_dict())
    own = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
    ref_mtp = ReferenceMTP(layer, {name: stored[f"model.layers.{n}.{name}"] for name in own})

    attn_config = AttentionConfig(block_size=4)
    main = load_model(path, attn_config=attn_config)
    mtp = load_mtp(path, main, attn_config)
    main_runner, mtp_runner = PagedRunner(main, attn_config), PagedRunner(mtp, attn_config, seed=1)
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 96, (k,), generator=g).tolist() for k in LENS]
    hidden = main_runner.forward(list(enumerate(sequences)))
    pairs = torch.cat([h[:-1] for h in hidden.split(LENS)])
    logits = mtp_runner.step([(r, seq[1:]) for r, seq in enumerate(sequences)], pairs)
    for seq, ours in zip(sequences, logits.split([k - 1 for k in LENS])):
        expected = reference_mtp_logprobs(reference, ref_mtp, seq)
        assert expected.std(-1).min() > 0.3
        torch.testing.assert_close(ours.log_softmax(-1), expected, rtol=0, atol=1e-4)
    # a decode step of each
    last = [h[-1:] for h in hidden.split(LENS)]
    new = [[7], [9]]
    hidden = main_runner.forward(list(enumerate(new)))
    logits = mtp_runner.step(list(enumerate(new)), torch.cat(last))
    for r, ours in enumerate(logits):
        sequences[r] += new[r]
        torch.testing.assert_close(ours.log_softmax(-1), reference_mtp_logprobs(reference, ref_mtp, sequences[r])[-1],
                                   rtol=0, atol=1e-4)
