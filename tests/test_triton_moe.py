"""The routed experts of the sparse MoE layers (kernels/moe.py, kernels/moe_triton.py): routing against a plain
torch computation, the torch reference against an independent per-token loop in float64, the pair alignment's
layout, and the Triton grouped GEMM path against the reference through the public function (under the interpreter
here, compiled on a GPU): decode and prefill row counts, experts no token picks, every token on one expert, H and I
that are not multiples of the tiles, strided activations, fp32 and fp16. Experts kept FP8 (stacked Fp8Weights,
w8a8 and w8a16): the reference against float64 and against the dequantized experts, the FP8 grouped GEMM against
the reference on the same cases (ragged routing, partial K groups, one GEMM FP8 and the other not). The GPU tier
adds the Qwen3.5-35B-A3B shapes in bf16 (FP8 experts too) and checks that the Triton path never synchronizes with
the host."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from triton_setup import DEV, ON_GPU, backend, both, fp8_dot_tol, gen_, gpu, needs_gpu, rnd, tol  # noqa: F401  (first)
from tinyserve.kernels.fp8 import quantize_activations  # noqa: E402
from tinyserve.kernels.fp8_weight import ACT_GROUP, FP8, FP8_MAX, Fp8Weight  # noqa: E402
from tinyserve.kernels.moe import fused_experts, route  # noqa: E402


def experts(E: int, H: int, I: int, dtype, gen: torch.Generator, scale: float = 0.3):
    """Stacked expert weights: w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I]."""
    return (rnd(E, 2 * I, H, dtype=dtype, gen=gen, scale=scale / H ** 0.5 * 4),
            rnd(E, H, I, dtype=dtype, gen=gen, scale=scale / I ** 0.5 * 4))


def routed(T: int, E: int, top_k: int, gen: torch.Generator):
    return route(torch.randn(T, E, generator=gen).to(DEV), top_k, True)


def naive(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    I = w_down.shape[2]
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double().cpu()
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            wgu, wd = w_gate_up[e].double().cpu(), w_down[e].double().cpu()
            h = F.silu(wgu[:I] @ xt) * (wgu[I:] @ xt)
            out[t] += float(topk_weights[t, j]) * (wd @ h)
    return out


def assert_close_scaled(tri: torch.Tensor, ref: torch.Tensor, dtype, act_quant: bool = False) -> None:
    scale = max(ref.float().abs().max().item(), 1e-6)
    torch.testing.assert_close(tri.float() / scale, ref.float() / scale, **fp8_dot_tol(dtype, act_quant))


# --- routing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T, E, top_k", [(1, 4, 1), (5, 8, 2), (9, 8, 4), (3, 16, 8)])
def test_route_against_plain_torch(T, E, top_k, renormalize):
    logits = torch.randn(T, E, generator=gen_(T * E + top_k), dtype=torch.float64).to(torch.float16)
    weights, ids = route(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (T, top_k)
    probs = torch.exp(logits.double()) / torch.exp(logits.double()).sum(-1, keepdim=True)
    expect_w, expect_ids = probs.sort(dim=-1, descending=True)
    expect_w, expect_ids = expect_w[:, :top_k], expect_ids[:, :top_k]
    if renormalize:
        expect_w = expect_w / expect_w.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1).double(), torch.ones(T, dtype=torch.float64))
    assert torch.equal(ids.long(), expect_ids)
    torch.testing.assert_close(weights.double(), expect_w, rtol=1e-6, atol=1e-7)


# --- the torch reference ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("T, E, top_k, H, I", [(1, 4, 1, 24, 16), (6, 8, 2, 40, 24), (17, 8, 4, 33, 20)])
def test_reference_against_float64(T, E, top_k, H, I):
    g = gen_(T + 10 * E + top_k)
    w_gate_up, w_down = experts(E, H, I, torch.float32, g)
    x = rnd(T, H, gen=g)
    topk_weights, topk_ids = routed(T, E, top_k, g)
    with backend("torch"):
        y = fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids)
    assert y.dtype == torch.float32 and y.shape == (T, H)
    torch.testing.assert_close(y.double().cpu(), naive(x, w_gate_up, w_down, topk_weights, topk_ids),
                               rtol=1e-5, atol=1e-5)


# --- the pair alignment ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ids, E, BM", [
    ([[3], [3], [3]], 4, 16),                              # one expert, three rows: one padded block
    ([[0, 5], [5, 2], [7, 0], [5, 1]], 8, 2),              # experts 3, 4, 6 unused
    ([[e] for e in range(8)] * 5, 8, 4),                   # every expert, groups of 5 -> two blocks each
    ([[1, 0]], 256, 16),                                   # decode: the buffers stay small whatever E is
])
def test_alignment_layout(ids, E, BM):
    from tinyserve.kernels.moe_triton import align_pairs
    topk_ids = torch.tensor(ids, dtype=torch.int32, device=DEV)
    sorted_ids, expert_ids, padded_len = align_pairs(topk_ids, E, BM)
    flat = topk_ids.reshape(-1).tolist()
    P, n = len(flat), int(padded_len.item())
    counts = [flat.count(e) for e in range(E)]
    assert n == sum(-(-c // BM) * BM for c in counts) and n <= sorted_ids.numel()
    assert sorted_ids.numel() == expert_ids.numel() * BM and sorted_ids.numel() < P + min(E, P) * (BM - 1) + BM
    rows = sorted_ids[:n].tolist()
    assert sorted(r for r in rows if r < P) == list(range(P))           # every pair once
    assert all(r == P for r in rows if r >= P)                          # padding holds the sentinel
    for b in range(n // BM):
        block = [r for r in rows[b * BM:(b + 1) * BM] if r < P]
        assert block, "a block of padding only"
        assert all(flat[r] == int(expert_ids[b]) for r in block)       # one expert per block
        assert block == sorted(block)                                   # pair order within an expert


# --- Triton against the reference ------------------------------------------------------------------------------


def dtype_id(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16"}[dtype]


# Every T with every top_k (decode, a few rows, rows over one tile, several tiles per expert), and each of the four
# factors paired with every value of each other one: E and the dtype alternate over the twelve (T, top_k) pairs.
PAIRWISE = [(T, [4, 8][i % 2], top_k, [torch.float32, torch.float16][i // 2 % 2])
            for i, (T, top_k) in enumerate((T, k) for T in (1, 3, 17, 70) for k in (1, 2, 4))]


@pytest.mark.parametrize("T, E, top_k, dtype", PAIRWISE, ids=[f"{T}-{E}-{k}-{dtype_id(d)}" for T, E, k, d in PAIRWISE])
def test_triton_against_reference(T, E, top_k, dtype):
    H, I = 72, 40                                          # partial K, N tiles in both GEMMs
    g = gen_(100 * T + 10 * E + top_k)
    w_gate_up, w_down = experts(E, H, I, dtype, g)
    x = rnd(T, H, dtype=dtype, gen=g)
    topk_weights, topk_ids = routed(T, E, top_k, g)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    assert tri.dtype == torch.float32 and tri.shape == (T, H)
    assert_close_scaled(tri, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", ["one_expert_k1", "one_pair_of_experts", "unused_experts"])
def test_triton_skewed_routing(case, dtype):
    """Every token on one expert (one long group, many full blocks), every token on the same two experts, and most
    experts picked by no token."""
    T, E, H, I = 70, 8, 48, 24
    g = gen_(len(case))
    w_gate_up, w_down = experts(E, H, I, dtype, g)
    x = rnd(T, H, dtype=dtype, gen=g)
    if case == "one_expert_k1":
        topk_ids = torch.full((T, 1), 3, dtype=torch.int32)
    elif case == "one_pair_of_experts":
        topk_ids = torch.tensor([[2, 5], [5, 2]], dtype=torch.int32).repeat(T // 2, 1)
    else:
        topk_ids = torch.tensor([[0, 7], [7, 6], [6, 0]], dtype=torch.int32).repeat(T // 3 + 1, 1)[:T]
    topk_weights = torch.rand(T, topk_ids.shape[1], generator=g)
    topk_ids, topk_weights = topk_ids.to(DEV), topk_weights.to(DEV)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    assert_close_scaled(tri, ref, dtype)
    unused = sorted(set(range(E)) - set(topk_ids.reshape(-1).tolist()))
    w_gate_up[unused] = float("nan")                       # weights no token routes to are never read
    w_down[unused] = float("nan")
    with backend("triton"):
        assert torch.isfinite(fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids)).all()


@pytest.mark.parametrize("rows_per_expert", [1, 40, 200])
def test_triton_every_tile_shape(rows_per_expert, monkeypatch):
    """Each of tile_shape's choices (decode, mid, prefill) on the same small problem, forced."""
    from tinyserve.kernels import moe_triton
    tiles = moe_triton.tile_shape(rows_per_expert * 4, 4)
    monkeypatch.setattr(moe_triton, "tile_shape", lambda pairs, num_experts: tiles)
    T, E, H, I, top_k = 21, 4, 72, 40, 2
    g = gen_(rows_per_expert)
    w_gate_up, w_down = experts(E, H, I, torch.float16, g)
    x = rnd(T, H, dtype=torch.float16, gen=g)
    topk_weights, topk_ids = routed(T, E, top_k, g)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    assert_close_scaled(tri, ref, torch.float16)


def test_triton_strided_activations_and_empty_batch():
    T, E, H, I, top_k = 9, 4, 40, 24, 2
    g = gen_(9)
    w_gate_up, w_down = experts(E, H, I, torch.float32, g)
    x = rnd(T, H + 8, gen=g)[:, 4:H + 4]                    # rows of a wider buffer: stride(0) != H
    topk_weights, topk_ids = routed(T, E, top_k, g)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    assert_close_scaled(tri, ref, torch.float32)
    tri, ref, *_ = both(fused_experts, x[:0], w_gate_up, w_down, topk_weights[:0], topk_ids[:0])
    assert tri.shape == ref.shape == (0, H)


def test_sparse_moe_layer_backends_agree():
    """The model's layer (router, routed experts, shared expert) under either backend."""
    from tinyserve.models.qwen3_next import SparseMoE
    cfg = SimpleNamespace(num_experts=8, hidden_size=40, moe_intermediate_size=24, num_experts_per_tok=2,
                          norm_topk_prob=True, shared_expert_intermediate_size=32)
    layer = SparseMoE(cfg, torch.float32, DEV)
    g = gen_(5)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = rnd(11, 40, gen=g)
    with torch.no_grad():
        tri, ref, *_ = both(layer, x)
    assert_close_scaled(tri, ref, torch.float32)


# --- experts kept FP8 -------------------------------------------------------------------------------------------


def fp8_experts(E: int, N: int, K: int, block: tuple[int, int], act_quant: bool, gen: torch.Generator) -> Fp8Weight:
    """Stacked FP8 experts [E, N, K]: random e4m3 values and block scales, the products sized as `experts`'."""
    w = Fp8Weight(N, K, block, DEV, act_quant, experts=E)
    w.weight.copy_((torch.randn(E, N, K, generator=gen) * 120).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    w.scale.copy_((torch.rand(w.scale.shape, generator=gen) + 0.5) / (100 * K ** 0.5))
    return w


def fp8_pair(E: int, H: int, I: int, block: tuple[int, int], act_quant: bool, gen: torch.Generator):
    return fp8_experts(E, 2 * I, H, block, act_quant, gen), fp8_experts(E, H, I, block, act_quant, gen)


def as_seen_by_w8a8(x: torch.Tensor) -> torch.Tensor:
    """x's rows quantized per 128-group and scaled back: what a w8a8 GEMM multiplies."""
    xq, xs = quantize_activations(x)
    return xq.float() * xs.repeat_interleave(ACT_GROUP, 1)[:, :x.shape[1]]


FP8_CASES = [  # (T, E, top_k, H, I, block)
    (1, 4, 2, 128, 64, (128, 128)),       # decode; the down GEMM's K (64) is one partial group
    (17, 8, 2, 200, 48, (16, 128)),       # partial K groups in both GEMMs, ragged expert groups
    (70, 8, 4, 256, 128, (128, 128)),     # whole groups (EVEN_K) in both, several blocks per expert
]


@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("T, E, top_k, H, I, block", FP8_CASES[:2])
def test_fp8_reference(T, E, top_k, H, I, block, act_quant):
    """w8a16: the dequantized experts' numbers; w8a8: float64 experts on activations quantized per row and
    128-group (x for gate_up, the activation for down)."""
    g = gen_(T + E + H)
    w_gate_up, w_down = fp8_pair(E, H, I, block, act_quant, g)
    x = rnd(T, H, gen=g)
    topk_weights, topk_ids = routed(T, E, top_k, g)
    with backend("torch"):
        y = fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids)
        deq = fused_experts(x, w_gate_up.dequantize(torch.float32), w_down.dequantize(torch.float32), topk_weights,
                            topk_ids)
    assert y.dtype == torch.float32 and y.shape == (T, H)
    if not act_quant:                          # equal but for the GEMM route's summation order (kernels/linear.py)
        assert_close_scaled(y, deq, torch.float32)
        return
    wgu, wd = w_gate_up.dequantize(torch.float64), w_down.dequantize(torch.float64)
    expect = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        xt = as_seen_by_w8a8(x[t:t + 1].cpu()).double()[0]
        for j in range(top_k):
            e = int(topk_ids[t, j])
            h = F.silu(wgu[e, :I].cpu() @ xt) * (wgu[e, I:].cpu() @ xt)
            h = as_seen_by_w8a8(h.float()[None]).double()[0]
            expect[t] += float(topk_weights[t, j]) * (wd[e].cpu() @ h)
    torch.testing.assert_close(y.double().cpu(), expect, rtol=1e-4, atol=1e-4 * expect.abs().max().item())
    assert (y - deq).norm() / deq.norm() < 0.08                 # and close to the unquantized activations'


def assert_fused_fp8_close(tri: torch.Tensor, ref: torch.Tensor, dtype, act_quant: bool) -> None:
    """The whole routed MoE, Triton against the reference. w8a8 quantizes the down GEMM's input, the activation
    silu_and_mul computed, and the two paths' silu_and_mul (a Triton kernel, a torch op) differ in the last bit
    now and then: an element that lands on the other side of an e4m3 rounding boundary moves its token's output by
    one e4m3 step of that element's share (each GEMM on the same input agrees to the dtype's rounding:
    test_triton_fp8_grouped_gemm). So w8a8 is held to a norm-wise bound (wider in bf16, whose 8-bit mantissa makes
    those last-bit differences, and so the flips, more frequent), w8a16 to the dtype's rounding."""
    if act_quant:
        assert (tri - ref).norm() / ref.norm() < (3e-2 if dtype == torch.bfloat16 else 1e-2)
    else:
        assert_close_scaled(tri, ref, dtype)


def grouped_gemm_reference(a, w: Fp8Weight, a_row_div: int, routed_weights, topk_ids) -> torch.Tensor:
    """Row p of one grouped GEMM: A row p // a_row_div times expert topk_ids.flat[p] through kernels.fp8's
    fp8_linear (torch), times routed_weights[p] when given, rounded to A's dtype."""
    with backend("torch"):
        from tinyserve.kernels.fp8 import fp8_linear
        flat = topk_ids.reshape(-1).long()
        out = torch.empty((flat.numel(), w.shape[1]), dtype=a.dtype, device=a.device)
        for e in flat.unique().tolist():
            rows = (flat == e).nonzero()[:, 0]
            y = fp8_linear(a[rows // a_row_div], w.expert(e)).float()
            if routed_weights is not None:
                y = y * routed_weights[rows, None]
            out[rows] = y.to(a.dtype)
    return out


@pytest.mark.parametrize("rows_per_expert", [1, 40, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "w8a16"])
def test_triton_fp8_grouped_gemm(act_quant, dtype, rows_per_expert):
    """Each GEMM of the layer on the same input as the reference (w8a8 then quantizes identical rows), under each
    tile shape (the BM tile_shape picks, forced, with the FP8 tile that goes with it): the gate_up GEMM gathering
    x's rows by token (partial K groups, 16-row scale blocks), the down GEMM with the routing weights (K = 64 in one
    partial group), ragged routing with unused experts."""
    from tinyserve.kernels import moe_triton
    T, E, H, I, top_k = 21, 6, 200, 64, 2
    g = gen_(rows_per_expert + act_quant)
    w_gate_up, w_down = fp8_pair(E, H, I, (16, 128), act_quant, g)
    x = rnd(T, H, dtype=dtype, gen=g)
    act = rnd(T * top_k, I, dtype=dtype, gen=g)
    topk_ids = torch.tensor([[0, 3]] * 15 + [[3, 5]] * 6, dtype=torch.int32).to(DEV)   # experts 1, 2, 4 unused
    topk_weights = torch.rand(T, top_k, generator=g).to(DEV)
    tiles = moe_triton.tile_shape(rows_per_expert * E, E)
    sorted_ids, expert_ids, padded_len = moe_triton.align_pairs(topk_ids, E, tiles[0])
    for a, w, div, rw in [(x, w_gate_up, top_k, None), (act, w_down, 1, topk_weights.reshape(-1))]:
        out = torch.empty((T * top_k, w.shape[1]), dtype=dtype, device=DEV)
        with backend("triton"):
            moe_triton._grouped_gemm(a, w, out, div, rw, sorted_ids, expert_ids, padded_len, tiles)
        assert_close_scaled(out, grouped_gemm_reference(a, w, div, rw, topk_ids), dtype, act_quant)


# Each case w8a8 and w8a16, the two in different dtypes: each dtype meets every case and both schemes.
FP8_RUNS = [(*case, act_quant, [torch.float32, torch.float16][(i + act_quant) % 2])
            for i, case in enumerate(FP8_CASES) for act_quant in (True, False)]


@pytest.mark.parametrize("T, E, top_k, H, I, block, act_quant, dtype", FP8_RUNS,
                         ids=[f"{r[0]}-{'w8a8' if r[6] else 'w8a16'}-{dtype_id(r[7])}" for r in FP8_RUNS])
def test_triton_fp8_against_reference(T, E, top_k, H, I, block, act_quant, dtype):
    g = gen_(3 * T + E + I)
    w_gate_up, w_down = fp8_pair(E, H, I, block, act_quant, g)
    x = rnd(T, H, dtype=dtype, gen=g)
    topk_weights, topk_ids = routed(T, E, top_k, g)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    assert tri.dtype == torch.float32 and tri.shape == (T, H)
    assert_fused_fp8_close(tri, ref, dtype, act_quant)


@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "w8a16"])
def test_triton_fp8_ragged_routing(act_quant):
    """Most experts picked by no token, one expert by many (several blocks, the last one partial): the unused
    experts' scales are never read."""
    T, E, H, I = 45, 8, 128, 64
    g = gen_(45)
    w_gate_up, w_down = fp8_pair(E, H, I, (128, 128), act_quant, g)
    x = rnd(T, H, dtype=torch.float16, gen=g)
    topk_ids = torch.tensor([[3, 6]] * 40 + [[6, 0]] * 5, dtype=torch.int32).to(DEV)
    topk_weights = torch.rand(T, 2, generator=g).to(DEV)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    assert_fused_fp8_close(tri, ref, torch.float16, act_quant)
    unused = [1, 2, 4, 5, 7]
    w_gate_up.scale[unused] = float("nan")
    w_down.scale[unused] = float("nan")
    with backend("triton"):
        assert torch.isfinite(fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids)).all()


def test_triton_fp8_gate_up_and_plain_down():
    """A layer whose expert width is off the scale blocks' rows keeps gate_up dequantized while down stays FP8 (and
    the other way round): the two GEMMs share the pair alignment's BM."""
    T, E, H, I, top_k = 30, 4, 128, 40, 2
    g = gen_(30)
    w_gate_up, w_down = experts(E, H, I, torch.float16, g)
    fp8_gate_up, fp8_down = fp8_pair(E, H, I, (16, 128), False, g)
    x = rnd(T, H, dtype=torch.float16, gen=g)
    topk_weights, topk_ids = routed(T, E, top_k, g)
    for pair in [(fp8_gate_up, w_down), (w_gate_up, fp8_down)]:
        tri, ref, *_ = both(fused_experts, x, *pair, topk_weights, topk_ids)
        assert_close_scaled(tri, ref, torch.float16)


# --- GPU tier: Qwen3.5-35B-A3B shapes (H 2048, I 512, 256 experts, top 8) in bf16 ------------------------------------


@gpu
@needs_gpu
@pytest.mark.parametrize("T", [1, 8, 512])
def test_gpu_qwen3_5_moe_shapes(T):
    E, H, I, top_k, dtype = 256, 2048, 512, 8, torch.bfloat16
    g = gen_(T)
    w_gate_up, w_down = experts(E, H, I, dtype, g)
    x = rnd(T, H, dtype=dtype, gen=g)
    topk_weights, topk_ids = routed(T, E, top_k, g)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    assert_close_scaled(tri, ref, dtype)
    assert_no_host_sync(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)


@gpu
@needs_gpu
@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("T", [1, 8, 512])
def test_gpu_qwen3_5_moe_shapes_fp8(T, act_quant):
    """Qwen3.5-35B-A3B-FP8's experts (128 x 128 blocks) kept FP8, bf16 activations; no host sync either."""
    E, H, I, top_k, dtype = 256, 2048, 512, 8, torch.bfloat16
    g = gen_(T + 1)
    w_gate_up, w_down = fp8_pair(E, H, I, (128, 128), act_quant, g)
    x = rnd(T, H, dtype=dtype, gen=g)
    topk_weights, topk_ids = routed(T, E, top_k, g)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    assert_fused_fp8_close(tri, ref, dtype, act_quant)
    if not act_quant:
        return
    assert_no_host_sync(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)


def assert_no_host_sync(fn, *args) -> None:
    """fn(*args) through the Triton path never waits on the host (CUDA's sync debug mode raises if it does):
    the pair alignment and both GEMMs stay on the device, as a CUDA graph needs."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with backend("triton"):
            fn(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
