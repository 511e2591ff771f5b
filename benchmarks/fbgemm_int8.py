"""fbgemm's dynamic int8 linear as a peer for the kernel benchmarks (latentserve ran it where its kernels did not
build until its per-row `torch._int_mm` layer replaced it): each call quantizes the activations per tensor (uint8,
asymmetric) and runs fbgemm's int8 GEMM on the prepacked weight, fp32 out."""
from __future__ import annotations

import warnings

import torch


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class FbgemmInt8Linear:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, reduce_range: bool, engine: str = "fbgemm") -> None:
        """q int8 `[out, in]`, scale fp32 `[out]`; reduce_range: 7-bit activations (without VNNI fbgemm's u8 * s8
        pair sums saturate int16); engine: the quantized engine that packs the weight ("x86" picks per op)."""
        self.reduce_range = reduce_range
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = engine
        try:
            with warnings.catch_warnings():  # quantized tensors are deprecated as a user API; the packing takes one
                warnings.simplefilter("ignore")
                zero_points = torch.zeros(q.shape[0], dtype=torch.long)
                qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
                self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        finally:
            torch.backends.quantized.engine = previous

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, self.reduce_range)
