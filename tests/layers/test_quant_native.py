"""latentserve's own int8/int4 CPU kernels (kernels/native/) against exact integer references, for each
instruction set this machine can run: the AVX2 build runs on any AVX-512 machine too."""
from __future__ import annotations


import pytest
import torch

from latentserve.kernels import native
from latentserve.kernels.cpu import cpu_features
from latentserve.layers.quant.heads import Int8HeadProducts
from latentserve.layers.quant.int4 import NativeInt4Linear, quantize_int4
from latentserve.layers.quant import int8 as int8_layers
from latentserve.layers.quant.int8 import IntMMInt8Linear, NativeInt8Linear, quantize_int8
from tests.kernels.builds import ISAS, kernels, needs_a_build, needs_the_engines_kernels


pytestmark = needs_a_build


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels do to the activations: per row, symmetric, round half to even."""
    s = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
    return torch.div(x, s).round(), s


def _data(rows: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(rows, k, generator=g)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows, n, k", [(1, 37, 200), (2, 64, 2048), (5, 9, 64), (8, 130, 1408), (33, 12, 96),
                                     (300, 20, 36)])
def test_int8_kernel_is_the_exact_integer_product(isa, rows, n, k):
    """Tails of every kind: outputs past the last block of 16, columns past the last chains of 4 units, activation
    rows past the last pass and past a chunk of 256."""
    w, x = _data(rows, n, k)
    q, scale = quantize_int8(w)
    xq, s = _quantized_rows(x)
    expected = (xq.double() @ q.double().t()) * s.double() * scale.double()
    got = native.int8_linear(kernels(isa), x, native.pack_int8(q, scale), n)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_int8_builds_and_the_rows_kernel_agree_bitwise():
    """Integer sums are exact, and the blocks' and the rows' kernels compute the same float products after them."""
    w, x = _data(11, 70, 320, seed=1)
    q, scale = quantize_int8(w)
    qsum = q.sum(dim=1, dtype=torch.int32)
    results = [native.int8_linear(kernels(isa), x, native.pack_int8(q, scale), 70) for isa in ISAS]
    results += [native.int8_heads(kernels(isa), x[:, None], q[None], scale, qsum)[:, 0] for isa in ISAS]
    for other in results[1:]:
        assert torch.equal(results[0], other)


def _assert_rows_are_the_row_kernels(isa: str, most: int, seed: int) -> None:
    """int8_linear of the first 1..`most` rows at 1-3 threads equals the row kernel's (`int8_heads`) bit for bit, on
    117 outputs (8 blocks, the last partial) of 204 columns (51 units of 4: a tail after the chunks and chains)."""
    w, x = _data(most, 117, 204, seed=seed)
    q, scale = quantize_int8(w)
    packed = native.pack_int8(q, scale)
    expected = native.int8_heads(kernels(isa), x[:, None], q[None], scale, q.sum(dim=1, dtype=torch.int32))[:, 0]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in range(1, most + 1):
                assert torch.equal(native.int8_linear(kernels(isa), x[:rows], packed, 117), expected[:rows])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ISAS)
def test_int8_few_rows_read_two_blocks_at_once_and_keep_the_row_kernels_results(isa):
    """Up to 8 rows a thread reads two blocks side by side (the i-th of each half of its share): at every row count
    and thread count (shares of odd length leave a block without a partner) each row's result is the row kernel's,
    bit for bit. 117 outputs: 8 blocks, the last partial; 51 units of 4 columns: a tail after the 2-KB turns and
    after the chains."""
    _assert_rows_are_the_row_kernels(isa, 9, seed=6)


@pytest.mark.parametrize("isa", ISAS)
def test_int8_rows_that_fetch_the_next_block_keep_the_row_kernels_results(isa):
    """From 5 rows of a pass (AVX2: 3) each block's loop also fetches the next block into L2 (the blocks in order
    above 8 rows, the pairs at 5-8; the last block's fetch points past the weight): each row's result stays the row
    kernel's, bit for bit, at 1-20 rows (passes of 8, then 1-4 rows that do not fetch) and 1-3 threads."""
    _assert_rows_are_the_row_kernels(isa, 20, seed=7)


def test_pack_int8_layout():
    """Blocks of 16 outputs (the last padded with zeros): the 16 fp32 scales, the 16 int32 sums of q, then per 4
    columns 64 bytes, byte 4j + i output j's column 4c + i; `unpack_int8` gives q and scale back."""
    n, k = 20, 36
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    scale = torch.rand(n) + 0.5
    packed = native.pack_int8(q, scale)
    assert packed.shape == (2, 128 + 16 * k) and packed.dtype == torch.int8
    block1 = packed[1]  # outputs 16-19, then padding
    assert block1[:64].view(torch.float32)[3].item() == scale[19].item()
    assert block1[64:128].view(torch.int32)[3].item() == q[19].sum().item()
    assert block1[:128].view(torch.int32)[4:16].eq(0).all()
    unit5 = block1[128 + 5 * 64: 128 + 6 * 64]  # columns 20-23
    assert unit5[4 * 3 + 1].item() == q[19, 21].item()
    assert unit5[4 * 4:].eq(0).all()
    back_q, back_scale = native.unpack_int8(packed, n, k)
    assert torch.equal(back_q, q) and torch.equal(back_scale, scale)
    with pytest.raises(ValueError, match=r"pack_int8 takes int8 q \[N, K\] with K % 4 == 0"):
        native.pack_int8(q[:, :30].contiguous(), scale)


def _int4_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The kernel's formula in float64, the weight as (q - 8) * scale + (minimum + 8 * scale): activations quantized
    per 64 columns times the centred part, the (unquantized) activations' group sums times the rest; scale and
    minimum as stored (bf16)."""
    (n, k), rows = q.shape, x.shape[0]
    xq, s = _quantized_rows(x.reshape(-1, 64))
    xq = (xq * s).double().view(rows, k)  # each block's integers times its scale
    per_group = k // scale.shape[1]
    scale, minimum = scale.bfloat16().double(), minimum.bfloat16().double()
    dots = torch.einsum("mgk,ngk->mng", xq.view(rows, -1, per_group), q.double().view(n, -1, per_group) - 8)
    sums = x.double().view(rows, -1, per_group).sum(-1)
    return (dots * scale).sum(-1) + sums @ (minimum + 8 * scale).t()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows, n, k, group", [(1, 37, 256, 32), (3, 64, 2048, 64), (8, 130, 1408, 64),
                                               (5, 9, 384, 128), (2, 20, 320, 32), (1, 11, 192, 64),
                                               (4, 7, 640, 128)])
def test_int4_kernel_matches_its_formula(isa, rows, n, k, group):
    w, x = _data(rows, n, k, seed=2)
    q, scale, minimum = quantize_int4(w, group)
    expected = _int4_reference(x, q, scale, minimum)
    got = native.int4_linear(kernels(isa), x, native.pack_int4(q, scale, minimum), group, n)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_few_rows_read_two_blocks_at_once_and_keep_each_rows_result(isa, group):
    """Up to 8 rows a thread reads two blocks side by side, group by group (int4_block_pair_dots): at every row count
    and thread count (shares of odd length leave a block without a partner) each row's result is the one it gets
    among 20 rows (one block at a time), bit for bit. 117 outputs: 8 blocks, the last partial."""
    w, x = _data(20, 117, 256, seed=7)
    packed = native.pack_int4(*quantize_int4(w, group))
    expected = native.int4_linear(kernels(isa), x, packed, group, 117)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in range(1, 10):
                assert torch.equal(native.int4_linear(kernels(isa), x[:rows], packed, group, 117), expected[:rows])
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(len(ISAS) < 2, reason="needs two builds")
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_build_gives_int8_and_int4_the_same_bits(group, dtype):
    """The builds' integer sums are equal (vpdpbusd, AVX2's vpmaddubsw on nibbles, AMX tiles), every float operation
    after them is the same on each output's lane in the same order, and the sums of x that int4's corrections take
    run on 8 lanes in every build (quant_acts.c): int8 and int4 products at any x equal the AVX2 build's bit for bit,
    at every row count (1-9, a pass's tails, past a chunk, AMX's rows) and thread count."""
    g = torch.Generator().manual_seed(9)
    w, x = torch.randn(117, 384, generator=g) * 0.05, torch.randn(301, 384, generator=g).to(dtype)
    int8, int4 = native.pack_int8(*quantize_int8(w)), native.pack_int4(*quantize_int4(w, group))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (*range(1, 10), 21, 47, 301):
                want = (native.int8_linear(kernels("avx2"), x[:rows], int8, 117),
                        native.int4_linear(kernels("avx2"), x[:rows], int4, group, 117))
                for isa in ISAS:
                    got = (native.int8_linear(kernels(isa), x[:rows], int8, 117),
                           native.int4_linear(kernels(isa), x[:rows], int4, group, 117))
                    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (isa, threads, rows)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_layer_runs_its_kernel_at_any_row_count(isa, group):
    """Prefill's many rows too (past the kernel's chunk of 256 rows a pass over the weight; on AVX2 the blocks' halves
    in turn): every row's result is the one it gets alone, bit for bit, and matches the formula."""
    w, x = _data(301, 40, 256, seed=3)
    q, scale, minimum = quantize_int4(w, group)
    bias = torch.randn(40)
    layer = NativeInt4Linear(q, scale, minimum, torch.nn.Parameter(bias), kernels(isa))
    many = layer(x)
    assert torch.equal(many, torch.cat([layer(x[i : i + 1]) for i in range(len(x))]))
    expected = _int4_reference(x, q, scale, minimum) + bias.double()
    torch.testing.assert_close(many.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    assert layer(x[:2].bfloat16()).dtype == torch.bfloat16


def test_int8_layer_gives_each_row_its_own_result():
    w, x = _data(29, 48, 128, seed=4)
    q, scale = quantize_int8(w)
    bias = torch.randn(48)
    layer = NativeInt8Linear(q, scale, torch.nn.Parameter(bias), kernels(ISAS[0]))
    few = torch.cat([layer(x[i : i + 3]) for i in range(0, len(x), 3)])
    assert torch.equal(layer(x), few)
    assert layer(x[:2].bfloat16()).dtype == torch.bfloat16
    assert NativeInt8Linear(q, scale, None, kernels(ISAS[0]), torch.float32)(x[:2].bfloat16()).dtype == torch.float32


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype, out_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("parts", [1, 2])
def test_the_torch_int8_layer_gives_the_kernels_bits(monkeypatch, isa, dtype, out_dtype, parts):
    """Where latentserve's kernels do not run, int8 layers run their arithmetic through torch._int_mm (the weight
    whole, or in two parts where _int_mm saturates): every output equal to the kernel's, at decode and prefill row
    counts, a row of zeros and rows holding an infinity or a NaN included (NaN out, as the kernel gives)."""
    if parts < int8_layers.int_mm_parts():
        pytest.skip("torch._int_mm saturates here: the weight goes in two parts")
    monkeypatch.setattr(int8_layers, "int_mm_parts", lambda: parts)
    w, x = _data(300, 70, 2048, seed=5)
    x[3] = 0.0
    x[4, 7], x[5, 9] = float("inf"), float("nan")
    x = (x * torch.logspace(-3, 3, len(x))[:, None]).to(dtype)
    q, scale = quantize_int8(w)
    bias = torch.nn.Parameter(torch.randn(70))
    native_layer = NativeInt8Linear(q, scale, bias, kernels(isa), out_dtype)
    torch_layer = IntMMInt8Linear(q, scale, bias, out_dtype)
    assert len(torch_layer.qweight) == parts
    for rows in (1, 2, 7, 16, 300):
        torch.testing.assert_close(torch_layer(x[:rows]), native_layer(x[:rows]), rtol=0, atol=0, equal_nan=True)
    assert torch_layer(x[:6])[4:].isnan().all()


def test_pack_int4_layout():
    """Blocks of 16 outputs (the last padded with zeros), per group the 16 (scale, minimum) pairs, then per 8 columns
    64 bytes: byte 4j + i is output j's column i (low nibble) and 4 + i (high)."""
    n, k, group = 20, 128, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    scale, minimum = torch.rand(n, 2) + 0.5, -torch.rand(n, 2)
    packed = native.pack_int4(q, scale, minimum)
    assert packed.shape == (2, 2 * (64 + 8 * 64))
    group1 = packed[1, 64 + 8 * 64:].view(-1)  # block 1 (outputs 16-19, then padding), group 1 (columns 64-127)
    pairs = group1[:64].view(torch.bfloat16).view(16, 2)
    assert pairs[3].tolist() == [scale[19, 1].bfloat16().item(), minimum[19, 1].bfloat16().item()]
    assert pairs[4:].eq(0).all()
    unit2 = group1[64 + 2 * 64: 64 + 3 * 64]  # columns 80-87
    assert unit2[4 * 3 + 1].item() == q[19, 81] | (q[19, 85] << 4)
    assert unit2[4 * 4:].eq(0).all()
    with pytest.raises(ValueError, match=r"20 outputs, 128 inputs, group size 32 in pack_int4's layout\) must be a CPU "
                                         r"tensor, contiguous uint8 \[2, 1280\]; got cpu uint8 \[2, 1152\]"):
        native.int4_linear(kernels(ISAS[0]), torch.randn(1, k), packed, 32, n)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads, n, k, lanes", [(4, 24, 40, False), (3, 32, 28, True), (2, 512, 128, True),
                                                 (2, 128, 512, True), (2, 16, 516, False)])
def test_int8_head_products_are_per_head_integer_products(isa, heads, n, k, lanes):
    """MLA's absorbed products: each (token, head) row quantized on its own, times that head's int8 weight; in the
    lanes layout where N % 16 == 0 and K % 4 == 0 (W_UK's shape last)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(heads, n, k, generator=g) * 0.1  # [heads, out, in]
    x = torch.randn(3, heads, k, generator=g)  # [tokens, heads, in]
    products = Int8HeadProducts(w, kernels(isa))
    assert products.lanes == lanes
    q, scale = quantize_int8(w.reshape(-1, k))
    xq, s = _quantized_rows(x.reshape(-1, k))
    per_head = torch.einsum("thk,hnk->thn", xq.double().view(3, heads, k), q.double().view(heads, n, k))
    expected = per_head * s.double().view(3, heads, 1) * scale.double().view(1, heads, n)
    got = products(x)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())
    assert products(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 2, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_lanes_layout_gives_the_rows_kernels_outputs(isa, tokens, dtype):
    """Same integer sums, same float epilogue: the two layouts' outputs are equal, bit for bit."""
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(3, 48, 36, generator=g), torch.randn(tokens, 3, 36, generator=g).to(dtype)
    q, scale = quantize_int8(w.reshape(-1, 36))
    qsum = q.sum(dim=1, dtype=torch.int32)
    rows = native.int8_heads(kernels(isa), x, q.view(3, 48, 36), scale, qsum, dtype)
    lanes = native.int8_heads_lanes(kernels(isa), x, native.int8_lanes(q.view(3, 48, 36)), scale, qsum, dtype)
    assert torch.equal(rows, lanes)


def test_int8_lanes_names_a_shape_it_cannot_lay_out():
    with pytest.raises(ValueError, match=r"N % 16 == 0 and K % 4 == 0.*\(2, 24, 8\)"):
        native.int8_lanes(torch.zeros(2, 24, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="torch.float32"):
        native.int8_lanes(torch.zeros(2, 32, 8))


@needs_the_engines_kernels
def test_int8_models_run_the_absorbed_decode_products_in_int8(tmp_path):
    from latentserve.models import load_model
    from latentserve.layers.quant.config import QuantConfig
    from tests.checkpoints import make_checkpoint

    src = make_checkpoint(tmp_path, "v3", q_lora_rank=32, moe_intermediate_size=32, intermediate_size=64)
    for method, group in (("int8", None), ("int4", 32)):
        attention = load_model(src, quantization=QuantConfig(method, group)).model.layers[0].self_attn.attn
        assert attention.int8_absorbed is not None
        to_latent, _ = attention.int8_absorbed
        w = attention.W_UK_T.transpose(1, 2)
        q = to_latent.q.transpose(2, 3).reshape(w.shape) if to_latent.lanes else to_latent.q  # lanes -> rows
        torch.testing.assert_close(q.float() * to_latent.scale.view(*w.shape[:2], 1), w.float(), rtol=0, atol=0.01)
    assert load_model(src).model.layers[0].self_attn.attn.int8_absorbed is None


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method, group, down_method", [("int8", None, "int8"), ("int4", 32, "int4"),
                                                        ("int4", 64, "int4"), ("int4", 128, "int4"),
                                                        ("int4", 32, "int8"), ("int8", None, "int4")])
def test_one_token_through_its_experts_in_one_call(monkeypatch, method, group, down_method, isa):
    """Batch-1 decode's routed experts in one native call: the same as running each expert's layers, summed with
    the routing weights in expert order; gate_up and down each in its own format."""
    from torch import nn

    from latentserve.layers.mlp import GatedMLP
    from latentserve.layers.quant.config import QuantConfig
    from latentserve.layers.quant.experts import run_expert_loop
    from latentserve.layers.quant.linear import quantize_linear

    g = torch.Generator().manual_seed(7)
    config = QuantConfig(method, group)
    experts = nn.ModuleList()
    inter = 384 if group == 128 else 192  # an odd number of 64-column chunks where the group allows
    for _ in range(8):
        mlp = GatedMLP(128, inter)
        mlp.fuse_gate_up(quantize_linear("gate_up", torch.randn(2 * inter, 128, generator=g) * 0.1, None, config, "cpu"))
        mlp.down_proj = quantize_linear("down", torch.randn(128, inter, generator=g) * 0.1, None,
                                        QuantConfig(down_method, group if down_method == method else None), "cpu")
        experts.append(mlp)
    if native.native_kernels(cpu_features())[0] is None:
        pytest.skip("no native kernels here")
    for layer in experts.modules():
        if hasattr(layer, "kernels"):
            layer.kernels = kernels(isa)  # each build's SiLU and kernels
    calls = []
    monkeypatch.setattr(native, "experts", lambda *a, _f=native.experts, **k: calls.append(1) or _f(*a, **k))
    x = torch.randn(1, 128, generator=g) * 3  # SiLU over a wide range
    ids, weights = torch.tensor([[5, 2, 7]]), torch.tensor([[0.5, 0.3, 0.2]])
    got = run_expert_loop(experts, x, weights, ids)
    assert calls == [1]

    def layer_by_layer(mlp: GatedMLP) -> torch.Tensor:
        gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
        return mlp.down_proj(torch.nn.functional.silu(gate) * up)

    expected = sum(w * layer_by_layer(experts[e]) for e, w in sorted(zip(ids[0].tolist(), weights[0].tolist())))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method, group", [("int8", None), ("int4", 64), ("int4", None)])
def test_one_token_gated_mlp_in_one_call(monkeypatch, method, group):
    """Dense and shared-expert MLPs at batch 1: one native call, the same result as the layer by layer path (int4
    by default: gate_up over 128 inputs in groups of 128, down over 64 in groups of 64)."""
    from latentserve.layers.mlp import GatedMLP
    from latentserve.layers.quant.config import QuantConfig
    from latentserve.layers.quant.linear import quantize_linear

    if native.native_kernels(cpu_features())[0] is None:
        pytest.skip("no native kernels here")
    g = torch.Generator().manual_seed(8)
    config = QuantConfig(method, group)
    mlp = GatedMLP(128, 64)
    mlp.fuse_gate_up(quantize_linear("gate_up", torch.randn(128, 128, generator=g) * 0.1, None, config, "cpu"))
    mlp.down_proj = quantize_linear("down", torch.randn(128, 64, generator=g) * 0.1, None, config, "cpu")
    x = torch.randn(2, 128, generator=g).bfloat16()
    calls = []
    monkeypatch.setattr(native, "experts", lambda *a, _f=native.experts, **k: calls.append(1) or _f(*a, **k))
    one = mlp(x[:1])
    assert calls == [1] and one.dtype == torch.bfloat16
    # Layer by layer in fp32 (two rows), as the one call computes inside: the same up to the output's bf16 rounding.
    torch.testing.assert_close(one.float(), mlp(x.float())[:1], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_activations_and_outputs_go_in_and_out_as_they_are(isa):
    """bf16 x is read as the fp32 of the same values, a bf16 y is the fp32 result rounded to nearest even."""
    w, x = _data(3, 40, 128, seed=9)
    xb = x.bfloat16()
    q, scale = quantize_int8(w)
    packed = native.pack_int8(q, scale)
    fp32 = native.int8_linear(kernels(isa), xb.float(), packed, 40)
    assert torch.equal(native.int8_linear(kernels(isa), xb, packed, 40), fp32)
    assert torch.equal(native.int8_linear(kernels(isa), xb, packed, 40, torch.bfloat16), fp32.bfloat16())
    q4, s4, m4 = quantize_int4(w, 64)
    packed = native.pack_int4(q4, s4, m4)
    fp32 = native.int4_linear(kernels(isa), xb.float(), packed, 64, q4.shape[0])
    assert torch.equal(native.int4_linear(kernels(isa), xb, packed, 64, q4.shape[0], torch.bfloat16), fp32.bfloat16())


def test_the_one_token_mlp_keeps_its_table_until_a_weight_is_replaced(monkeypatch):
    """The table `tokens_mlp` hands the experts kernel is built once per weight (not per call), and rebuilt when a
    layer is replaced: the new weight's result, not the kept table's."""
    from latentserve.layers.mlp import GatedMLP
    from latentserve.layers.quant import experts
    from latentserve.layers.quant.config import QuantConfig
    from latentserve.layers.quant.linear import quantize_linear

    if native.native_kernels(cpu_features())[0] is None:
        pytest.skip("no native kernels here")
    g = torch.Generator().manual_seed(9)
    config = QuantConfig("int8")
    mlp = GatedMLP(128, 64)
    mlp.fuse_gate_up(quantize_linear("gate_up", torch.randn(128, 128, generator=g) * 0.1, None, config, "cpu"))
    mlp.down_proj = quantize_linear("down", torch.randn(128, 64, generator=g) * 0.1, None, config, "cpu")
    x = torch.randn(1, 128, generator=g)
    builds = []
    monkeypatch.setattr(experts, "quantized_table", lambda *a, _f=experts.quantized_table: builds.append(1) or _f(*a))
    first = [mlp(x) for _ in range(3)]
    assert len(builds) == 1 and all(torch.equal(first[0], y) for y in first)
    down = torch.randn(128, 64, generator=g) * 0.1
    mlp.down_proj = quantize_linear("down", down, None, config, "cpu")
    again = mlp(x)
    assert len(builds) == 2 and not torch.equal(again, first[0])
    # the replaced weight's result: layer by layer over the new down projection, up to the output's rounding
    torch.testing.assert_close(again, mlp.down_proj(mlp._act(*mlp.gate_up_proj(x).chunk(2, dim=-1))), rtol=1e-4,
                               atol=1e-5)
