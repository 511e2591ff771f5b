"""latentserve beside llama.cpp on one DeepSeek-V2-Lite-shaped checkpoint: batch-1 decode and 512-token prefill
tok/s per format, and the ratios the weights issue targets (int8 vs Q8_0, int4 vs Q4_K_M, auto vs F32 prefill).

llama.cpp is not a dependency; build its two tools once, CPU only, outside the repository. Its source is vendored
in the llama-cpp-python sdist on PyPI:
    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llsrc && tar xzf /tmp/llsrc/*.tar.gz -C /tmp/llsrc
    cmake -S /tmp/llsrc/llama_cpp_python-*/vendor/llama.cpp -B /tmp/llbuild -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DGGML_OPENMP=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build /tmp/llbuild -j2 --target llama-bench llama-quantize      (~15-20 min on 2 cores)
The converter (vendor/llama.cpp/convert_hf_to_gguf.py) uses the gguf-py next to it and transformers from our venv.
Run: `.venv/bin/python benchmarks/llama_cpp.py --llama-src /tmp/llsrc/llama_cpp_python-*/vendor/llama.cpp
--llama-build /tmp/llbuild [--layers 2] [--threads 2] [--formats int8,int4] [--interleave 3] [--depth 2048]`.
The checkpoint is benchmarks/weights.py's; the GGUF files go to --gguf-dir (a few GB; never inside the repository).
On a shared machine use --interleave: each format loads once, and single llama-bench runs alternate with rounds of
ours. --depth measures decode after that many tokens of context, where attention is a larger share of the step.
--gguf: latentserve loads the GGUF file llama-bench runs (`--model file.gguf`; Q4_K becomes int4 without
requantizing, Q6_K, Q5_0 and Q5_K stay so), instead of quantizing the safetensors checkpoint itself: one file, two
engines.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.weights import write_checkpoint  # noqa: E402
from latentserve.kernels.cpu import auto_dtype, cpu_features  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "latentserve" / "assets" / "default_model"
# Which latentserve format each llama.cpp type is compared with (the targets).
PAIRS = (("fp32", "F32"), ("auto", "F32"), ("int8", "Q8_0"), ("int4", "Q4_K_M"))

# Two patches to the converter. It refuses a tokenizer whose pre-tokenizer hash it does not know; tokens do not
# matter to llama-bench (it feeds random ids), so the embedded model's byte-level BPE is declared plain GPT-2.
# It writes no q_lora_rank when the config's is null (V2-Lite's), and llama.cpp then requires one unless the model
# has V2-Lite's 27 layers; 0 is how llama.cpp says "no q LoRA".
CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base, conversion.deepseek
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
model = conversion.deepseek.DeepseekV2Model
set_parameters = model.set_gguf_parameters
def set_gguf_parameters(self):
    set_parameters(self)
    if self.hparams.get("q_lora_rank") is None:
        self.gguf_writer.add_q_lora_rank(0)
model.set_gguf_parameters = set_gguf_parameters
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(command: list[str]) -> str:
    """stdout of `command`; on failure, exit naming the command with the end of what it printed."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        sys.exit(f"{Path(command[0]).name} {' '.join(command[1:3])} ... failed ({done.returncode}):\n{tail}")
    return done.stdout


def convert_source(checkpoint: Path, work: Path) -> Path:
    """The checkpoint's files plus the embedded model's tokenizer, linked into one directory for the converter
    (ids past the tokenizer's 4096 become padding tokens); the checkpoint itself is left as it is."""
    source = work / "hf"
    source.mkdir(parents=True, exist_ok=True)
    for f in [*checkpoint.iterdir(), ASSETS / "tokenizer.json", ASSETS / "tokenizer_config.json"]:
        link = source / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    return source


def make_ggufs(checkpoint: Path, work: Path, src: Path, build: Path, types: list[str]) -> dict[str, Path]:
    """The GGUF of each type, existing files reused. With F32 among them, llama.cpp's converter writes F32 and
    llama-quantize the rest from it; without, the converter writes Q8_0 and the rest are requantized from that (the
    27-layer checkpoint's F32 GGUF would take 63 GB)."""
    files = {name: work / f"model-{name}.gguf" for name in types}
    if all(f.is_file() for f in files.values()):
        return files
    base = "F32" if "F32" in types else "Q8_0"
    files.setdefault(base, work / f"model-{base}.gguf")
    if not files[base].is_file():
        run([sys.executable, "-c", CONVERT, str(src), str(convert_source(checkpoint, work)), "--outtype", base.lower(),
             "--outfile", str(files[base])])
    requantize = [] if base == "F32" else ["--allow-requantize"]
    for name, f in files.items():
        if not f.is_file():
            run([str(build / "bin" / "llama-quantize"), *requantize, str(files[base]), str(f), name])
    return files


def mainline_flags(batched: bool = False) -> list[str]:
    """Mainline's own settings on this CPU: its defaults, except on a CPU with AMX, where a native build puts
    the weights in its AMX buffer type and then finds no backend for some of this model's ops (`GGML_ASSERT(
    *cur_backend_id != -1)` in ggml-backend.cpp, seen on a DeepSeek-V3-shaped file): there it runs as its users
    must, without the extra buffer types (llama-bench `--repack 0`, the other tools `--no-repack`)."""
    if not cpu_features().amx:
        return []
    return ["--no-repack"] if batched else ["--repack", "0"]


def llama_bench(build: Path, gguf: Path, threads: int, prefill: int, decode: int, repeats: int,
                depth: int = 0) -> dict:
    """llama-bench's mean tok/s for a `prefill`-token prompt and `decode` batch-1 generated tokens after `depth`
    tokens of context."""
    base = [str(build / "bin" / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", str(repeats), "-o", "json",
            *mainline_flags()]
    prompt = json.loads(run(base + ["-p", str(prefill), "-n", "0"]))[0]
    gen = json.loads(run(base + ["-p", "0", "-n", str(decode), "-d", str(depth)]))[0]
    return {"prefill_tok_s": prompt["avg_ts"], "decode_b1_tok_s": gen["avg_ts"], "size_gb": gen["model_size"] / 1e9}


# One format in a process of its own (`our_engine`, then the best of `rounds` of `our_round`), JSON out.
WORKER = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from benchmarks.llama_cpp import our_engine, our_round, _best
torch.set_num_threads(int(sys.argv[4]))
llm = our_engine(Path(sys.argv[2]), sys.argv[3], int(sys.argv[6]), int(sys.argv[8]) + int(sys.argv[5]))
best = None
for _ in range(int(sys.argv[7])):
    best = _best(best, our_round(llm.engine, int(sys.argv[6]), int(sys.argv[5]), int(sys.argv[8])))
best["dtype"] = str(llm.engine.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
print(json.dumps(best))
"""


def latentserve(checkpoint: Path, name: str, threads: int, prefill: int, decode: int, rounds: int,
                depth: int = 0) -> dict:
    """One format in its own process, measured as `interleaved` measures it: the best of `rounds` rounds."""
    root = Path(__file__).resolve().parent.parent
    out = run([sys.executable, "-c", WORKER, str(root), str(checkpoint), name, str(threads), str(decode), str(prefill),
               str(rounds), str(depth)])
    return json.loads(out.strip().splitlines()[-1])


def our_engine(checkpoint: Path, name: str, prefill: int, context: int = 0):
    """An LLM of `checkpoint` in format `name` (benchmarks/weights.py's FORMATS; "gguf": `checkpoint` is a GGUF file,
    its own types decide) for `our_round`, room for `context` tokens of one request besides the prefill."""
    from benchmarks.weights import FORMATS
    from latentserve import LLM

    length = max(1024, prefill, context + 8)
    return LLM(model=str(checkpoint), num_kv_blocks=-(-length // 16), block_size=16, max_model_len=length,
               max_num_seqs=1, max_num_batched_tokens=max(prefill, context + 8), enable_prefix_caching=False,
               **({} if name == "gguf" else FORMATS[name]))


def our_round(engine, prefill: int, decode: int, depth: int = 0) -> dict:
    """One round as llama-bench measures it: mean tok/s of `decode` batch-1 steps after a prompt of `depth` tokens
    (at least 4), and of one `prefill`-token prompt."""
    from latentserve import SamplingParams

    prompt = [(11 * i) % 100000 + 5 for i in range(max(4, depth))]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=decode + 1, ignore_eos=True))
    engine.step()  # the prompt
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    decode_s = time.perf_counter() - start
    engine.add_request([(7 * i) % 100000 + 5 for i in range(prefill)], SamplingParams(temperature=0.0, max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return {"decode_b1_tok_s": decode / decode_s, "prefill_tok_s": prefill / (time.perf_counter() - start)}


def _best(so_far: dict | None, this: dict) -> dict:
    return this if so_far is None else {k: max(v, so_far[k]) for k, v in this.items()}


def interleaved(
    checkpoint: Path, ggufs: dict[str, Path], pairs: list[tuple[str, str]], args: argparse.Namespace
) -> tuple[dict, dict]:
    """Each latentserve format loaded once in this process, then `args.interleave` rounds of one llama-bench run
    (-r 1) and one round of ours: the best round of each side counts, and both saw the same noise."""
    import gc

    import torch

    torch.set_num_threads(args.threads)
    ours, theirs = {}, {}
    for name, kind in pairs:
        source, form = (ggufs[kind], "gguf") if args.gguf else (checkpoint, name)
        llm = our_engine(source, form, args.prefill_len, args.depth + args.decode_len)
        for _ in range(args.interleave):
            theirs[kind] = _best(theirs.get(kind), llama_bench(args.llama_build, ggufs[kind], args.threads,
                                                               args.prefill_len, args.decode_len, 1, args.depth))
            ours[name] = _best(ours.get(name), our_round(llm.engine, args.prefill_len, args.decode_len, args.depth))
        ours[name]["dtype"] = str(llm.engine.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
        del llm
        gc.collect()
    return ours, theirs


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-src", type=Path, required=True, help="llama.cpp source (has convert_hf_to_gguf.py)")
    parser.add_argument("--llama-build", type=Path, required=True, help="build dir with bin/llama-bench, -quantize")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (V2-Lite: 27)")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (written if missing)")
    parser.add_argument("--gguf-dir", type=Path, default=None, help="where the GGUF files go (reused if present)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-len", type=int, default=32, help="llama.cpp's tokens per decode run; "
                        "latentserve's decode steps")
    parser.add_argument("--depth", type=int, default=0, help="tokens of context before the decode steps (llama-bench "
                        "-d); the prefill column stays at depth 0")
    parser.add_argument("--repeats", type=int, default=3, help="llama-bench repetitions")
    parser.add_argument("--formats", default=",".join(name for name, _ in PAIRS),
                        help=f"latentserve formats to compare, from {[name for name, _ in PAIRS]}")
    parser.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                        help="load each format once in this process and alternate ROUNDS single llama-bench runs with "
                             "ROUNDS of ours (mean decode step, as llama-bench's), best round each: steadier on a "
                             "shared machine")
    parser.add_argument("--gguf", action="store_true", help="latentserve loads the same GGUF file as llama.cpp "
                        "(formats with a quantized GGUF: int8, int4) instead of the safetensors checkpoint")
    args = parser.parse_args()
    names = args.formats.split(",")
    pairs = [(name, kind) for name, kind in PAIRS if name in names]
    if len(pairs) != len(set(names)):
        parser.error(f"--formats {args.formats!r}: each must be one of {[name for name, _ in PAIRS]}")
    if args.gguf and not {"int8", "int4"} >= set(names):
        parser.error(f"--gguf compares quantized GGUF files only: --formats int8, int4 (got {args.formats!r})")
    if not (args.llama_src / "convert_hf_to_gguf.py").is_file():
        parser.error(f"--llama-src {args.llama_src} has no convert_hf_to_gguf.py (want the sdist's vendor/llama.cpp)")
    missing = [t for t in ("llama-bench", "llama-quantize") if not (args.llama_build / "bin" / t).is_file()]
    if missing:
        parser.error(f"--llama-build {args.llama_build} has no bin/{', bin/'.join(missing)} (build them first)")
    checkpoint = args.dir or Path(f"/tmp/latentserve-v2lite-{args.layers}l")
    if not (checkpoint / "model.safetensors.index.json").is_file():
        write_checkpoint(checkpoint, args.layers)
    work = args.gguf_dir or checkpoint.with_name(checkpoint.name + "-gguf")
    ggufs = make_ggufs(checkpoint, work, args.llama_src, args.llama_build, sorted({t for _, t in pairs}))
    print(f"CPU: {cpu_features().describe()}; dtype auto -> {auto_dtype('cpu')[0]}; {args.threads} threads; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {load_average()}")
    if args.interleave:
        ours, theirs = interleaved(checkpoint, ggufs, pairs, args)
    else:
        theirs = {kind: llama_bench(args.llama_build, ggufs[kind], args.threads, args.prefill_len, args.decode_len,
                                    args.repeats, args.depth) for kind in sorted({t for _, t in pairs})}
        ours = {name: latentserve(ggufs[kind] if args.gguf else checkpoint, "gguf" if args.gguf else name,
                                  args.threads, args.prefill_len, args.decode_len, args.repeats, args.depth)
                for name, kind in pairs}
    ours_from = " (from the GGUF)" if args.gguf else ""
    print(f"| latentserve{ours_from} | llama.cpp | decode b1 tok/s after {max(4, args.depth)} tokens (ours / theirs "
          f"= ratio) | prefill {args.prefill_len} tok/s (ours / theirs = ratio) |\n|---|---|---|---|")
    for name, kind in pairs:
        cells = [f"{ours[name][k]:.1f} / {theirs[kind][k]:.1f} = {ours[name][k] / theirs[kind][k]:.2f}x"
                 for k in ("decode_b1_tok_s", "prefill_tok_s")]
        print(f"| {name} ({ours[name]['dtype']}) | {kind} ({theirs[kind]['size_gb']:.2f} GB) | " + " | ".join(cells)
              + " |")
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
