"""GLM-4.7-Flash's (glm4_moe_lite) MTP layer, stored as GLM publishes it (`model.layers.{num_hidden_layers}.*`, the
DeepSeek-V3 naming), against the published MTP formula run through transformers' decoder layer, and MTP speculative
decoding leaving greedy output unchanged."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from latentserve import SamplingParams
from latentserve.config import AttentionConfig
from latentserve.models import load_model
from latentserve.models.mtp import load_mtp
from tests.checkpoints import load_reference
from tests.models.arch_harness import PROMPTS, llm, make_arch_checkpoint
from tests.models.mtp_checkpoint import ReferenceMTP, reference_mtp_logprobs
from tests.models.paged import PagedRunner
from tests.models import test_arch_glm4_moe_lite as glm4  # (its suite class imported by name would run again here)

LENS = (9, 6)
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
SPARSE = 1  # the case's sparse layer: GLM's MTP layer is MoE


def with_mtp_layer(checkpoint: Path, root: Path, source: int) -> Path:
    """The checkpoint plus an MTP layer at `model.layers.{n}`: layer `source`'s weights (fresh copies) and random
    MTP norms and projection."""
    path = root / "with_mtp"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    tensors = load_file(path / "model.safetensors")
    src = f"model.layers.{source}."
    g = torch.Generator().manual_seed(3)
    extra = {f"model.layers.{n}.{k[len(src):]}": v.clone() for k, v in tensors.items() if k.startswith(src)}
    for name, shape in [("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("shared_head.norm.weight", (h,)),
                        ("eh_proj.weight", (h, 2 * h))]:
        extra[f"model.layers.{n}.{name}"] = (torch.rand(shape, generator=g) + 0.5 if len(shape) == 1
                                             else torch.randn(shape, generator=g) * 0.1)
    save_file(tensors | extra, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_glm4_moe_lite_mtp_layer_matches_the_formula(tmp_path) -> None:
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteDecoderLayer

    path = with_mtp_layer(make_arch_checkpoint(tmp_path, glm4.TestGlm4MoeLite.case), tmp_path, SPARSE)
    reference = load_reference(path)
    n = reference.config.num_hidden_layers
    stored = load_file(path / "model.safetensors")
    layer = Glm4MoeLiteDecoderLayer(reference.config, SPARSE).float().eval()
    layer.load_state_dict(reference.model.layers[SPARSE].state_dict())
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


def test_glm4_moe_lite_mtp_speculative_decoding_keeps_greedy_output(tmp_path) -> None:
    path = with_mtp_layer(make_arch_checkpoint(tmp_path, glm4.TestGlm4MoeLite.case), tmp_path, SPARSE)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = llm(path).generate(PROMPTS, params)
    engine = llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                           "disable_by_batch_size": None})
    drafted = engine.generate(PROMPTS, params)
    assert engine.engine.spec_decoding_stats.num_draft_tokens > 0
    for a, b in zip(plain, drafted):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
