"""benchmarks/peer_batched.py's pure-Python parts: the prompts both sides get, the GGUF's vocabulary, the JSON rows,
and the build step's errors (the C program itself runs against llama builds, in the benchmark only)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFWriter

from benchmarks import peer_batched
from benchmarks.peer_batched import batched_prompts, gguf_vocab, parse_rows
from tests.kernels.builds import needs_a_compiler


def test_alike_prompts_are_token_zero_everywhere():
    assert batched_prompts(3, 5, distinct=False) == [[0] * 5] * 3


def test_distinct_prompts_differ_and_a_smaller_batch_is_a_prefix_of_a_larger():
    big, small = batched_prompts(32, 128, distinct=True), batched_prompts(8, 128, distinct=True)
    assert small == big[:8]
    assert len({tuple(p) for p in big}) == 32  # every sequence its own prompt
    assert all(len(set(p)) == 128 for p in big)  # and no prompt repeats a token, unlike the alike ones
    ids = np.array(big)
    assert ids.min() >= 5 and ids.max() < 100005  # past the special tokens, inside DeepSeek's 102400 vocabulary


def _write_gguf(path, tensors: dict[str, tuple[int, int]]) -> None:
    writer = GGUFWriter(str(path), "deepseek2")
    for name, (rows, cols) in tensors.items():
        writer.add_tensor(name, np.zeros((rows, cols), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_vocab_is_the_output_rows_else_the_embedding_rows(tmp_path):
    _write_gguf(tmp_path / "untied.gguf", {"token_embd.weight": (40, 8), "output.weight": (37, 8)})
    _write_gguf(tmp_path / "tied.gguf", {"token_embd.weight": (40, 8)})
    _write_gguf(tmp_path / "none.gguf", {"blk.0.attn_norm.weight": (1, 8)})
    assert gguf_vocab(tmp_path / "untied.gguf") == 37
    assert gguf_vocab(tmp_path / "tied.gguf") == 40
    with pytest.raises(SystemExit, match="no output.weight or token_embd.weight"):
        gguf_vocab(tmp_path / "none.gguf")


def test_parse_rows_keeps_the_later_row_of_a_batch_size_and_skips_other_lines():
    first = {"batch": 8, "decode_tok_s": 10.0, "streams": 1}
    again = {"batch": 8, "decode_tok_s": 30.0, "streams": 1}
    other = {"batch": 32, "decode_tok_s": 90.5, "streams": 32}
    text = "\n".join(["llama_model_loader: something", json.dumps(first), json.dumps(again), json.dumps(other), ""])
    assert parse_rows(text) == {8: again, 32: other}


def test_build_names_what_is_missing(tmp_path):
    with pytest.raises(SystemExit, match="no CMakeCache.txt"):
        peer_batched.build_peer(tmp_path, ik=True)
    source = tmp_path / "src"
    (source / "include").mkdir(parents=True)
    (source / "include" / "llama.h").write_text("")
    (tmp_path / "CMakeCache.txt").write_text(f"FOO:BOOL=ON\nCMAKE_HOME_DIRECTORY:INTERNAL={source}\n")
    with pytest.raises(SystemExit) as error:
        peer_batched.build_peer(tmp_path, ik=False)
    message = str(error.value)
    assert "ggml/include/ggml.h" in message and "libllama.so" in message and "include/llama.h" not in message


@needs_a_compiler  # the command names it
def test_compile_command_takes_the_forks_define_headers_and_every_library_directory(tmp_path):
    source, build = tmp_path / "src", tmp_path / "build"
    for header in ("include/llama.h", "ggml/include/ggml.h"):
        (source / header).parent.mkdir(parents=True, exist_ok=True)
        (source / header).write_text("")
    for lib in ("src/libllama.so", "ggml/src/libggml.so", "ggml/src/libggml-base.so"):
        (build / lib).parent.mkdir(parents=True, exist_ok=True)
        (build / lib).write_text("")
    (build / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={source}\n")
    ik = peer_batched._compile_command(build, True, tmp_path / "out")
    mainline = peer_batched._compile_command(build, False, tmp_path / "out")
    assert "-DPEER_IK" in ik and "-DPEER_IK" not in mainline
    assert {f"-I{source}/include", f"-I{source}/ggml/include", f"-L{build}/src", "-lllama"} <= set(ik)
    assert f"-Wl,-rpath,{build}/ggml/src:{build}/src" in ik
