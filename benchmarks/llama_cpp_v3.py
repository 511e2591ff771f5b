"""latentserve beside llama.cpp F32 on the ~94M DeepSeek-V3-shaped checkpoint of `benchmarks/vs_transformers.py`:
batch-1 decode tok/s after a `--context`-token prompt, fp32 on both sides, same thread count.

llama.cpp: `llama-bench -p 0 -n N -d CONTEXT` (mean over N generated tokens after a CONTEXT-token prompt; its KV
cache in its default F16: llama-bench offers no F32 cache). latentserve: its engine on one request of CONTEXT random
tokens, prefilled for real, then N decode steps (scheduler, runner, model, sampler), in a process of its own; mean
and fastest step.
The two alternate `--rounds` times. Build llama.cpp as `benchmarks/llama_cpp.py` says; the GGUF is written once by
its patched converter.
Run: `.venv/bin/python benchmarks/llama_cpp_v3.py --llama-src <sdist>/vendor/llama.cpp --llama-build /tmp/llbuild`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.llama_cpp import CONVERT, convert_source, load_average, run  # noqa: E402
from benchmarks.vs_transformers import FULL, make_checkpoint  # noqa: E402

# The engine in a process of its own: argv = root, checkpoint, threads, context, decode steps.
WORKER = """
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from latentserve import LLM, SamplingParams
torch.set_num_threads(int(sys.argv[3]))
context, steps = int(sys.argv[4]), int(sys.argv[5])
llm = LLM(model=sys.argv[2], dtype="float32", max_num_seqs=1, max_model_len=context + steps + 8,
          enable_prefix_caching=False)
engine = llm.engine
prompt = torch.randint(0, engine.model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
engine.add_request(prompt.tolist(), SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0))
engine.step()  # the prefill, and the first token
times = []
while engine.has_unfinished_requests():
    start = time.perf_counter()
    engine.step()
    times.append(time.perf_counter() - start)
print(json.dumps({"mean_s": sum(times) / len(times), "min_s": min(times)}))
"""


def llama_bench(build: Path, gguf: Path, threads: int, context: int, decode: int, repeats: int) -> float:
    """llama-bench's mean batch-1 decode tok/s over `decode` tokens after `context` tokens."""
    rows = json.loads(run([str(build / "bin" / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", "0",
                           "-n", str(decode), "-d", str(context), "-r", str(repeats), "-o", "json"]))
    return rows[0]["avg_ts"]


def latentserve(checkpoint: Path, threads: int, context: int, decode: int) -> dict:
    root = Path(__file__).resolve().parent.parent
    out = run([sys.executable, "-c", WORKER, str(root), str(checkpoint), str(threads), str(context), str(decode)])
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-src", type=Path, required=True, help="llama.cpp source (has convert_hf_to_gguf.py)")
    parser.add_argument("--llama-build", type=Path, required=True, help="build dir with bin/llama-bench")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/latentserve-v3-94m"), help="checkpoint directory "
                        "(written if missing; its GGUF goes next to it)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--decode-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="llama-bench repetitions per round")
    parser.add_argument("--rounds", type=int, default=2, help="llama.cpp and latentserve alternately, this often")
    args = parser.parse_args()
    if not (args.llama_src / "convert_hf_to_gguf.py").is_file():
        parser.error(f"--llama-src {args.llama_src} has no convert_hf_to_gguf.py (want the sdist's vendor/llama.cpp)")
    if not (args.llama_build / "bin" / "llama-bench").is_file():
        parser.error(f"--llama-build {args.llama_build} has no bin/llama-bench (build it first)")
    config = dict(FULL, max_position_embeddings=max(FULL["max_position_embeddings"], args.context + 64))
    if not (args.dir / "config.json").is_file():
        make_checkpoint(args.dir, config)
    work = args.dir.with_name(args.dir.name + "-gguf")
    gguf = work / "model-F32.gguf"
    if not gguf.is_file():
        run([sys.executable, "-c", CONVERT, str(args.llama_src), str(convert_source(args.dir, work)), "--outtype",
             "f32", "--outfile", str(gguf)])
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.threads} threads; batch 1 after "
          f"{args.context} tokens; load average {load_average()}")
    print(f"| round | llama.cpp F32 tok/s (mean of {args.decode_len}) | latentserve fp32 tok/s mean (fastest step) "
          "| ratio (mean) |\n|---|---|---|---|")
    for i in range(args.rounds):
        theirs = llama_bench(args.llama_build, gguf, args.threads, args.context, args.decode_len, args.repeats)
        ours = latentserve(args.dir, args.threads, args.context, args.decode_len)
        mean = 1 / ours["mean_s"]
        print(f"| {i + 1} | {theirs:.1f} | {mean:.1f} ({1 / ours['min_s']:.1f}) | {mean / theirs:.2f}x |", flush=True)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
