"""The torch reference kernels against independent computations: a per-token Python loop of the delta rule,
transformers' chunked delta rule, torch conv1d over the whole history, dense causal SDPA over the same tokens, and
the norm formulas written out here. fp32, tiny shapes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from conftest import TEST_DEVICE
from tinyserve.kernels.attention import paged_attention_decode, paged_attention_prefill, store_kv
from tinyserve.kernels.conv import causal_conv1d_decode, causal_conv1d_prefill
from tinyserve.kernels.gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule_decode
from tinyserve.kernels.pointwise import gated_rms_norm, rms_norm
from tinyserve.pools import KVPool
from tinyserve.plan import DTYPE_TABLE, torch_dtype

DK, DV = 16, 8


# ---------------------------------------------------------------------------------------------------------------
# Gated delta rule
# ---------------------------------------------------------------------------------------------------------------
def delta_rule_loop(q, k, v, g, beta, S0):
    """The recurrence token by token for one sequence. q, k [L, HV, dk] (already head-expanded), v [L, HV, dv],
    g, beta [L, HV], S0 [HV, dk, dv]. Returns (o [L, HV, dv], S_final)."""
    S = S0.clone().double()
    outs = []
    for t in range(q.shape[0]):
        S = S * g[t].double().exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", S, k[t].double())
        delta = beta[t].double()[:, None] * (v[t].double() - pred)
        S = S + k[t].double()[:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t].double()))
    return torch.stack(outs).float(), S.float()


def gdn_inputs(T: int, H: int, HV: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, H, DK, generator=gen), dim=-1) * DK ** -0.5
    k = F.normalize(torch.randn(T, H, DK, generator=gen), dim=-1)
    v = torch.randn(T, HV, DV, generator=gen)
    g = -torch.rand(T, HV, generator=gen) * 0.5              # log-decay in (-0.5, 0]
    beta = torch.rand(T, HV, generator=gen)
    return q, k, v, g, beta


def expand(x: torch.Tensor, HV: int) -> torch.Tensor:
    return x.repeat_interleave(HV // x.shape[1], dim=1)


@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4), (1, 3)])
def test_chunk_gdn_packed_varlen_matches_loop_and_transformers(H, HV):
    lens = [1, 63, 64, 65, 130]
    slots = [5, 0, 3, 6, 1]                        # distinct, out of order; slots 2, 4, 7 must stay untouched
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = gdn_inputs(cu[-1], H, HV, seed=H * 10 + HV)
    gen = torch.Generator().manual_seed(7)
    state = torch.randn(8, HV, DK, DV, generator=gen) * 0.5
    before = state.clone()

    out = chunk_gated_delta_rule(q, k, v, g, beta, state, cu, slots)

    for i, slot in enumerate(slots):
        s, e = cu[i], cu[i + 1]
        o_ref, S_ref = delta_rule_loop(expand(q[s:e], HV), expand(k[s:e], HV), v[s:e], g[s:e], beta[s:e],
                                       before[slot])
        torch.testing.assert_close(out[s:e], o_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[slot], S_ref, atol=1e-4, rtol=1e-4)
        # transformers' chunked form (it scales q by dk^-1/2 itself, so hand it the unscaled q)
        o_hf, S_hf = torch_chunk_gated_delta_rule(
            (q[s:e] * DK ** 0.5)[None], k[s:e][None], v[s:e][None], g[s:e][None], beta[s:e][None],
            initial_state=before[slot][None].clone(), output_final_state=True)
        torch.testing.assert_close(out[s:e], o_hf[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[slot], S_hf[0], atol=1e-4, rtol=1e-4)
    for untouched in (2, 4, 7):
        assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunk_gdn_continuation_equals_one_pass(chunk_size):
    """Prefill 70 tokens then 50 more from the written-back state == 120 tokens at once."""
    q, k, v, g, beta = gdn_inputs(120, 2, 4, seed=3)
    one = torch.zeros(2, 4, DK, DV)
    full = chunk_gated_delta_rule(q, k, v, g, beta, one, [0, 120], [1], chunk_size)
    two = torch.zeros(2, 4, DK, DV)
    a = chunk_gated_delta_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], two, [0, 70], [1], chunk_size)
    b = chunk_gated_delta_rule(q[70:], k[70:], v[70:], g[70:], beta[70:], two, [0, 50], [1], chunk_size)
    torch.testing.assert_close(torch.cat([a, b]), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


def test_chunk_gdn_snapshots_inside_a_chunk_are_the_state_there():
    """Snapshots written by the forward (the prefix cache's, inside a prefill chunk) hold the state after exactly
    their offset, as the token-by-token recurrence gives it; the outputs and final states do not change."""
    cu, slots = [0, 120, 168, 201], [1, 2, 3]
    q, k, v, g, beta = gdn_inputs(cu[-1], 2, 4, seed=5)
    snaps = [(0, 16, 4), (0, 112, 5), (1, 32, 6), (2, 16, 7)]
    initial = torch.randn(8, 4, DK, DV, generator=torch.Generator().manual_seed(6))
    plain, with_snaps = initial.clone(), initial.clone()
    o_plain = chunk_gated_delta_rule(q, k, v, g, beta, plain, cu, slots)
    o_snaps = chunk_gated_delta_rule(q, k, v, g, beta, with_snaps, cu, slots, snapshots=snaps)
    torch.testing.assert_close(o_snaps, o_plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(with_snaps[1:4], plain[1:4], atol=1e-5, rtol=1e-5)
    for i, offset, slot in snaps:
        t = slice(cu[i], cu[i] + offset)
        _, S = delta_rule_loop(expand(q[t], 4), expand(k[t], 4), v[t], g[t], beta[t], initial[slots[i]])
        torch.testing.assert_close(with_snaps[slot], S, atol=1e-4, rtol=1e-4)


def test_conv_snapshots_inside_a_chunk_are_the_history_there():
    """A snapshot's conv history is what a prefill that stopped at its offset leaves (offsets shorter than the
    history included); the outputs and final histories do not change."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(C, K, generator=gen)
    x = torch.randn(50, C, generator=gen)
    cu, slots, snaps = [0, 34, 50], [1, 2], [(0, 16, 3), (0, 32, 4), (1, 1, 5)]
    initial = torch.randn(6, C, K - 1, generator=gen)
    plain, with_snaps = initial.clone(), initial.clone()
    out_plain = causal_conv1d_prefill(x, weight, plain, cu, slots)
    out_snaps = causal_conv1d_prefill(x, weight, with_snaps, cu, slots, snaps)
    torch.testing.assert_close(out_snaps, out_plain)
    torch.testing.assert_close(with_snaps[1:3], plain[1:3])
    for i, offset, slot in snaps:
        stopped = initial.clone()
        causal_conv1d_prefill(x[cu[i]:cu[i] + offset], weight, stopped, [0, offset], [slots[i]])
        torch.testing.assert_close(with_snaps[slot], stopped[slots[i]])


@pytest.mark.parametrize("slot_list", [[4, 1, 2], [1, 2, 3], [4]], ids=["scattered", "run", "lone"])  # runs: views
@pytest.mark.parametrize("H,HV", [(2, 2), (2, 4), (2, 6)])
def test_recurrent_decode_matches_loop(H, HV, slot_list):
    N, steps = len(slot_list), 4
    slots = torch.tensor(slot_list)
    gen = torch.Generator().manual_seed(HV)
    state = torch.randn(6, HV, DK, DV, generator=gen) * 0.5
    before = state.clone()
    q, k, v, g, beta = gdn_inputs(N * steps, H, HV, seed=HV + 100)
    q, k, v, g, beta = (x.view(steps, N, *x.shape[1:]) for x in (q, k, v, g, beta))
    outs = [recurrent_gated_delta_rule_decode(q[t], k[t], v[t], g[t], beta[t], state, slots) for t in range(steps)]
    out = torch.stack(outs)                                         # [steps, N, HV, dv]
    for n, slot in enumerate(slots.tolist()):
        o_ref, S_ref = delta_rule_loop(expand(q[:, n], HV), expand(k[:, n], HV), v[:, n], g[:, n], beta[:, n],
                                       before[slot])
        torch.testing.assert_close(out[:, n], o_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[slot], S_ref, atol=1e-5, rtol=1e-5)
    for untouched in sorted(set(range(6)) - set(slot_list)):
        assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("lens", [[3, 1, 4], [2, 2], [4]], ids=["ragged", "even", "lone"])
def test_recurrent_verify_equals_decode_steps(lens):
    """The torch verify (a compiled CPU step's): sequences of 1 + k tokens at once give the outputs of decoding them
    one by one, and the state after each real token lands in its own slot; padding (a ragged batch) writes nothing
    else."""
    from tinyserve.kernels.gdn import recurrent_gated_delta_rule_verify
    from tinyserve.kernels.verify_layout import verify_layout
    H, HV, n = 2, 4, len(lens)
    cu = [0]
    for m in lens:
        cu.append(cu[-1] + m)
    out_slots = [list(range(n + cu[i], n + cu[i + 1])) for i in range(n)]      # each token its own fresh slot
    gen = torch.Generator().manual_seed(len(lens))
    state = torch.randn(n + cu[-1] + 2, HV, DK, DV, generator=gen) * 0.5
    before = state.clone()
    q, k, v, g, beta = gdn_inputs(cu[-1], H, HV, seed=7)
    lay = verify_layout(cu, [30 + m for m in lens], list(range(n)), out_slots, "cpu")
    out = recurrent_gated_delta_rule_verify(q, k, v, g, beta, state, lay)
    for i in range(n):
        rows = slice(cu[i], cu[i + 1])
        dec_state, dec = before.clone(), []
        for j, t in enumerate(range(rows.start, rows.stop)):
            dec.append(recurrent_gated_delta_rule_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                                         beta[t:t + 1], dec_state, torch.tensor([i])))
            torch.testing.assert_close(state[out_slots[i][j]], dec_state[i], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(out[rows], torch.cat(dec), atol=1e-6, rtol=1e-6)
        o_ref, S_ref = delta_rule_loop(expand(q[rows], HV), expand(k[rows], HV), v[rows], g[rows], beta[rows],
                                       before[i])
        torch.testing.assert_close(state[out_slots[i][-1]], S_ref, atol=1e-5, rtol=1e-5)
    written = {s for slots in out_slots for s in slots}
    for untouched in sorted(set(range(state.shape[0])) - written):
        assert torch.equal(state[untouched], before[untouched])


def test_chunk_prefill_then_decode_equals_loop():
    q, k, v, g, beta = gdn_inputs(40, 2, 4, seed=11)
    state = torch.zeros(3, 4, DK, DV)
    a = chunk_gated_delta_rule(q[:37], k[:37], v[:37], g[:37], beta[:37], state, [0, 37], [2])
    dec = [recurrent_gated_delta_rule_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state,
                                             torch.tensor([2])) for t in range(37, 40)]
    o_ref, S_ref = delta_rule_loop(expand(q, 4), expand(k, 4), v, g, beta, torch.zeros(4, DK, DV))
    torch.testing.assert_close(torch.cat([a] + dec), o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state[2], S_ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Causal depthwise conv1d
# ---------------------------------------------------------------------------------------------------------------
C, K = 12, 4


def conv_reference(x_full: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(conv1d) over a whole sequence with K-1 zeros on the left. x_full [L, C]."""
    y = F.conv1d(F.pad(x_full.t()[None], (K - 1, 0)), weight[:, None, :], groups=C)
    return F.silu(y[0].t())


def test_conv_prefill_packed_with_history():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(C, K, generator=gen)
    lens, slots = [1, 2, 5, 9], [3, 0, 2, 5]
    hist = [torch.randn(K - 1, C, generator=gen) for _ in lens]   # pretend earlier inputs of each sequence
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = torch.randn(cu[-1], C, generator=gen)
    conv_state = torch.randn(6, C, K - 1, generator=gen)
    for i, s in enumerate(slots):
        conv_state[s] = hist[i].t()
    before = conv_state.clone()
    out = causal_conv1d_prefill(x, weight, conv_state, cu, slots)
    for i, s in enumerate(slots):
        seq = torch.cat([hist[i], x[cu[i]:cu[i + 1]]])
        ref = conv_reference(seq, weight)[K - 1:]                   # drop the history's own outputs
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_state[s], seq[-(K - 1):].t())
    for untouched in (1, 4):
        assert torch.equal(conv_state[untouched], before[untouched])


def test_conv_continuations_equal_one_pass():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(C, K, generator=gen)
    x = torch.randn(20, C, generator=gen)
    ref = conv_reference(x, weight)

    st = torch.zeros(2, C, K - 1)                  # prefill 2 (shorter than K-1) + prefill 11 + prefill 7
    parts = [causal_conv1d_prefill(x[a:b], weight, st, [0, b - a], [1]) for a, b in [(0, 2), (2, 13), (13, 20)]]
    torch.testing.assert_close(torch.cat(parts), ref, atol=1e-5, rtol=1e-5)

    st = torch.zeros(2, C, K - 1)                  # prefill 15 + 5 decodes
    parts = [causal_conv1d_prefill(x[:15], weight, st, [0, 15], [1])]
    parts += [causal_conv1d_decode(x[t:t + 1], weight, st, torch.tensor([1])) for t in range(15, 20)]
    torch.testing.assert_close(torch.cat(parts), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st[1], x[-(K - 1):].t())
    assert torch.equal(st[0], torch.zeros(C, K - 1))


@pytest.mark.parametrize("slot_list", [[1, 2, 3], [3, 0, 2], [4]], ids=["run", "scattered", "lone"])
def test_conv_decode_batch_matches_reference(slot_list):
    """A batch of decodes: each output from its own slot's window, each slot shifted by one, others untouched
    (a run of slots is updated through a view, other sets through index_copy_)."""
    C, K = 6, 4
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(C, K, generator=g)
    state = torch.randn(5, C, K - 1, generator=g)
    before = state.clone()
    x = torch.randn(len(slot_list), C, generator=g)
    out = causal_conv1d_decode(x, weight, state, torch.tensor(slot_list))
    for n, slot in enumerate(slot_list):
        window = torch.cat([before[slot], x[n][:, None]], dim=1)
        torch.testing.assert_close(out[n], F.silu((window * weight).sum(-1)))
        torch.testing.assert_close(state[slot], window[:, 1:])
    for slot in set(range(5)) - set(slot_list):
        assert torch.equal(state[slot], before[slot])


# ---------------------------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------------------------
NH, NKV, HD = 4, 2, 8


def dense_causal(q, k, v, scale):
    """q [n, H, hd] are the last n of L positions; k, v [L, KV, hd]."""
    n, L = q.shape[0], k.shape[0]
    kk, vv = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk.double()) * scale
    mask = torch.arange(L)[None] <= torch.arange(L - n, L)[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv.double()).float()


def scattered_pages(lengths: list[int], page_size: int, num_pages: int, seed: int) -> list[list[int]]:
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    out = []
    for L in lengths:
        n = -(-L // page_size)
        out.append(perm[:n])
        perm = perm[n:]
    return out


def page_table_of(pages: list[list[int]]) -> torch.Tensor:
    width = max(len(p) for p in pages)
    return torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.int32)


def slots_of(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    return torch.tensor([pages[p // page_size] * page_size + p % page_size for p in range(start, end)])


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_prefill_and_decode_match_dense(page_size):
    gen = torch.Generator().manual_seed(page_size)
    lengths = [1, 17, 70, 130]
    cached = [0, 5, 64, 100]                       # tokens already in the cache; the rest are new this step
    num_pages = sum(-(-(L + 1) // page_size) for L in lengths) + 3
    # pages for the prompt plus the decode token below, scattered over the pool in shuffled order
    pages = scattered_pages([L + 1 for L in lengths], page_size, num_pages, seed=page_size)
    cache = torch.zeros(num_pages, 2, page_size, NKV, HD)
    ks = [torch.randn(L, NKV, HD, generator=gen) for L in lengths]
    vs = [torch.randn(L, NKV, HD, generator=gen) for L in lengths]
    qs = [torch.randn(L, NH, HD, generator=gen) for L in lengths]
    scale = HD ** -0.5
    # the cached part was written by earlier steps
    for i, c in enumerate(cached):
        if c:
            store_kv(ks[i][:c], vs[i][:c], cache, slots_of(pages[i], page_size, 0, c))
    # this step: store the new tokens of every sequence (packed), then attend
    new_k = torch.cat([ks[i][c:] for i, c in enumerate(cached)])
    new_v = torch.cat([vs[i][c:] for i, c in enumerate(cached)])
    q = torch.cat([qs[i][c:] for i, c in enumerate(cached)])
    slot_map = torch.cat([slots_of(pages[i], page_size, c, lengths[i]) for i, c in enumerate(cached)])
    store_kv(new_k, new_v, cache, slot_map)
    cu = [0]
    for L, c in zip(lengths, cached):
        cu.append(cu[-1] + L - c)
    out = paged_attention_prefill(q, cache, page_table_of(pages), cu, lengths, scale)
    for i, (L, c) in enumerate(zip(lengths, cached)):
        ref = dense_causal(qs[i][c:], ks[i], vs[i], scale)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, atol=1e-5, rtol=1e-5)

    # decode: one more token per sequence
    dq = torch.randn(len(lengths), NH, HD, generator=gen)
    dk = torch.randn(len(lengths), NKV, HD, generator=gen)
    dv = torch.randn(len(lengths), NKV, HD, generator=gen)
    new_lens = [L + 1 for L in lengths]
    store_kv(dk, dv, cache, torch.cat([slots_of(p, page_size, L, L + 1) for p, L in zip(pages, lengths)]))
    out = paged_attention_decode(dq, cache, page_table_of(pages), torch.tensor(new_lens, dtype=torch.int32),
                                 max(new_lens), scale)
    for i in range(len(lengths)):
        ref = dense_causal(dq[i:i + 1], torch.cat([ks[i], dk[i:i + 1]]), torch.cat([vs[i], dv[i:i + 1]]), scale)
        torch.testing.assert_close(out[i:i + 1], ref, atol=1e-5, rtol=1e-5)


def test_store_kv_round_trip():
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(5, 2, 4, NKV, HD)
    slots = torch.tensor([17, 3, 8, 0, 19])
    k, v = torch.randn(5, NKV, HD, generator=gen), torch.randn(5, NKV, HD, generator=gen)
    store_kv(k, v, cache, slots)
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(cache[s // 4, 0, s % 4], k[t])
        assert torch.equal(cache[s // 4, 1, s % 4], v[t])
    written = torch.zeros(5 * 4, dtype=torch.bool)
    written[slots] = True
    flat = cache.transpose(0, 1).reshape(2, 20, NKV, HD)
    assert flat[:, ~written].abs().sum() == 0


def test_kv_pool_layer_views_share_the_buffer():
    pool = KVPool(3, 4, num_layers=2, num_kv_heads=NKV, head_dim=HD, dtype=torch.float32, device="cpu")
    k = torch.ones(1, NKV, HD)
    store_kv(k, 2 * k, pool.layer(1), torch.tensor([5]))
    assert pool.buffer[1, 1, 0, 1].eq(1).all() and pool.buffer[1, 1, 1, 1].eq(2).all()
    assert pool.buffer[:, 0].abs().sum() == 0
    assert pool.bytes_per_page == 2 * 2 * 4 * NKV * HD * 4


@pytest.mark.parametrize("name", [n for n in DTYPE_TABLE if n.startswith("fp8")])
def test_fp8_kv_pool_round_trip(name):
    dtype = torch_dtype(name)
    pool = KVPool(4, 16, num_layers=1, num_kv_heads=NKV, head_dim=HD, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(20, NKV, HD, generator=gen), torch.randn(20, NKV, HD, generator=gen)
    pages = [[2, 0]]
    store_kv(k, v, pool.layer(0), slots_of(pages[0], 16, 0, 20))
    q = torch.randn(20, NH, HD, generator=gen)
    out = paged_attention_prefill(q, pool.layer(0), page_table_of(pages), [0, 20], [20], HD ** -0.5)
    kq, vq = k.to(dtype).float(), v.to(dtype).float()
    torch.testing.assert_close(out, dense_causal(q, kq, vq, HD ** -0.5), atol=1e-5, rtol=1e-5)
    # e4m3 keeps ~2 significant bits of mantissa beyond the implicit one: relative error <= 1/16
    assert ((kq - k).abs() <= k.abs() / 16 + 1e-3).all()


# ---------------------------------------------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------------------------------------------
def test_rms_norm_zero_centred_and_plain():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=gen), torch.randn(32, generator=gen)
    eps = 1e-6
    rms = (x.double().pow(2).mean(-1, keepdim=True) + eps).sqrt()
    torch.testing.assert_close(rms_norm(x, w, eps), (x.double() / rms * (1 + w.double())).float())
    torch.testing.assert_close(rms_norm(x, w, eps, zero_centred=False), (x.double() / rms * w.double()).float())
    xb = x.to(torch.bfloat16)
    assert rms_norm(xb, w, eps).dtype == torch.bfloat16


def test_gated_rms_norm_formula():
    gen = torch.Generator().manual_seed(1)
    x, z = torch.randn(3, 4, 16, generator=gen), torch.randn(3, 4, 16, generator=gen)
    w = torch.randn(16, generator=gen)
    eps = 1e-6
    xd = x.double()
    ref = xd / (xd.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w.double() * (z.double() * torch.sigmoid(z.double()))
    torch.testing.assert_close(gated_rms_norm(x, z, w, eps), ref.float())


def test_an_old_triton_is_not_used(monkeypatch):
    """The Triton kernels need triton >= kernels.MIN_TRITON (bf16x3 dots): an older one makes "auto" run the torch
    references and "triton" fail naming the version, instead of a compile error at the first prefill."""
    triton = pytest.importorskip("triton")
    import tinyserve.kernels as kernels
    monkeypatch.setattr(kernels, "_triton", None)
    monkeypatch.setattr(triton, "__version__", "3.4.0")
    assert not kernels.triton_available() and "triton >= 3.5, found 3.4.0" in kernels.triton_problem()
    with pytest.raises(RuntimeError, match="3.4.0"):
        kernels.set_backend("triton")
    monkeypatch.setattr(kernels, "_triton", None)
    monkeypatch.setattr(triton, "__version__", "3.7.1+git1234")
    assert kernels.triton_available()
    monkeypatch.setattr(kernels, "_triton", None)          # the next caller checks the real version again


# ---------------------------------------------------------------------------------------------------------------
# Dense projections: the CPU GEMM routes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not in this torch build")
def test_every_cpu_gemm_route_gives_the_plain_product(monkeypatch):
    """Each route `calibrate` may choose (oneDNN on the plain weight or on its packed copy, MKL) computes x W^T for
    every bucket's row counts, and a packed copy goes when its weight goes."""
    import gc
    from tinyserve.kernels import linear as lin
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 80, generator=gen)
    for route in lin.ROUTES:
        monkeypatch.setitem(lin._route, "few", route)
        monkeypatch.setitem(lin._route, "many", route)
        monkeypatch.setattr(lin, "_packed", {})
        assert lin.pack([w]) == (w.numel() * 4 if route == "onednn-packed" else 0)
        for rows in (1, 2, 8, 16, 17, 300):
            x = torch.randn(rows, 80, generator=gen)
            torch.testing.assert_close(lin.linear(x, w), x @ w.t(), atol=1e-4, rtol=1e-5)
    # the packed route reads the copy (here one of 2 W under W's address), for its rows only
    monkeypatch.setitem(lin._route, "few", "onednn-packed")
    monkeypatch.setitem(lin._route, "many", "onednn")
    monkeypatch.setattr(lin, "_packed", {(w.data_ptr(), tuple(w.shape)): lin._pack_one(2 * w)})
    x = torch.randn(8, 80, generator=gen)
    torch.testing.assert_close(lin.linear(x, w), 2 * (x @ w.t()), atol=1e-4, rtol=1e-5)
    for rows in (1, 17):
        torch.testing.assert_close(lin.linear(x[:1].expand(rows, 80), w), x[:1].expand(rows, 80) @ w.t(),
                                   atol=1e-4, rtol=1e-5)
    monkeypatch.setitem(lin._route, "few", "onednn-packed")
    monkeypatch.setattr(lin, "_packed", {})
    doomed = torch.randn(64, 80, generator=gen)
    lin.pack([w, doomed])
    assert len(lin._packed) == 2
    del doomed
    gc.collect()
    assert len(lin._packed) == 1, "a packed copy outlived its weight"


def test_bfloat16_gemms_calibrate_and_run_on_any_cpu():
    """oneDNN's bfloat16 GEMM cannot even be set up on a CPU without AVX512 BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only
    AMD EPYC 7001): calibrating a bfloat16 model's projections there stopped the server at start. Now bfloat16 takes
    oneDNN only where it runs, and F.linear elsewhere. In a fresh process: `calibrate` runs once per process."""
    code = """
import torch
from tinyserve.kernels import ONEDNN_DTYPES, linear as lin
w = torch.randn(96, 80).to(torch.bfloat16)
print(lin.calibrate([w], repeats=1, may_pack=True))
assert lin.pack([w]) in (0, w.numel() * 2)
for rows in (1, 8, 300):
    x = torch.randn(rows, 80).to(torch.bfloat16)
    torch.testing.assert_close(lin.linear(x, w).float(), x.float() @ w.float().t(), atol=2e-2, rtol=2e-2)
print(torch.bfloat16 in ONEDNN_DTYPES)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the compiled CPU steps' route")
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_lone_decode_multiplies_in_its_own_code_as_the_gemm_does(dtype):
    """A compiled step of one sequence multiplies up to FUSED_ROWS rows in its own C++ (_multiply_and_sum, no call
    out of the graph), in float32 and in bfloat16: the float32 product of the same values, rounded once to the
    dtype (what oneDNN's GEMM gives: bfloat16 products are exact in float32, summed in float32), up to the order of
    the sums."""
    import torch._dynamo
    from torch._inductor.compile_fx import compile_fx
    from tinyserve.kernels import linear as lin
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 256, generator=gen).to(dtype)
    traced: list[str] = []

    def inductor(gm, example_inputs):          # inductor, after noting what the graph calls
        traced.extend(str(node.target) for node in gm.graph.nodes)
        return compile_fx(gm, example_inputs)
    torch._dynamo.reset()
    with lin.fused_rows(True):
        step = torch.compile(lambda x: lin.linear(x, w), backend=inductor, fullgraph=True, dynamic=False)
        for rows in range(1, lin.FUSED_ROWS + 1):
            x = torch.randn(rows, 256, generator=gen).to(dtype)
            got, want = step(x), (x.float() @ w.float().t())
            assert got.dtype == dtype
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
            else:                              # within one rounding of bfloat16 (2^-8 relative) of the exact sum
                torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2 ** -8)
    torch._dynamo.reset()
    assert traced and not [t for t in traced if "linear" in t or "mm" in t], traced


GEMM_GROWTH = r"""
import sys
import torch
if sys.argv[1] == "ours":
    import tinyserve.kernels.linear  # noqa: F401  (sets oneDNN's cache sizes)
w = torch.randn(256, 64)
def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
start = rss_mb()
with torch.inference_mode():
    for rows in range(17, 1217):
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, 64), w, None, "none", [], "")
print(rss_mb() - start)
"""


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not os.path.exists("/proc/self/status"),
                    reason="oneDNN is not in this torch build, or no /proc to read memory from")
def test_onednn_keeps_a_bounded_number_of_gemms():
    """oneDNN keeps every GEMM it has set up, per row count (~0.6 MB each, 1,024 in each of two caches by default):
    prefill chunks of every length grew a server by ~600 MB. Importing our linear module bounds both caches, so
    1,200 row counts grow a fresh process by well under what they do with oneDNN's defaults."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    growth = {which: float(subprocess.run([sys.executable, "-c", GEMM_GROWTH, which], env=env, check=True,
                                          capture_output=True, text=True).stdout)
              for which in ("default", "ours")}
    assert growth["ours"] < 0.6 * growth["default"], growth
