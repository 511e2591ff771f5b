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

from safetensors.torch import load_file, save_file

from latentserve.models import ModelConfig, DeepseekForCausalLM, load_model
from latentserve.models.loader import SINGLE_FILE, _parameters_on_meta, checkpoint_name
from tests.checkpoints import make_checkpoint, make_config

# Many mid-sized tensors: the checkpoint (~60 MB bf16) is far bigger than the allowance for tensors in flight.
SHAPES = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, n_routed_experts=16,
              num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=64, q_lora_rank=128, n_group=4, topk_group=2)

MEASURE = """
import ctypes, gc, json, sys, torch
from latentserve.layers.quant.config import QuantConfig
from latentserve.models import load_model, safetensors_reader

safetensors_reader.TRIM_EVERY_BYTES = int(sys.argv[3])  # the loader's 64 MiB, scaled to this checkpoint


def status(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))

path, warmup = sys.argv[1], sys.argv[2]
load_model(warmup, quantization=QuantConfig("int8"))  # a first load pages in ~150 MiB of code and libraries
for case in sys.argv[4:]:
    dtype, method, threads = case.split(":")
    torch.set_num_threads(int(threads))  # quantizing workers: one per thread
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # the previous case's model is gone from the process
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from here
    model = load_model(path, dtype=getattr(torch, dtype), quantization=QuantConfig(method) if method else None)
    print(json.dumps(dict(case=case, before=before, peak=status("VmHWM"), after=status("VmRSS"))))
    del model
"""
# dtype:quantization:threads. A cast of every tensor (bf16 -> fp32); quantization as read, on one and two workers.
CASES = ["float32::1", "bfloat16:int8:1", "bfloat16:int8:2"]
TRIM_EVERY_BYTES = 2 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Random bf16 weights under transformers' config and tensor names (quicker to write than its model)."""
    path = tmp_path_factory.mktemp("big")
    make_config("v3", architectures=["DeepseekV3ForCausalLM"], **SHAPES).save_pretrained(path)
    with _parameters_on_meta():
        skeleton = DeepseekForCausalLM(ModelConfig.from_pretrained(path))
    g = torch.Generator().manual_seed(0)
    tensors = {checkpoint_name(name): (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)
               for name, t in skeleton.state_dict().items()}
    save_file(tensors, path / SINGLE_FILE)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"), "v3", dtype=torch.bfloat16)


def test_peak_memory_stays_near_the_final_weights(checkpoint, tiny):
    file_bytes = (checkpoint / SINGLE_FILE).stat().st_size
    run = subprocess.run([sys.executable, "-c", MEASURE, str(checkpoint), str(tiny), str(TRIM_EVERY_BYTES), *CASES],
                         capture_output=True,
                         text=True, env={"OMP_NUM_THREADS": "1", "PATH": ""}, check=True, cwd=Path.cwd())
    results = [json.loads(line) for line in run.stdout.strip().splitlines()[-len(CASES):]]
    assert [m["case"] for m in results] == CASES
    for m in results:
        final, peak = m["after"] - m["before"], m["peak"] - m["before"]
        largest = 1024 * 512 * 4  # the largest tensor (dense MLP), in fp32
        # Tensors in flight, and what their conversions free between two trims of glibc's heap.
        allowance = 1.15 * final + 4 * largest + 4 * TRIM_EVERY_BYTES + (8 << 20)
        assert allowance < final + file_bytes  # so a load that held the whole file at once would fail here
        assert peak <= allowance, f"{m['case']}: peak {peak >> 20} MiB over final weights {final >> 20} MiB"


def test_progress_is_logged_off_a_terminal(checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="latentserve.models.safetensors_reader"):
        load_model(checkpoint, dtype=torch.bfloat16)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "loading shard 1/1: model.safetensors"
    assert lines[-1].startswith("loaded ") and lines[-1].endswith("(100%)")
    assert len(lines) >= 5


def test_progress_bar_on_a_terminal(checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    load_model(checkpoint, dtype=torch.bfloat16)
    err = capsys.readouterr().err
    total = f"{sum(t.nbytes for t in load_file(checkpoint / SINGLE_FILE).values()) / 1e6:.1f}M"
    assert "shard 1/1: model.safetensors" in err and f"/{total}" in err and "B/s" in err  # shards and bytes
