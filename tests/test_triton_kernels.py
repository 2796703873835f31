"""The Triton kernels against their torch references (kernels/*_triton.py vs kernels/*.py), called through the
public functions with the backend forced (kernels.set_backend), so the dispatch is tested too.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before any kernel module is
imported, see triton_setup.py) on tiny ragged shapes in fp32 and fp16: the interpreter computes bf16 on raw bits, so bf16 is left to the
GPU. With CUDA the same tests run compiled on the device, and the `gpu` tier adds bf16 and Qwen3.5-27B shapes
(bench/gpu_check.py runs this file on a CUDA machine). The whole file skips when triton is not installed.
"""
from __future__ import annotations

import pytest
import torch

from triton_setup import DEV, ON_GPU, backend, both, gen_, gpu, needs_gpu, paged_kv, rnd, tol  # noqa: E402,F401  (first)
import tinyserve.kernels as kernels  # noqa: E402
from tinyserve.kernels import attention_triton  # noqa: E402
from tinyserve.kernels.pointwise import apply_rotary, gated_rms_norm, l2_norm, rms_norm, silu_and_mul  # noqa: E402
from tinyserve.kernels.attention import paged_attention_decode, paged_attention_prefill  # noqa: E402
from tinyserve.kernels.conv import causal_conv1d_decode, causal_conv1d_verify  # noqa: E402
from tinyserve.kernels.gdn import (gdn_gating, recurrent_gated_delta_rule_decode,  # noqa: E402
                                   recurrent_gated_delta_rule_verify)
from tinyserve.kernels.verify_layout import verify_layout  # noqa: E402


# ---------------------------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------------------------
def test_backend_switch(monkeypatch):
    assert kernels.backend() == "auto"
    with pytest.raises(ValueError):
        kernels.set_backend("cuda")
    x = torch.zeros(2)
    assert not kernels.use_triton(x)                      # auto: CPU tensors take the reference
    with backend("torch"):
        assert not kernels.use_triton(x.to(DEV))
    if ON_GPU:
        assert kernels.use_triton(x.cuda())               # auto: CUDA tensors take Triton
    else:
        with backend("triton"):
            assert kernels.use_triton(x)                  # forced: here under the interpreter
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            kernels.set_backend("triton")                 # forced without CUDA or the interpreter
        assert kernels.backend() == "auto"


# ---------------------------------------------------------------------------------------------------------------
# Norms and the activation
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("zero_centred", [True, False])
def test_rms_norm(dtype, zero_centred):
    g = gen_(0)
    for shape in [(5, 40), (3, 32), (1, 7)]:                  # D not a power of two, a lone row
        x, w = rnd(*shape, dtype=dtype, gen=g), rnd(shape[-1], gen=g)
        tri, ref, *_ = both(rms_norm, x, w, 1e-6, zero_centred)
        assert tri.dtype == dtype and tri.shape == x.shape
        torch.testing.assert_close(tri, ref, **tol(dtype))
    # the model's q norm: per-head slices of a fused [T, heads, query | gate] projection, read in place
    qg = rnd(3, 4, 2 * 16, dtype=dtype, gen=g)
    q = qg.split([16, 16], dim=-1)[0]
    w = rnd(16, gen=g)
    tri, ref, *_ = both(rms_norm, q, w, 1e-6, zero_centred)
    torch.testing.assert_close(tri, ref, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_l2_norm_goes_through_the_kernel(dtype):
    """fp32 out from any input dtype; a strided view of a fused projection (the model's q and k) read in place."""
    fused = rnd(6, 3, 2 * 16, dtype=dtype, gen=gen_(1))
    x = fused[..., 16:]
    tri, ref, *_ = both(l2_norm, x, 16 ** -0.5)
    assert tri.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(tri, ref, **tol(torch.float32))
    zero = torch.zeros(2, 16, dtype=dtype, device=DEV)                 # the 1e-6 keeps a zero row at zero
    tri, ref, *_ = both(l2_norm, zero)
    assert torch.equal(tri, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gdn_gating(dtype):
    """g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) from the [b | a] projection, a strided slice of
    a wider one; a + dt_bias past softplus's threshold (20) and far below zero."""
    g = gen_(5)
    HV, T = 6, 7
    wide = rnd(T, 2 * HV + 3, dtype=dtype, gen=g, scale=4.0)
    wide[0, HV:2 * HV] = 30.0
    wide[1, HV:2 * HV] = -30.0
    ba = wide[:, :2 * HV]
    A_log = torch.log(torch.rand(HV, generator=g) * 15 + 1).to(DEV)
    dt_bias = rnd(HV, gen=g)
    (tg, tb), (rg, rb), *_ = both(gdn_gating, ba, A_log, dt_bias)
    assert tg.dtype == tb.dtype == torch.float32 and tg.shape == tb.shape == (T, HV)
    torch.testing.assert_close(tg, rg, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(tb, rb, **tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_rms_norm(dtype):
    g = gen_(2)
    T, HV, dv = 5, 3, 24
    x = rnd(T, HV, dv, dtype=dtype, gen=g)
    qkvz = rnd(T, 40 + HV * dv, dtype=dtype, gen=g)
    z = qkvz[:, 40:].reshape(T, HV, dv)                       # the model's gate: a strided view
    w = rnd(dv, gen=g)
    tri, ref, *_ = both(gated_rms_norm, x, z, w, 1e-6)
    assert tri.dtype == dtype
    torch.testing.assert_close(tri, ref, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(dtype):
    g = gen_(3)
    for shape in [(7, 48), (2, 3, 20), (1, 2)]:
        x = rnd(*shape, dtype=dtype, gen=g, scale=3.0)
        tri, ref, *_ = both(silu_and_mul, x)
        assert tri.shape == shape[:-1] + (shape[-1] // 2,) and tri.dtype == dtype
        torch.testing.assert_close(tri, ref, **tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hd, rd", [(32, 8), (24, 24), (20, 12)], ids=["partial", "whole", "odd"])
def test_rotary(dtype, hd, rd):
    """Partial rotary on q-like views (strided along tokens and heads: a slice of a fused projection), 5 heads (one
    block of 4 and a partial one), tables with unequal halves (as no real table has: each half read for itself)."""
    g = gen_(4)
    fused = rnd(6, 5, 2 * hd, dtype=dtype, gen=g)
    x = fused[..., :hd]
    cos, sin = rnd(6, 1, rd, gen=g), rnd(6, 1, rd, gen=g)
    tri, ref, *_ = both(apply_rotary, x, cos, sin)
    assert tri.shape == x.shape and tri.dtype == dtype
    torch.testing.assert_close(tri, ref, **tol(dtype))
    assert torch.equal(tri[..., rd:], x[..., rd:])


@pytest.mark.parametrize("pool_dtype, x_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                 (torch.float8_e4m3fn, torch.float16)], ids=["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv(page_size, pool_dtype, x_dtype):
    """The KV write: one layer of a two-layer pool, scattered slots, k and v as strided views of a projection (as the
    model's v is); the other layer and every other slot untouched; an FP8 pool saturates at +-448 as torch does."""
    from tinyserve.kernels.attention import store_kv
    from tinyserve.kernels import PoolLayer
    g = gen_(page_size)
    T, KV, hd, pages = 5, 2, 24, 8
    proj = rnd(T, 3 * KV * hd, dtype=x_dtype, gen=g, scale=100.0)
    k, v = proj[:, :KV * hd].reshape(T, KV, hd), proj[:, 2 * KV * hd:].reshape(T, KV, hd)
    slots = torch.randperm(pages * page_size, generator=g)[:T].to(DEV)
    pool = rnd(pages, 2, 2, page_size, KV, hd, gen=g).to(pool_dtype)
    _, _, (_, _, tri_pool, _), (_, _, ref_pool, _) = both(
        lambda k_, v_, p_, s_: store_kv(k_, v_, PoolLayer(p_, 1), s_), k, v, pool, slots, clone=(2,))
    assert torch.equal(tri_pool.float(), ref_pool.float())
    assert torch.equal(tri_pool[:, 0].float(), pool[:, 0].float())


# ---------------------------------------------------------------------------------------------------------------
# Gated delta rule: decode and speculative verify
# ---------------------------------------------------------------------------------------------------------------
def gdn_inputs(T, H, HV, dk, dv, seed, v_dtype=torch.float32):
    g = gen_(seed)
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
    v = torch.randn(T, HV, dv, generator=g).to(v_dtype)
    gate = -torch.rand(T, HV, generator=g) * 0.5
    beta = torch.rand(T, HV, generator=g)
    return [t.to(DEV) for t in (q, k, v, gate, beta)]


@pytest.mark.parametrize("v_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("H,HV", [(2, 2), (2, 6)])
def test_gdn_decode(H, HV, v_dtype):
    dk, dv, N = 16, 40, 3                                      # dv 40: a full and a partial 32-wide block
    slots = torch.tensor([4, 1, 2], device=DEV)
    state = rnd(6, HV, dk, dv, gen=gen_(HV), scale=0.5)
    tri_state, ref_state = state.clone(), state.clone()
    for step in range(2):                                      # the state carries over steps
        q, k, v, gate, beta = gdn_inputs(N, H, HV, dk, dv, seed=step, v_dtype=v_dtype)
        with backend("triton"):
            tri = recurrent_gated_delta_rule_decode(q, k, v, gate, beta, tri_state, slots)
        with backend("torch"):
            ref = recurrent_gated_delta_rule_decode(q, k, v, gate, beta, ref_state, slots)
        assert tri.dtype == v_dtype
        torch.testing.assert_close(tri, ref, **tol(v_dtype))
        torch.testing.assert_close(tri_state, ref_state, **tol(torch.float32))
    for untouched in (0, 3, 5):
        assert torch.equal(tri_state[untouched], state[untouched])


def test_gdn_decode_strided_pool_and_padding_slot():
    """The engine passes one layer's view of a [slots, layers, HV, dk, dv] pool; slot -1 (padding) is neither read
    nor written."""
    H, HV, dk, dv = 1, 2, 16, 16
    pool = rnd(4, 3, HV, dk, dv, gen=gen_(5))
    layer = pool[:, 1]
    before = pool.clone()
    q, k, v, gate, beta = gdn_inputs(2, H, HV, dk, dv, seed=9)
    with backend("torch"):
        ref_state = layer.clone()
        ref = recurrent_gated_delta_rule_decode(q[:1], k[:1], v[:1], gate[:1], beta[:1], ref_state,
                                                torch.tensor([2], device=DEV))
    with backend("triton"):
        out = recurrent_gated_delta_rule_decode(q, k, v, gate, beta, layer, torch.tensor([2, -1], device=DEV))
    torch.testing.assert_close(out[:1], ref, **tol(torch.float32))
    torch.testing.assert_close(pool[:, 1], ref_state, **tol(torch.float32))
    assert torch.equal(pool[:, 0], before[:, 0]) and torch.equal(pool[:, 2], before[:, 2])


def ragged_verify(lens, in_slots, first_free, seed, H=2, HV=4, dk=16, dv=16, v_dtype=torch.float32):
    """A verify step: sequence i has lens[i] tokens, reads in_slots[i], and (as the scheduler does) keeps the state
    after its first token in its own slot and after each draft in a fresh one."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    out_slots, nxt = [], first_free
    for s, n in zip(in_slots, lens):
        out_slots.append([s] + list(range(nxt, nxt + n - 1)))
        nxt += n - 1
    lay = verify_layout(cu, [40 + n for n in lens], in_slots, out_slots, DEV)
    return lay, gdn_inputs(cu[-1], H, HV, dk, dv, seed, v_dtype), nxt


@pytest.mark.parametrize("lens", [[3, 1, 4], [2, 2]], ids=["ragged", "even"])
def test_gdn_verify(lens):
    lay, (q, k, v, gate, beta), n_slots = ragged_verify(lens, [0, 2, 1][:len(lens)], 3, seed=len(lens))
    state = rnd(n_slots + 1, 4, 16, 16, gen=gen_(6), scale=0.5)
    tri, ref, (*_, tri_state, _), (*_, ref_state, _) = both(
        recurrent_gated_delta_rule_verify, q, k, v, gate, beta, state, lay, clone=(5,))
    torch.testing.assert_close(tri, ref, **tol(torch.float32))
    torch.testing.assert_close(tri_state, ref_state, **tol(torch.float32))
    assert torch.equal(tri_state[n_slots], state[n_slots])


def test_gdn_verify_equals_decode_steps():
    """The verify kernel and the decode kernel do the same math: tokens verified at once == decoded one by one."""
    lens = [3, 3]
    lay, (q, k, v, gate, beta), n_slots = ragged_verify(lens, [0, 1], 2, seed=4)
    state = rnd(n_slots, 4, 16, 16, gen=gen_(7), scale=0.5)
    with backend("triton"):
        ver_state = state.clone()
        ver = recurrent_gated_delta_rule_verify(q, k, v, gate, beta, ver_state, lay)
        dec_state = state.clone()
        idx = torch.tensor([0, 1], device=DEV)
        dec = torch.stack([recurrent_gated_delta_rule_decode(q[t::3], k[t::3], v[t::3], gate[t::3], beta[t::3],
                                                             dec_state, idx) for t in range(3)], 1).flatten(0, 1)
    torch.testing.assert_close(ver, dec, atol=1e-6, rtol=1e-6)
    # verify keeps the state after each token in its own slot: after the last, slots 3 and 5 (see ragged_verify)
    torch.testing.assert_close(ver_state[[3, 5]], dec_state[[0, 1]], atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Causal conv1d: decode and speculative verify
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_list", [[1, 2, 3], [3, 0, 2]], ids=["run", "scattered"])
def test_conv_decode(slot_list, dtype):
    C, K = 20, 4
    g = gen_(8)
    weight = rnd(C, K, dtype=dtype, gen=g)
    pool = rnd(5, 2, C, K - 1, dtype=dtype, gen=g)              # [slots, layers, C, K-1]: a layer is a view
    state, other_layer = pool[:, 1], pool[:, 0].clone()
    for step in range(2):
        x = rnd(len(slot_list), C, dtype=dtype, gen=g)
        ref_state = state.clone()
        with backend("torch"):
            # the reference convolves in x's dtype: give it fp32 copies for the oracle
            ref32_state = ref_state.float()
            ref = causal_conv1d_decode(x.float(), weight.float(), ref32_state, torch.tensor(slot_list, device=DEV))
        with backend("triton"):
            tri = causal_conv1d_decode(x, weight, state, torch.tensor(slot_list, device=DEV))
        assert tri.dtype == dtype
        torch.testing.assert_close(tri, ref.to(dtype), **tol(dtype))
        torch.testing.assert_close(state, ref32_state.to(dtype), **tol(dtype))
    assert torch.equal(pool[:, 0], other_layer)


def test_conv_decode_padding_slot():
    C, K = 8, 4
    weight, state = rnd(C, K, gen=gen_(9)), rnd(3, C, K - 1, gen=gen_(10))
    before = state.clone()
    x = rnd(2, C, gen=gen_(11))
    with backend("triton"):
        causal_conv1d_decode(x, weight, state, torch.tensor([-1, -1], device=DEV))
    assert torch.equal(state, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens", [[3, 1, 4], [2, 2]], ids=["ragged", "even"])
def test_conv_verify(lens, dtype):
    C, K = 20, 4
    lay, _, n_slots = ragged_verify(lens, [0, 2, 1][:len(lens)], 3, seed=1)
    g = gen_(12)
    weight = rnd(C, K, dtype=dtype, gen=g)
    x = rnd(sum(lens), C, dtype=dtype, gen=g)
    state = rnd(n_slots + 1, C, K - 1, dtype=dtype, gen=g)
    ref_state = state.clone().float()
    with backend("torch"):
        ref = causal_conv1d_verify(x.float(), weight.float(), ref_state, lay)
    tri_state = state.clone()
    with backend("triton"):
        tri = causal_conv1d_verify(x, weight, tri_state, lay)
    torch.testing.assert_close(tri, ref.to(dtype), **tol(dtype))
    torch.testing.assert_close(tri_state, ref_state.to(dtype), **tol(dtype))
    assert torch.equal(tri_state[n_slots], state[n_slots])


# ---------------------------------------------------------------------------------------------------------------
# Paged attention decode
# ---------------------------------------------------------------------------------------------------------------
def paged_decode_case(lengths, page_size, NH, NKV, HD, kv_dtype, q_dtype, seed):
    """A KV pool with each sequence's context on scattered pages; returns the decode arguments."""
    g = gen_(seed)
    cache, pages, num_pages = paged_kv(lengths, page_size, NKV, HD, kv_dtype, g, spare_pages=2)
    width = max(len(p) for p in pages)
    table = torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.int32, device=DEV)
    q = rnd(len(lengths), NH, HD, dtype=q_dtype, gen=g)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    return q, cache, table, lens, max(lengths), HD ** -0.5


@pytest.mark.parametrize("splits", ["one", "many"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_decode(page_size, splits, monkeypatch):
    monkeypatch.setattr(attention_triton, "SPLIT_MIN_TOKENS", 1 << 20 if splits == "one" else 16)
    args = paged_decode_case([1, 17, 70, 131], page_size, 4, 2, 32, torch.float32, torch.float32, seed=page_size)
    tri, ref, *_ = both(paged_attention_decode, *args)
    torch.testing.assert_close(tri, ref, **tol(torch.float32))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8_e4m3"])
def test_paged_decode_low_precision_kv(kv_dtype, monkeypatch):
    """fp16 q and KV (fp16 dots, fp32 softmax) and fp32 q over an fp8 e4m3 cache, against the reference in fp32
    over the same stored values; GQA 3:1 (an odd group, padded to 16 rows)."""
    monkeypatch.setattr(attention_triton, "SPLIT_MIN_TOKENS", 32)
    q_dtype = torch.float16 if kv_dtype == torch.float16 else torch.float32
    q, cache, table, lens, max_len, scale = paged_decode_case([5, 40, 100], 16, 6, 2, 32, kv_dtype, q_dtype, seed=3)
    with backend("triton"):
        tri = paged_attention_decode(q, cache, table, lens, max_len, scale)
    with backend("torch"):
        ref = paged_attention_decode(q.float(), cache.float(), table, lens, max_len, scale)
    assert tri.dtype == q_dtype
    torch.testing.assert_close(tri.float(), ref, **tol(q_dtype))


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_paged_verify_rows_equal_causal_prefill(page_size, monkeypatch):
    """A NEXTN verify through the decode kernels (each token a row of length position + 1 over its sequence's
    page-table row, table_rows), Triton and torch (both its paths), equals the same tokens attending as causal
    prefill chunks (the torch prefill reference, an independent formulation). Ragged: 3, 1 and 4 tokens; GQA 3:1;
    many splits."""
    monkeypatch.setattr(attention_triton, "SPLIT_MIN_TOKENS", 16)
    lengths, new = [9, 70, 131], [3, 1, 4]
    _, cache, table, *_ = paged_decode_case(lengths, page_size, 6, 2, 32, torch.float32, torch.float32, seed=11)
    cu = [0, 3, 4, 8]
    q = rnd(cu[-1], 6, 32, gen=gen_(12))
    with backend("torch"):
        ref = paged_attention_prefill(q, cache, table, cu, lengths, 32 ** -0.5)
    rows = torch.tensor([i for i, n in enumerate(new) for _ in range(n)], device=DEV)
    lens = torch.tensor([L - n + t + 1 for L, n in zip(lengths, new) for t in range(n)], dtype=torch.int32,
                        device=DEV)
    tri, dec, *_ = both(paged_attention_decode, q, cache, table, lens, max(lengths), 32 ** -0.5, rows)
    torch.testing.assert_close(dec, ref, **tol(torch.float32))
    torch.testing.assert_close(tri, ref, **tol(torch.float32))
    from tinyserve.kernels import attention                       # the reference's path without host reads (GPU)
    monkeypatch.setattr(attention, "row_groups", lambda rows, q: None)
    with backend("torch"):
        per_row = paged_attention_decode(q, cache, table, lens, max(lengths), 32 ** -0.5, rows)
    torch.testing.assert_close(per_row, ref, **tol(torch.float32))


# ---------------------------------------------------------------------------------------------------------------
# The model through the kernels: the real call sites (strided views of fused projections, per-layer pool views)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_greedy_tokens_equal_through_the_triton_kernels(tmp_path, monkeypatch):
    """A tiny hybrid model with a NEXTN head, its linear weights kept FP8 (w8a8: activations quantized per group),
    prefills, decodes and verifies drafts through every Triton kernel here and gives the greedy tokens of the torch
    references."""
    import re

    from checkpoints import fp8_checkpoint, make_agreeing_head, make_qwen3_5_text
    from conftest import PinnedCost, engine_for, nextn, tokens
    from tinyserve.kernels import (activation_triton, attention_triton, conv_triton, fp8_triton, gdn_triton,
                                   norm_triton, rotary_triton)
    from tinyserve.loader import load_model
    from tinyserve.sampling import SamplingParams

    path, _ = make_qwen3_5_text(tmp_path / "bf", with_mtp=True)
    make_agreeing_head(path, mix=0.3)
    ignore = ["lm_head", "re:.*linear_attn\\.in_proj_[ab]$"]
    fp8_checkpoint(path, tmp_path / "fp8", method="fp8", strategy="block", block=(16, 128), ignore=ignore,
                   ignored=lambda m: m == "lm_head" or re.match(r".*linear_attn\.in_proj_[ab]$", m) is not None)
    model = load_model(tmp_path / "fp8", torch.float32, DEV, fp8_weights="w8a8")
    kernels_used = {gdn_triton: ["chunk_gated_delta_rule", "recurrent_gated_delta_rule_decode",
                                 "recurrent_gated_delta_rule_verify"],
                    conv_triton: ["causal_conv1d_prefill", "causal_conv1d_decode", "causal_conv1d_verify"],
                    attention_triton: ["paged_attention_prefill", "paged_attention_decode"],
                    activation_triton: ["silu_and_mul"], norm_triton: ["rms_norm", "gated_rms_norm"],
                    fp8_triton: ["fp8_linear"], rotary_triton: ["apply_rotary"]}
    calls: dict[str, int] = {}
    for mod, names in kernels_used.items():
        for name in names:
            def spy(*a, _f=getattr(mod, name), _n=name, **k):
                calls[_n] = calls.get(_n, 0) + 1
                return _f(*a, **k)
            monkeypatch.setattr(mod, name, spy)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [tokens(5, 0), tokens(20, 1)]
    out = {}
    for name in ("torch", "triton"):
        with backend("auto"):                          # restored after: the engine sets it from engine.kernels
            eng = engine_for(model, engine={"page_size": 16, "kernels": name}, cache={"enabled": False},
                             speculative={"num_steps": 3, "max_running": 0})
            assert kernels.backend() == name
            nextn(eng).step_cost = PinnedCost()
            out[name] = eng.generate(prompts, params)
    assert out["triton"] == out["torch"]
    assert set(calls) == {n for names in kernels_used.values() for n in names}, calls


# ---------------------------------------------------------------------------------------------------------------
# The GPU tier: bf16 and the shapes of Qwen3.5-27B (hidden 5120, MLP 17408; GDN 16 key / 48 value heads of 128,
# conv_dim 10240, width 4; attention 24 q / 4 KV heads of 256). Compiled kernels, bf16 dots, looser tolerances.
# ---------------------------------------------------------------------------------------------------------------
def close_to_fp32_reference(tri: torch.Tensor, ref32: torch.Tensor, rel: float = 2e-2) -> None:
    """bf16 results: the error against the fp32 reference, relative to the reference's scale."""
    err = (tri.float() - ref32).abs().max().item()
    assert err <= rel * max(ref32.abs().max().item(), 1.0), f"max error {err}"


@gpu
@needs_gpu
def test_gpu_norms_and_activation_bf16():
    bf = torch.bfloat16
    w = rnd(5120, scale=0.1)
    qg = rnd(64, 24, 512, dtype=bf)
    o, z = rnd(64, 48, 128, dtype=bf), rnd(64, 48 * 128 * 2, dtype=bf)[:, 6144:].reshape(64, 48, 128)
    cases = [(rms_norm, (rnd(64, 5120, dtype=bf), w, 1e-6)),
             (rms_norm, (qg.split([256, 256], dim=-1)[0], w[:256], 1e-6)),     # per-head q norm, in place
             (rms_norm, (rnd(64, 5120, dtype=bf), w, 1e-6, False)),
             (gated_rms_norm, (o, z, w[:128], 1e-6)),
             (silu_and_mul, (rnd(64, 2 * 17408, dtype=bf, scale=3.0),)),
             (apply_rotary, (qg.split([256, 256], dim=-1)[0], rnd(64, 1, 64), rnd(64, 1, 64)))]
    for fn, args in cases:
        with backend("triton"):
            tri = fn(*args)
        with backend("torch"):
            ref32 = fn(*[a.float() if torch.is_tensor(a) else a for a in args])
        assert tri.dtype == bf
        close_to_fp32_reference(tri, ref32)


@gpu
@needs_gpu
def test_gpu_gdn_decode_and_verify_qwen35_27b_shapes():
    H, HV, dk, dv = 16, 48, 128, 128
    state = rnd(24, HV, dk, dv, scale=0.1)
    q, k, v, gate, beta = gdn_inputs(8, H, HV, dk, dv, seed=1, v_dtype=torch.bfloat16)
    slots = torch.tensor([3, 9, 1, 0, 7, 2, 11, 5], device=DEV)
    tri, ref, (*_, tri_state, _), (*_, ref_state, _) = both(
        recurrent_gated_delta_rule_decode, q, k, v, gate, beta, state, slots, clone=(5,))
    close_to_fp32_reference(tri, ref.float())
    torch.testing.assert_close(tri_state, ref_state, atol=1e-3, rtol=1e-3)
    lay, (q, k, v, gate, beta), n = ragged_verify([4, 2, 4, 1], [0, 2, 1, 3], 4, seed=2, H=H, HV=HV, dk=dk, dv=dv,
                                                  v_dtype=torch.bfloat16)
    state = rnd(n, HV, dk, dv, scale=0.1)
    tri, ref, (*_, tri_state, _), (*_, ref_state, _) = both(
        recurrent_gated_delta_rule_verify, q, k, v, gate, beta, state, lay, clone=(5,))
    close_to_fp32_reference(tri, ref.float())
    torch.testing.assert_close(tri_state, ref_state, atol=1e-3, rtol=1e-3)


@gpu
@needs_gpu
def test_gpu_conv_decode_and_verify_qwen35_27b_shapes():
    C, K, bf = 10240, 4, torch.bfloat16
    weight = rnd(C, K, dtype=bf)
    state = rnd(16, C, K - 1, dtype=bf)
    x = rnd(8, C, dtype=bf)
    slots = torch.tensor([3, 9, 1, 0, 7, 2, 11, 5], device=DEV)
    ref_state = state.clone().float()
    with backend("torch"):
        ref = causal_conv1d_decode(x.float(), weight.float(), ref_state, slots)
    with backend("triton"):
        tri = causal_conv1d_decode(x, weight, state, slots)
    close_to_fp32_reference(tri, ref)
    close_to_fp32_reference(state, ref_state)
    lay, _, n = ragged_verify([4, 2, 4, 1], [0, 2, 1, 3], 4, seed=2)
    state, x = rnd(n, C, K - 1, dtype=bf), rnd(lay.out_slots.numel(), C, dtype=bf)
    ref_state = state.clone().float()
    with backend("torch"):
        ref = causal_conv1d_verify(x.float(), weight.float(), ref_state, lay)
    with backend("triton"):
        tri = causal_conv1d_verify(x, weight, state, lay)
    close_to_fp32_reference(tri, ref)
    close_to_fp32_reference(state, ref_state)


@gpu
@needs_gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_paged_decode_qwen35_27b_shapes(page_size, kv_dtype):
    q, cache, table, lens, max_len, scale = paged_decode_case([1, 300, 4097, 20000], page_size, 24, 4, 256,
                                                              kv_dtype, torch.bfloat16, seed=page_size)
    with backend("triton"):
        tri = paged_attention_decode(q, cache, table, lens, max_len, scale)
    with backend("torch"):
        ref = paged_attention_decode(q.float(), cache.float(), table, lens, max_len, scale)
    close_to_fp32_reference(tri, ref)
