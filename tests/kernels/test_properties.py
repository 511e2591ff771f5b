"""Property tests of the wrappers' boundary, one per family: random shapes, dtypes, layouts and contents, with at
most one thing wrong; the call either raises a ValueError naming the wrong argument or returns the fp32 torch
reference's result. Bounded: few examples, small tensors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from latentserve.kernels import native
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
FLOATS = [torch.float32, torch.bfloat16]


def _tensor(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, strided: bool) -> torch.Tensor:
    """Random values of `shape`; `strided`: a transposed view of the last two dims (same values, not contiguous)."""
    if strided and len(shape) >= 2 and shape[-1] > 1 and shape[-2] > 1:
        return torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g).to(dtype).transpose(-1, -2)
    return torch.randn(*shape, generator=g).to(dtype)


def _outcome(call, reference, wrong: str | None, rtol: float, atol: float) -> None:
    """`call()` raises a ValueError naming `wrong`, or where nothing is wrong equals `reference()`."""
    if wrong is not None:
        with pytest.raises(ValueError, match=wrong):
            call()
        return
    got, expected = call(), reference()
    torch.testing.assert_close(got.double(), expected.double(), rtol=rtol, atol=atol * max(1.0, expected.abs().max()))


@SETTINGS
@given(st.data())
def test_dense_linear_is_an_error_or_the_product(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    m, k, n = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 70)), data.draw(st.integers(1, 20))
    fault = data.draw(st.sampled_from([None, "x dtype", "x strided", "weight columns", "weight dtype", "weight 1d"]))
    x = _tensor(g, (m, k), torch.float16 if fault == "x dtype" else data.draw(st.sampled_from(FLOATS)),
                fault == "x strided")
    wk = k + data.draw(st.integers(1, 8)) if fault == "weight columns" else k
    w = _tensor(g, (n, wk), torch.float64 if fault == "weight dtype" else data.draw(st.sampled_from(FLOATS)), False)
    w = w.reshape(-1) if fault == "weight 1d" else w
    wrong = None if fault is None else "x must" if fault.startswith("x") else "weight must"
    wrong = None if fault == "x strided" and x.is_contiguous() else wrong  # one element: no stride to get wrong
    isa = data.draw(st.sampled_from(ISAS))
    _outcome(lambda: native.dense_linear(kernels(isa), x, w), lambda: x.float() @ w.float().t(), wrong, 1e-4, 1e-4)


@SETTINGS
@given(st.data())
def test_int8_linear_is_an_error_or_the_integer_product(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    m, k, n = data.draw(st.integers(1, 5)), 4 * data.draw(st.integers(1, 33)), data.draw(st.integers(1, 40))
    fault = data.draw(st.sampled_from([None, "x dtype", "x wider", "x strided", "x odd", "more outputs"]))
    columns = {"x wider": k + 4, "x odd": k + 1}.get(fault, k)
    x = _tensor(g, (m, columns), torch.float16 if fault == "x dtype" else torch.float32, fault == "x strided")
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) + 0.1
    outputs = n + 16 if fault == "more outputs" else n
    wrong = {None: None, "x dtype": "x must", "x wider": "packed .* must", "x strided": "x must",
             "x odd": "K a multiple of 4", "more outputs": "packed .* must"}[fault]
    wrong = None if fault == "x strided" and x.is_contiguous() else wrong

    def reference():
        s = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        return (torch.div(x, s).round().double() @ q.double().t()) * s.double() * scale.double()

    isa = data.draw(st.sampled_from(ISAS))
    _outcome(lambda: native.int8_linear(kernels(isa), x, native.pack_int8(q, scale), outputs), reference, wrong,
             1e-5, 1e-5)


@SETTINGS
@given(st.data())
def test_rms_norm_is_an_error_or_the_norm(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    shape = tuple(data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    fault = data.draw(st.sampled_from([None, "x dtype", "x meta", "weight length", "weight dtype"]))
    x = _tensor(g, shape, torch.float64 if fault == "x dtype" else torch.float32, data.draw(st.booleans()))
    x = torch.empty(shape, device="meta") if fault == "x meta" else x
    w = torch.randn(shape[-1] + (3 if fault == "weight length" else 0), generator=g)
    w = w.bfloat16() if fault == "weight dtype" else w
    wrong = None if fault is None else "x must" if fault.startswith("x") else "weight must"
    isa = data.draw(st.sampled_from(ISAS))
    _outcome(lambda: native.rms_norm(kernels(isa), x, w, 1e-6), lambda: F.rms_norm(x, (shape[-1],), w, 1e-6), wrong,
             1e-5, 1e-5)


@SETTINGS
@given(st.data())
def test_mla_decode_is_an_error_or_attention_over_the_blocks(data):
    """Requests of random lengths over random blocks of a small cache; one fault in the metadata at most."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    heads, latent, rope, block, blocks = data.draw(st.integers(1, 9)), 16 * data.draw(st.integers(1, 3)), 8, 4, 10
    dim = latent + rope
    lens = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    news = [data.draw(st.integers(1, min(s, 3))) for s in lens]
    width = 3
    table = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in lens]).int()
    fault = data.draw(st.sampled_from([None, "block id", "query starts", "seq_lens", "latent", "cache rows"]))
    tokens = sum(news)
    qsl = torch.tensor([0] + torch.tensor(news).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    if fault == "block id":
        table[len(lens) - 1, (lens[-1] - 1) // block] = blocks
    elif fault == "query starts":
        qsl[-1] = tokens + 1
    elif fault == "seq_lens":
        seq_lens[0] = width * block + 1
    q = torch.randn(tokens, heads, dim, generator=g).to(data.draw(st.sampled_from(FLOATS)))
    cache = torch.randn(blocks, block, dim + (8 if fault == "cache rows" else 0), generator=g)
    cache = cache.to(data.draw(st.sampled_from(FLOATS)))
    use_latent = dim + 1 if fault == "latent" else latent
    wrong = {None: None, "block id": "block_table names a block outside", "query starts": "query_start_loc must rise",
             "seq_lens": "longer than its row of the block table", "latent": "latent must be in",
             "cache rows": "kv_cache must"}[fault]

    def reference():
        out = []
        for r, (length, new) in enumerate(zip(lens, news)):
            rows = cache[table[r].long()].reshape(-1, dim)[:length].float()
            for j in range(new):
                seen = rows[: length - new + j + 1]
                p = torch.softmax(0.1 * q[qsl[r] + j].float() @ seen.t(), dim=-1)
                out.append(p @ seen[:, :latent])
        return torch.stack(out)

    isa = data.draw(st.sampled_from(ISAS))
    _outcome(lambda: native.mla_decode(kernels(isa), q, cache, table, qsl, seq_lens, 0.1, use_latent).float(),
             reference, wrong, 2e-2, 2e-2)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_mla_decode_splits_many_heads_into_items(isa, dtype):
    """300 heads of one token (an item takes at most 256: their lane groups live on its stack) over 300 positions:
    each head's attention as one head's alone."""
    g = torch.Generator().manual_seed(3)
    heads, latent, dim, length = 300, 32, 48, 300
    q = torch.randn(1, heads, dim, generator=g).to(dtype)
    cache = torch.randn(-(-length // 16), 16, dim, generator=g).to(dtype)
    table = torch.arange(cache.shape[0], dtype=torch.int32)[None]
    got = native.mla_decode(kernels(isa), q, cache, table, torch.tensor([0, 1], dtype=torch.int32),
                            torch.tensor([length], dtype=torch.int32), 0.1, latent)
    rows = cache.reshape(-1, dim)[:length].float()
    expected = torch.softmax(0.1 * q[0].float() @ rows.t(), dim=-1) @ rows[:, :latent]
    torch.testing.assert_close(got[0].float(), expected, rtol=2e-2, atol=2e-2)


@SETTINGS
@given(st.data())
def test_experts_are_an_error_or_the_weighted_mlps(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tokens, k, inter, experts = (data.draw(st.integers(1, 4)), data.draw(st.integers(1, 48)),
                                 data.draw(st.integers(1, 24)), 4)
    fault = data.draw(st.sampled_from([None, "ids tokens", "ids range", "down dtype", "gate_up rows", "weights dtype"]))
    dtype = data.draw(st.sampled_from(FLOATS))
    x = torch.randn(tokens, k, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, k, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(experts, k, inter, generator=g) * 0.3).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    ids = ids[:-1] if fault == "ids tokens" and tokens > 1 else ids[:, :0] if fault == "ids tokens" else ids
    if fault == "ids range":
        ids[0, 0] = experts
    weights = torch.rand(ids.shape, generator=g, dtype=torch.float64 if fault == "weights dtype" else None)
    wrong = {None: None, "ids tokens": "ids must|weights must", "ids range": "holds experts 0..3",
             "down dtype": r"experts\[0\].down must", "gate_up rows": r"experts\[0\].gate_up must",
             "weights dtype": "weights must"}[fault]
    if fault == "ids tokens" and tokens == 1:
        wrong = None  # no experts for the one token: zeros, as the reference gives
    fmt = native.DENSE_FORMATS[dtype]

    def call():
        gate_up = w13[:, : 2 * inter - 1] if fault == "gate_up rows" else w13
        down = w2.double() if fault == "down dtype" else w2
        table = native.expert_table(list(zip(gate_up, down)), k, inter, (fmt, fmt))
        return native.experts(kernels(isa), x, table, ids, weights)

    def reference():
        y = torch.zeros(tokens, k, dtype=torch.float64)
        for t in range(tokens):
            for e, w in sorted(zip(ids[t].tolist(), weights[t].tolist())):
                h = F.silu(w13[e, :inter].double() @ x[t].double()) * (w13[e, inter:].double() @ x[t].double())
                y[t] += w * (w2[e].double() @ h)
        return y

    isa = data.draw(st.sampled_from(ISAS))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    _outcome(call, reference, wrong, tol, tol)


def _int4_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """int4.c's formula in float64: activations quantized per 64 columns (nearest, scale max|x| / 127) times the
    centred weight (q - 8) * scale, plus the raw activations' group sums times minimum + 8 * scale (bf16 as stored)."""
    (n, k), rows = q.shape, x.shape[0]
    blocks = x.float().reshape(-1, 64)
    s = blocks.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    xq = (torch.div(blocks, s).round() * s).double().view(rows, k)
    per_group = k // scale.shape[1]
    scale, minimum = scale.bfloat16().double(), minimum.bfloat16().double()
    dots = torch.einsum("mgk,ngk->mng", xq.view(rows, -1, per_group), q.double().view(n, -1, per_group) - 8)
    sums = x.double().view(rows, -1, per_group).sum(-1)
    return (dots * scale).sum(-1) + sums @ (minimum + 8 * scale).t()


@SETTINGS
@given(st.data())
def test_int4_linear_is_an_error_or_its_formula(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    m, k, n = data.draw(st.integers(1, 5)), 64 * data.draw(st.integers(1, 4)), data.draw(st.integers(1, 40))
    group = data.draw(st.sampled_from([g_ for g_ in (32, 64, 128) if k % g_ == 0]))
    fault = data.draw(st.sampled_from([None, "x dtype", "x strided", "group", "out_features", "packed dtype"]))
    x = _tensor(g, (m, k), torch.float16 if fault == "x dtype" else data.draw(st.sampled_from(FLOATS)),
                fault == "x strided")
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=g) * 0.1 + 0.01
    minimum = -8 * scale + torch.randn(n, k // group, generator=g) * 0.01
    packed = native.pack_int4(q, scale, minimum)
    packed = packed.to(torch.int8) if fault == "packed dtype" else packed
    use_group = 48 if fault == "group" else group
    out_features = n + 16 if fault == "out_features" else n
    wrong = {None: None, "x dtype": "x must", "x strided": "x must", "group": "group size", "out_features": "packed",
             "packed dtype": "packed"}[fault]
    wrong = None if fault == "x strided" and x.is_contiguous() else wrong
    isa = data.draw(st.sampled_from(ISAS))
    _outcome(lambda: native.int4_linear(kernels(isa), x, packed, use_group, out_features),
             lambda: _int4_reference(x, q, scale, minimum), wrong, 1e-4, 1e-4)


def _route_reference(logits, k, sigmoid, groups, topk_groups, bias, norm, scaling):
    """DeepSeek's routing in torch ops: scores (+ bias to choose), the best groups (softmax: a group's best score,
    sigmoid: its best two) kept, the top k, their scores normalized and scaled."""
    tokens, experts = logits.shape
    scores = logits.sigmoid() if sigmoid else logits.softmax(-1)
    choice = scores if bias is None else scores + bias
    if topk_groups < groups:
        grouped = choice.view(tokens, groups, experts // groups)
        best = grouped.topk(2, dim=-1).values.sum(-1) if sigmoid else grouped.amax(-1)
        keep = torch.zeros(tokens, groups, dtype=torch.bool).scatter_(1, best.topk(topk_groups, -1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(experts // groups, 1), float("-inf"))
    ids = choice.topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@SETTINGS
@given(st.data())
def test_route_is_an_error_or_the_routing(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tokens, groups, size = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([1, 2, 4])), data.draw(
        st.integers(2, 8))
    experts, topk_groups = groups * size, data.draw(st.integers(1, groups))
    k = data.draw(st.integers(1, topk_groups * size))
    sigmoid, norm, scaling = data.draw(st.booleans()), data.draw(st.booleans()), data.draw(st.sampled_from([1., 2.5]))
    fault = data.draw(st.sampled_from([None, "logits dtype", "k", "groups", "bias shape", "bias dtype"]))
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64 if fault == "logits dtype" else None)
    bias = torch.randn(experts + (1 if fault == "bias shape" else 0), generator=g) if data.draw(
        st.booleans()) or fault in ("bias shape", "bias dtype") else None
    bias = bias.double() if fault == "bias dtype" else bias
    use_k = topk_groups * size + 1 if fault == "k" else k
    use_groups = experts + 1 if fault == "groups" else groups
    wrong = {None: None, "logits dtype": "logits must", "k": "cannot be chosen", "groups": "cannot be chosen",
             "bias shape": "cannot be chosen", "bias dtype": "bias must"}[fault]
    isa = data.draw(st.sampled_from(ISAS))
    call = lambda: native.route(kernels(isa), logits, use_k, sigmoid, use_groups, topk_groups, bias, norm,  # noqa
                                scaling)
    if wrong is not None:
        with pytest.raises(ValueError, match=wrong):
            call()
        return
    weights, ids = call()
    expected_weights, expected_ids = _route_reference(logits, k, sigmoid, groups, topk_groups, bias, norm, scaling)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)


def test_route_refuses_sigmoid_groups_of_one_expert():
    """Sigmoid scores a group by its best two experts: a limit on groups of one expert would score every group -inf
    and keep the first ones whatever the logits (route.c did). Refused by the wrapper and, past it, by the C side;
    softmax's groups of one, or no limit, still route."""
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="at least 2 experts a group"):
        native.route(kernels(ISAS[0]), logits, 2, True, 8, 4, None, True, 1.0)
    lib = kernels(ISAS[0]).lib
    weights, ids = torch.empty(2, 2), torch.empty(2, 2, dtype=torch.int64)
    code = lib.ls_route(native.desc(logits), 1, 8, 4, None, 1, 1.0, native.desc(weights), native.desc(ids))
    assert code == native.abi.BAD_TENSOR and "at least 2 experts a group" in lib.ls_last_error().decode()
    for sigmoid, topk_groups in ((False, 4), (True, 8)):
        got = native.route(kernels(ISAS[0]), logits, 2, sigmoid, 8, topk_groups, None, True, 1.0)
        assert torch.equal(got[1], _route_reference(logits, 2, sigmoid, 8, topk_groups, None, True, 1.0)[1])


@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("groups", [1, 4])
def test_route_chooses_with_the_bias_and_weighs_without_it(sigmoid, groups):
    """Softmax scoring with a correction bias too (route.c once ignored it there)."""
    g = torch.Generator().manual_seed(groups)
    logits, bias = torch.randn(3, 16, generator=g), torch.randn(16, generator=g) * 3
    got = native.route(kernels(ISAS[0]), logits, 4, sigmoid, groups, 2 if groups > 1 else 1, bias, True, 1.0)
    expected = _route_reference(logits, 4, sigmoid, groups, 2 if groups > 1 else 1, bias, True, 1.0)
    assert torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)


@SETTINGS
@given(st.data())
def test_mla_prologue_is_an_error_or_norm_rope_and_cache_write(data):
    from latentserve.layers.rotary import ROPE_STYLES, RopeConfig, RotaryEmbedding

    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tokens, heads, nope = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 3)), data.draw(st.integers(0, 8))
    rope, latent, style = 2 * data.draw(st.integers(1, 8)), data.draw(st.integers(1, 40)), data.draw(
        st.sampled_from(ROPE_STYLES))
    dtype, cache_dtype = data.draw(st.sampled_from(FLOATS)), data.draw(st.sampled_from(FLOATS))
    fault = data.draw(st.sampled_from([None, "cos tokens", "slot past cache", "slots", "kv dtype", "q dtype",
                                       "weight", "cache rows"]))
    rotary = RotaryEmbedding(rope, RopeConfig(), style)
    cos, sin = rotary.cos_sin(torch.randint(0, 500, (tokens,), generator=g))
    cos, sin = (cos[:1], sin[:1]) if fault == "cos tokens" and tokens > 1 else (cos, sin)
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(torch.float16 if fault == "q dtype" else dtype)
    kv = torch.randn(tokens, latent + rope, generator=g).to(torch.float16 if fault == "kv dtype" else dtype)
    weight = torch.randn(latent + (1 if fault == "weight" else 0), generator=g).to(dtype)
    cache = torch.zeros(3, 4, latent + rope + (2 if fault == "cache rows" else 0), dtype=cache_dtype)
    slots = torch.randperm(12, generator=g)[:tokens]
    slots = slots[:-1] if fault == "slots" else slots
    if fault == "slot past cache":
        slots[-1] = 12
    wrong = {None: None, "cos tokens": "cos must", "slot past cache": "lies past the cache",
             "slots": "slot_mapping must", "kv dtype": "kv must", "q dtype": "q must", "weight": "weight must",
             "cache rows": "kv_cache must"}[fault]
    wrong = None if fault == "cos tokens" and tokens == 1 else wrong
    isa = data.draw(st.sampled_from(ISAS))
    call = lambda: native.mla_prologue(kernels(isa), q, kv, weight, 1e-6, cos, sin, style, cache, slots)  # noqa
    if wrong is not None:
        with pytest.raises(ValueError, match=wrong):
            call()
        return
    expected_q = q.float().clone()
    expected_q[..., nope:] = rotary.rotate(expected_q[..., nope:], cos[:, None], sin[:, None])
    normed = kv[:, :latent].float() * torch.rsqrt(kv[:, :latent].float().pow(2).mean(-1, keepdim=True) + 1e-6)
    expected_c = normed.to(dtype).float() * weight.float()
    expected_pe = rotary.rotate(kv[:, latent:].float(), cos, sin)
    kv_c, k_pe = call()
    close = dict(rtol=1e-2, atol=1e-2) if torch.bfloat16 in (dtype, cache_dtype) else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_c.float(), expected_c, **close)
    torch.testing.assert_close(k_pe.float(), expected_pe, **close)
    torch.testing.assert_close(q.float(), expected_q, **close)
    rows = cache.view(-1, latent + rope).float()
    torch.testing.assert_close(rows[slots], torch.cat([expected_c, expected_pe], -1), **close)
    untouched = torch.ones(12, dtype=torch.bool).index_fill_(0, slots, False)
    assert not rows[untouched].any()
