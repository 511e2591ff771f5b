"""Start-up: time to first token and peak RSS of a fresh process, per way of starting, in interleaved rounds.

Ways: the embedded model as `latentserve generate --max-tokens 1` does it (`embedded`), and on a
DeepSeek-V2-Lite-shaped checkpoint (benchmarks/weights.py's, --layers layers) the bf16 checkpoint (`bf16`), the same
quantized as it loads (`quantize-at-load`) and the saved quantized model (`saved`, written once by
`latentserve quantize`). Each run is its own process: `after import` is measured inside it, from the end of
`import latentserve` to the first token; `total - import` is its wall time minus the median of bare
`python -c "import latentserve"` runs, measured in the same rounds. Peak RSS is the child's VmHWM. Files are
in the page cache after the first round (a warm start; nothing here drops caches on a shared machine).
Run: `.venv/bin/python benchmarks/startup.py [--layers 2] [--method int4] [--rounds 3] [--dir /tmp/...]`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.weights import write_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CHILD = """
import ast, sys, time
start = time.perf_counter()
import latentserve
imported = time.perf_counter()
from latentserve import LLM, SamplingParams
model, kwargs = sys.argv[1], ast.literal_eval(sys.argv[2])
llm = LLM(model if model != "embedded" else None, **kwargs)
prompt = "And God said" if model == "embedded" else [1, 2, 3, 4]
llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
elapsed = time.perf_counter() - imported
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(elapsed, int(hwm.split()[1]) / 1024)
"""
IMPORT_ONLY = "import latentserve"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/latentserve-startup"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--method", choices=["int8", "int4"], default="int4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare-tree", type=Path, default=None,
                        help="another checkout (e.g. main's) whose embedded start runs interleaved with this one's")
    args = parser.parse_args()
    source = args.dir / f"v2lite-{args.layers}"
    saved = args.dir / f"v2lite-{args.layers}-{args.method}"
    if not (source / "config.json").is_file():
        write_checkpoint(source, args.layers)
    if not saved.is_dir():
        subprocess.run([sys.executable, "-m", "latentserve.cli", "quantize", "--model", str(source), "--quantization",
                        args.method, "--output", str(saved)], check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
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
