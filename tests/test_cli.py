"""The `latentserve` command line: generate, chat, bench, backends, and how user mistakes are reported."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from latentserve import LLM, SamplingParams
from latentserve.attention.prefill.reference import ReferencePrefillBackend
from latentserve.attention.prefill.registry import MLAPrefillBackendEnum
from latentserve.cli import main
from latentserve.cli.bench import percentile
from latentserve.engine.chat_template import render_chat
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint

REPO = Path(__file__).resolve().parents[1]
CORPUS = [
    "and god said let there be light and there was light",
    "in the beginning god created the heaven and the earth",
    "hello there, how are you? i am fine. thank you!",
] * 10
BOS, EOS, USER, ASSISTANT = "<s>", "</s>", "<|User|>", "<|Assistant|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '" + USER + "' + m['content'] }}"
    "{% else %}{{ '" + ASSISTANT + "' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
ENGINE_FLAGS = ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "64", "--max-num-batched-tokens", "64"]
GREEDY = ["--temperature", "0"]
DBO_FLAGS = ["--enable-dbo", "--dbo-decode-token-threshold", "2", "--dbo-prefill-token-threshold", "2"]
# One intra-op thread, as in conftest.py: CPU thread hand-offs dominate tiny models on shared cores.
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def write_tokenizer(model_dir: Path) -> None:
    """A lower-cased BPE over a few sentences: its 90 tokens fit the checkpoint's vocab_size of 96."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=["<unk>", BOS, EOS, USER, ASSISTANT],
                                  show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = dict(bos_token=BOS, eos_token=EOS, add_bos_token=False, chat_template=CHAT_TEMPLATE)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("cli"), "v3")
    write_tokenizer(path)
    return path


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Exit status (argparse exits through SystemExit), stdout and stderr of one in-process run."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def greedy(model_dir: Path, prompts, max_tokens: int):
    llm = LLM(model=str(model_dir), **ENGINE)
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def test_generate_streams_the_greedy_completion(model_dir, capsys, monkeypatch):
    steps, chunks = [0], []
    original_step = LLMEngine.step

    def counting_step(self):
        steps[0] += 1
        return original_step(self)

    def recording_write(text):
        chunks.append((steps[0], text))
        sys.stdout.write(text)

    monkeypatch.setattr(LLMEngine, "step", counting_step)
    monkeypatch.setattr("latentserve.cli.streaming.write", recording_write)
    prompt = "and god said"
    code, out, err = run_cli(["generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "8",
                              *GREEDY, *ENGINE_FLAGS], capsys)
    expected = greedy(model_dir, prompt, 8)[0].outputs[0]
    assert code == 0, err
    assert out == prompt + expected.text + "\n"
    assert expected.text and len({step for step, _ in chunks}) >= 2, "the text must appear step by step"


@pytest.mark.parametrize("extra_flags", [[], DBO_FLAGS], ids=["plain", "dbo"])
def test_generate_json_equals_llm_generate(model_dir, tmp_path, capsys, extra_flags):
    prompts = ["in the beginning", "hello there, how are you?", "light"]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join([prompts[0], "", prompts[1], "  ", prompts[2]]) + "\n")
    code, out, err = run_cli(["generate", "--model", str(model_dir), "--prompts-file", str(prompts_file), "--json",
                              "--max-tokens", "6", *GREEDY, *ENGINE_FLAGS, *extra_flags], capsys)
    assert code == 0, err
    results = json.loads(out)
    expected = greedy(model_dir, prompts, 6)
    assert [r["prompt"] for r in results] == prompts
    for result, ref in zip(results, expected):
        assert result["token_ids"] == ref.outputs[0].token_ids
        assert result["text"] == ref.outputs[0].text
        assert result["finish_reason"] == ref.outputs[0].finish_reason
        assert result["prompt_token_ids"] == ref.prompt_token_ids


def test_generate_labels_each_of_several_completions(model_dir, tmp_path, capsys):
    prompts = ["and god said", "the earth"]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(prompts))
    code, out, err = run_cli(["generate", "--model", str(model_dir), "--prompts-file", str(prompts_file),
                              "--max-tokens", "5", *GREEDY, *ENGINE_FLAGS], capsys)
    assert code == 0, err
    for i, (prompt, ref) in enumerate(zip(prompts, greedy(model_dir, prompts, 5))):
        completion = ref.outputs[0]
        header = f"=== [{i}] {prompt!r} ({completion.finish_reason}, {len(completion.token_ids)} tokens)\n"
        assert header + prompt + completion.text + "\n" in out


def _expected_chat(model_dir: Path, turns: list[str], max_tokens: int) -> list[str]:
    """Each turn's greedy reply, with the conversation written out by hand in the template's format."""
    llm = LLM(model=str(model_dir), **ENGINE)
    tokenizer = llm.get_tokenizer().tokenizer
    history, replies = BOS, []
    for turn in turns:
        history += USER + turn + ASSISTANT
        ids = tokenizer.encode(history, add_special_tokens=False).ids
        reply = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0].text
        replies.append(reply)
        history += reply + EOS
    return replies


def test_chat_keeps_the_history_over_two_turns(model_dir, capsys, monkeypatch):
    turns = ["hello there", "how are you?"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(t + "\n" for t in turns)))
    code, out, err = run_cli(["chat", "--model", str(model_dir), "--max-tokens", "6", *GREEDY, *ENGINE_FLAGS],
                             capsys)
    assert code == 0, err
    replies = _expected_chat(model_dir, turns, 6)
    assert out == "".join(reply + "\n" for reply in replies)
    assert any(replies)


def test_chat_through_a_pipe_in_a_subprocess(model_dir):
    """A real process reading a pipe (no TTY): one turn, then /exit ends it before the next line."""
    proc = subprocess.run(
        [sys.executable, "-m", "latentserve.cli", "chat", "--model", str(model_dir), "--max-tokens", "6", *GREEDY,
         *ENGINE_FLAGS],
        input="hello there\n/exit\nnever read\n", capture_output=True, text=True, cwd=REPO, timeout=120,
        env=SUBPROCESS_ENV,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _expected_chat(model_dir, ["hello there"], 6)[0] + "\n"


def test_bench_reports_and_writes_json(model_dir, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    code, out, err = run_cli(["bench", "--model", str(model_dir), "--num-prompts", "3", "--input-len", "5",
                              "--output-len", "4", "--output-json", str(out_json), *ENGINE_FLAGS], capsys)
    assert code == 0, err
    assert "3/3 requests" in err
    for label in ("requests/s", "input tokens/s", "output tokens/s", "time to first token", "inter-token latency"):
        assert label in out
    r = json.loads(out_json.read_text())
    assert (r["num_prompts"], r["num_input_tokens"], r["num_output_tokens"]) == (3, 15, 12)
    assert r["total_time_s"] > 0
    assert r["requests_per_s"] == pytest.approx(3 / r["total_time_s"])
    assert r["output_tokens_per_s"] == pytest.approx(12 / r["total_time_s"])
    for key in ("ttft_ms", "itl_ms"):
        stats = r[key]
        assert 0 < stats["p50"] <= stats["p99"] and stats["mean"] > 0
        assert stats["p99"] <= 1000 * r["total_time_s"]


def test_percentile_matches_torch_quantile():
    values = torch.rand(37, generator=torch.Generator().manual_seed(0)).tolist()
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(torch.quantile(torch.tensor(values, dtype=torch.float64),
                                                                      q / 100).item())
    assert percentile([4.0], 99) == 4.0


class CudaOnlyPrefill(ReferencePrefillBackend):
    supported_device_types = ("cuda",)

    @classmethod
    def get_name(cls):
        return "CLI_CUDA_ONLY"


def test_backends_lists_every_member_and_why_not(capsys):
    if "CLI_CUDA_ONLY" not in MLAPrefillBackendEnum.__members__:
        MLAPrefillBackendEnum.register("CLI_CUDA_ONLY", f"{__name__}.CudaOnlyPrefill")
    code, out, err = run_cli(["backends"], capsys)
    assert code == 0, err
    prefill, decode = out.split("decode backends")
    from latentserve.attention.prefill.native import NativePrefillBackend

    sdpa = "TORCH_SDPA: latentserve.attention.prefill.torch_sdpa.TorchSDPAPrefillBackend\n    cpu: valid"
    if NativePrefillBackend.unavailable_reason() is None:
        assert "NATIVE: latentserve.attention.prefill.native.NativePrefillBackend\n    cpu: valid (default)" in prefill
        assert sdpa + "\n" in prefill
    else:
        assert sdpa + " (default)" in prefill
    assert "REFERENCE: latentserve.attention.prefill.reference.ReferencePrefillBackend\n    cpu: valid\n" in prefill
    assert "CUSTOM: unregistered" in prefill and "CUSTOM: unregistered" in decode
    assert "CLI_CUDA_ONLY: tests.test_cli.CudaOnlyPrefill\n    cpu: invalid: CLI_CUDA_ONLY does not support " \
        "device 'cpu'" in prefill
    from latentserve.attention.decode.native import NativeMQADecodeBackend

    if NativeMQADecodeBackend.unavailable_reason() is None:
        assert "NATIVE: latentserve.attention.decode.native.NativeMQADecodeBackend\n    cpu: valid (default)" in decode
        assert "PAGED: latentserve.attention.decode.paged.PagedMQADecodeBackend\n    cpu: valid\n" in decode
    else:
        assert "PAGED: latentserve.attention.decode.paged.PagedMQADecodeBackend\n    cpu: valid (default)" in decode
    assert "TORCH: latentserve.attention.decode.torch_mqa.TorchMQADecodeBackend\n    cpu: valid\n" in decode


def test_engine_flags_reach_llm(monkeypatch, capsys):
    seen = {}

    class RecordingLLM:
        def __init__(self, model=None, **kwargs):
            seen.update(model=model, **kwargs)
            raise ValueError("recorded")

    monkeypatch.setattr("latentserve.cli.args.LLM", RecordingLLM)
    code, _, err = run_cli(
        ["bench", "--model", "m", "--dtype", "bf16", "--block-size", "8", "--max-num-seqs", "3",
         "--max-num-batched-tokens", "99", "--max-model-len", "77", "--num-kv-blocks", "5", *DBO_FLAGS[:3],
         "--dbo-prefill-token-threshold", "6", "--prefill-backend", "reference", "--decode-backend", "Torch",
         "--seed", "9", "--num-threads", "3", "--reasoning-parser", "deepseek_r1", "--quantization", "int4",
         "--quantization-group-size", "64", "--batch-invariant"], capsys)
    assert (code, err) == (1, "latentserve: error: recorded\n")
    assert seen == dict(model="m", dtype="bf16", device="cpu", quantization="int4", quantization_group_size=64,
                        lm_head_quantized=None, block_size=8, max_num_seqs=3,
                        max_num_batched_tokens=99, max_model_len=77, num_kv_blocks=5, enable_dbo=True,
                        dbo_decode_token_threshold=2, dbo_prefill_token_threshold=6, prefill_backend="REFERENCE",
                        decode_backend="TORCH", seed=9, num_threads=3, data_parallel_size=1, enable_expert_parallel=False,
                        link_latency_us=0.0, link_bandwidth_gbps=None, reasoning_parser="deepseek_r1",
                        speculative_config=None, kv_cache_dtype="auto", enable_prefix_caching=None,
                        enable_chunked_prefill=True, tokenizer=None, tokenizer_mode="auto", max_logprobs=20,
                        batch_invariant=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_usage_error(capsys):
    code, _, err = run_cli(["generate", "--device", "cuda"], capsys)
    assert code == 2 and err == "latentserve generate: error: argument --device: device cuda requested but CUDA " \
        "is not available on this machine\n"


@pytest.fixture(scope="module")
def bare_model_dir(model_dir, tmp_path_factory) -> Path:
    """The same checkpoint without a tokenizer."""
    path = tmp_path_factory.mktemp("bare")
    for f in model_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            (path / f.name).symlink_to(f)
    return path


MISTAKES = {
    "missing model": (["generate", "--model", "/nonexistent/model"], 1, "model directory /nonexistent/model does not"),
    "unknown backend": (["generate", "--prefill-backend", "nope"], 2, "valid names: NATIVE, TORCH_SDPA, REFERENCE"),
    "unregistered backend": (["generate", "--decode-backend", "custom"], 1, "must be registered before use"),
    "negative max tokens": (["generate", "--max-tokens", "-4"], 2, "--max-tokens: must be >= 1, got -4"),
    "missing prompts file": (["generate", "--prompts-file", "{tmp}/none.txt"], 1, "No such file"),
    "prompts file is a directory": (["generate", "--prompts-file", "{tmp}"], 1, "Is a directory"),
    "empty prompts file": (["generate", "--prompts-file", "{tmp}/empty.txt"], 1, "has no prompts"),
    "bad dtype": (["generate", "--dtype", "int3"], 2, "unknown dtype 'int3'"),
    "bad top_p": (["generate", "--top-p", "1.5"], 1, "top_p must be in (0, 1]"),
    "prompt too long": (["generate", "--max-model-len", "6", "--prompt", "and god said let there be light"], 1,
                        "leaves no room to generate within max_model_len=6"),
    "kv cache too small": (["generate", "--num-kv-blocks", "2", "--max-tokens", "20"], 1, "cannot hold one request of max_model_len=256"),
    "bench too long": (["bench", "--input-len", "250", "--output-len", "10"], 1, "exceeds max_model_len=256"),
    "bench json dir": (["bench", "--output-json", "{tmp}/no/such.json"], 1, "does not exist"),
    "no command": ([], 2, "required: COMMAND"),
    "unknown flag": (["backends", "--frobnicate"], 2, "unrecognized arguments: --frobnicate"),
}


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_user_mistakes_print_one_line(name, model_dir, tmp_path, capsys):
    argv, expected_code, message = MISTAKES[name]
    (tmp_path / "empty.txt").write_text("\n  \n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv and argv[0] != "backends":  # a flag given again after these wins
        argv = [argv[0], "--model", str(model_dir), *ENGINE_FLAGS, *argv[1:]]
    code, out, err = run_cli(argv, capsys)
    assert code == expected_code
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("latentserve") and ": error: " in err and message in err, err


def test_chat_template_renders_like_transformers(model_dir):
    from transformers import PreTrainedTokenizerFast

    template = (  # newlines and block tags, so that trim_blocks / lstrip_blocks matter
        "{{ bos_token }}\n{% for m in messages %}\n  {% if m['role'] == 'user' %}\n"
        "U: {{ m['content'] }}\n  {% else %}\nA: {{ m['content'] }}{{ eos_token }}\n  {% endif %}\n"
        "{% endfor %}\n{% if add_generation_prompt %}A:{% endif %}"
    )
    info = load_tokenizer(model_dir)
    info.chat_template = template
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), bos_token=BOS, eos_token=EOS)
    messages = [dict(role="user", content="hi"), dict(role="assistant", content="yo"), dict(role="user", content="x")]
    expected = hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert render_chat(info, messages) == expected


def test_chat_needs_a_chat_template(model_dir, tmp_path, capsys):
    for f in model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(bos_token=BOS, eos_token=EOS)))
    code, _, err = run_cli(["chat", "--model", str(tmp_path), *ENGINE_FLAGS], capsys)
    assert (code, err) == (1, "latentserve: error: this model has no chat template (tokenizer_config.json chat_template)\n")


def test_text_prompt_needs_a_tokenizer(bare_model_dir, capsys):
    code, _, err = run_cli(["generate", "--model", str(bare_model_dir), *ENGINE_FLAGS], capsys)
    assert code == 1 and err.strip() == "latentserve: error: this checkpoint has no tokenizer.json: pass prompts " \
        "as token id lists"
    code, _, err = run_cli(["chat", "--model", str(bare_model_dir), *ENGINE_FLAGS], capsys)
    assert code == 1 and "has no tokenizer.json: chat needs one" in err


def test_mistake_in_a_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "latentserve.cli", "generate", "--model", str(tmp_path / "nope")],
                          capture_output=True, text=True, cwd=REPO, timeout=120, env=SUBPROCESS_ENV)
    assert proc.returncode == 1
    assert proc.stderr == (f"latentserve: error: model directory {tmp_path / 'nope'} does not exist (latentserve "
                           "downloads nothing: the model is a local checkpoint directory)\n")
    assert proc.stdout == ""


def test_serve_and_scale_out_flags_parse():
    from latentserve.cli import make_parser

    args = make_parser().parse_args(
        ["serve", "--port", "9001", "--api-key", "k", "--data-parallel-size", "2", "--enable-expert-parallel"]
    )
    assert (args.port, args.api_key, args.data_parallel_size, args.enable_expert_parallel) == (9001, "k", 2, True)


def test_backends_prints_the_kernel_policy_and_the_weight_kernels_it_gives(capsys, monkeypatch):
    from latentserve.kernels.cpu import AUTO_DTYPE_ENV
    from latentserve.kernels.policy import KernelPolicy

    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    code, out, _ = run_cli(["backends"], capsys)
    policy = KernelPolicy.detect()  # what the engine hands its loader
    weights = out.split("weights (", 1)[1]
    assert code == 0 and f"  cpu:\n    features: {policy.features.describe()}\n" in weights
    assert f"    threads: {policy.threads}\n" in weights
    assert all(f"    {line}\n" in weights for line in policy.describe().splitlines())
    auto = "bfloat16 (native bf16" if policy.features.native_bf16 else "float32 (no native bf16"
    assert f"dtype auto: {auto}" in weights
    kernels, why = policy.kernels, policy.why
    if kernels is not None:
        assert f"latentserve's kernels: built for {kernels.isa} ({why})" in weights
        assert f"int8: latentserve int8 (built for {kernels.isa} ({why})" in weights
        assert f"int4: latentserve int4 (built for {kernels.isa}" in weights
        assert f"GGUF Q6_K: latentserve q6_k (built for {kernels.isa} ({why})" in weights
        assert "fp32 / bf16 linears: latentserve's up to 3 fp32 rows" in weights
        assert "decode attention block: one native call per layer" in weights
        assert "decode MoE block: one native call per layer" in weights
    else:
        assert f"latentserve's kernels: not used ({why})" in weights and "linears: latentserve's" not in weights
        assert f"decode attention block: the layer's modules one by one ({why})" in weights
        assert f"decode MoE block: the layer's modules one by one ({why})" in weights
        assert "int8: int8 per-row torch._int_mm" in weights
        assert f"int4: int4pack_mm (latentserve's kernels: {why}" in weights
        assert f"GGUF Q6_K: int8 per-row torch._int_mm (latentserve's kernels: {why}; dequantized" in weights


def test_backends_lists_the_architectures(capsys):
    from latentserve.models.arch import ARCHITECTURES

    code, out, _ = run_cli(["backends"], capsys)
    listed = out.split("architectures (", 1)[1].splitlines()[1:]
    assert code == 0 and [line.split(":")[0].strip() for line in listed] == list(ARCHITECTURES)
    assert "  deepseek_v3: DeepseekV3ForCausalLM (" in out


def test_start_imports_neither_dynamo_nor_sympy():
    """Building the model on meta once pulled torch._dynamo and sympy in through torch._refs (~2 s of a start)."""
    code = ("import sys; from latentserve.cli import main; main(['generate', '--max-tokens', '1']); "
            "print([m for m in ('torch._dynamo', 'sympy') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=SUBPROCESS_ENV)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


def test_generation_config_gives_the_sampling_defaults(model_dir, tmp_path, capsys):
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    base = ["generate", "--model", str(model_dir), *ENGINE_FLAGS, "--prompt", "and god said", "--json"]
    code, out, _ = run_cli([*base, "--generation-config", str(folder)], capsys)
    assert code == 0
    code, flagged, _ = run_cli([*base, "--max-tokens", "3", *GREEDY], capsys)
    assert code == 0 and json.loads(out) == json.loads(flagged)
    code, _, err = run_cli([*base, "--generation-config", str(tmp_path)], capsys)
    assert code == 1 and "no generation_config.json there" in err


def test_chat_template_kwargs_reach_the_template(model_dir, tmp_path, capsys, monkeypatch):
    """A template that writes a word after the assistant tag when `thinking` is set: the reply continues it."""
    for f in model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (tmp_path / f.name).symlink_to(f)
    template = CHAT_TEMPLATE + "{% if thinking is defined and thinking %}in the beginning{% endif %}"
    config = dict(bos_token=BOS, eos_token=EOS, add_bos_token=False, chat_template=template)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n"))
    argv = ["chat", "--model", str(tmp_path), "--max-tokens", "6", *GREEDY, *ENGINE_FLAGS]
    code, out, err = run_cli([*argv, "--chat-template-kwargs", '{"thinking": true}'], capsys)
    assert code == 0, err
    llm = LLM(model=str(tmp_path), **ENGINE)
    ids = llm.get_tokenizer().tokenizer.encode(BOS + USER + "hello there" + ASSISTANT + "in the beginning",
                                               add_special_tokens=False).ids
    assert out == llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n"))
    assert run_cli(argv, capsys)[1] != out  # without the variable the prompt, and here the reply, differ
    code, _, err = run_cli([*argv, "--chat-template-kwargs", '{"enable_thinking": true}'], capsys)
    assert code == 1 and "reads no variable 'enable_thinking' (the variables it reads: thinking)" in err


def test_chat_in_tokenizer_mode_deepseek_v32(model_dir, capsys, monkeypatch):
    """The chat command renders DeepSeek-V3.2's encoding (its own tokens, whatever this tokenizer makes of them), and
    thinking is its switch; another mode is refused naming the two there are."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n"))
    argv = ["chat", "--model", str(model_dir), "--max-tokens", "6", *GREEDY, *ENGINE_FLAGS, "--tokenizer-mode",
            "deepseek_v32", "--chat-template-kwargs", '{"thinking": true}']
    code, out, err = run_cli(argv, capsys)
    assert code == 0, err
    prompt = "<｜begin▁of▁sentence｜><｜User｜>hello there<｜Assistant｜><think>"
    ids = load_tokenizer(model_dir).encode(prompt, add_special_tokens=False)
    assert out == greedy(model_dir, [ids], 6)[0].outputs[0].text + "\n"
    code, _, err = run_cli([*argv[:-2], "--chat-template-kwargs", '{"reasoning": true}'], capsys)
    assert code == 1 and "reads no variable 'reasoning' (the variables it reads: enable_thinking, thinking)" in err
    code, _, err = run_cli(["chat", "--tokenizer-mode", "mistral"], capsys)
    assert code == 2 and "invalid choice: 'mistral'" in err and "deepseek_v32" in err
