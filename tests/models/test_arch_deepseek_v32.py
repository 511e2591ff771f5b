"""DeepSeek-V3.2 (deepseek_v32) against transformers: DSA with top-k below the prompt lengths, an indexer on every
layer (half-split RoPE), YaRN, q LoRA, the first layer dense."""
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from latentserve import SamplingParams
from tests.models.arch_harness import PROMPTS, YARN, ArchCase, llm, make_arch_checkpoint
from tests.models.dsa_suite import DSASuite


class TestDeepseekV32(DSASuite):
    case = ArchCase("deepseek_v32", dict(
        q_lora_rank=32, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_parameters=YARN, index_topk=8, index_n_heads=16, index_head_dim=32),
        native_attention=False)


def _with_mtp_layer(checkpoint: Path, root: Path) -> Path:
    """The checkpoint plus an MTP layer stored as DeepSeek stores it (`model.layers.{n}`): the last layer's weights,
    its indexer included, and random MTP norms and projection."""
    path = root / "with_mtp"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    tensors = load_file(path / "model.safetensors")
    last = f"model.layers.{n - 1}."
    g = torch.Generator().manual_seed(3)
    extra = {f"model.layers.{n}.{k[len(last):]}": v.clone() for k, v in tensors.items() if k.startswith(last)}
    for name, shape in [("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("shared_head.norm.weight", (h,)),
                        ("eh_proj.weight", (h, 2 * h))]:
        extra[f"model.layers.{n}.{name}"] = (torch.rand(shape, generator=g) + 0.5 if len(shape) == 1
                                             else torch.randn(shape, generator=g) * 0.1)
    save_file(tensors | extra, path / "model.safetensors", metadata={"format": "pt"})
    return path


def test_mtp_speculative_decoding_keeps_greedy_output(tmp_path) -> None:
    """The MTP layer runs its own indexer over its own caches; verification steps are decodes of k+1 tokens on the
    sparse path. Greedy output is the model's, drafts or not."""
    base = make_arch_checkpoint(tmp_path, TestDeepseekV32.case)
    path = _with_mtp_layer(base, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # (logprobs would stop drafting)
    plain = llm(path).generate(PROMPTS, params)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": None}
    engine = llm(path, speculative_config=spec)
    drafted = engine.generate(PROMPTS, params)
    assert engine.engine.spec_decoding_stats.num_draft_tokens > 0
    for a, b in zip(plain, drafted):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
