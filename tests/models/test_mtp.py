"""The MTP layer over its paged cache against a naive fp32 implementation of DeepSeek-V3's MTP formula."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.config import AttentionConfig
from latentserve.layers.moe import MoE
from latentserve.models import load_model
from latentserve.models.mtp import load_mtp
from tests.models.mtp_checkpoint import make_mtp_checkpoint, reference_mtp_logprobs
from tests.models.paged import PagedRunner

ATOL = 1e-4
# Genesis 1 (KJV), verses joined by newlines as the training script writes a chapter: a chapter the embedded model
# never trained on (every 50th is held out).
HELD_OUT = (Path(__file__).parent / "genesis_1.txt").read_text().rstrip("\n")
LENS = (7, 4, 10)


def _tokens(lengths, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _runners(path, attn_config):
    main = load_model(path, attn_config=attn_config)
    mtp = load_mtp(path, main, attn_config)
    return PagedRunner(main, attn_config), PagedRunner(mtp, attn_config, seed=1), mtp


def _check(logits: torch.Tensor, expected: torch.Tensor) -> None:
    assert expected.std(-1).min() > 0.3  # a near-uniform oracle would match anything
    torch.testing.assert_close(logits.log_softmax(-1), expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("own_embed_head, overrides", [
    (False, {}),  # MoE MTP layer, embedding and head shared with the main model (our embedded model's layout)
    (True, {}),  # the MTP's own embedding and head, as DeepSeek-V3 ships them
    (False, dict(first_k_dense_replace=3)),  # layer 2 is below first_k_dense_replace: a dense MTP layer
])
def test_prefill_then_multi_token_steps_match_the_formula(tmp_path, own_embed_head: bool, overrides: dict) -> None:
    path, reference, ref_mtp = make_mtp_checkpoint(tmp_path, own_embed_head, **overrides)
    attn_config = AttentionConfig(block_size=4)
    main_runner, mtp_runner, mtp = _runners(path, attn_config)
    assert isinstance(mtp.layer.mlp, MoE) == ("first_k_dense_replace" not in overrides)
    if isinstance(mtp.layer.mlp, MoE):
        assert mtp.layer.mlp.stacked is not None  # its experts run as the main model's do
    sequences = _tokens(LENS)
    # Prefill: MTP position i pairs h_i (the main model's output, after its final norm) with t_{i+1} (a zero
    # embedding at position 0); the last prompt token has no successor yet.
    hidden = main_runner.forward(list(enumerate(sequences)))
    pairs = torch.cat([h[:-1] for h in hidden.split(LENS)])
    logits = mtp_runner.step([(r, seq[1:]) for r, seq in enumerate(sequences)], pairs)
    for seq, ours in zip(sequences, logits.split([n - 1 for n in LENS])):
        _check(ours, reference_mtp_logprobs(reference, ref_mtp, seq))
    # Then steps of 1 and 3 new tokens per request (a decode; a verification-sized step).
    last_hidden = [h[-1:] for h in hidden.split(LENS)]
    for step, width in enumerate((1, 3, 1)):
        new = _tokens([width] * len(sequences), seed=10 + step)
        hidden = main_runner.forward(list(enumerate(new))).split(width)
        pairs = torch.cat([torch.cat([last[-1:], h[:-1]]) for last, h in zip(last_hidden, hidden)])
        logits = mtp_runner.step(list(enumerate(new)), pairs)
        for r, ours in enumerate(logits.split(width)):
            sequences[r] += new[r]
            _check(ours, reference_mtp_logprobs(reference, ref_mtp, sequences[r])[-width:])
        last_hidden = hidden


def test_refuses_a_checkpoint_without_mtp_weights(tmp_path) -> None:
    path, _, _ = make_mtp_checkpoint(tmp_path)
    file = path / "model.safetensors"
    everything = load_file(file)
    save_file({k: v for k, v in everything.items() if not k.startswith("model.layers.2.")}, file)
    main = load_model(path)  # the main model does not need them
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=1 .*no 'model.layers.2.\*' tensors"):
        load_mtp(path, main)
    save_file({k: v for k, v in everything.items() if k != "model.layers.2.eh_proj.weight"}, file)
    with pytest.raises(ValueError, match="MTP layer is missing tensor.*model.layers.2.eh_proj.weight"):
        load_mtp(path, main)
    save_file({**everything, "model.layers.2.bogus.weight": torch.zeros(2)}, file)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.2.bogus.weight'"):
        load_mtp(path, main)
    save_file({**everything, "model.layers.2.eh_proj.weight": torch.zeros(3, 3)}, file)
    with pytest.raises(ValueError, match="eh_proj.weight' has shape"):
        load_mtp(path, main)
    save_file({k: v for k, v in everything.items() if not k.startswith("model.layers.2.")}, file)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="declares no MTP layer"):
        load_mtp(path, load_model(path))


def embedded_agreement(model_dir: Path = DEFAULT_MODEL_DIR, window: int = 256) -> float:
    """Teacher-forced on HELD_OUT cut into sequences of `window` tokens (the embedded model's training length): how
    often the MTP's argmax for t_{i+2} is the main model's (the greedy acceptance rate of a first draft token)."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(HELD_OUT).ids
    windows = [ids[start:start + window] for start in range(0, len(ids), window)]
    lens = [len(w) for w in windows]
    attn_config = AttentionConfig(block_size=16)
    main = load_model(model_dir, attn_config=attn_config)
    mtp = load_mtp(model_dir, main, attn_config)
    blocks = len(ids) // 16 + len(windows)
    hidden = PagedRunner(main, attn_config, num_blocks=blocks).forward(list(enumerate(windows))).split(lens)
    with torch.no_grad():  # main's t_{i+2}, from t_0..t_{i+1}
        target = torch.cat([main.compute_logits(h[1:]).argmax(-1) for h in hidden])
    pairs = torch.cat([h[:-1] for h in hidden])  # MTP position i: h_i with t_{i+1}
    mtp_runner = PagedRunner(mtp, attn_config, num_blocks=blocks, seed=1)
    draft = mtp_runner.step([(r, w[1:]) for r, w in enumerate(windows)], pairs).argmax(-1)
    assert draft.numel() == len(ids) - len(windows) > 800
    return (draft == target).float().mean().item()


def test_embedded_models_mtp_layer_drafts_the_main_models_next_token_on_held_out_text() -> None:
    """Its weights were trained on the input convention the engine uses: teacher-forced on a held-out chapter, its
    argmax for t_{i+2} is the main model's at >= 80 % of positions (88 %; the layer shipped before: 74 %)."""
    assert embedded_agreement() >= 0.8
