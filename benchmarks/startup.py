"""Start-up: time to first token and peak RSS of a fresh process, per way of starting, in interleaved rounds.

Ways: the embedded model as `latentserve generate --max-tokens 1` does it (`embedded`), and on a
DeepSeek-V2-Lite-shaped checkpoint (benchmarks/weights.py's, --layers layers) the bf16 checkpoint (`bf16`), the same
quantized as it loads (`quantize-at-load`) and the saved quantized model (`saved`, written once by
`latentserve quantize`). Each run is its own process: `after import` is measured inside it, from the end of
`import latentserve` to the first token; `total - import` is its wall time minus the median of bare
`python -c "import latentserve"` runs, measured in the same rounds. Peak RSS is the child's VmHWM. Files are
in the page cache after the first round (a warm start; nothing here drops caches on a shared machine).
Run: `.venv/bin/python benchmarks/startup.py [--layers 2] [--method int4] [--rounds 3] [--dir /tmp/...]`.

With `--llama-bin DIR --gguf FILE` it compares whole processes instead, in alternating rounds: `latentserve generate
--model SAVED --max-tokens 1` (wall time minus the same rounds' median `python -c "import latentserve"`) against
llama.cpp's `llama-simple -n 1` on FILE, the same checkpoint's GGUF (Q4_K_M for int4: `benchmarks/llama_cpp.py
--formats int4 --layers N --dir DIR/v2lite-N` writes it); peak RSS of each is `/usr/bin/time -v`'s maximum.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.weights import write_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO / "latentserve" / "assets" / "default_model"
CHILD = """
import ast, sys, time
start = time.perf_counter()
import latentserve
imported = time.perf_counter()
from latentserve import LLM, SamplingParams
model, kwargs = sys.argv[1], ast.literal_eval(sys.argv[2])
llm = LLM(model if model != "embedded" else None, **kwargs)
prompt = "And God said" if model == "embedded" else [1, 2, 3, 4]
llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
elapsed = time.perf_counter() - imported
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(elapsed, int(hwm.split()[1]) / 1024)
"""
IMPORT_ONLY = "import latentserve"
PROMPT = "And God said"
# `latentserve generate --model SAVED --max-tokens 1 --prompt PROMPT` as the console script runs it, printing also
# the seconds from the end of `import latentserve` to its exit: a second figure, free of the subtracted import's noise.
GENERATE = """
import sys, time
import latentserve
imported = time.perf_counter()
from latentserve.cli import main
code = main(["generate", "--model", sys.argv[1], "--max-tokens", "1", "--prompt", sys.argv[2]])
print(f"\\n{time.perf_counter() - imported}")
sys.exit(code)
"""


def run_child(args: list[str], tree: Path = REPO) -> tuple[float, float, float]:
    """(wall seconds, then what the child printed: seconds from import to first token and peak RSS in MiB, its
    VmHWM: getrusage's maximum would include this process's size at the fork) of one fresh process."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"failed: {args}: {done.stderr[-2000:]}")
    printed = [float(x) for x in done.stdout.split()] or [0.0, 0.0]
    return wall, printed[0], printed[1]


def timed(command: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MiB, stdout) of `command` run under `/usr/bin/time -v`, whose own start is in both
    sides' wall time alike."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}: {done.stderr[-2000:]}")
    peak_kib = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return wall, int(peak_kib.group(1)) / 1024, done.stdout


def size_mib(path: Path) -> float:
    files = path.iterdir() if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files) / 2**20


def versus_llama(saved: Path, gguf: Path, llama_bin: Path, rounds: int) -> None:
    """Rounds of: the bare import, latentserve's first token from the saved model, llama.cpp's from the GGUF; the
    ratio ours / theirs per round, and its median."""
    commands = {
        "import": [sys.executable, "-c", IMPORT_ONLY],
        "latentserve": [sys.executable, "-c", GENERATE, str(saved), PROMPT],
        "llama.cpp": [str(llama_bin / "llama-simple"), "-m", str(gguf), "-n", "1", PROMPT],
    }
    results: dict[str, list[tuple[float, float, str]]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            results[name].append(timed(command))
    import_s = statistics.median(r[0] for r in results["import"])
    theirs = [r[0] for r in results["llama.cpp"]]
    ours = {"latentserve, wall - median import": [r[0] - import_s for r in results["latentserve"]],
            "latentserve, after its import (in-process)": [float(r[2].split()[-1]) for r in results["latentserve"]]}
    print(f"import latentserve: {' / '.join(f'{r[0]:.2f}' for r in results['import'])} s (median {import_s:.2f})")
    print("| first token | from | seconds, per round | / llama.cpp, median of rounds | peak RSS (MiB) | file (MiB) |")
    print("|---|---|---|---|---|---|")
    rows = [(name, saved, times, "latentserve") for name, times in ours.items()]
    for name, path, times, key in [*rows, ("llama.cpp, llama-simple -n 1 wall", gguf, theirs, "llama.cpp")]:
        ratio = statistics.median(a / b for a, b in zip(times, theirs))
        peak = max(r[1] for r in results[key])
        print(f"| {name} | {path.name} | {' / '.join(f'{t:.2f}' for t in times)} | {ratio:.2f}x | {peak:.0f} | "
              f"{size_mib(path):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/latentserve-startup"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--method", choices=["int8", "int4"], default="int4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-tree", type=Path, default=None,
                        help="another checkout (e.g. main's) whose embedded start runs interleaved with this one's")
    parser.add_argument("--llama-bin", type=Path, default=None,
                        help="llama.cpp's bin folder: compare the saved model's start with llama-simple's on --gguf")
    parser.add_argument("--gguf", type=Path, default=None, help="with --llama-bin: the same checkpoint's GGUF")
    args = parser.parse_args()
    if args.llama_bin is not None and not (args.llama_bin / "llama-simple").is_file():
        parser.error(f"--llama-bin {args.llama_bin} has no llama-simple (build llama.cpp's llama-simple target)")
    if args.llama_bin is not None and (args.gguf is None or not args.gguf.is_file()):
        parser.error(f"--llama-bin needs --gguf, an existing GGUF file of the same checkpoint (got {args.gguf})")
    source = args.dir / f"v2lite-{args.layers}"
    saved = args.dir / f"v2lite-{args.layers}-{args.method}"
    if not (source / "config.json").is_file():
        write_checkpoint(source, args.layers)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # `generate` takes text: the embedded model's tokenizer
        if not (source / name).is_file():
            shutil.copy(ASSETS / name, source / name)
    if not saved.is_dir():
        subprocess.run([sys.executable, "-m", "latentserve.cli", "quantize", "--model", str(source), "--quantization",
                        args.method, "--output", str(saved)], check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if args.llama_bin is not None:
        versus_llama(saved, args.gguf, args.llama_bin, args.rounds)
        return
    small = dict(max_model_len=256, num_kv_blocks=16)
    ways = {
        "embedded": ("embedded", {}),
        "bf16": (str(source), small),
        "quantize-at-load": (str(source), {**small, "quantization": args.method}),
        "saved": (str(saved), small),
    }
    trees = {name: REPO for name in ways}
    if args.compare_tree is not None:
        ways[f"embedded ({args.compare_tree})"] = ways["embedded"]
        trees[f"embedded ({args.compare_tree})"] = args.compare_tree
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ["import", *ways]}
    for _ in range(args.rounds):
        results["import"].append(run_child([IMPORT_ONLY]))
        for name, (model, kwargs) in ways.items():
            results[name].append(run_child([CHILD, model, repr(kwargs)], trees[name]))
    import_s = statistics.median(r[0] for r in results["import"])
    file_mib = sum(f.stat().st_size for f in saved.iterdir()) / 2**20
    print(f"import latentserve: {import_s:.2f} s (median wall); saved {args.method} folder {file_mib:.0f} MiB")
    print("| start | after import (s) | total - import (s) | peak RSS (MiB) |")
    print("|---|---|---|---|")
    for name in ways:
        runs = results[name]
        after = " / ".join(f"{r[1]:.2f}" for r in runs)
        total = " / ".join(f"{r[0] - import_s:.2f}" for r in runs)
        print(f"| {name} | {after} | {total} | {max(r[2] for r in runs):.0f} |")


if __name__ == "__main__":
    main()
