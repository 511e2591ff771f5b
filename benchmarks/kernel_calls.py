"""The cost of one call through the kernels' wrappers at decode sizes (one token, V2-Lite's attention shapes, fp32,
one thread), by the calling thread's CPU time: what the boundary (checks, descriptors, ctypes) and the scratch arena
add to the kernels' arithmetic. Each figure is the fastest of `--repeats` runs of many calls.
To compare two trees, run it in each, interleaved (the machine's noise moves both alike):
`for t in A B A B; do (cd $t && PYTHONPATH=$PWD .venv/bin/python benchmarks/kernel_calls.py); done`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latentserve.kernels import native  # noqa: E402
from latentserve.kernels.policy import default_policy  # noqa: E402

HEADS, HIDDEN, NOPE, ROPE, LATENT, V_DIM = 16, 2048, 128, 64, 512, 128


def _attention_case(kernels: native.NativeKernels):
    g = torch.Generator().manual_seed(0)
    shapes = {"q_b": (HEADS * (NOPE + ROPE), HIDDEN), "kv_a": (LATENT + ROPE, HIDDEN), "o_proj": (HIDDEN, HEADS * V_DIM),
              "uk": (HEADS, NOPE, LATENT), "uv": (HEADS, LATENT, V_DIM), "input_norm": (HIDDEN,),
              "kv_a_norm": (LATENT,), "post_norm": (HIDDEN,)}
    held = {name: torch.randn(*shape, generator=g) * 0.05 for name, shape in shapes.items()}
    block = native.MLABlock(hidden=HIDDEN, heads=HEADS, nope=NOPE, rope=ROPE, latent=LATENT, v_dim=V_DIM, q_lora=0,
                            **{n: native.Weight(kind=native.DENSE, w=held[n].data_ptr())
                               for n in ("q_b", "kv_a", "o_proj", "uk", "uv")},
                            **{n: held[n].data_ptr() for n in ("input_norm", "kv_a_norm", "post_norm")},
                            eps=1e-6, kv_a_eps=1e-6, post_eps=1e-6, scale=0.1, style=2, bf=0)
    x, cos, sin = torch.randn(1, HIDDEN, generator=g), torch.ones(1, ROPE), torch.zeros(1, ROPE)
    cache, table = torch.zeros(64, 16, LATENT + ROPE), torch.arange(64, dtype=torch.int32).view(2, 32)
    metadata = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([300], dtype=torch.int32), torch.tensor([299]))
    return lambda: (held, native.mla_attention_block(kernels, block, x, cos, sin, cache, table, *metadata))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = default_policy().kernels
    if kernels is None:
        sys.exit("latentserve's kernels do not build here")
    x, weight, linear, logits = torch.randn(1, HIDDEN), torch.randn(HIDDEN), torch.randn(512, HIDDEN), torch.randn(1, 64)
    cases = {"rms_norm [1, 2048]": (lambda: native.rms_norm(kernels, x, weight, 1e-6), 200),
             "dense_linear [1, 2048] x [512, 2048]": (lambda: native.dense_linear(kernels, x, linear), 200),
             "route 6 of 64": (lambda: native.route(kernels, logits, 6, False, 1, 1, None, True, 1.0), 200),
             "mla_attention_block, 300 positions": (_attention_case(kernels), 20)}
    print(f"| call ({kernels.isa}, 1 thread) | us |\n|---|---|")
    for name, (fn, calls) in cases.items():
        for _ in range(calls // 10):
            fn()
        best = float("inf")
        for _ in range(args.repeats):
            start = time.thread_time()
            for _ in range(calls):
                fn()
            best = min(best, (time.thread_time() - start) / calls * 1e6)
        print(f"| {name} | {best:.1f} |")


if __name__ == "__main__":
    main()
