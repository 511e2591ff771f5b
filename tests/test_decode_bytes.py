"""benchmarks/decode_bytes.py against the checkpoint's own tensors, as transformers names them."""
from __future__ import annotations

import pytest
import torch

from benchmarks.decode_bytes import decode_bytes_per_token, gguf_decode_bytes
from latentserve import LLM
from latentserve.models.formats import gguf as gguf_format
from tests.checkpoints import load_reference, make_checkpoint
from tests.kernels.builds import needs_the_engines_kernels
from tests.models.gguf_checkpoint import write_gguf


def _elements(state: dict[str, torch.Tensor], *prefixes: str) -> int:
    return sum(t.numel() for name, t in state.items() if name.startswith(prefixes))


def test_fp32_decode_bytes_are_the_checkpoints_tensors_a_token_reads(tmp_path):
    checkpoint = make_checkpoint(tmp_path, "v3")  # layer 0 dense, layer 1 MoE: 8 experts top-2, 2 shared
    llm = LLM(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=32)
    counted = decode_bytes_per_token(llm.engine.model)
    reference = load_reference(checkpoint)
    state, config = reference.state_dict(), reference.config
    attention = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    expected = {
        "embedding row": config.hidden_size,
        # the absorbed W_UK / W_UV hold kv_b_proj's elements
        "attention": _elements(state, *(f"model.layers.{i}.self_attn.{m}." for i in (0, 1) for m in attention)),
        "layer norms": _elements(state, *(f"model.layers.{i}.{n}." for i in (0, 1)
                                         for n in ("input_layernorm", "post_attention_layernorm"))),
        "MLP / MoE": _elements(state, "model.layers.0.mlp.", "model.layers.1.mlp.gate.",
                               "model.layers.1.mlp.shared_experts.")
        + config.num_experts_per_tok * _elements(state, "model.layers.1.mlp.experts.") // config.n_routed_experts,
        "final norm": config.hidden_size,
        "lm_head": config.vocab_size * config.hidden_size,
    }
    assert counted == {part: 4 * n for part, n in expected.items()}


@needs_the_engines_kernels  # the absorbed products run in int8 through latentserve's kernels
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_decode_reads_the_int8_absorbed_products_not_the_full_precision_ones(tmp_path, quantization):
    # int4 takes input widths in multiples of 32
    checkpoint = make_checkpoint(tmp_path, "v3", intermediate_size=64, moe_intermediate_size=32, q_lora_rank=32)
    llm = LLM(model=str(checkpoint), dtype="float32", quantization=quantization, block_size=4, num_kv_blocks=16,
              max_model_len=32)
    model = llm.engine.model
    fp32 = LLM(model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=32)
    counted, full = decode_bytes_per_token(model), decode_bytes_per_token(fp32.engine.model)
    core = model.model.layers[0].self_attn.attn
    assert core.int8_absorbed is not None
    absorbed = sum(t.nbytes for products in core.int8_absorbed for t in (products.q, products.scale, products.qsum))
    assert absorbed < core.W_UK_T.nbytes + core.W_UV.nbytes
    # int8 weights: about a quarter of fp32 (plus scales), int4 less again; norms and the router stay fp32.
    assert counted["attention"] < full["attention"] / 2 and counted["MLP / MoE"] < full["MLP / MoE"] / 2
    assert counted["layer norms"] == full["layer norms"] and counted["final norm"] == full["final norm"]


@pytest.mark.parametrize("kv_b", ["split", "whole", "both"])
def test_gguf_decode_bytes_of_an_f32_file_equal_the_loaded_models(tmp_path, monkeypatch, kv_b):
    # An F32 file holds each tensor at the size latentserve runs it at in float32, so the file's count and the
    # loaded model's agree part by part: the same tensors are read, whatever form kv_b_proj takes in the file.
    monkeypatch.setattr(gguf_format, "cache_root", lambda: tmp_path / "gguf-cache")
    src = make_checkpoint(tmp_path, "v3")
    path = tmp_path / "model.gguf"
    write_gguf(src, path, kv_b=kv_b)
    llm = LLM(model=str(path), dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=32)
    assert gguf_decode_bytes(path) == decode_bytes_per_token(llm.engine.model)
