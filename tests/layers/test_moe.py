"""MoE routing and the MoE block against transformers' DeepSeek-V2/V3 modules, on random inputs."""
from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from latentserve.forward_context import set_dbo_yield_hook
from latentserve.layers.linear import linear
from latentserve.layers.moe import MoE, Router, RoutingConfig, select_experts
from tests.checkpoints import make_config

HIDDEN = 32


def _routing(hf_config) -> RoutingConfig:
    v3 = hf_config.model_type == "deepseek_v3"
    return RoutingConfig(
        n_routed_experts=hf_config.n_routed_experts,
        num_experts_per_tok=hf_config.num_experts_per_tok,
        scoring_func="sigmoid" if v3 else "softmax",
        topk_method="noaux_tc" if v3 else hf_config.topk_method,
        n_group=hf_config.n_group,
        topk_group=hf_config.topk_group,
        norm_topk_prob=hf_config.norm_topk_prob if v3 else False,
        routed_scaling_factor=hf_config.routed_scaling_factor,
    )


def _sorted_by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k order is not part of the contract; compare (expert, weight) sets."""
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def _hf_config(variant: str, **overrides):
    return make_config(variant, hidden_size=HIDDEN, n_routed_experts=16, num_experts_per_tok=4, **overrides)


CASES = {
    "v2_greedy": ("v2_lite", dict(routed_scaling_factor=3.0)),
    "v2_group_limited": ("v2_group", dict(n_group=4, topk_group=2)),
    "v3_groups_norm": ("v3", dict(n_group=4, topk_group=2, norm_topk_prob=True)),
    "v3_groups_no_norm": ("v3", dict(n_group=8, topk_group=3, norm_topk_prob=False)),
    "v3_one_group": ("v3", dict(n_group=1, topk_group=1, norm_topk_prob=True)),
}


def _hf_router(hf_config):
    return (hf_v3.DeepseekV3TopkRouter if hf_config.model_type == "deepseek_v3" else hf_v2.DeepseekV2TopkRouter)(
        hf_config
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_routing_matches_transformers(case: str) -> None:
    variant, overrides = CASES[case]
    hf_config = _hf_config(variant, **overrides)
    g = torch.Generator().manual_seed(0)
    hf_router = _hf_router(hf_config)
    router = Router(HIDDEN, _routing(hf_config))
    with torch.no_grad():
        hf_router.weight.normal_(0, 0.3, generator=g)
        router.weight.copy_(hf_router.weight)
        if router.e_score_correction_bias is not None:
            hf_router.e_score_correction_bias.normal_(0, 0.2, generator=g)
            router.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    x = torch.randn(64, HIDDEN, generator=g)
    _, hf_weights, hf_ids = hf_router(x)
    weights, ids = router(x)
    hf_weights, hf_ids = _sorted_by_expert(hf_weights, hf_ids)
    weights, ids = _sorted_by_expert(weights, ids)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)


def test_group_limits_exclude_experts_outside_chosen_groups() -> None:
    """With one group allowed, every pick comes from the group holding the best expert."""
    cfg = RoutingConfig(16, 3, "softmax", "group_limited_greedy", n_group=4, topk_group=1)
    logits = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    _, ids = select_experts(logits, cfg)
    assert torch.equal(ids // 4, (logits.argmax(-1) // 4)[:, None].expand_as(ids))


def test_v3_bias_chooses_but_does_not_weigh() -> None:
    cfg = RoutingConfig(8, 2, "sigmoid", "noaux_tc", n_group=1, topk_group=1, norm_topk_prob=False)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    bias = torch.full((8,), -10.0)
    bias[[3, 5]] = 10.0
    weights, ids = select_experts(logits, cfg, bias)
    assert set(ids.flatten().tolist()) == {3, 5}
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, ids))


@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_softmax_norm_topk_prob_normalizes_then_scales(scale: float) -> None:
    """transformers' V2 ignores norm_topk_prob (every released V2 config has it off); we follow V3 and vLLM."""
    cfg = RoutingConfig(8, 3, "softmax", "greedy", norm_topk_prob=True, routed_scaling_factor=scale)
    logits = torch.randn(10, 8, generator=torch.Generator().manual_seed(3))
    weights, ids = select_experts(logits, cfg)
    probs = logits.softmax(-1)
    top = probs.topk(3, dim=-1)
    torch.testing.assert_close(weights.sum(-1), torch.full((10,), scale))
    torch.testing.assert_close(weights, top.values / top.values.sum(-1, keepdim=True) * scale)
    assert torch.equal(ids, top.indices)


def _copy_moe_weights(hf_moe, moe: MoE) -> None:
    inter = hf_moe.experts.intermediate_dim
    with torch.no_grad():
        moe.gate.weight.copy_(hf_moe.gate.weight)
        if moe.gate.e_score_correction_bias is not None:
            moe.gate.e_score_correction_bias.copy_(hf_moe.gate.e_score_correction_bias)
        for e, expert in enumerate(moe.experts):
            expert.gate_proj.weight.copy_(hf_moe.experts.gate_up_proj[e, :inter])
            expert.up_proj.weight.copy_(hf_moe.experts.gate_up_proj[e, inter:])
            expert.down_proj.weight.copy_(hf_moe.experts.down_proj[e])
        moe.shared_experts.load_state_dict(hf_moe.shared_experts.state_dict())


@pytest.mark.parametrize("stacked", [False, True], ids=["loop", "stacked"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_block_matches_transformers(case: str, stacked: bool) -> None:
    variant, overrides = CASES[case]
    hf_config = _hf_config(variant, **overrides)
    hf_config._experts_implementation = "eager"
    torch.manual_seed(0)
    cls = hf_v3.DeepseekV3MoE if hf_config.model_type == "deepseek_v3" else hf_v2.DeepseekV2Moe
    hf_moe = cls(hf_config)
    with torch.no_grad():
        for p in hf_moe.parameters():
            p.normal_(0, 0.2)
        if hasattr(hf_moe.gate, "e_score_correction_bias"):
            hf_moe.gate.e_score_correction_bias.normal_(0, 0.2)
    moe = MoE(HIDDEN, hf_config.moe_intermediate_size, _routing(hf_config), hf_config.n_shared_experts)
    _copy_moe_weights(hf_moe, moe)
    if stacked:
        moe.stack_experts()
        assert moe.stacked is not None and moe.stacked.shared is not None  # shared experts join the kernel calls
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = hf_moe(x[None])[0]
        actual = moe(x)
        one = moe(x[:1])  # batch-1 decode: routed and shared experts in one native call where the kernels build
        expected_one = hf_moe(x[None, :1])[0]
        few = moe(x[:6])  # a few decode tokens: one native call for all of them
        expected_few = hf_moe(x[None, :6])[0]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one, expected_one, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(few, expected_few, rtol=1e-5, atol=1e-6)


def test_moe_yields_around_the_routed_experts() -> None:
    """Two dbo_yield()s, where the dispatch and combine all-to-alls go: after routing, after the experts."""
    cfg = RoutingConfig(4, 2)
    moe = MoE(HIDDEN, 8, cfg, n_shared_experts=1)
    events: list[str] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda *_, e=e: events.append(f"expert{e}"))
    moe.gate.register_forward_hook(lambda *_: events.append("gate"))
    set_dbo_yield_hook(lambda: events.append("yield"))
    try:
        with torch.no_grad():
            moe(torch.randn(16, HIDDEN))
    finally:
        set_dbo_yield_hook(None)
    assert events.count("yield") == 2
    first, last = events.index("yield"), len(events) - 1
    assert events[last] == "yield" and events.index("gate") < first
    assert all(name.startswith("expert") for name in events[first + 1 : last]) and last > first + 1


def test_experts_that_get_no_tokens_are_skipped() -> None:
    moe = MoE(HIDDEN, 8, RoutingConfig(4, 1), n_shared_experts=0)
    calls: list[int] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda *_, e=e: calls.append(e))
    x = torch.randn(3, HIDDEN)
    weights = torch.ones(3, 1)
    ids = torch.tensor([[2], [2], [0]])
    with torch.no_grad():
        out = moe.run_experts(x, weights, ids)
        assert calls == [0, 2]
        torch.testing.assert_close(out[2], moe.experts[0](x[2:]).squeeze(0))
        torch.testing.assert_close(out[:2], moe.experts[2](x[:2]))


def test_no_tokens_give_an_empty_output_without_running_an_expert() -> None:
    """An expert-parallel rank may receive no tokens at all."""
    moe = MoE(HIDDEN, 8, RoutingConfig(4, 2), n_shared_experts=0)
    calls: list[int] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda *_, e=e: calls.append(e))
    with torch.no_grad():
        out = moe.run_experts(torch.randn(0, HIDDEN), torch.ones(0, 2), torch.zeros(0, 2, dtype=torch.long))
    assert out.shape == (0, HIDDEN) and calls == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(scoring_func="relu"), "scoring_func"),
        (dict(topk_method="noaux_tc"), "topk_method"),
        (dict(scoring_func="sigmoid", topk_method="greedy"), "topk_method"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(topk_method="group_limited_greedy", n_group=3, topk_group=1), "n_group"),
        (dict(topk_method="group_limited_greedy", n_group=4, topk_group=5), "topk_group"),
        (dict(topk_method="group_limited_greedy", n_group=4, topk_group=1, num_experts_per_tok=3), "exceeds"),
        (dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=2), "top 2"),
    ],
)
def test_routing_config_rejects_bad_values(kwargs: dict, field: str) -> None:
    base = dict(n_routed_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**{**base, **kwargs})


@pytest.mark.parametrize("tokens", [1, 3, 8])  # up to NATIVE_MAX_TOKENS the router routes in one native call
@pytest.mark.parametrize("case", sorted(CASES))
def test_native_routing_matches_select_experts(case: str, tokens: int) -> None:
    from latentserve.kernels.policy import default_policy

    if default_policy().kernels is None:
        pytest.skip("latentserve's kernels do not build here")
    variant, overrides = CASES[case]
    cfg = _routing(_hf_config(variant, **overrides))
    router = Router(HIDDEN, cfg)
    g = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        router.weight.normal_(0, 0.2, generator=g)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.normal_(0, 0.2, generator=g)
    x = torch.randn(tokens, HIDDEN, generator=g)
    with torch.no_grad():
        weights, ids = router(x)
        logits = linear(x, router.weight)
        expected_weights, expected_ids = select_experts(logits, cfg, router.e_score_correction_bias)
    weights, ids = _sorted_by_expert(weights, ids)
    expected_weights, expected_ids = _sorted_by_expert(expected_weights, expected_ids)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


def test_native_routing_refuses_choices_it_cannot_make() -> None:
    from latentserve.kernels import native
    from latentserve.kernels.policy import default_policy

    kernels = default_policy().kernels
    if kernels is None:
        pytest.skip("latentserve's kernels do not build here")
    logits = torch.randn(2, 8)
    for k, groups, kept in ((9, 1, 1), (2, 3, 1), (5, 4, 2), (2, 4, 5)):
        with pytest.raises(ValueError, match=f"route: {k} of 8 experts from the best {kept} of {groups} groups"):
            native.route(kernels, logits, k, True, groups, kept, None, True, 1.0)
    with pytest.raises(ValueError, match=r"bias \(4,\)"):
        native.route(kernels, logits, 2, True, 1, 1, torch.zeros(4), True, 1.0)
