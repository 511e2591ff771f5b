"""Engine settings resolved at start-up: the KV pool against max_model_len, torch's thread count, DBO thresholds."""
from __future__ import annotations

import argparse
import shutil

import pytest
import torch

from latentserve import LLM, SamplingParams
from latentserve.cli.args import add_engine_args, build_llm
from latentserve.config import DBOConfig
from latentserve.engine.engine_config import CPU_DBO_DECODE_TOKEN_THRESHOLD, EngineConfig, dbo_config
from latentserve.kernels.policy import KernelPolicy
from latentserve.layers.linear import Linear
from latentserve.layers.norm import RMSNorm
from latentserve.models.loader import SINGLE_FILE
from tests.checkpoints import make_checkpoint

# The checkpoint's max_position_embeddings is 256: 64 blocks of 4 tokens.
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=64)  # fp32: the KV sizes below are 4-byte


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "v3")


@pytest.fixture
def threads():
    """Restores one torch thread, as tests/conftest.py sets it, whatever the test did."""
    yield
    torch.set_num_threads(1)


def test_kv_pool_that_holds_exactly_one_longest_request_is_enough(checkpoint):
    llm = LLM(model=str(checkpoint), num_kv_blocks=16, max_model_len=64, **ENGINE)
    out = llm.generate([list(range(1, 60))], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5  # 64 tokens in 16 blocks: the pool's every slot


@pytest.mark.parametrize("kwargs, needed, max_model_len", [
    (dict(num_kv_blocks=16, max_model_len=65), 17, 65),  # ceil(65 / 4)
    (dict(num_kv_blocks=63), 64, 256),  # max_model_len defaults to max_position_embeddings
])
def test_kv_pool_too_small_for_max_model_len(checkpoint, kwargs, needed, max_model_len):
    with pytest.raises(ValueError, match=rf"num_kv_blocks={kwargs['num_kv_blocks']} .*max_model_len={max_model_len}"
                                         rf" .*needs {needed} blocks"):
        LLM(model=str(checkpoint), **kwargs, **ENGINE)


def test_kv_memory_too_small_for_max_model_len(checkpoint):
    # One block: 4 tokens x (kv_lora_rank 16 + rope 8) values x 2 layers x 4 bytes = 768 bytes.
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=8000 \(10 blocks\).*max_model_len=64 .*needs 16 "
                                         r"blocks.*at most 40"):
        LLM(model=str(checkpoint), kv_cache_memory_bytes=8000, max_model_len=64, **ENGINE)
    LLM(model=str(checkpoint), kv_cache_memory_bytes=16 * 768, max_model_len=64, **ENGINE)


def test_kv_pool_is_checked_before_the_weights_are_read(checkpoint, tmp_path):
    model_dir = tmp_path / "config-only"
    model_dir.mkdir()
    shutil.copy(checkpoint / "config.json", model_dir)  # no weights: loading them would fail
    with pytest.raises(ValueError, match="num_kv_blocks=2 "):
        LLM(model=str(model_dir), num_kv_blocks=2, **ENGINE)
    with pytest.raises(FileNotFoundError, match=SINGLE_FILE):
        LLM(model=str(model_dir), num_kv_blocks=64, **ENGINE)


def test_num_threads_sets_torch_threads(checkpoint, threads):
    LLM(model=str(checkpoint), num_kv_blocks=64, num_threads=2, **ENGINE)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(3)
    LLM(model=str(checkpoint), num_kv_blocks=64, **ENGINE)  # None: torch's setting stays
    assert torch.get_num_threads() == 3


def test_the_engine_builds_one_kernel_policy_for_its_threads_and_every_layer_asks_it(checkpoint, threads):
    engine = LLM(model=str(checkpoint), num_kv_blocks=64, num_threads=2, **ENGINE).engine
    policy = engine.kernel_policy
    assert policy == KernelPolicy.detect(2) and policy.threads == 2
    linears = [m for m in engine.model.modules() if type(m) is Linear]
    assert linears and all(m.kernels is policy.kernels for m in linears)
    assert all(m.native_rows == policy.dense_rows(m.weight.dtype, m.in_features) for m in linears)
    norms = [m for m in engine.model.modules() if type(m) is RMSNorm]
    assert norms and all(n.asked and n.kernels is policy.kernels for n in norms)


@pytest.mark.parametrize("name", ["num_threads", "num_kv_blocks"])
@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "2"])
def test_bad_counts(checkpoint, name, bad):
    with pytest.raises(ValueError, match=rf"{name} must be an int >= 1 or None, got {bad!r}"):
        LLM(model=str(checkpoint), **{name: bad})


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_num_threads_flag_reaches_the_engine(checkpoint, threads):
    llm = build_llm(_parse(["--model", str(checkpoint), "--block-size", "4", "--num-kv-blocks", "64",
                            "--num-threads", "2"]))
    assert llm.engine is not None and torch.get_num_threads() == 2
    assert _parse([]).num_threads is None
    with pytest.raises(SystemExit):
        _parse(["--num-threads", "0"])


def test_dbo_decode_threshold_defaults_by_device(checkpoint):
    """vLLM's 32 where its GPU kernels make a split cheap; on CPU 256, below which a split costs more than it hides
    (benchmarks/dbo_overlap.py)."""
    assert dbo_config(EngineConfig(device="cuda")).dbo_decode_token_threshold == 32
    assert dbo_config(EngineConfig()).dbo_decode_token_threshold == CPU_DBO_DECODE_TOKEN_THRESHOLD == 256
    assert dbo_config(EngineConfig(device="cuda", dbo_decode_token_threshold=8)).dbo_decode_token_threshold == 8
    llm = LLM(model=str(checkpoint), num_kv_blocks=64, enable_dbo=True, **ENGINE)
    assert llm.engine.runner.dbo_config == DBOConfig(True, 256, 512)
    with pytest.raises(ValueError, match="dbo_decode_token_threshold must be an int >= 2"):
        LLM(model=str(checkpoint), num_kv_blocks=64, dbo_decode_token_threshold=1, **ENGINE)
