"""latentserve beside mainline llama.cpp and ik_llama.cpp on the same GGUF files (Q8_0, Q4_K_M, Q5_K_M, Q3_K_M, Q2_K)
of a DeepSeek-V3-shaped random checkpoint: prefill, batch-1 decode after a context, batched decode throughput, and
optionally long context.

The checkpoint is benchmarks/weights.py's V2-Lite shape with DeepSeek-V3's q LoRA (hidden 2048, 16 heads, q_lora
1536, kv_lora 512, rope 64, nope / v 128, 64 experts top-6 + 2 shared of width 1408, first layer dense of width
10944, vocab 102400), 4 layers by default: ik_llama.cpp takes mainline-converted MLA files only with DeepSeek's head
sizes, and assumes no q LoRA only for 26/27-layer models. Mainline llama.cpp's converter and llama-quantize write
the GGUFs (benchmarks/llama_cpp.py, whose docstring says how to build mainline); latentserve loads the same files.

ik_llama.cpp is not a dependency either; build its two tools once, CPU only, outside the repository, from its public
git repository (ikawrakow/ik_llama.cpp; measured at commit 8337e4cd, 2026-08-15):
    git clone https://github.com/ikawrakow/ik_llama.cpp /tmp/iksrc
    cmake -S /tmp/iksrc -B /tmp/ikbuild -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_AVX512=ON \
        -DGGML_AVX512_VNNI=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON
    nice cmake --build /tmp/ikbuild -j2 --target llama-bench llama-batched-bench      (~20-30 min on 2 cores)
Without the AVX-512 flags its IQK kernels are silently off; the run's banner then lacks `HAVE_FANCY_SIMD is
defined` (this script refuses such a build). From a bare copy of the repository, write its tree out blob by blob
(`git ls-tree -r HEAD` and `git cat-file blob`); the few absent large blobs (vocab GGUFs, a web page) are not needed.
For an AVX2-only CPU's figures on an AVX-512 one, run this script under `ATEN_CPU_CAPABILITY=avx2` (our AVX2 build)
with an ik and a mainline built `-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
-DGGML_AVX512=OFF` (`check_ik_build` refuses an ik of the other class); where the CPU has AVX-VNNI that picks our
avx2_vnni build (an Intel client CPU's), to be run against an ik built with `-DGGML_AVXVNNI=ON` too, and
`LATENTSERVE_NATIVE_KERNELS=avx2` keeps plain AVX2 (a CPU without it).
ik runs as its users run DeepSeek: llama-bench `-mla 3 -fa 1 -fmoe 1 -rtr 1` (MLA attention, flash attention, fused
MoE, weights repacked row-interleaved at load); batched, with the parameters its llama-batched-bench `-mla 3 -fa on
-rtr` sets (fused MoE is its default there). Mainline runs with its defaults, as in benchmarks/llama_cpp.py
(`mainline_flags`: on an AMX CPU without its extra buffer types, which fail on this model).

Run: `.venv/bin/python benchmarks/llama_cpp_ik.py --llama-src <sdist>/vendor/llama.cpp --llama-build /tmp/llbuild
--ik-build /tmp/ikbuild [--rounds 3] [--formats int8,int4,q5_k] [--batches 8,32] [--long]` (--ik-build defaults to
$IK_LLAMA_BUILD). Each format's engine loads once; each round runs ours, then mainline, then ik, every point; the
best round of each counts, so all three saw the same noise. Each round also measures the machine's copy bandwidth
right after each engine's points (benchmarks/common.py's `copy_bandwidth`: torch `copy_` of 256 MiB or twice the
last-level cache, on the --threads torch threads, read + write counted); the batch-1 decode's weight bandwidth is its
tok/s times the bytes of weights one token reads, counted from the loaded model's tensors (benchmarks/decode_bytes.py);
mainline's and ik's likewise, from the GGUF's tensors at their stored types (which differ from ours where we
convert). --long adds a 4096-token prefill and decode at a 4096-token depth (slow); --only-long runs those two alone
(and no bandwidth figure). The batched rows feed all three engines the same prompts (benchmarks/peer_batched.py:
the peers run benchmarks/peer_batched.c, compiled once per build against its llama.h, greedy as ours): token 0 at
every position of every sequence by default, as ik's llama-batched-bench feeds (the sequences are alike and route to
the same experts), or with --distinct each sequence its own tokens (what a server meets, and slower: an MoE layer then
reads the experts of every sequence). llama-batched-bench is not used there: ik's feeds only token 0 and mainline's
random ids. peer_batched's batch-1 row is printed beside each peer's llama-bench decode as a check.
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

from benchmarks.common import batch_sizes, copy_bandwidth  # noqa: E402
from benchmarks.decode_bytes import decode_bytes_per_token, gguf_decode_bytes  # noqa: E402
from benchmarks.llama_cpp import _best, load_average, mainline_flags, make_ggufs, our_round, run  # noqa: E402
from benchmarks.peer_batched import batched_prompts, peer_batched  # noqa: E402
from benchmarks.weights import V2_LITE, write_checkpoint  # noqa: E402

V3_SHAPE = {**V2_LITE, "q_lora_rank": 1536, "max_position_embeddings": 8192}
# (our name, the file type): int8 and int4 are the methods latentserve loads Q8_0 and Q4_K_M files as; a Q5_K_M
# file's Q5_K, Q6_K and Q5_0 blocks run as they are, as do a Q3_K_M file's Q3_K blocks and a Q2_K file's Q2_K ones.
PAIRS = (("int8", "Q8_0"), ("int4", "Q4_K_M"), ("q5_k", "Q5_K_M"), ("q3_k", "Q3_K_M"), ("q2_k", "Q2_K"))
ENGINES = ("latentserve", "llama.cpp", "ik_llama.cpp")
IK_BENCH = ["-mla", "3", "-fa", "1", "-fmoe", "1", "-rtr", "1"]
LONG = 4096


def points(args: argparse.Namespace) -> list[tuple[str, str, int, int]]:
    """(key, label, tokens, depth) of each measured point: prefill of `tokens`, or `tokens` decode steps at `depth`."""
    out = [] if args.only_long else [
        ("prefill", f"prefill {args.prefill_len} tok/s", args.prefill_len, 0),
        ("decode", f"decode b1 tok/s ({args.decode_len} after {args.context})", args.decode_len, args.context)]
    if args.long:
        out += [("prefill_long", f"prefill {LONG} tok/s", LONG, 0),
                ("decode_long", f"decode b1 tok/s ({args.decode_len} after {LONG})", args.decode_len, LONG)]
    return out


def bench(build: Path, gguf: Path, threads: int, ik: bool, tokens: int, depth: int, prefill: bool) -> float:
    """llama-bench's mean tok/s of one run (-r 1): a `tokens`-token prompt, or `tokens` batch-1 decode steps after
    `depth` tokens of context (mainline: -d; ik has no -d, its -gp times the generation after a prompt)."""
    cmd = [str(build / "bin" / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json"]
    if prefill:
        cmd += ["-p", str(tokens), "-n", "0"]
    elif ik:
        cmd += ["-p", "0", "-n", "0", "-gp", f"{depth},{tokens}"]
    else:
        cmd += ["-p", "0", "-n", str(tokens), "-d", str(depth)]
    return json.loads(run(cmd + (IK_BENCH if ik else mainline_flags())))[0]["avg_ts"]


def our_batched(engine, batch: int, context: int, decode: int, distinct: bool) -> float:
    """Decode throughput as llama-batched-bench counts it: `batch` requests of `context` tokens each, prefilled, then
    tokens generated over all of them per second from when every request has its first token. The requests' tokens
    are `batched_prompts`', the peers' too: alike (token 0 everywhere, so an MoE layer's tokens choose the same
    experts, read once for the batch), or with `distinct` each request its own (what a server meets: about 35 of 64
    experts a layer at 8 sequences, top 6)."""
    from latentserve import SamplingParams

    for prompt in batched_prompts(batch, context, distinct):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=decode + 1, ignore_eos=True))
    generated: dict[str, int] = {}
    while len(generated) < batch or min(generated.values()) == 0:
        for out in engine.step():
            generated[out.request_id] = len(out.outputs[0].token_ids)
    before = sum(generated.values())
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (batch * (decode + 1) - before) / (time.perf_counter() - start)


def our_engine(gguf: Path, args: argparse.Namespace):
    """An LLM of the GGUF file (its own types decide latentserve's formats), room for every point and batch."""
    from latentserve import LLM

    longest = max(args.context, LONG if args.long else 0, args.prefill_len) + args.decode_len + 16
    tokens = max(max(args.batches) * (args.batched_context + args.decode_len + 16), longest)
    return LLM(model=str(gguf), num_kv_blocks=-(-tokens // 16) + max(args.batches), block_size=16,
               max_model_len=longest, max_num_seqs=max(args.batches), enable_prefix_caching=False,
               max_num_batched_tokens=max(args.prefill_len, LONG if args.long else 0, args.context + 8))


def one_round(engine: str, llm, gguf: Path, args: argparse.Namespace) -> dict[str, float]:
    """Every point and batch size once on `engine`."""
    out: dict[str, float] = {}
    for key, _, tokens, depth in points(args):
        if engine == "latentserve":
            prefill, decode = (tokens, 1) if key.startswith("prefill") else (args.prefill_len, tokens)
            measured = our_round(llm.engine, prefill, decode, depth)
            out[key] = measured["prefill_tok_s" if key.startswith("prefill") else "decode_b1_tok_s"]
        else:
            build = args.ik_build if engine == "ik_llama.cpp" else args.llama_build
            out[key] = bench(build, gguf, args.threads, engine == "ik_llama.cpp", tokens, depth,
                             key.startswith("prefill"))
    if args.only_long:
        return out
    out["copy_gb_s"] = copy_bandwidth() / 1e9  # right after this engine's batch-1 decode: its bandwidth's moment
    if engine == "latentserve":
        out.update({f"b{b}": our_batched(llm.engine, b, args.batched_context, args.decode_len, args.distinct)
                    for b in args.batches})
    else:
        out.update(peer_round(engine, gguf, args))
    return out


def peer_round(engine: str, gguf: Path, args: argparse.Namespace) -> dict[str, float]:
    """A llama engine's batched decode tok/s per batch size (and batch 1, the check against llama-bench) through
    peer_batched, on the prompts ours get; prints its greedy tokens' checksums (alike prompts must keep one stream)
    and its argmaxes' share of the decode time."""
    ik = engine == "ik_llama.cpp"
    rows = peer_batched(args.ik_build if ik else args.llama_build, gguf, args.threads, ik, args.batched_context,
                        args.decode_len, sorted({1, *args.batches}), args.distinct, [] if ik else mainline_flags(True))
    streams = ", ".join(f"b{b} {r['streams']} ({r['checksum']}; argmax {r['sample_s'] / r['decode_s']:.1%} of decode)"
                        for b, r in rows.items())
    alike = "" if args.distinct or all(r["streams"] == 1 for r in rows.values()) else " (alike prompts: want 1 each)"
    print(f"{engine} greedy token streams per batch: {streams}{alike}; sequence 0 begins {rows[1]['head']}", flush=True)
    return {f"b{b}": r["decode_tok_s"] for b, r in rows.items()}


def measure(gguf: Path, name: str, args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """({engine: {point: best tok/s}} of one format, plus our "copy_gb_s"; {part: bytes} one batch-1 decode token
    reads): its engine loaded once and warmed up, then `args.rounds` alternating rounds."""
    import gc

    llm = our_engine(gguf, args)
    weights = decode_bytes_per_token(llm.engine.model)
    file_bytes = sum(gguf_decode_bytes(gguf).values())
    per_token = {"latentserve": sum(weights.values()), **dict.fromkeys(ENGINES[1:], file_bytes)}
    our_round(llm.engine, args.prefill_len, 2)  # first-call costs, as llama-bench's own warm-up run
    best: dict[str, dict[str, float]] = {}
    for r in range(args.rounds):
        ratios = []
        for engine in ENGINES:
            this = one_round(engine, llm, gguf, args)
            best[engine] = _best(best.get(engine), this)
            if "copy_gb_s" in this:
                ratios.append(f"{engine} {this['decode'] * per_token[engine] / 1e9 / this['copy_gb_s']:.0%}")
        bandwidth = f"; batch-1 decode at this share of the copy right after it: {', '.join(ratios)}" if ratios else ""
        print(f"{name} round {r + 1}: load average {load_average()}{bandwidth}", flush=True)
    del llm
    gc.collect()
    return best, weights


def report_bandwidth(best: dict[str, dict[str, float]], weights: dict[str, int], gguf: Path) -> None:
    """Batch-1 decode's weight bandwidth beside the copy bandwidth measured right after it (each the best of its
    rounds): ours from our tensors, the two llama.cpp engines' from the file's."""
    file_bytes = sum(gguf_decode_bytes(gguf).values())
    parts = ", ".join(f"{part} {n / 1e6:.1f}" for part, n in weights.items())
    print(f"bytes of weights a batch-1 token reads: latentserve {sum(weights.values()) / 1e6:.1f} MB ({parts}); "
          f"the file's {file_bytes / 1e6:.1f} MB (llama.cpp, ik_llama.cpp)", flush=True)
    for engine in ENGINES:
        per_token = sum(weights.values()) if engine == "latentserve" else file_bytes
        figures = best[engine]
        effective = figures["decode"] * per_token / 1e9
        print(f"{engine}: {figures['decode']:.1f} tok/s x {per_token / 1e6:.1f} MB = {effective:.1f} GB/s; copy "
              f"bandwidth {figures['copy_gb_s']:.1f} GB/s (read + write); ratio "
              f"**{effective / figures['copy_gb_s']:.0%}**",
              flush=True)


def report(best: dict[str, dict[str, float]], name: str, kind: str, gguf: Path, args: argparse.Namespace) -> None:
    rows = [(key, label) for key, label, _, _ in points(args)]
    workload = ", distinct prompts" if args.distinct else ", prompts alike"
    rows += [(f"b{b}", f"batched decode tok/s, {b} x {args.decode_len} after {args.batched_context}{workload}")
             for b in ([] if args.only_long else args.batches)]
    print(f"\n{name} / {kind} ({gguf.stat().st_size / 1e9:.2f} GB)\n\n| | latentserve | llama.cpp | ik_llama.cpp "
          "| vs ik | vs llama.cpp |\n|---|---|---|---|---|---|")
    for key, label in rows:
        ours, main, ik = (best[e][key] for e in ENGINES)
        print(f"| {label} | {ours:.1f} | {main:.1f} | {ik:.1f} | **{ours / ik:.2f}x** | {ours / main:.2f}x |")
    if args.only_long:
        return
    ik, main = best["ik_llama.cpp"], best["llama.cpp"]
    print(f"check: peer_batched batch 1 against llama-bench decode: ik {ik['b1']:.1f} / {ik['decode']:.1f}, "
          f"mainline {main['b1']:.1f} / {main['decode']:.1f} tok/s", flush=True)


def check_ik_build(build: Path, gguf: Path, threads: int) -> None:
    """Refuse an ik build whose vector kernels are not the class ours run (its banner says which): an AVX-512 build of
    ours against ik's AVX-512 IQK kernels (built with the docstring's flags; without them they are silently off), an
    AVX2 one (`ATEN_CPU_CAPABILITY=avx2`, as on an AVX2-only CPU) against an ik built for AVX2 (`-DGGML_NATIVE=OFF
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON`), our avx2_vnni (AVX2 with AVX-VNNI) against one built so too
    (`-DGGML_AVXVNNI=ON`, which the banner does not show: read from the build's CMakeCache.txt). llama-batched-bench
    prints the banner; llama-bench does not."""
    from latentserve.kernels.build import kernel_isa
    from latentserve.kernels.cpu import cpu_features

    isa = kernel_isa(cpu_features())[0] or "none"
    done = subprocess.run([str(build / "bin" / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-c",
                           "64", "-npp", "8", "-ntg", "1", "-npl", "1"], capture_output=True, text=True)
    fancy = "HAVE_FANCY_SIMD is defined" in done.stdout + done.stderr
    cache = build / "CMakeCache.txt"
    vnni = cache.is_file() and "GGML_AVXVNNI:BOOL=ON" in cache.read_text()
    if fancy != isa.startswith("avx512") or (not fancy and vnni != (isa == "avx2_vnni")):
        sys.exit(f"--ik-build {build}: its banner says HAVE_FANCY_SIMD is {'' if fancy else 'NOT '}defined and it "
                 f"was built {'with' if vnni else 'without'} GGML_AVXVNNI, but our kernels run the {isa} build: build "
                 f"ik for the same class of CPU (this script's docstring)")
    ik = "AVX-512 (HAVE_FANCY_SIMD)" if fancy else "AVX2 with AVX-VNNI" if vnni else "AVX2"
    print(f"our kernels: {isa}; ik_llama.cpp: {ik}", flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-src", type=Path, required=True, help="mainline source (has convert_hf_to_gguf.py)")
    parser.add_argument("--llama-build", type=Path, required=True, help="mainline build dir: bin/llama-bench, "
                        "bin/llama-quantize, libllama.so")
    parser.add_argument("--ik-build", type=Path, default=os.environ.get("IK_LLAMA_BUILD"),
                        help="ik_llama.cpp build dir: bin/llama-bench, bin/llama-batched-bench, libllama.so "
                        "($IK_LLAMA_BUILD)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (written if missing)")
    parser.add_argument("--gguf-dir", type=Path, default=None, help="where the GGUF files go (reused if present)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--context", type=int, default=512, help="tokens of context before batch-1 decode")
    parser.add_argument("--batched-context", type=int, default=512, help="each sequence's prompt, batched")
    parser.add_argument("--distinct", action="store_true",
                        help="batched sequences each their own tokens (default: token 0 everywhere, all alike)")
    parser.add_argument("--decode-len", type=int, default=64)
    parser.add_argument("--batches", default="8,32", help="batched decode sizes (comma-separated)")
    parser.add_argument("--formats", default="int8,int4", help="from int8 (vs Q8_0), int4 (vs Q4_K_M), q5_k (vs "
                        "Q5_K_M), q3_k (vs Q3_K_M), q2_k (vs Q2_K)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per format; best counts")
    parser.add_argument("--long", action="store_true", help=f"also prefill {LONG} and decode at {LONG} depth (slow)")
    parser.add_argument("--only-long", action="store_true", help=f"only prefill {LONG} and decode at {LONG} depth: "
                        "no short or batched points")
    args = parser.parse_args()
    args.long = args.long or args.only_long
    names = args.formats.split(",")
    args.pairs = [(name, kind) for name, kind in PAIRS if name in names]
    if len(args.pairs) != len(set(names)):
        parser.error(f"--formats {args.formats!r}: each must be one of {[name for name, _ in PAIRS]}")
    args.batches = batch_sizes(parser, args.batches, 2, " (batch 1 is the decode point)")
    if args.ik_build is None:
        parser.error("--ik-build (or $IK_LLAMA_BUILD) is required: the ik_llama.cpp build directory")
    if not (args.llama_src / "convert_hf_to_gguf.py").is_file():
        parser.error(f"--llama-src {args.llama_src} has no convert_hf_to_gguf.py (want the sdist's vendor/llama.cpp)")
    for flag, build, tools in (("--llama-build", args.llama_build, ("llama-bench", "llama-quantize")),
                               ("--ik-build", args.ik_build, ("llama-bench", "llama-batched-bench"))):
        missing = [t for t in tools if not (build / "bin" / t).is_file()]
        if missing:
            parser.error(f"{flag} {build} has no bin/{', bin/'.join(missing)} (build them first)")
    return args


def main() -> None:
    import torch

    args = parse_args()
    checkpoint = args.dir or Path(f"/tmp/latentserve-v3shape-{args.layers}l")
    if not (checkpoint / "model.safetensors.index.json").is_file():
        write_checkpoint(checkpoint, args.layers, V3_SHAPE)
    work = args.gguf_dir or checkpoint.with_name(checkpoint.name + "-gguf")
    ggufs = make_ggufs(checkpoint, work, args.llama_src, args.llama_build, sorted({t for _, t in args.pairs}))
    check_ik_build(args.ik_build, ggufs[args.pairs[0][1]], args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.threads} threads; {args.layers} layers; "
          f"{args.rounds} rounds; load average {load_average()}", flush=True)
    torch.set_num_threads(args.threads)
    for name, kind in args.pairs:  # each format's table as soon as it is measured
        best, weights = measure(ggufs[kind], name, args)
        report(best, name, kind, ggufs[kind], args)
        if not args.only_long:
            report_bandwidth(best, weights, ggufs[kind])
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
