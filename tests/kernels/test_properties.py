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


@SETTINGS
@given(st.data())
def test_stacked_experts_are_an_error_or_the_weighted_mlps(data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    tokens, k, inter, experts = (data.draw(st.integers(1, 4)), 8 * data.draw(st.integers(1, 6)),
                                 data.draw(st.integers(1, 24)), 4)
    fault = data.draw(st.sampled_from([None, "ids tokens", "ids range", "w2t dtype", "w13 rows", "weights dtype"]))
    x = torch.randn(tokens, k, generator=g)
    w13 = torch.randn(experts, 2 * inter + (1 if fault == "w13 rows" else 0), k, generator=g) * 0.3
    w2t = torch.randn(experts, inter, k, generator=g, dtype=torch.float64 if fault == "w2t dtype" else None) * 0.3
    ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    ids = ids[:-1] if fault == "ids tokens" and tokens > 1 else ids[:, :0] if fault == "ids tokens" else ids
    if fault == "ids range":
        ids[0, 0] = experts
    weights = torch.rand(ids.shape, generator=g, dtype=torch.float64 if fault == "weights dtype" else None)
    wrong = {None: None, "ids tokens": "ids must|weights must", "ids range": "holds experts 0..3",
             "w2t dtype": "w2t must", "w13 rows": "w13 must", "weights dtype": "weights must"}[fault]
    if fault == "ids tokens" and tokens == 1:
        wrong = None  # no experts for the one token: zeros, as the reference gives

    def reference():
        y = torch.zeros(tokens, k)
        for t in range(tokens):
            for e, w in zip(ids[t].tolist(), weights[t].tolist()):
                h = F.silu(w13[e, :inter] @ x[t]) * (w13[e, inter:] @ x[t])
                y[t] += w * (h @ w2t[e])
        return y

    isa = data.draw(st.sampled_from(ISAS))
    _outcome(lambda: native.stacked_experts(kernels(isa), x, w13, w2t, 0, ids, weights), reference, wrong, 1e-4, 1e-4)
