"""The C interface (latentserve.h) and its ctypes mirror (abi.py): the exported symbols are exactly the declared
ones, descriptors pack as the C struct lays them out, a mirror that disagrees with the library refuses it, the entry
points refuse descriptors and block structs they cannot read, and the scratch arena's exhaustion is a MemoryError."""
from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess

import pytest
import torch

from latentserve.kernels import abi, build, native
from latentserve.layers.quant.int4 import quantize_int4
from latentserve.layers.quant.int8 import quantize_int8
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build
ISA = ISAS[0] if ISAS else "avx2"


def test_the_library_exports_exactly_the_declared_functions():
    if shutil.which("nm") is None:
        pytest.skip("no nm")
    listed = subprocess.run(["nm", "-D", "--defined-only", kernels(ISA).lib._name], capture_output=True, text=True,
                            check=True).stdout
    exported = {line.split()[-1] for line in listed.splitlines() if line.split()[1:2] == ["T"]}
    assert exported == set(abi.SIGNATURES)


@pytest.mark.parametrize("t", [torch.tensor(3.0), torch.randn(7), torch.randn(2, 3).t(), torch.zeros(2, 3, 4,
                                                                                                      dtype=torch.int8),
                               torch.zeros(1, 2, 3, 4, 5, dtype=torch.bfloat16)], ids=lambda t: f"{t.dim()}d")
def test_a_descriptor_packs_as_the_ctypes_struct_lays_it_out(t):
    pad = (0,) * (abi.MAX_DIMS - t.dim())
    mirror = abi.Tensor(t.data_ptr(), abi.DTYPES[t.dtype], t.dim(), (*t.shape, *pad), (*t.stride(), *pad))
    assert abi.desc(t) == bytes(mirror)


def test_the_mirror_matches_the_library_layout():
    assert abi.layout_mismatch(kernels(ISA).lib) is None


@pytest.mark.parametrize("corrupt", ["a field's type", "a missing field", "an extra field"])
def test_a_mirror_that_disagrees_is_named_and_the_library_refused(monkeypatch, caplog, corrupt):
    fields = list(abi.MLABlock._fields_)
    if corrupt == "a field's type":
        fields[fields.index(("style", ctypes.c_int32))] = ("style", ctypes.c_int64)
    elif corrupt == "a missing field":
        fields.remove(("bf", ctypes.c_int32))
    else:
        fields.append(("spare", ctypes.c_int32))
    corrupted = type("MLABlock", (ctypes.Structure,), {"_fields_": fields})
    why = abi.layout_mismatch(kernels(ISA).lib, {**abi.STRUCTS, "MLABlock": corrupted})
    assert why is not None and why.startswith("struct MLABlock:")

    monkeypatch.setitem(abi.STRUCTS, "MLABlock", corrupted)
    build.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=build.__name__):
            refused = build.load(ISA)
        assert isinstance(refused, str) and "struct MLABlock" in refused
        assert any("refusing" in r.message and "MLABlock" in r.message for r in caplog.records)
    finally:
        build.load.cache_clear()  # the next load builds nothing: the library is cached on disk


def _bad(lib, code: int, wrong: str) -> None:
    assert code == abi.BAD_TENSOR and wrong in lib.ls_last_error().decode()


@pytest.mark.parametrize("fault", ["dtype", "strided", "rank", "columns", "null", "output rows"])
def test_entry_points_refuse_descriptors_they_cannot_read(fault):
    """Past the wrappers (a C caller, a future wrapper that forgets a check): the kernel reads no byte it was not
    given a size for."""
    lib = kernels(ISA).lib
    x, w, y = torch.randn(2, 8), torch.randn(4, 8), torch.empty(2, 4)
    args = {"dtype": (x.double(), w, y), "strided": (torch.randn(8, 2).t(), w, y), "rank": (x.view(2, 2, 4), w, y),
            "columns": (x, torch.randn(4, 6), y), "output rows": (x, w, torch.empty(3, 4))}
    if fault == "null":
        code = lib.ls_dense_linear(abi.desc(x), None, abi.desc(y), 1)
    else:
        code = lib.ls_dense_linear(*(abi._PACKERS[t.dim()].pack(t.data_ptr(), abi.DTYPES.get(t.dtype, 99), t.dim(),
                                                                  *t.shape, *t.stride()) for t in args[fault]), 1)
    _bad(lib, code, {"dtype": "x: dtype 99", "strided": "x: stride", "rank": "x: rank 3", "columns": "w: dim 1",
                     "null": "w: no descriptor", "output rows": "y: dim 0"}[fault])


def _mla_block(g: torch.Generator) -> tuple[native.MLABlock, list[torch.Tensor]]:
    """A one-head fp32 attention block with dense weights: hidden 32, nope = rope = latent = v_dim = 16."""
    w = {"q_b": (32, 32), "kv_a": (32, 32), "o_proj": (32, 16), "uk": (1, 16, 16), "uv": (1, 16, 16),
         "input_norm": (32,), "kv_a_norm": (16,), "post_norm": (32,)}
    held = {name: torch.randn(*shape, generator=g) * 0.1 for name, shape in w.items()}
    block = native.MLABlock(hidden=32, heads=1, nope=16, rope=16, latent=16, v_dim=16, q_lora=0,
                            **{name: native.Weight(kind=native.DENSE, w=held[name].data_ptr())
                               for name in ("q_b", "kv_a", "o_proj", "uk", "uv")},
                            **{name: held[name].data_ptr() for name in ("input_norm", "kv_a_norm", "post_norm")},
                            eps=1e-6, kv_a_eps=1e-6, post_eps=1e-6, scale=0.25, style=2, bf=0)
    return block, list(held.values())


def _attend(block: native.MLABlock, x: torch.Tensor):
    tokens = x.shape[0]
    cache = torch.zeros(2, 4, 32)
    return native.mla_attention_block(
        kernels(ISA), block, x, torch.ones(tokens, 16), torch.zeros(tokens, 16), cache,
        torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, tokens], dtype=torch.int32),
        torch.tensor([tokens], dtype=torch.int32), torch.arange(tokens))


@pytest.mark.parametrize("fault", [None, "post_norm", "kv_a_norm", "uk.w", "o_proj.scale", "q_lora", "style",
                                   "x columns", "q_b inputs", "kv_a group", "kind"])
def test_the_attention_block_refuses_a_struct_that_lacks_what_it_reads(fault):
    block, held = _mla_block(torch.Generator().manual_seed(0))
    x = torch.randn(2, 33 if fault == "x columns" else 32)
    if fault in ("post_norm", "kv_a_norm"):
        setattr(block, fault, None)
    elif fault == "uk.w":
        block.uk.w = None
    elif fault == "o_proj.scale":
        block.o_proj.kind = native.INT8  # an int8 weight with no scale or qsum
    elif fault == "q_lora":
        block.q_lora = 16  # a q_a projection and norm it does not have
    elif fault == "style":
        block.style = 3
    elif fault == "q_b inputs":
        block.q_b.kind, block.q_b.group = native.Q4K, 256  # Q4_K over the block's 32 inputs: not a multiple of 256
    elif fault == "kv_a group":
        block.kv_a.kind, block.kv_a.group = native.Q3K, 32  # Q3_K's groups are 16 columns
    elif fault == "kind":
        block.o_proj.kind = native.Q3K + 1  # past the last kind
    if fault is None:
        y, normed = _attend(block, x)
        assert torch.isfinite(y).all() and torch.isfinite(normed).all()
        return
    wrong = {"post_norm": "norm weight", "kv_a_norm": "norm weight", "uk.w": "uk.w is NULL", "o_proj.scale":
             "o_proj: an int8 weight", "q_lora": "q_a.w is NULL|norm weight", "style": "style is 3",
             "x columns": "x must", "q_b inputs": "q_b: bits 4, group 256, mins 0 over 32 inputs",
             "kv_a group": "kv_a.group is 32, not the 16 of Q6_K, Q3_K and Q2_K",
             "kind": f"o_proj.kind is {native.Q3K + 1}"}[fault]
    with pytest.raises(ValueError, match=wrong):
        _attend(block, x)


def _moe_block(g: torch.Generator) -> tuple[native.MoEBlock, list]:
    """Four fp32 experts, top 2, hidden 32, intermediate 16."""
    held = [torch.randn(4, 32, generator=g), torch.randn(4, 32, 32, generator=g) * 0.1,
            torch.randn(4, 32, 16, generator=g) * 0.1]
    table = native.expert_table(list(zip(held[1], held[2])), 32, 16, ((32, 0), (32, 0)))
    block = native.MoEBlock(hidden=32, experts=4, topk=2, groups=1, topk_groups=1, sigmoid=0, norm=1, scaling=1.0,
                            router=held[0].data_ptr(), bias=None, bf=0, routed=table.table)
    return block, held + [table]


@pytest.mark.parametrize("fault", [None, "router", "weights", "one weight", "shared", "down bits 3", "int4 group",
                                   "topk", "x columns"])
def test_the_moe_block_refuses_a_struct_that_lacks_what_it_reads(fault):
    block, (router, w13, w2, table) = _moe_block(torch.Generator().manual_seed(1))
    x, residual = torch.randn(3, 33 if fault == "x columns" else 32), torch.randn(3, 32)
    pointers = (ctypes.c_void_p * 8)(*table.held[0])
    if fault == "router":
        block.router = None
    elif fault == "weights":
        block.routed.weights = None
    elif fault == "one weight":
        pointers[5] = None
        block.routed.weights = ctypes.addressof(pointers)
    elif fault == "shared":
        block.shared = native.ExpertTable(experts=1, inter=16, bits=(32, 32))  # a shared expert with no weights
    elif fault == "down bits 3":  # each projection its own format: one the kernels do not read
        block.routed.bits[:] = [4, 3]
    elif fault == "int4 group":  # int4 over 32 inputs: not a multiple of 64
        block.routed.bits[:], block.routed.group[:] = [32, 4], [0, 32]
    elif fault == "topk":
        block.topk = 5
    if fault is None:
        y = native.moe_block(kernels(ISA), block, x, residual)
        weights, ids = native.route(kernels(ISA), x @ router.t(), 2, False, 1, 1, None, True, 1.0)
        expected = residual.clone()
        for t in range(3):
            for weight, e in zip(weights[t], ids[t]):
                h = w13[e] @ x[t]
                expected[t] += weight * w2[e] @ (torch.nn.functional.silu(h[:16]) * h[16:])
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
        return
    wrong = {"router": "router is NULL", "weights": "routed: weights is NULL",
             "one weight": r"routed: weights\[5\] is NULL", "shared": "shared: weights is NULL",
             "down bits 3": "routed gate_up: bits 4",
             "int4 group": "routed down: bits 4, group 32, mins 0 over 16 inputs",
             "topk": "5 of 4 experts", "x columns": "x must"}[fault]
    with pytest.raises(ValueError, match=wrong):
        native.moe_block(kernels(ISA), block, x, residual)


@pytest.fixture
def scratch_limit():
    lib = kernels(ISA).lib
    yield lib.ls_set_scratch_limit
    lib.ls_set_scratch_limit(0)


def test_an_exhausted_scratch_arena_is_a_memory_error_and_nothing_is_lost(scratch_limit):
    logits = torch.randn(3, 64)
    expected = native.route(kernels(ISA), logits, 6, False, 1, 1, None, True, 1.0)
    scratch_limit(64)  # less than the 64 scores route.c needs
    with pytest.raises(MemoryError, match="route"):
        native.route(kernels(ISA), logits, 6, False, 1, 1, None, True, 1.0)
    block, held = _mla_block(torch.Generator().manual_seed(0))
    with pytest.raises(MemoryError, match="mla_attention_block"):
        _attend(block, torch.randn(2, 32))
    scratch_limit(0)
    for got, want in zip(native.route(kernels(ISA), logits, 6, False, 1, 1, None, True, 1.0), expected):
        assert torch.equal(got, want)


def _quantized_calls():
    """The kernels whose temporaries (quantized activations, per-thread dot buffers, the experts' tables and
    intermediates) come from the scratch arena, each as a call returning its result."""
    g = torch.Generator().manual_seed(1)
    x, k = torch.randn(3, 64, generator=g), kernels(ISA)
    int8 = native.pack_int8(*quantize_int8(torch.randn(40, 64, generator=g)))
    int4 = native.pack_int4(*quantize_int4(torch.randn(40, 64, generator=g), 64))
    heads_q, heads_scale = quantize_int8(torch.randn(2 * 16, 64, generator=g))
    heads = (torch.randn(3, 2, 64, generator=g), heads_q.view(2, 16, 64), heads_scale,
             heads_q.sum(dim=1, dtype=torch.int32))
    quantized = native.expert_table(
        [(native.pack_int4(*quantize_int4(torch.randn(64, 64, generator=g), 64)),
          native.pack_int8(*quantize_int8(torch.randn(64, 32, generator=g)))) for _ in range(2)], 64, 32,
        ((4, 64), (8, 0)))
    shared = native.expert_table([(torch.randn(96, 64, generator=g), torch.randn(64, 48, generator=g))], 64, 48,
                                 ((32, 0), (32, 0)))
    gates = torch.rand(3, 2, generator=g)
    ids = torch.tensor([[0, 3], [2, 1], [3, 0]])
    return {
        "int8_linear": lambda: native.int8_linear(k, x, int8, 40),
        "int4_linear": lambda: native.int4_linear(k, x, int4, 64, 40),
        "int8_heads": lambda: native.int8_heads(k, *heads),
        "experts": lambda: native.experts(k, x, quantized, ids % 2, gates, shared),
    }


@pytest.mark.parametrize("name", ["int8_linear", "int4_linear", "int8_heads", "experts"])
def test_the_quantized_and_experts_kernels_take_their_temporaries_from_the_arena(scratch_limit, name):
    """An exhausted arena is a MemoryError naming the call; lifted, the same call gives the same bits as before."""
    call = _quantized_calls()[name]
    expected = call()
    scratch_limit(64)  # one allocation's smallest unit: every one of these calls takes more
    with pytest.raises(MemoryError, match=name):
        call()
    scratch_limit(0)
    assert torch.equal(call(), expected)


def _layers(seed: int, layers: int) -> tuple[native.LayerStack, list]:
    g = torch.Generator().manual_seed(seed)
    built = [(_mla_block(g), _moe_block(g)) for _ in range(layers)]
    stack = native.LayerStack.of([a[0] for a, _ in built], [m[0] for _, m in built])
    return stack, built


def _decode_args(tokens: int, layers: int, g: torch.Generator) -> tuple:
    """x, cos, sin, caches (each holding 3 earlier positions), block table, query starts, lengths, slots: one request
    of `tokens` new tokens."""
    caches = [torch.randn(2, 4, 32, generator=g) for _ in range(layers)]
    return (torch.randn(tokens, 32, generator=g), torch.randn(tokens, 16, generator=g).cos(),
            torch.randn(tokens, 16, generator=g).sin(), caches, torch.tensor([[1, 0]], dtype=torch.int32),
            torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([3 + tokens], dtype=torch.int32),
            torch.tensor([7, 4][:tokens]))


@pytest.mark.parametrize("tokens", [1, 2])
def test_the_layers_in_one_call_equal_their_blocks_called_one_by_one(tokens):
    stack, built = _layers(2, 3)
    x, cos, sin, caches, table, qsl, lens, slots = _decode_args(tokens, 3, torch.Generator().manual_seed(3))
    mine = [c.clone() for c in caches]
    y = native.decode_layers(kernels(ISA), stack, x, cos, sin, mine, table, qsl, lens, slots)
    h = x
    for ((attention, _), (moe, _)), cache in zip(built, caches):
        h, normed = native.mla_attention_block(kernels(ISA), attention, h, cos, sin, cache, table, qsl, lens, slots)
        h = native.moe_block(kernels(ISA), moe, normed, h)
    assert torch.equal(y, h)
    for a, b in zip(mine, caches):
        assert torch.equal(a, b)


def test_the_layers_call_ends_in_the_final_norm_where_given():
    """The run's output normed in the same call equals rms_norm of the run's output; its weight is checked."""
    stack, _ = _layers(2, 2)
    x, cos, sin, caches, table, qsl, lens, slots = _decode_args(2, 2, torch.Generator().manual_seed(4))
    w = torch.randn(32, generator=torch.Generator().manual_seed(6))
    y = native.decode_layers(kernels(ISA), stack, x, cos, sin, [c.clone() for c in caches], table, qsl, lens, slots)
    normed = native.decode_layers(kernels(ISA), stack, x, cos, sin, [c.clone() for c in caches], table, qsl, lens,
                                  slots, (w, 1e-5))
    assert torch.equal(normed, native.rms_norm(kernels(ISA), y, w, 1e-5))
    with pytest.raises(ValueError, match=r"decode_layers: the final norm's weight must be .* \[32\]; got .* \[16\]"):
        native.decode_layers(kernels(ISA), stack, x, cos, sin, caches, table, qsl, lens, slots, (w[:16], 1e-5))


@pytest.mark.parametrize("fault", ["no layers", "a cache short", "caches differ", "moe hidden", "attention dtype",
                                   "router", "slot"])
def test_the_layers_call_refuses_what_it_cannot_read(fault):
    stack, built = _layers(4, 2)
    x, cos, sin, caches, table, qsl, lens, slots = _decode_args(1, 2, torch.Generator().manual_seed(5))
    if fault == "no layers":
        with pytest.raises(ValueError, match="one MoE block a layer"):
            native.LayerStack.of([], [])
        return
    if fault == "a cache short":
        caches = caches[:1]
    elif fault == "caches differ":
        caches[1] = torch.zeros(3, 4, 32)
    elif fault == "moe hidden":
        built[1][1][0].hidden = 48
    elif fault == "attention dtype":
        built[1][0][0].bf = 1
    elif fault == "router":
        built[1][1][0].router = None
    elif fault == "slot":
        slots = torch.tensor([8])
    wrong = {"a cache short": "2 layers need as many caches", "caches differ": r"kv_caches\[1\]: its dtype or blocks",
             "moe hidden": "layer 1: its blocks' dtype, hidden size", "attention dtype": "layer 1: its blocks' dtype",
             "router": "router is NULL", "slot": "slot_mapping.0. = 8 lies past the cache's 8 slots"}[fault]
    with pytest.raises(ValueError, match=wrong):
        native.decode_layers(kernels(ISA), stack, x, cos, sin, caches, table, qsl, lens, slots)


@pytest.mark.parametrize("fault", [None, "topk", "router", "no shared", "routed"])
def test_a_moe_block_of_no_routed_experts_is_its_dense_mlp(fault):
    """experts 0: the block's `shared` table alone, as the experts kernel runs a one-expert table at weight 1 (a
    dense layer's module for one token); nothing of the routing may be set."""
    block, (router, w13, w2, table) = _moe_block(torch.Generator().manual_seed(6))
    dense = native.expert_table([(w13[0], w2[0])], 32, 16, ((32, 0), (32, 0)))
    block.experts, block.topk, block.groups, block.topk_groups, block.norm = 0, 0, 0, 0, 0
    block.router, block.routed, block.shared = None, native.ExpertTable(), dense.table
    x, residual = torch.randn(3, 32), torch.randn(3, 32)
    if fault is None:
        y = native.moe_block(kernels(ISA), block, x, residual)
        alone = native.experts(kernels(ISA), x, dense, torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1))
        assert torch.equal(y, residual + alone)
        return
    if fault == "topk":
        block.topk = 1
    elif fault == "router":
        block.router = router.data_ptr()
    elif fault == "no shared":
        block.shared = native.ExpertTable()
    elif fault == "routed":
        block.routed = table.table
    wrong = {"topk": "no routed experts: topk", "router": "no routed experts: topk", "routed": "no routed experts",
             "no shared": "shared: 0 experts, not 1"}[fault]
    with pytest.raises(ValueError, match=wrong):
        native.moe_block(kernels(ISA), block, x, residual)
