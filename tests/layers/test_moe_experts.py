"""The routed experts' execution paths (stacked `torch._grouped_mm`, the per-expert loop, quantized experts) against
a naive per-token fp32 reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from latentserve.distributed.expert_parallel import RemoteExpert
from latentserve.forward_context import set_dbo_yield_hook
from latentserve.layers.linear import Linear
from latentserve.layers.mlp import GatedMLP
from latentserve.layers.moe import MoE, RoutingConfig
from latentserve.layers.quant.config import QuantConfig
from latentserve.layers.quant.experts import run_expert_loop
from latentserve.layers.quant.linear import quantize_linear

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 3


def _moe(dtype: torch.dtype = torch.float32, seed: int = 0, shared: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(HIDDEN, INTER, RoutingConfig(EXPERTS, TOP_K), n_shared_experts=shared)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe.to(dtype)


def _full_precision_weights(moe: MoE) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each expert's (gate, up, down) as fp32 copies, taken before any stacking or quantization."""
    return [tuple(p.weight.detach().float().clone() for p in (e.gate_proj, e.up_proj, e.down_proj))
            for e in moe.experts]


def _naive(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts) -> torch.Tensor:
    """fp32, one token and one of its experts at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        xt = x[t].float()
        for k in range(ids.shape[1]):
            gate, up, down = experts[ids[t, k]]
            out[t] += weights[t, k].float() * (down @ (F.silu(gate @ xt) * (up @ xt)))
    return out


def _routing(tokens: int, experts: range = range(EXPERTS)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.rand(tokens, len(experts), generator=g).argsort(dim=1)[:, :TOP_K] + experts.start
    return x, torch.rand(tokens, TOP_K, generator=g), ids


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens", [0, 1, 5, 40])
def test_stacked_and_loop_match_the_naive_reference(dtype: torch.dtype, tol: float, tokens: int) -> None:
    moe = _moe(dtype)
    experts = _full_precision_weights(moe)
    x, weights, ids = _routing(tokens)
    x = x.to(dtype)
    expected = _naive(x, weights, ids, experts)
    with torch.no_grad():
        loop = moe.run_experts(x, weights, ids)
        moe.stack_experts()
        assert moe.stacked is not None
        stacked = moe.run_experts(x, weights, ids)
    assert loop.dtype == stacked.dtype == dtype and stacked.shape == x.shape
    scale = max(expected.abs().amax().item() if tokens else 0.0, 1.0)
    torch.testing.assert_close(loop.float(), expected, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(stacked.float(), expected, rtol=tol, atol=tol * scale)


def test_stacking_keeps_one_copy_of_the_weights() -> None:
    """The experts' parameters become views of the stack, so loading into them (or the state dict) sees it."""
    moe = _moe()
    moe.stack_experts()
    stack = moe.stacked.w13.untyped_storage().data_ptr()
    for e, expert in enumerate(moe.experts):
        assert expert.gate_proj.weight.untyped_storage().data_ptr() == stack
        assert expert.down_proj.weight.untyped_storage().data_ptr() == moe.stacked.w2.untyped_storage().data_ptr()
        assert torch.equal(moe.stacked.w13[e, INTER:], expert.up_proj.weight)
    assert not any(".stacked." in name for name in moe.state_dict())
    x, weights, ids = _routing(6)
    with torch.no_grad():
        moe.experts[ids[0, 0]].down_proj.weight.mul_(2)  # reaches the stacked path
        expected = _naive(x, weights, ids, _full_precision_weights(moe))
        torch.testing.assert_close(moe.run_experts(x, weights, ids), expected, rtol=1e-5, atol=1e-5)


def test_expert_parallel_rank_stacks_only_its_experts() -> None:
    """Rank 1 of 2 owns experts 4-7 (the others are stand-ins) and gets global expert ids."""
    moe = _moe()
    experts = _full_precision_weights(moe)
    for i in range(EXPERTS // 2):
        moe.experts[i] = RemoteExpert(0)
    moe.stack_experts()
    assert moe.stacked is not None and moe.stacked.first == EXPERTS // 2 and len(moe.stacked.w13) == EXPERTS // 2
    x, weights, ids = _routing(9, experts=range(EXPERTS // 2, EXPERTS))
    with torch.no_grad():
        torch.testing.assert_close(moe.run_experts(x, weights, ids), _naive(x, weights, ids, experts),
                                   rtol=1e-5, atol=1e-5)


def _effective_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The fp32 `[out, in]` weight a (quantized) layer applies, read back through its kernel."""
    return layer(torch.eye(layer.in_features)).t().float()


@pytest.mark.parametrize("tokens", [1, 7], ids=["1 token", "7 tokens"])  # 1: the batch-1 path, no sort or gather
@pytest.mark.parametrize("fused", [False, True], ids=["gate,up", "gate_up"])
@pytest.mark.parametrize("config, tol", [(QuantConfig("int8"), 2e-2), (QuantConfig("int4", 32), 2e-2)])
def test_quantized_experts_keep_the_loop_and_match_their_dequantized_reference(
    config: QuantConfig, tol: float, fused: bool, tokens: int
) -> None:
    """As the loader leaves them: gate, up, down quantized each, or gate and up quantized as one fused weight."""
    moe = _moe()
    experts = []
    for e, expert in enumerate(moe.experts):
        gate, up, down = (getattr(expert, n).weight.detach() for n in ("gate_proj", "up_proj", "down_proj"))
        expert.down_proj = quantize_linear(f"experts.{e}.down_proj", down, None, config, "cpu")
        if fused:
            gate_up = torch.cat([gate, up])
            expert.fuse_gate_up(quantize_linear(f"experts.{e}.gate_up_proj", gate_up, None, config, "cpu"))
            gate, up = _effective_weight(expert.gate_up_proj).chunk(2)
        else:
            expert.gate_proj = quantize_linear(f"experts.{e}.gate_proj", gate, None, config, "cpu")
            expert.up_proj = quantize_linear(f"experts.{e}.up_proj", up, None, config, "cpu")
            gate, up = _effective_weight(expert.gate_proj), _effective_weight(expert.up_proj)
        experts.append((gate, up, _effective_weight(expert.down_proj)))
    moe.stack_experts()
    assert moe.stacked is None
    x, weights, ids = _routing(tokens)
    with torch.no_grad():
        got = moe.run_experts(x, weights, ids)
    expected = _naive(x, weights, ids, experts)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol * expected.abs().max().item())


def test_fused_gate_up_matches_the_separate_layers() -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(HIDDEN, INTER)
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        expected = mlp(x)
        fused = Linear(HIDDEN, 2 * INTER, bias=False)
        fused.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        mlp.fuse_gate_up(fused)
        torch.testing.assert_close(mlp(x), expected, rtol=1e-6, atol=1e-6)
    assert not hasattr(mlp, "gate_proj") and not hasattr(mlp, "up_proj")
    with pytest.raises(ValueError, match=f"needs {2 * INTER} outputs, got {INTER}"):
        GatedMLP(HIDDEN, INTER).fuse_gate_up(Linear(HIDDEN, INTER))


def test_stacked_moe_still_yields_twice() -> None:
    """DBO: both ubatches yield equally per layer, whichever path runs the experts."""
    moe = _moe()
    moe.stack_experts()
    yields: list[int] = []
    set_dbo_yield_hook(lambda: yields.append(1))
    try:
        with torch.no_grad():
            moe(torch.randn(5, HIDDEN))
    finally:
        set_dbo_yield_hook(None)
    assert len(yields) == 2


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens", [1, 3, 8, 9])  # 9: past the few-token kernel, shared experts on their own
def test_shared_experts_join_the_stack_as_gate_one_experts(dtype: torch.dtype, tol: float, tokens: int) -> None:
    """Two I-wide shared experts (one MLP of 2I) ride in the routed experts' kernel call; the sum is the naive one."""
    moe = _moe(dtype, shared=2)
    experts = _full_precision_weights(moe)
    shared = [p.weight.detach().float().clone() for p in (moe.shared_experts.gate_proj, moe.shared_experts.up_proj,
                                                          moe.shared_experts.down_proj)]
    moe.stack_experts()
    fused = moe.stacked.shared_gate_up  # the shared gate and up: views of one weight, as the kernel reads them
    assert moe.stacked.shared is not None and moe.shared_experts.gate_proj.weight.data_ptr() == fused.data_ptr()
    x, weights, ids = _routing(tokens)
    x = x.to(dtype)
    gate, up, down = shared
    expected = _naive(x, weights, ids, experts) + (F.silu(x.float() @ gate.t()) * (x.float() @ up.t())) @ down.t()
    with torch.no_grad():
        got = moe.stacked.with_shared(x, weights, ids)
        if tokens <= 8 and moe.stacked._kernels(x) is not None:
            scale = expected.abs().amax().item()
            torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * scale)
        else:
            assert got is None
        # A down projection replaced is read at its new address; a gate no longer in the fused weight is not read
        # as the stack's: the separate path runs.
        moe.shared_experts.down_proj.weight = torch.nn.Parameter(moe.shared_experts.down_proj.weight.clone())
        again = moe.stacked.with_shared(x, weights, ids)
        assert (again is None and got is None) or torch.equal(again, got)
        moe.shared_experts.gate_proj.weight = torch.nn.Parameter(moe.shared_experts.gate_proj.weight.clone())
        assert moe.stacked.with_shared(x, weights, ids) is None



@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int4", 32)], ids=["int8", "int4"])
def test_a_prefills_quantized_moe_is_one_kernel_call_each_token_as_alone(config: QuantConfig, monkeypatch) -> None:
    """Quantized routed experts (gate_up fused, as the loader leaves them) and shared MLP: 50 tokens run through
    `native.experts` with the shared MLP, 16 tokens a call here, never the loop: each token's result is what it gets
    alone (decode's), to the bit; the dequantized weights' naive sum and the loop's within the quantization's
    error."""
    monkeypatch.setattr("latentserve.layers.quant.experts.TOKENS_PER_CALL", 16)
    torch.manual_seed(0)
    moe = MoE(HIDDEN, 2 * HIDDEN, RoutingConfig(EXPERTS, TOP_K), n_shared_experts=2)  # int4: K a multiple of 64
    effective = []
    with torch.no_grad():
        for e, mlp in enumerate([*moe.experts, moe.shared_experts]):
            gate, up, down = (getattr(mlp, n).weight.normal_(0, 0.2).detach() for n in ("gate_proj", "up_proj",
                                                                                         "down_proj"))
            mlp.fuse_gate_up(quantize_linear(f"{e}.gate_up_proj", torch.cat([gate, up]), None, config, "cpu"))
            mlp.down_proj = quantize_linear(f"{e}.down_proj", down, None, config, "cpu")
            effective.append((*_effective_weight(mlp.gate_up_proj).chunk(2), _effective_weight(mlp.down_proj)))
    if type(moe.experts[0].down_proj).__name__ not in ("NativeInt8Linear", "NativeInt4Linear"):
        pytest.skip("latentserve's kernels are not built here")
    x, weights, ids = _routing(50)
    x = x.bfloat16()
    with torch.no_grad():
        loop = run_expert_loop(moe.experts, x, weights, ids) + moe.shared_experts(x)
        calls = []
        monkeypatch.setattr("latentserve.layers.moe.run_expert_loop", lambda *a: calls.append(a))
        routed = moe.run_experts(x, weights, ids)
        together = moe.native_experts(moe.experts, moe.shared_experts, x, weights, ids)
        alone = [moe.native_experts(moe.experts, moe.shared_experts, x[t : t + 1], weights[t : t + 1],
                                    ids[t : t + 1]) for t in range(50)]
    assert not calls and torch.equal(together, torch.cat(alone))
    assert torch.equal(routed, moe.native_experts(moe.experts, None, x, weights, ids))
    gate, up, down = effective[-1]
    expected = _naive(x, weights, ids, effective) + (F.silu(x.float() @ gate.t()) * (x.float() @ up.t())) @ down.t()
    scale = expected.abs().max().item()
    torch.testing.assert_close(together.float(), expected, rtol=3e-2, atol=3e-2 * scale)
    torch.testing.assert_close(loop.float(), together.float(), rtol=3e-2, atol=3e-2 * scale)
