"""The routed experts of the sparse MoE layers (kernels/moe.py, kernels/moe_triton.py): routing against a plain
torch computation, the torch reference against an independent per-token loop in float64, the pair alignment's
layout, and the Triton grouped GEMM path against the reference through the public function (under the interpreter
here, compiled on a GPU): decode and prefill row counts, experts no token picks, every token on one expert, H and I
that are not multiples of the tiles, strided activations, fp32 and fp16. The GPU tier adds the Qwen3.5-35B-A3B
shapes in bf16 and checks that the Triton path never synchronizes with the host."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from triton_setup import DEV, ON_GPU, backend, both, gen_, gpu, needs_gpu, rnd, tol  # noqa: F401  (first)
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


def assert_close_scaled(tri: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    scale = max(ref.float().abs().max().item(), 1e-6)
    torch.testing.assert_close(tri.float() / scale, ref.float() / scale, **tol(dtype))


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("T", [1, 3, 17, 70])
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
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")                # alignment and GEMMs never wait on the host
    try:
        with backend("triton"):
            fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
