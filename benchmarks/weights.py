"""Weight formats on a DeepSeek-V2-Lite-shaped checkpoint: load time, peak RSS, decode and prefill speed per format
beside the fp32 engine in the same run, and the linear kernels each format can use, per shape and row count.

The checkpoint (random bf16 weights, V2-Lite's layer shapes: hidden 2048, 16 heads, kv_lora 512, no q_lora, 64
routed experts top-6, 2 shared, expert width 1408, first layer dense of width 10944, vocab 102400) is written once
to --dir with --layers layers (V2-Lite has 27: 31 GB, `--write-only` writes it and stops). Each format loads in its
own process, so its peak RSS (and peak anonymous memory, which leaves out page cache) is its own.
Run: `.venv/bin/python benchmarks/weights.py [--layers 2] [--formats fp32,auto,int8,int4] [--kernels-only]`;
`--skip-kernels --formats ""` runs only the side-by-side decode (`--interleave`); `--load-speed` times each
load-time quantization step and the quantized loads.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import best_time  # noqa: E402
from latentserve.kernels.cpu import auto_dtype, cpu_features  # noqa: E402
from latentserve.layers.quant.int4 import Int4Linear, Int4PackLinear, quantize_int4  # noqa: E402
from benchmarks.fbgemm_int8 import FbgemmInt8Linear, fbgemm_available  # noqa: E402
from latentserve.layers.quant.int8 import Int8Linear, quantize_int8  # noqa: E402

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_attention_heads": 16,
    "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
    "n_shared_experts": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy",
    "scoring_func": "softmax", "norm_topk_prob": False, "routed_scaling_factor": 1.0, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
FORMATS = {"fp32": dict(dtype="float32"), "auto": dict(dtype="auto"), "int8": dict(quantization="int8"),
           "int4": dict(quantization="int4")}


def write_checkpoint(path: Path, layers: int, config: dict = V2_LITE) -> None:
    """One safetensors shard per layer (~1.2 GB for a MoE layer), each tensor generated and written on its own:
    memory stays at one tensor however large the checkpoint (27 layers: 31 GB). `config`: V2-Lite's, or a variant."""
    from latentserve.models import ModelConfig, DeepseekForCausalLM
    from latentserve.models.loader import _parameters_on_meta, checkpoint_name

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    with _parameters_on_meta():
        skeleton = DeepseekForCausalLM(ModelConfig.from_pretrained(path))
    shards: dict[str, dict[str, torch.Size]] = {}
    for name, t in skeleton.state_dict().items():
        name = checkpoint_name(name)
        shard = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        shards.setdefault(shard, {})[name] = t.shape
    weight_map = {}
    for shard, tensors in shards.items():
        file = f"model-{shard}.safetensors"
        _write_random_shard(path / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _write_random_shard(file: Path, shapes: dict[str, torch.Size]) -> None:
    """A bf16 safetensors file of random weights (norms ~1, the rest ~0.02), written tensor by tensor."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = shape.numel() * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(file.with_suffix(".tmp"), "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, shape in shapes.items():
            t = torch.randn(shape).mul_(1.0 if name.endswith("norm.weight") else 0.02).to(torch.bfloat16)
            f.write(t.view(torch.int16).numpy().data)
    file.with_suffix(".tmp").rename(file)  # a shard exists only once complete


def rss(field: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))


class AnonPeak:
    """The process's peak anonymous memory (RssAnon, sampled every 50 ms on a thread) while in the `with` block:
    page cache of the checkpoint does not count, as the issue's loading target says."""

    def __enter__(self) -> AnonPeak:
        import threading

        self.before = self.peak = rss("RssAnon")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, rss("RssAnon"))

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.after = rss("RssAnon")
        self.peak = max(self.peak, self.after)


def worker(path: Path, settings: dict, decode_steps: int, prefill_len: int) -> dict:
    """Load with `settings`, then time batch-1 and batch-8 decode steps and one prefill of `prefill_len` tokens
    (none if 0)."""
    from latentserve import LLM, SamplingParams

    start = time.perf_counter()
    # No prefix caching: the prefill below runs the same prompt each repeat and must compute all of it.
    with AnonPeak() as anon:
        llm = LLM(model=str(path), num_kv_blocks=160, block_size=16, max_model_len=1024, max_num_seqs=8,
                  max_num_batched_tokens=max(prefill_len, 64), enable_prefix_caching=False, **settings)
    result = dict(load_s=time.perf_counter() - start, peak_rss_gb=rss("VmHWM") / 1e9,
                  dtype=str(llm.engine.model.model.embed_tokens.weight.dtype).removeprefix("torch."),
                  anon_before_gb=anon.before / 1e9, anon_loaded_gb=(anon.after - anon.before) / 1e9,
                  anon_peak_gb=(anon.peak - anon.before) / 1e9)
    print(json.dumps(result), file=sys.stderr, flush=True)  # the load alone, should decoding fail
    engine = llm.engine
    for batch in (1, 8):
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
        for i in range(batch):
            engine.add_request([11 + i, 22, 33, 44], params)
        engine.step()  # the prefills
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        result[f"decode_b{batch}_tok_s"] = batch / min(times)
    if not prefill_len:
        return result
    prompt = [(7 * i) % 100000 + 5 for i in range(prefill_len)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill() -> None:
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()

    result["prefill_tok_s"] = prefill_len / best_time(prefill, repeats=2)
    return result


def interleaved_decode(path: Path, names: list[str], steps: int = 12) -> list[str]:
    """Decode tok/s of several formats loaded in this one process, their steps alternating, fastest step each: the
    steadiest comparison on a shared machine (every format sees the same noise)."""
    from latentserve import LLM, SamplingParams

    engines = {name: LLM(model=str(path), num_kv_blocks=64, block_size=16, max_model_len=512, max_num_seqs=8,
                         **FORMATS[name]).engine for name in names}
    rows = ["| batch | " + " | ".join(f"{n} tok/s" for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    for batch in (1, 8):
        best = dict.fromkeys(names, float("inf"))
        for engine in engines.values():
            for i in range(batch):
                engine.add_request([11 + i, 22, 33], SamplingParams(temperature=0.0, max_tokens=steps + 2,
                                                                    ignore_eos=True))
            engine.step()  # the prefills
        for _ in range(steps):
            for name, engine in engines.items():
                start = time.perf_counter()
                engine.step()
                best[name] = min(best[name], time.perf_counter() - start)
        for engine in engines.values():
            while engine.has_unfinished_requests():
                engine.step()
        base = best[names[0]]
        rows.append(f"| {batch} | " + " | ".join(f"{batch / best[n]:.1f} ({base / best[n]:.2f}x)" for n in names)
                    + " |")
    return rows


def kernel_table(threads: int) -> list[str]:
    """ms per call of each kernel on V2-Lite's expert matrices (1408x2048, 2048x1408), streamed: each call takes the
    next of 48 copies (int4: 69 MB, twice this CPU's 32 MB L3), as a model's weights stream."""
    torch.set_num_threads(threads)
    features = cpu_features()
    rows = ["| shape (out x in) | rows | fp32 | bf16 | int8 fbgemm | int8 x86-packed | int8 dequant | "
            "int4pack bf16 | int4pack fp32 | int4 dequant |", "|---|---|---|---|---|---|---|---|---|---|"]
    for out_f, in_f in ((1408, 2048), (2048, 1408)):
        copies = 48
        w = [torch.randn(out_f, in_f) * 0.02 for _ in range(copies)]
        q8 = [quantize_int8(x) for x in w]
        q4 = [quantize_int4(x, 128) for x in w]
        kernels = {
            "fp32": [lambda x, m=m: torch.nn.functional.linear(x, m) for m in w],
            "bf16": [lambda x, m=m.bfloat16(): torch.nn.functional.linear(x.bfloat16(), m) for m in w],
            "fbgemm": [FbgemmInt8Linear(q, s, not features.vnni) for q, s in q8] if fbgemm_available() else None,
            "x86": [FbgemmInt8Linear(q, s, not features.vnni, "x86") for q, s in q8] if fbgemm_available() else None,
            "int8 dequant": [Int8Linear(q, s, None) for q, s in q8],
            "int4 bf16": [Int4PackLinear(q, s, m, None, torch.bfloat16) for q, s, m in q4],
            "int4 fp32": [Int4PackLinear(q, s, m, None, torch.float32) for q, s, m in q4],
            "int4 dequant": [Int4Linear(q, s, m, None) for q, s, m in q4],
        }
        for n in (1, 8):
            x = torch.randn(n, in_f)
            best = {name: float("inf") for name, layers in kernels.items() if layers is not None}
            for _ in range(8):  # round-robin, so that every kernel sees the same noise; the fastest run counts
                for name in best:
                    start = time.perf_counter()
                    for layer in kernels[name]:
                        layer(x)
                    best[name] = min(best[name], time.perf_counter() - start)
            cells = [f"{best[name] / copies * 1e3:.3f}" if name in best else "n/a" for name in kernels]
            rows.append(f"| {out_f}x{in_f} | {n} | " + " | ".join(cells) + " |")
    return rows


def _whole_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 quantization as it was before blockwise: each pass over the whole fp32 copy."""
    w = weight.to(torch.float32, copy=True)
    scale = torch.linalg.vector_norm(w, ord=float("inf"), dim=1).clamp_(min=1e-12) / 127
    return w.div_(scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), scale


def _whole_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 quantization as it was before blockwise."""
    w = weight.to(torch.float32, copy=True).view(weight.shape[0], -1, group_size)
    minimum, maximum = w.aminmax(dim=-1)
    scale = (maximum - minimum).clamp_(min=1e-12) / 15
    q = w.sub_(minimum[..., None]).div_(scale[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return q.view(weight.shape), scale, minimum


def quantize_speed(threads: int) -> list[str]:
    """M weights/s of each load-time step on V2-Lite's fused expert gate_up (2816x2048, bf16 as read), 16 copies,
    round-robin, fastest of 3: the whole-tensor quantizers beside the blockwise ones, then each kernel's packing."""
    torch.set_num_threads(threads)
    w = [(torch.randn(2816, 2048) * 0.02).bfloat16() for _ in range(16)]
    q8, q4 = [quantize_int8(x) for x in w], [quantize_int4(x, 64) for x in w]
    steps = {
        "int8 quantize, whole tensor (before)": lambda i: _whole_int8(w[i]),
        "int8 quantize, blockwise": lambda i: quantize_int8(w[i]),
        "int8 fbgemm prepack": lambda i: FbgemmInt8Linear(*q8[i], False),
        "int4 quantize, whole tensor (before)": lambda i: _whole_int4(w[i], 64),
        "int4 quantize, blockwise": lambda i: quantize_int4(w[i], 64),
        "int4pack conversion": lambda i: Int4PackLinear(*q4[i], None, torch.bfloat16),
    }
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(3):
        for name, step in steps.items():
            start = time.perf_counter()
            for i in range(len(w)):
                step(i)
            best[name] = min(best[name], time.perf_counter() - start)
    numel = sum(x.numel() for x in w)
    return ["| step | M weights/s |", "|---|---|"] + [f"| {name} | {numel / best[name] / 1e6:.0f} |" for name in steps]


def load_speed(path: Path, threads: int) -> dict:
    """Seconds (wall and CPU) to load `path` quantized, and quantized weights per second (torch threads =
    quantizing workers). On a shared machine the CPU seconds are the steadier figure."""
    import gc

    from latentserve.layers.quant.config import QuantConfig
    from latentserve.models import load_model

    torch.set_num_threads(threads)
    result = {}
    for method in ("int8", "int4"):
        start, cpu = time.perf_counter(), time.process_time()
        model = load_model(path, dtype=torch.bfloat16, quantization=QuantConfig(method))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        numel = sum(m.in_features * m.out_features for name, m in model.named_modules()
                    if hasattr(m, "kernel") and not isinstance(m, torch.nn.Linear))
        result[method] = dict(load_s=seconds, cpu_s=cpu, mweights_s=numel / seconds / 1e6)
        del model
        gc.collect()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (V2-Lite: 27)")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (written if missing)")
    parser.add_argument("--formats", default="fp32,auto,int8,int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-steps", type=int, default=6)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--kernels-only", action="store_true")
    parser.add_argument("--write-only", action="store_true", help="write the checkpoint and stop")
    parser.add_argument("--load-speed", action="store_true",
                        help="time quantization steps and quantized loads (1 and --threads threads) only")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--interleave", default="auto,int8,int4",
                        help="formats whose decode runs side by side in one process (empty: skip)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        torch.set_num_threads(args.threads)
        print(json.dumps(worker(args.dir, FORMATS[args.worker], args.decode_steps, args.prefill_len)))
        return
    import warnings

    warnings.simplefilter("ignore")
    print(f"CPU: {cpu_features().describe()}; dtype auto -> {auto_dtype('cpu')[0]}; {args.threads} threads")
    if args.load_speed:
        print("\n".join(quantize_speed(1)), flush=True)
    if not args.skip_kernels and not args.write_only and not args.load_speed:
        print("\n".join(kernel_table(args.threads)), flush=True)
    if args.kernels_only:
        return
    path = args.dir or Path(f"/tmp/latentserve-v2lite-{args.layers}l")
    if not (path / "model.safetensors.index.json").is_file():
        start = time.perf_counter()
        write_checkpoint(path, args.layers)
        print(f"wrote {path} in {time.perf_counter() - start:.0f} s", flush=True)
    if args.write_only:
        return
    if args.load_speed:
        for threads in sorted({1, args.threads}):
            for method, r in load_speed(path, threads).items():
                print(f"{path.name} {method}, {threads} thread(s): {r['load_s']:.1f} s ({r['cpu_s']:.1f} s of CPU), "
                      f"{r['mweights_s']:.0f} M quantized weights/s", flush=True)
        return
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"\n{args.layers} layers, {size / 1e9:.2f} GB bf16 on disk")
    print("| format | dtype | load s | peak RSS GB | load's peak anon GB | decode b1 tok/s | decode b8 tok/s | "
          "prefill tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for name in filter(None, args.formats.split(",")):
        run = subprocess.run([sys.executable, __file__, "--worker", name, "--dir", str(path), "--threads",
                              str(args.threads), "--decode-steps", str(args.decode_steps), "--prefill-len",
                              str(args.prefill_len)], capture_output=True, text=True)
        if run.returncode:
            print(f"| {name} | failed: {run.stderr.strip().splitlines()[-1]} |")
            continue
        r = json.loads(run.stdout.strip().splitlines()[-1])
        base = base or r

        def cell(key: str) -> str:
            return f"{r[key]:.1f} ({r[key] / base[key]:.2f}x)"

        print(f"| {name} | {r['dtype']} | {r['load_s']:.1f} | {r['peak_rss_gb']:.2f} | {r['anon_peak_gb']:.2f} | "
              f"{cell('decode_b1_tok_s')} | "
              f"{cell('decode_b8_tok_s')} | {cell('prefill_tok_s')} |", flush=True)
    if args.interleave:
        torch.set_num_threads(args.threads)
        print("\ndecode side by side in one process\n" + "\n".join(interleaved_decode(path, args.interleave.split(","))))


if __name__ == "__main__":
    main()
