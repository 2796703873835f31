"""The chunked gated delta rule (GDN prefill) Triton kernel against the torch reference, both through the public
kernels.gdn.chunk_gated_delta_rule: the output and the state pool (only the listed slots change).

Without CUDA the kernel runs in Triton's interpreter (see triton_setup.py) on tiny ragged shapes in fp32 and fp16;
bf16 and the model's shapes are the GPU tier at the end.
"""
from __future__ import annotations

import pytest
import torch

from triton_setup import DEV, ON_GPU, backend, both, gen_, gpu, needs_gpu, rnd, tol  # noqa: E402,F401  (first)
from tinyserve.kernels.gdn import chunk_gated_delta_rule  # noqa: E402

FP32 = dict(atol=1e-4, rtol=1e-4)


def prefill_inputs(lens, H, HV, dk, dv, seed, dtype=torch.float32, strong_decay=False):
    """q, k (l2-normalised, q scaled), v in `dtype`; g, beta fp32; cu_seqlens of `lens`."""
    g = gen_(seed)
    T = sum(lens)
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    v = torch.randn(T, HV, dv, generator=g)
    gate = -torch.rand(T, HV, generator=g) * 0.5
    if strong_decay:                        # some tokens all but reset the state: exp(G_i - G_j) spans 1e-30..1
        gate = torch.where(torch.rand(T, HV, generator=g) < 0.1, torch.full_like(gate, -30.0), gate)
    beta = torch.rand(T, HV, generator=g)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return [x.to(dtype).to(DEV) for x in (q, k, v)] + [x.to(DEV) for x in (gate, beta)] + [cu]


def check(lens, slots, n_slots, H, HV, dk, dv, dtype=torch.float32, seed=0, strong_decay=False, state_tol=FP32):
    q, k, v, gate, beta, cu = prefill_inputs(lens, H, HV, dk, dv, seed, dtype, strong_decay)
    state = rnd(n_slots, HV, dk, dv, gen=gen_(seed + 100), scale=0.5)        # non-zero initial states
    tri, ref, (*_, tri_state, _, _), (*_, ref_state, _, _) = both(
        chunk_gated_delta_rule, q, k, v, gate, beta, state, cu, slots, clone=(5,))
    assert tri.shape == (sum(lens), HV, dv) and tri.dtype == dtype
    torch.testing.assert_close(tri, ref, **(FP32 if dtype == torch.float32 else tol(dtype)))
    torch.testing.assert_close(tri_state, ref_state, **state_tol)
    untouched = [s for s in range(n_slots) if s not in slots]
    assert torch.equal(tri_state[untouched], state[untouched])
    assert not torch.equal(tri_state[slots], state[slots])


@pytest.mark.parametrize("H,HV,dk,dv,dtype", [
    (1, 1, 16, 32, torch.float32), (1, 1, 16, 32, torch.float16),
    (2, 4, 32, 16, torch.float16), (1, 3, 16, 24, torch.float32),
], ids=["HV=H-fp32", "HV=H-fp16", "HV=2H-fp16", "HV=3H,dv=24-fp32"])
def test_ragged_batch(H, HV, dk, dv, dtype):
    """Lengths 1, 5, 64, 65, 130 in one call (partial, exact and multi-chunk sequences), non-consecutive slots.
    Each head layout once and each dtype (the dtype only changes the loads and stores, not the head indexing)."""
    check([1, 5, 64, 65, 130], [7, 0, 3, 5, 2], 9, H, HV, dk, dv, dtype, seed=HV)


def test_single_sequence():
    check([130], [1], 3, 2, 2, 32, 32, seed=3)


def test_strong_decay_stays_finite():
    check([70, 3], [2, 0], 3, 1, 2, 16, 16, seed=4, strong_decay=True)


@pytest.mark.parametrize("dk", [80, 200])
def test_head_dims_over_64(dk):
    """dk past one 64-wide tile: the state kernel holds S as two or four dk tiles, the last one partly masked."""
    check([70, 3], [1, 0], 2, 1, 2, dk, 16, seed=dk)


@pytest.mark.slow
def test_split_dots_path(monkeypatch):
    """The GPU's plan for bf16 activations (w stored as hi + lo, the state kernel's dots on hi + lo pairs, h and the
    stored v_new in the 16-bit dtype) with fp16 as that dtype, which the interpreter computes right. The state is
    held to 1e-5 (it comes out ~1e-6 off; leaving out any one lo term costs 5e-5 to 3e-4), the output to fp16's
    tolerance."""
    from tinyserve.kernels import gdn_triton
    monkeypatch.setattr(gdn_triton, "_split_dtype", lambda k, v: torch.float16)
    check([1, 5, 64, 65, 130], [7, 0, 3, 5, 2], 9, 2, 4, 80, 16, torch.float16, seed=7,
          state_tol=dict(atol=1e-5, rtol=1e-5))


def test_engine_views_and_continuation():
    """The engine's inputs: v a column view of the conv output, the state one layer of a [slots, layers, ...] pool.
    Prefilling 70 then 60 tokens from the carried state equals prefilling the 130 at once."""
    H, HV, dk, dv = 1, 2, 16, 16
    q, k, v, gate, beta, _ = prefill_inputs([130], H, HV, dk, dv, seed=5)
    mixed = torch.cat([torch.zeros(130, 8, device=DEV), v.reshape(130, HV * dv)], dim=1)
    v_view = mixed[:, 8:].view(130, HV, dv)                                  # token stride HV * dv + 8
    pool = rnd(4, 3, HV, dk, dv, gen=gen_(6), scale=0.5)
    before = pool.clone()
    with backend("torch"):
        ref_state = pool[:, 1].clone()
        ref = chunk_gated_delta_rule(q, k, v, gate, beta, ref_state, [0, 130], [2])
    with backend("triton"):
        layer = pool[:, 1]
        a = chunk_gated_delta_rule(q[:70], k[:70], v_view[:70], gate[:70], beta[:70], layer, [0, 70], [2])
        b = chunk_gated_delta_rule(q[70:], k[70:], v_view[70:], gate[70:], beta[70:], layer, [0, 60], [2])
    torch.testing.assert_close(torch.cat([a, b]), ref, **FP32)
    torch.testing.assert_close(pool[:, 1], ref_state, **FP32)
    assert torch.equal(pool[:, 0], before[:, 0]) and torch.equal(pool[:, 2], before[:, 2])
    assert torch.equal(pool[[0, 1, 3], 1], before[[0, 1, 3], 1])


# ---------------------------------------------------------------------------------------------------------------
# The GPU tier: bf16 and the GDN shapes of Qwen3.5-27B (16 key / 48 value heads of 128) and Qwen3-Next (16 / 32),
# a 4096-token step in 3 sequences. Compiled kernels; bf16 output compared with the reference's fp32 result.
# ---------------------------------------------------------------------------------------------------------------
@gpu
@needs_gpu
@pytest.mark.parametrize("HV", [48, 32], ids=["qwen3.5-27b", "qwen3-next"])
def test_gpu_prefill_model_shapes(HV):
    H, dk, dv, lens, slots = 16, 128, 128, [1000, 2900, 196], [5, 1, 3]
    q, k, v, gate, beta, cu = prefill_inputs(lens, H, HV, dk, dv, seed=1, dtype=torch.bfloat16)
    state = rnd(6, HV, dk, dv, scale=0.1)
    tri_state, ref_state = state.clone(), state.clone()
    with backend("triton"):
        tri = chunk_gated_delta_rule(q, k, v, gate, beta, tri_state, cu, slots)
    with backend("torch"):
        ref32 = chunk_gated_delta_rule(q.float(), k.float(), v.float(), gate, beta, ref_state, cu, slots)
    assert tri.dtype == torch.bfloat16
    err = (tri.float() - ref32).abs().max().item()
    assert err <= 2e-2 * max(ref32.abs().max().item(), 1.0), f"max error {err}"
    torch.testing.assert_close(tri_state, ref_state, atol=1e-3, rtol=1e-3)
    assert torch.equal(tri_state[[0, 2, 4]], state[[0, 2, 4]])


def test_fp32_output_kernel_is_never_pipelined():
    """The chunk output kernel over fp32 inputs runs unpipelined on every device (on an H200 under Triton 3.6 its
    pipelined dk loop returned NaN or faulted at dk 80 and 200); 16-bit inputs keep 2 stages, and the state kernel
    keeps the 2 stages it needs on Hopper (1 faulted there)."""
    from tinyserve.kernels.gdn_triton import _chunk_tiles
    for cap in (None, (8, 9), (9, 0), (10, 0), (12, 0)):
        assert _chunk_tiles(cap, fp32=True)["output"]["num_stages"] == 1, cap
        assert _chunk_tiles(cap, fp32=False)["output"]["num_stages"] == 2, cap
    assert _chunk_tiles((9, 0), fp32=True)["state"]["num_stages"] == 2
