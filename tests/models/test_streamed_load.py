"""Streamed loading: peak resident memory stays near the final weights (each tensor is converted and freed before
the next is read), and progress is reported."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from latentserve.models import load_model
from tests.checkpoints import make_checkpoint

# Many mid-sized tensors: the checkpoint (~60 MB bf16) is far bigger than the allowance for tensors in flight.
SHAPES = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=16,
              num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=64, q_lora_rank=128, n_group=4, topk_group=2)

MEASURE = """
import json, sys, torch
from latentserve.layers.quant.config import QuantConfig
from latentserve.models import load_model

def status(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))

path, warmup, dtype, method = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3]), sys.argv[4]
quantization = QuantConfig(method) if method != "none" else None
load_model(warmup, dtype=dtype, quantization=quantization)  # a first load pages in ~150 MiB of code and libraries
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from here
model = load_model(path, dtype=dtype, quantization=quantization)
print(json.dumps(dict(before=before, peak=status("VmHWM"), after=status("VmRSS"))))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("big"), "v3", dtype=torch.bfloat16, **SHAPES)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "v3", dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype, method", [("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8")])
def test_peak_memory_stays_near_the_final_weights(checkpoint, tiny, dtype, method):
    file_bytes = (checkpoint / "model.safetensors").stat().st_size
    run = subprocess.run([sys.executable, "-c", MEASURE, str(checkpoint), str(tiny), dtype, method], capture_output=True,
                         text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""}, check=True, cwd=Path.cwd())
    m = json.loads(run.stdout.strip().splitlines()[-1])
    final, peak = m["after"] - m["before"], m["peak"] - m["before"]
    largest = 1024 * 512 * 4  # the largest tensor (dense MLP), in fp32
    allowance = 1.15 * final + 4 * largest + (8 << 20)
    print(f"{dtype} {method}: peak {peak / 2**20:.1f} MiB, final {final / 2**20:.1f} MiB")
    assert allowance < final + file_bytes  # so a load that held the whole file at once would fail here
    assert peak <= allowance, f"peak {peak >> 20} MiB over final weights {final >> 20} MiB"


def test_progress_is_logged_off_a_terminal(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="latentserve.models.safetensors_reader"):
        load_model(checkpoint, dtype=torch.bfloat16)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "loading shard 1/1: model.safetensors"
    assert lines[-1].startswith("loaded ") and lines[-1].endswith("(100%)")
    assert len(lines) >= 5
