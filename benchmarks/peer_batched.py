"""Batched decode of mainline llama.cpp and ik_llama.cpp fed the same prompts as latentserve's batched requests.

llama-batched-bench picks its own tokens (ik's: token 0 at every position of every sequence, so an MoE layer reads
one token's experts; mainline's: random ids), so its batched figures are not the work our batched requests do.
benchmarks/peer_batched.c decodes given prompts through the llama.h C API, greedily, each sequence its own tokens;
this module builds it once per llama build (into latentserve's kernel cache, `LATENTSERVE_CACHE_DIR`, where it
is trusted; rebuilt when the source or the library changes) and runs it. The C file selects the fork's parameters
with -DPEER_IK: ik's as `llama-batched-bench -mla 3 -fa on -rtr` sets them, mainline's as its llama-batched-bench
with `mainline_flags(batched=True)` (their load and context logs match the tools' line for line).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from latentserve.kernels.build import _compiler, cache_dir

SOURCE = Path(__file__).resolve().with_suffix(".c")


def batched_prompts(batch: int, context: int, distinct: bool) -> list[list[int]]:
    """Each sequence's prompt: token 0 everywhere (as ik's llama-batched-bench feeds; the sequences are alike), or
    with `distinct` each its own ids (what a server meets). Sequence b's prompt does not depend on `batch`, so a
    batch of B is the first B of a larger batch's."""
    return [[(13 * i + 101 * b) % 100000 + 5 if distinct else 0 for i in range(context)] for b in range(batch)]


def gguf_vocab(gguf: Path) -> int:
    """The width of the file's logits: rows of its output matrix (the embedding's where the output is tied)."""
    from gguf import GGUFReader

    shapes = {t.name: t.shape for t in GGUFReader(gguf).tensors if t.name in ("output.weight", "token_embd.weight")}
    if not shapes:
        sys.exit(f"{gguf}: no output.weight or token_embd.weight tensor to read the vocabulary size from")
    return int(shapes.get("output.weight", shapes.get("token_embd.weight"))[1])


def _source_dir(build: Path) -> Path:
    """The llama source tree a CMake build directory was configured from (its CMakeCache.txt says)."""
    cache = build / "CMakeCache.txt"
    if not cache.is_file():
        sys.exit(f"{build}: no CMakeCache.txt, so not a CMake build directory of llama.cpp or ik_llama.cpp")
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            return Path(line.split("=", 1)[1])
    sys.exit(f"{cache}: no CMAKE_HOME_DIRECTORY line naming the source tree")


def _libllama(build: Path) -> Path | None:
    """The build's libllama.so (bin/ or src/, by the fork's and version's layout), or None."""
    return next((d / "libllama.so" for d in (build / "bin", build / "src") if (d / "libllama.so").is_file()), None)


def _compile_command(build: Path, ik: bool, output: Path) -> list[str]:
    """cc against the build's llama.h (its source tree's include/ and ggml/include/) and libllama.so (bin/ or src/),
    with an rpath to every directory of its llama and ggml libraries."""
    src = _source_dir(build)
    headers = [src / "include" / "llama.h", src / "ggml" / "include" / "ggml.h"]
    libllama = _libllama(build)
    missing = [str(h) for h in headers if not h.is_file()] + ([] if libllama else [f"{build}/{{bin,src}}/libllama.so"])
    if missing:
        sys.exit(f"cannot build {SOURCE.name} against {build}: missing {', '.join(missing)} (build the llama target "
                 "as a shared library, BUILD_SHARED_LIBS=ON, the default)")
    libs = sorted({libllama.parent, *(p.parent for p in build.rglob("libggml*.so"))})
    try:
        compiler = _compiler()
    except RuntimeError as e:
        sys.exit(f"cannot build {SOURCE.name}: {e}")
    return [*compiler, "-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror", *(["-DPEER_IK"] if ik else []),
            f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", str(SOURCE), f"-L{libllama.parent}", "-lllama",
            f"-Wl,-rpath,{':'.join(map(str, libs))}", "-o", str(output)]


def build_peer(build: Path, ik: bool) -> Path:
    """The peer_batched binary for `build`, compiled once: its cache key holds the build's path, the fork and the
    C source's and libllama.so's contents' identity (size and mtime)."""
    key = hashlib.sha256(f"{build.resolve()}|{ik}|".encode() + SOURCE.read_bytes())
    lib = _libllama(build)
    if lib is not None:
        key.update(f"{lib.stat().st_size}|{lib.stat().st_mtime_ns}".encode())
    binary = cache_dir() / f"peer_batched-{'ik' if ik else 'mainline'}-{key.hexdigest()[:16]}"
    if binary.is_file():
        return binary
    partial = binary.with_suffix(".partial")
    done = subprocess.run(_compile_command(build, ik, partial), capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"compiling {SOURCE.name} against {build} failed:\n{done.stderr.strip()[-2000:]}")
    partial.replace(binary)  # whole or absent, should two runs race
    return binary


def parse_rows(text: str) -> dict[int, dict]:
    """peer_batched's JSON lines by batch size (a later line of the same size wins); other lines are ignored."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rows[row["batch"]] = row
    return rows


def peer_batched(build: Path, gguf: Path, threads: int, ik: bool, context: int, decode: int, batches: list[int],
                 distinct: bool, extra: list[str]) -> dict[int, dict]:
    """peer_batched's row per batch size: each of B sequences gets `batched_prompts`' `context`-token prompt, then
    all decode `decode` tokens together. The first size runs twice and the second counts: a process's first batched
    row pays first-touch costs (ik's batch 1 in llama-batched-bench came out at a third of its llama-bench figure, the
    same row repeated at par). `extra`: the fork's flags (mainline's --no-repack)."""
    binary = build_peer(build, ik)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompts:
        prompts.write("".join(" ".join(map(str, p)) + "\n" for p in batched_prompts(max(batches), context, distinct)))
        prompts.flush()
        cmd = [str(binary), str(gguf), prompts.name, "--threads", str(threads),
               "--ctx", str(max(batches) * (context + decode) + 256), "--vocab", str(gguf_vocab(gguf)),
               "--decode", str(decode), "--batches", ",".join(map(str, batches[:1] + batches)), *extra]
        done = subprocess.run(cmd, capture_output=True, text=True)
    rows = parse_rows(done.stdout)
    if done.returncode or set(rows) != set(batches):
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        sys.exit(f"{binary.name} gave rows for batches {sorted(rows)} of {batches} (exit {done.returncode}):\n{tail}")
    return rows
