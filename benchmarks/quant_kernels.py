"""The quantized linear kernels per shape and row count, on DeepSeek-V2-Lite's matrices: what `layers/quant/linear.py`
chooses from. ms per call, round-robin over the kernels (each sees the same noise), fastest of --repeats.

Shapes: a routed expert's fused gate_up (2816 x 2048) and down (2048 x 1408), and lm_head (102400 x 2048). At a few
rows each call takes the next of enough copies of the weight to stream it from memory (more than the L3), as a
model's weights stream. Kernels: bf16 `F.linear`; int8 through fbgemm (`linear_dynamic`, activations quantized per
call, `fbgemm_int8.py`), latentserve's torch layer where its kernels do not run (`IntMMInt8Linear`: activations
quantized per row, oneDNN's `_int_mm`), latentserve's row kernel (`int8_heads`: one output row
at a time, what int8 layers ran up to 24 rows before the blocked layout) and latentserve's layer (the weight in
blocks of 16 outputs, at every row count); int4 through PyTorch's `_weight_int4pack_mm_for_cpu` (bf16 activations) and
latentserve's layer (its own kernel at every row count). `_weight_int8pack_mm`
measured 2-7x slower than fbgemm (benchmarks/RESULTS.md) and is left out.
Run: `PYTHONPATH=$PWD .venv/bin/python benchmarks/quant_kernels.py [--threads 1] [--repeats 3]`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latentserve.kernels.cpu import cpu_features  # noqa: E402
from latentserve.layers.quant.int4 import Int4PackLinear, NativeInt4Linear, quantize_int4  # noqa: E402
from benchmarks.fbgemm_int8 import FbgemmInt8Linear  # noqa: E402
from latentserve.layers.quant.int8 import IntMMInt8Linear, NativeInt8Linear, quantize_int8  # noqa: E402
from latentserve.kernels.native import activations, int8_heads, native_kernels  # noqa: E402

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
SHAPES = {(2816, 2048): ROWS, (2048, 1408): ROWS, (102400, 2048): (1, 2, 4, 8)}
STREAM_BYTES = 64 << 20  # int4 copies of a small weight until they are twice the L3


def kernels(out_features: int, in_features: int, copies: int) -> dict[str, list]:
    """name -> `copies` callables x -> y over distinct copies of one random weight."""
    w = torch.randn(out_features, in_features) * 0.02
    q8, s8 = quantize_int8(w)
    q4, s4, m4 = quantize_int4(w, 64)
    features = cpu_features()
    native = native_kernels(features)[0]
    if native is None:
        sys.exit(f"latentserve's kernels are not available here: {native_kernels(features)[1]}")
    wb = w.bfloat16()
    del w
    int4 = [Int4PackLinear(q4, s4, m4, None, torch.bfloat16) for _ in range(copies)]
    for layer in int4:
        layer.dequant_rows = None  # int4pack_mm at every row count
    return {
        "bf16": [lambda x, m=wb.clone(): F.linear(x, m) for _ in range(copies)],
        "int8 fbgemm": [FbgemmInt8Linear(q8, s8, not features.vnni) for _ in range(copies)],
        "int8 _int_mm": [IntMMInt8Linear(q8.clone(), s8, None) for _ in range(copies)],
        "int8 rows": [lambda x, q=q8.clone()[None], qsum=q8.sum(dim=1, dtype=torch.int32):
                      int8_heads(native, activations(x, in_features)[:, None], q, s8, qsum) for _ in range(copies)],
        "int8 latentserve": [NativeInt8Linear(q8.clone(), s8, None, native) for _ in range(copies)],
        "int4pack_mm": int4,
        "int4 latentserve": [NativeInt4Linear(q4, s4, m4, None, native) for _ in range(copies)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"CPU: {cpu_features().describe()}; {args.threads} thread(s); {when}; load average {os.getloadavg()}")
    names = ["bf16", "int8 fbgemm", "int8 _int_mm", "int8 rows", "int8 latentserve", "int4pack_mm", "int4 latentserve"]
    print("| shape (out x in) | rows | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for (out_features, in_features), row_counts in SHAPES.items():
        streamed = max(1, STREAM_BYTES // (out_features * in_features // 2))
        layers = kernels(out_features, in_features, streamed)
        for rows in row_counts:
            copies = streamed if rows <= 8 else 1  # many rows: compute-bound, streaming hardly matters
            x = torch.randn(rows, in_features).bfloat16()
            best = dict.fromkeys(names, float("inf"))
            for _ in range(args.repeats):
                for name in names:
                    start = time.perf_counter()
                    for layer in layers[name][:copies]:
                        layer(x)
                    best[name] = min(best[name], (time.perf_counter() - start) / copies)
            print(f"| {out_features}x{in_features} | {rows} | " + " | ".join(f"{best[n] * 1e3:.3f}" for n in names)
                  + " |", flush=True)


if __name__ == "__main__":
    main()
