"""`load_model`: single and sharded safetensors, stored dtypes, MTP layers, and every way a checkpoint can be wrong."""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentserve.distributed.expert_parallel import RemoteExpert, shard_experts
from latentserve.distributed.parallel_state import DPGroup
from latentserve.models import load_model, safetensors_reader
from latentserve.models.loader import INDEX_FILE, SINGLE_FILE, checkpoint_name
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def v2_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "v2_group")


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "v3")


def _stored(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / SINGLE_FILE)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint with its tensors edited by `edit(dict)`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = _stored(src)
    edit(tensors)
    save_file(tensors, dst / SINGLE_FILE, metadata={"format": "pt"})
    return dst


def _assert_holds(model, tensors: dict[str, torch.Tensor]) -> None:
    params = model.state_dict()
    for name, tensor in tensors.items():
        torch.testing.assert_close(params[_param(name)], tensor.float(), rtol=0, atol=0)


def _param(name: str) -> str:
    return name.replace(".self_attn.kv_b_proj.", ".self_attn.attn.kv_b_proj.")


def test_loads_every_tensor(v2_checkpoint) -> None:
    model = load_model(v2_checkpoint)
    _assert_holds(model, _stored(v2_checkpoint))
    layer = model.static_forward_context[model.attention_layer_names[0]]
    assert layer.W_UK_T is not None and layer.W_UV is not None  # process_weights_after_loading ran


def test_sharded_checkpoint(tmp_path) -> None:
    path = make_checkpoint(tmp_path, "v3", max_shard_size="20KB")
    index = json.loads((path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert not (path / SINGLE_FILE).exists() and len(shards) > 1
    model = load_model(path)
    stored = {}
    for shard in shards:
        stored.update(load_file(path / shard))
    _assert_holds(model, stored)


def test_missing_shard(tmp_path) -> None:
    path = make_checkpoint(tmp_path, "v3", max_shard_size="20KB")
    shard = sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))[-1]
    (path / shard).unlink()
    with pytest.raises(FileNotFoundError, match=shard):
        load_model(path)


def test_bf16_checkpoint_loads_into_fp32(tmp_path) -> None:
    path = make_checkpoint(tmp_path, "v3", dtype=torch.bfloat16)
    stored = _stored(path)
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    model = load_model(path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    _assert_holds(model, stored)


def test_fp16_checkpoint_loads(tmp_path) -> None:
    path = make_checkpoint(tmp_path, "v2_lite", dtype=torch.float16)
    _assert_holds(load_model(path), _stored(path))


def test_mtp_layers_are_ignored(v2_checkpoint, tmp_path) -> None:
    """Tensors of the num_nextn_predict_layers layers after the last one are skipped, nothing else is."""

    def add_mtp(tensors):
        tensors["model.layers.2.eh_proj.weight"] = torch.zeros(32, 64)
        tensors["model.layers.2.self_attn.kv_b_proj.weight"] = torch.zeros(64, 16)

    path = _rewrite(v2_checkpoint, tmp_path / "mtp", add_mtp)
    with pytest.raises(ValueError, match=r"model\.layers\.2\."):
        load_model(path)  # this config has no MTP layer
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    _assert_holds(load_model(path), _stored(v2_checkpoint))


def test_missing_model_dir(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")


def test_missing_config(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_malformed_config(v2_checkpoint, tmp_path) -> None:
    path = _rewrite(v2_checkpoint, tmp_path / "bad", lambda t: None)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_model(path)


def test_unknown_architecture(v2_checkpoint, tmp_path) -> None:
    path = _rewrite(v2_checkpoint, tmp_path / "llama", lambda t: None)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        load_model(path)


def test_missing_weights_file(v2_checkpoint, tmp_path) -> None:
    path = _rewrite(v2_checkpoint, tmp_path / "noweights", lambda t: None)
    (path / SINGLE_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=SINGLE_FILE):
        load_model(path)


@pytest.mark.parametrize("name", [
    "model.layers.1.self_attn.kv_b_proj.weight",  # named as stored, not as our renamed parameter
    "model.layers.0.mlp.experts.3.down_proj.weight",
    "lm_head.weight",
])
def test_missing_tensor(v2_checkpoint, tmp_path, name: str) -> None:
    path = _rewrite(v2_checkpoint, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(ValueError, match="missing tensor.*" + name.replace(".", r"\.")):
        load_model(path)


def test_unexpected_tensor(v2_checkpoint, tmp_path) -> None:
    path = _rewrite(v2_checkpoint, tmp_path / "extra", lambda t: t.update({"model.layers.0.mlp.bonus": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.bonus'"):
        load_model(path)


def test_shape_mismatch(v2_checkpoint, tmp_path) -> None:
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    path = _rewrite(v2_checkpoint, tmp_path / "shape", lambda t: t.update({name: torch.zeros(7, 32)}))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r".*\(7, 32\)"):
        load_model(path)


def test_unsupported_stored_dtype(v2_checkpoint, tmp_path) -> None:
    name = "model.norm.weight"
    path = _rewrite(v2_checkpoint, tmp_path / "int8", lambda t: t.update({name: t[name].to(torch.int8)}))
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*int8"):
        load_model(path)


def test_checkpoint_name_inverts_the_rename() -> None:
    ours = "model.layers.3.self_attn.attn.kv_b_proj.weight"
    assert checkpoint_name(ours) == "model.layers.3.self_attn.kv_b_proj.weight"


# Expert-sharded loading: v3 has one MoE layer (layer 1) of 8 routed experts; rank 1 of 2 owns experts 4-7.
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _shard(rank: int, world_size: int):
    return functools.partial(shard_experts, group=DPGroup(rank, world_size, torch.device("cpu")))


def _owned_by_rank1(name: str) -> bool:
    match = _EXPERT.match(name)
    return match is None or int(match.group(2)) >= 4


@pytest.fixture
def reads(monkeypatch) -> list[str]:
    """The names of the checkpoint tensors the loader reads."""
    names: list[str] = []

    read = safetensors_reader._read

    def spy_read(f, entry, file):
        names.append(entry.name)
        return read(f, entry, file)

    monkeypatch.setattr(safetensors_reader, "_read", spy_read)
    return names


def test_expert_shard_holds_and_reads_only_its_experts(tmp_path, reads) -> None:
    path = make_checkpoint(tmp_path, "v3", max_shard_size="20KB")
    stored = {}
    for shard in sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())):
        stored.update(load_file(path / shard))
    owned = {name: t for name, t in stored.items() if _owned_by_rank1(name)}
    assert len(owned) == len(stored) - 4 * 3  # experts 0-3 of layer 1, three projections each

    model = load_model(path, prepare=_shard(1, 2))

    assert sorted(reads) == sorted(owned)
    params = model.state_dict()
    assert {n for n in params if _EXPERT.match(n)} == {n for n in owned if _EXPERT.match(n)}
    _assert_holds(model, owned)
    experts = model.model.layers[1].mlp.experts
    assert [isinstance(e, RemoteExpert) for e in experts] == [True] * 4 + [False] * 4
    assert model.model.layers[1].mlp.shared_experts is not None  # replicated on every rank


def test_prepare_runs_before_any_weight_is_allocated(v3_checkpoint, reads) -> None:
    seen = []

    def prepare(model):
        seen.append([name for name, p in model.named_parameters() if not p.is_meta])
        assert not reads

    model = load_model(v3_checkpoint, prepare=prepare)
    assert seen == [[]]
    assert not any(p.is_meta for p in model.parameters())


def test_tied_embeddings_stay_tied(tmp_path) -> None:
    path = make_checkpoint(tmp_path, "v2_lite", tie_word_embeddings=True)
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _assert_holds(model, _stored(path))


@pytest.mark.parametrize("name, error", [
    ("model.layers.1.mlp.experts.5.up_proj.weight", "missing tensor.*experts\\.5\\.up_proj"),  # owned
    ("model.layers.1.mlp.experts.2.up_proj.weight", None),  # another rank's: never needed
    ("model.layers.1.mlp.shared_experts.down_proj.weight", "missing tensor.*shared_experts\\.down_proj"),
])
def test_expert_shard_missing_tensor(v3_checkpoint, tmp_path, name: str, error: str | None) -> None:
    path = _rewrite(v3_checkpoint, tmp_path / "missing", lambda t: t.pop(name))
    if error is None:
        load_model(path, prepare=_shard(1, 2))
    else:
        with pytest.raises(ValueError, match=error):
            load_model(path, prepare=_shard(1, 2))


def test_expert_shard_still_refuses_unexpected_tensors(v3_checkpoint, tmp_path) -> None:
    name = "model.layers.1.mlp.experts.8.up_proj.weight"  # there are 8 experts: 0-7
    path = _rewrite(v3_checkpoint, tmp_path / "extra", lambda t: t.update({name: torch.zeros(16, 32)}))
    with pytest.raises(ValueError, match="unexpected tensor " + repr(name).replace(".", r"\.")):
        load_model(path, prepare=_shard(0, 2))


def test_indivisible_experts_fail_before_reading(v3_checkpoint, reads) -> None:
    with pytest.raises(ValueError, match=r"n_routed_experts \(8\) divisible by data_parallel_size \(3\)"):
        load_model(v3_checkpoint, prepare=_shard(0, 3))
    assert not reads


@pytest.mark.parametrize("damage, error", [
    (lambda data: data[:4], r"is not a safetensors file \(header length None"),
    (lambda data: (10**9).to_bytes(8, "little") + data[8:], r"is not a safetensors file \(header length 1000000000"),
    (lambda data: data[:-100], r"tensor '.*' has data offsets .* that do not fit"),
])
def test_damaged_safetensors_file_is_named(v2_checkpoint, tmp_path, damage, error) -> None:
    path = tmp_path / "damaged"
    path.mkdir()
    (path / "config.json").write_text((v2_checkpoint / "config.json").read_text())
    (path / SINGLE_FILE).write_bytes(damage((v2_checkpoint / SINGLE_FILE).read_bytes()))
    with pytest.raises(ValueError, match=error):
        load_model(path)


def _native_calls(monkeypatch) -> list[str]:
    """The names of latentserve's kernel wrappers called from here on."""
    from latentserve.kernels import native

    calls: list[str] = []
    for name in ("dense_linear", "dense_heads", "rms_norm", "mla_prologue", "route", "experts",
                 "mla_attention_block", "moe_block"):
        monkeypatch.setattr(native, name, lambda *a, _f=getattr(native, name), _n=name: calls.append(_n) or _f(*a))
    return calls


def test_every_layer_runs_the_kernels_of_the_policy_it_is_loaded_with(tmp_path, monkeypatch) -> None:
    """The loader hands its policy to each layer once: a policy without kernels keeps every layer on PyTorch's, in
    the fused blocks too, whatever the process's default; the default one's layers run latentserve's kernels."""
    from latentserve.config import AttentionConfig
    from latentserve.kernels.policy import KernelPolicy, default_policy
    from latentserve.layers.linear import Linear
    from tests.models.paged import PagedRunner

    default = default_policy()
    if default.kernels is None:
        pytest.skip("latentserve's kernels do not build here")
    attn_config = AttentionConfig(block_size=4)
    # Shapes the one-call blocks take: the per-head kernel's multiples of 16.
    path = make_checkpoint(tmp_path, "v3", kv_lora_rank=64, v_head_dim=16, hidden_size=64, intermediate_size=64,
                           moe_intermediate_size=64, q_lora_rank=64)
    calls = _native_calls(monkeypatch)
    logits = {}
    for name, policy in (("none", KernelPolicy(default.features, None, "test", default.threads)),
                         ("default", default)):
        model = load_model(path, attn_config=attn_config, policy=policy)
        linears = [m for m in model.modules() if type(m) is Linear]
        assert linears and all(m.kernels is policy.kernels for m in linears)
        assert all(m.native_rows == policy.dense_rows(m.weight.dtype, m.in_features) for m in linears)
        runner = PagedRunner(model, attn_config, cache_dtype=torch.float32)
        calls.clear()
        logits[name] = [runner.step([(0, [3, 5, 7])]), runner.step([(0, [9])])]
        assert bool(calls) == (name == "default"), calls
    assert {"mla_attention_block", "moe_block"} <= set(calls)
    for a, b in zip(logits["none"], logits["default"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
