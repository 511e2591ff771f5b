"""lm-eval's `local-completions` runs unchanged (default settings: tokenized prompts, echo, logprobs) against a live
`latentserve serve` of the embedded model, on local tasks over its corpus; no hub access."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from latentserve.engine.llm import default_model_dir
from latentserve.sampling_params import SamplingParams
from tests.server.conftest import free_socket

REPO = Path(__file__).resolve().parents[2]
TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
MODEL_NAME = "kjv"
CHOICE_YAML = """task: kjv_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
GENERATE_YAML = """task: kjv_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [",", "\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    regexes_to_ignore: [" "]
"""
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": "", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def live_serve(tmp_path_factory):
    """`latentserve serve` of the embedded model in a subprocess on a free 127.0.0.1 port."""
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    cmd = [sys.executable, "-m", "latentserve.cli", "serve", "--port", str(port), "--served-model-name", MODEL_NAME,
           "--num-threads", "1", "--max-num-seqs", "16"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(60)


def test_lm_eval_local_completions_runs_unchanged(live_serve, tmp_path):
    env = {**os.environ, **OFFLINE_ENV, "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    (tmp_path / "kjv_choice.yaml").write_text(CHOICE_YAML.format(data=TASKS / "kjv_choice.jsonl"))
    (tmp_path / "kjv_generate.yaml").write_text(GENERATE_YAML.format(data=TASKS / "kjv_generate.jsonl"))
    model_args = f"model={MODEL_NAME},base_url={live_serve}/v1/completions,tokenizer={default_model_dir()}"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
           "--tasks", "kjv_choice,kjv_generate", "--include_path", str(tmp_path), "--output_path",
           str(tmp_path / "out"), "--log_samples"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results_file = next((tmp_path / "out").rglob("results_*.json"))
    results = json.loads(results_file.read_text())["results"]
    # Four choices: chance is 0.25; the model knows these verses.
    assert results["kjv_choice"]["acc,none"] >= 0.75
    samples_file = next((tmp_path / "out").rglob("samples_kjv_generate_*.jsonl"))
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 4
    # The generations equal the offline engine's greedy continuations, cut at the first stop string.
    from latentserve import LLM

    llm = LLM(max_num_seqs=4)
    contexts = [s["doc"]["context"] for s in samples]
    params = SamplingParams(temperature=0, max_tokens=8, stop=[",", "\n"])
    expected = [o.outputs[0].text for o in llm.generate(contexts, params)]
    assert [s["resps"][0][0] for s in samples] == expected
    assert results["kjv_generate"]["exact_match,none"] >= 0.5
