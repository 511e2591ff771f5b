"""GLM-4.7-Flash's (glm4_moe_lite) and GLM-5's (glm_moe_dsa) MTP layers, stored as GLM publishes them
(`model.layers.{num_hidden_layers}.*`, the DeepSeek-V3 naming; GLM-5's with its own indexer's weights), against the
published MTP formula run through transformers' decoder layer, and MTP speculative decoding leaving greedy output
unchanged."""
from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import load_file

from latentserve import SamplingParams
from latentserve.config import AttentionConfig
from latentserve.models import load_model
from latentserve.models.mtp import load_mtp
from tests.checkpoints import load_reference
from tests.models.arch_harness import PROMPTS, llm, make_arch_checkpoint
from tests.models.mtp_checkpoint import ReferenceMTP, reference_mtp_logprobs, with_mtp_layer
from tests.models.paged import PagedRunner
from tests.models import test_arch_glm4_moe_lite as glm4  # (their suite classes imported by name would run again)
from tests.models import test_arch_glm_moe_dsa as glm5

LENS = (12, 10)  # beyond GLM-5's top-k (8)
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
# (case, transformers' decoder layer, the layer whose weights the MTP layer copies): GLM's MTP layer is MoE, GLM-5's
# runs its own indexer, so a sparse layer, for GLM-5 a "full" one.
CASES = {"glm4_moe_lite": (glm4.TestGlm4MoeLite.case, "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteDecoderLayer",
                           1),
         "glm_moe_dsa": (glm5.TestGlmMoeDsa.case, "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaDecoderLayer", 2)}


@pytest.mark.parametrize("arch", CASES)
def test_glm_mtp_layer_matches_the_formula(tmp_path, arch) -> None:
    case, layer_class, source = CASES[arch]
    module, name = layer_class.rsplit(".", 1)
    decoder_layer = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    path = with_mtp_layer(make_arch_checkpoint(tmp_path, case), tmp_path, source)
    reference = load_reference(path)
    n = reference.config.num_hidden_layers
    stored = load_file(path / "model.safetensors")
    layer = decoder_layer(reference.config, source).float().eval()
    layer.load_state_dict(reference.model.layers[source].state_dict())
    ref_mtp = ReferenceMTP(layer, {name: stored[f"model.layers.{n}.{name}"] for name in OWN})

    attn_config = AttentionConfig(block_size=4)
    main = load_model(path, attn_config=attn_config)
    mtp = load_mtp(path, main, attn_config)
    assert main.config.is_moe_layer(n)
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


@pytest.mark.parametrize("arch", CASES)
def test_glm_mtp_speculative_decoding_keeps_greedy_output(tmp_path, arch) -> None:
    case, _, source = CASES[arch]
    path = with_mtp_layer(make_arch_checkpoint(tmp_path, case), tmp_path, source)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = llm(path).generate(PROMPTS, params)
    engine = llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                           "disable_by_batch_size": None})
    drafted = engine.generate(PROMPTS, params)
    assert engine.engine.spec_decoding_stats.num_draft_tokens > 0
    for a, b in zip(plain, drafted):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
