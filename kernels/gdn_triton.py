"""Triton kernels for kernels/gdn.py: the recurrent gated delta rule for decode (one token per sequence) and for
speculative verify (1 + k tokens per sequence, the state after each token stored in its own slot), and the chunked
form for prefill (chunk_gated_delta_rule, described where its kernels begin below).

One recurrent kernel serves decode and verify. A program owns one (sequence, value head, dv block) and keeps its
[dk, BV] slice of the fp32 state in registers across the sequence's tokens: it reads the slice once from the
sequence's slot and writes it after every token to that token's slot (decode: the same slot). The state pool is
[slots, HV, dk, dv] in any float dtype (math in fp32); a slot id < 0 means padding: nothing is read (zero state) and
nothing is stored, so padded rows of a captured graph are harmless. The per-token math is the reference's, in the
same order: S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tinyserve.kernels.gdn import VerifyLayout


@triton.jit
def _recurrent_gdn_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, in_slot_ptr, out_slot_ptr, rows_ptr,
                          L, T, R, DK, DV,
                          sqt, sqh, skt, skh, svt, svh, sgt, sgh, sbt, sbh, ss0, ss1, ss2, ss3, sot, soh,
                          VERIFY: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    i_n = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_h = i_hv // R                                   # the key head this value head reads (GVA)
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mk, mv = ok < DK, ov < DV
    s_off = i_hv.to(tl.int64) * ss1 + ok[:, None].to(tl.int64) * ss2 + ov[None, :].to(tl.int64) * ss3
    slot_in = tl.load(in_slot_ptr + i_n).to(tl.int64)
    S = tl.load(s_ptr + slot_in * ss0 + s_off, mask=(slot_in >= 0) & mk[:, None] & mv[None, :],
                other=0.0).to(tl.float32)
    for t in range(L):
        if VERIFY:
            row = tl.load(rows_ptr + i_n.to(tl.int64) * L + t).to(tl.int64)
        else:
            row = i_n.to(tl.int64)
        real = row < T                               # row T: padding past the sequence's end
        q = tl.load(q_ptr + row * sqt + i_h * sqh + ok, mask=real & mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * skt + i_h * skh + ok, mask=real & mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * svt + i_hv * svh + ov, mask=real & mv, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * sgt + i_hv * sgh, mask=real, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + row * sbt + i_hv * sbh, mask=real, other=0.0).to(tl.float32)
        S = S * tl.exp(g)
        pred = tl.sum(S * k[:, None], axis=0)                         # S^T k  [BV]
        delta = beta * (v - pred)
        S = S + k[:, None] * delta[None, :]
        o = tl.sum(S * q[:, None], axis=0)                            # S^T q  [BV]
        tl.store(o_ptr + row * sot + i_hv * soh + ov, o.to(o_ptr.dtype.element_ty), mask=real & mv)
        slot_out = tl.load(out_slot_ptr + row, mask=real, other=-1).to(tl.int64)
        tl.store(s_ptr + slot_out * ss0 + s_off, S.to(s_ptr.dtype.element_ty),
                 mask=real & (slot_out >= 0) & mk[:, None] & mv[None, :])


def _launch(q, k, v, g, beta, state, in_slots, out_slots, rows, L: int, T: int, N: int, verify: bool):
    HV, DV = v.shape[1], v.shape[2]
    DK = q.shape[2]
    for x in (q, k, v):
        assert x.stride(-1) == 1, "q, k, v need a unit stride on the head dim"
    out = torch.empty((T, HV, DV), dtype=v.dtype, device=v.device)
    if T == 0:
        return out
    BK = triton.next_power_of_2(DK)
    BV = min(triton.next_power_of_2(DV), 32)
    _recurrent_gdn_kernel[(N, HV, triton.cdiv(DV, BV))](
        q, k, v, g, beta, state, out, in_slots, out_slots, rows, L, T, HV // q.shape[1], DK, DV,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3), out.stride(0), out.stride(1),
        VERIFY=verify, BK=BK, BV=BV, num_warps=4)
    return out


def recurrent_gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    N = v.shape[0]
    return _launch(q, k, v, g, beta, state, slot_ids, slot_ids, slot_ids, 1, N, N, verify=False)


def recurrent_gated_delta_rule_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                      beta: torch.Tensor, state: torch.Tensor, lay: VerifyLayout) -> torch.Tensor:
    N, L = lay.rows.shape
    T = v.shape[0]
    return _launch(q, k, v, g, beta, state, lay.in_slots, lay.out_slots, lay.rows.contiguous(), L, T, N,
                   verify=True)


# ---------------------------------------------------------------------------------------------------------------
# Chunked prefill (chunk_gated_delta_rule): the reference's WY form, chunk BT = 64, in three kernels.
#
# Sequences are packed along T (cu_seqlens); every sequence is cut into chunks of BT tokens (its last one partial,
# a chunk never spans two sequences). Per chunk and value head, with G the within-chunk cumsum of g:
#   1. _chunk_wy_kernel      (one program per chunk x value head)
#        G = cumsum(g);  A = strict_lower(beta_i k_i.k_j exp(G_i - G_j));  Tm = (I + A)^-1 (forward substitution);
#        w = Tm (beta exp(G) k)  [BT, dk];  u = Tm (beta v)  [BT, dv].
#   2. _chunk_state_kernel   (one program per sequence x value head x dv block; loops over the sequence's chunks)
#        reads the initial state from the sequence's slot, then per chunk: h[chunk] = S (the state before it);
#        v_new = u - w S;  S <- exp(G_last) S + (k exp(G_last - G))^T v_new;  writes the final S to the slot.
#   3. _chunk_output_kernel  (one program per chunk x value head x dv block)
#        o = exp(G) q h[chunk] + (lower_incl_diag(q k^T exp(G_i - G_j))) v_new.
# The (sequence, chunk) index tensors are built on the host from the Python lists (no device -> host sync), once
# per step (every GDN layer of a step shares them). Intermediates (G, w, u, v_new, h) are fp32 and every tl.dot runs
# in IEEE fp32 (correctness first); bf16 w/u/v_new/h and bf16 or TF32 dots are the speed choice on a GPU. Offsets
# along T and along the chunks are int64 (T * HV * dv passes 2^31 at long prompts).
# ---------------------------------------------------------------------------------------------------------------
_DOT = "ieee"          # tl.dot input precision of the chunk kernels ("tf32" is faster on a GPU, less exact)


@triton.jit
def _chunk_wy_kernel(k_ptr, v_ptr, g_ptr, b_ptr, gcum_ptr, w_ptr, u_ptr, chunk_ptr, HV, R, DK, DV,
                     skt, skh, svt, svh, sgt, sgh, sbt, sbh,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Per (chunk, value head): the within-chunk cumsum G of g, and the WY factors w = Tm (beta exp(G) k) and
    u = Tm (beta v) with Tm = (I + strict_lower(beta_i k_i.k_j exp(G_i - G_j)))^-1."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // R
    bos = tl.load(chunk_ptr + i_c * 2)                           # int64: first token of the chunk
    eos = tl.load(chunk_ptr + i_c * 2 + 1)                       # one past its last token
    rows = tl.arange(0, BT)
    tok = bos + rows
    m = tok < eos
    G = tl.cumsum(tl.load(g_ptr + tok * sgt + i_hv * sgh, mask=m, other=0.0).to(tl.float32), 0)
    tl.store(gcum_ptr + tok * HV + i_hv, G, mask=m)
    beta = tl.load(b_ptr + tok * sbt + i_hv * sbh, mask=m, other=0.0).to(tl.float32)

    kk = tl.zeros([BT, BT], dtype=tl.float32)                    # k_i . k_j
    for i_k in range(0, tl.cdiv(DK, BK)):
        ok = i_k * BK + tl.arange(0, BK)
        kb = tl.load(k_ptr + tok[:, None] * skt + i_h * skh + ok[None, :], mask=m[:, None] & (ok < DK)[None, :],
                     other=0.0).to(tl.float32)
        kk += tl.dot(kb, tl.trans(kb), input_precision=PREC)
    strict = rows[:, None] > rows[None, :]
    A = kk * beta[:, None] * tl.exp(tl.where(strict, G[:, None] - G[None, :], float("-inf")))

    # Tm = (I + A)^-1 by forward substitution: row i of Tm is e_i - sum_{j<i} A[i, j] Tm[j, :] (rows past the
    # chunk's real tokens stay e_i: their A rows are zero)
    Tm = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, eos - bos):
        a_i = tl.sum(tl.where(rows[:, None] == i, A, 0.0), 0)   # A[i, :], indexed by j
        Tm -= tl.where(rows[:, None] == i, tl.sum(a_i[:, None] * Tm, 0)[None, :], 0.0)

    kscale = beta * tl.exp(G)
    for i_k in range(0, tl.cdiv(DK, BK)):
        ok = i_k * BK + tl.arange(0, BK)
        mk = m[:, None] & (ok < DK)[None, :]
        kb = tl.load(k_ptr + tok[:, None] * skt + i_h * skh + ok[None, :], mask=mk, other=0.0).to(tl.float32)
        w = tl.dot(Tm, kb * kscale[:, None], input_precision=PREC)
        tl.store(w_ptr + (tok[:, None] * HV + i_hv) * DK + ok[None, :], w, mask=mk)
    for i_v in range(0, tl.cdiv(DV, BV)):
        ov = i_v * BV + tl.arange(0, BV)
        mv = m[:, None] & (ov < DV)[None, :]
        vb = tl.load(v_ptr + tok[:, None] * svt + i_hv * svh + ov[None, :], mask=mv, other=0.0).to(tl.float32)
        u = tl.dot(Tm, vb * beta[:, None], input_precision=PREC)
        tl.store(u_ptr + (tok[:, None] * HV + i_hv) * DV + ov[None, :], u, mask=mv)


@triton.jit
def _chunk_state_kernel(k_ptr, w_ptr, u_ptr, gcum_ptr, h_ptr, vnew_ptr, s_ptr, seq_ptr, HV, R, DK, DV,
                        skt, skh, ss0, ss1, ss2, ss3,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Per (sequence, value head, dv block), sequentially over the sequence's chunks: the state before each chunk
    (h), v_new = u - w S, and the state hand-over; reads the initial state from the sequence's slot and writes the
    final state back to it."""
    i_n = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_h = i_hv // R
    bos = tl.load(seq_ptr + i_n * 4)                             # int64: first token of the sequence
    eos = tl.load(seq_ptr + i_n * 4 + 1)
    chunk0 = tl.load(seq_ptr + i_n * 4 + 2)                      # its first chunk's index among all chunks
    slot = tl.load(seq_ptr + i_n * 4 + 3)
    rows = tl.arange(0, BT)
    ok = tl.arange(0, BK)
    ov = i_v * BV + tl.arange(0, BV)
    mkv = (ok < DK)[:, None] & (ov < DV)[None, :]
    s_off = slot * ss0 + i_hv * ss1 + ok[:, None] * ss2 + ov[None, :] * ss3
    h_off = (i_hv * DK + ok[:, None]) * DV + ov[None, :]
    S = tl.load(s_ptr + s_off, mask=mkv, other=0.0).to(tl.float32)             # [BK, BV]
    for c in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + c * BT
        tok = t0 + rows
        m = tok < eos
        tl.store(h_ptr + (chunk0 + c) * HV * DK * DV + h_off, S, mask=mkv)
        mk = m[:, None] & (ok < DK)[None, :]
        mv = m[:, None] & (ov < DV)[None, :]
        w = tl.load(w_ptr + (tok[:, None] * HV + i_hv) * DK + ok[None, :], mask=mk, other=0.0)
        u = tl.load(u_ptr + (tok[:, None] * HV + i_hv) * DV + ov[None, :], mask=mv, other=0.0)
        v_new = u - tl.dot(w, S, input_precision=PREC)                          # [BT, BV]
        tl.store(vnew_ptr + (tok[:, None] * HV + i_hv) * DV + ov[None, :], v_new, mask=mv)
        G = tl.load(gcum_ptr + tok * HV + i_hv, mask=m, other=0.0)
        G_last = tl.load(gcum_ptr + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        kb = tl.load(k_ptr + tok[:, None] * skt + i_h * skh + ok[None, :], mask=mk, other=0.0).to(tl.float32)
        k_tail = kb * tl.exp(G_last - G)[:, None]
        S = S * tl.exp(G_last) + tl.dot(tl.trans(k_tail), v_new, input_precision=PREC)
    tl.store(s_ptr + s_off, S.to(s_ptr.dtype.element_ty), mask=mkv)


@triton.jit
def _chunk_output_kernel(q_ptr, k_ptr, gcum_ptr, h_ptr, vnew_ptr, o_ptr, chunk_ptr, HV, R, DK, DV,
                         sqt, sqh, skt, skh, sot, soh,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Per (chunk, value head, dv block): o = exp(G) q h + lower_incl_diag(q k^T exp(G_i - G_j)) v_new."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_h = i_hv // R
    bos = tl.load(chunk_ptr + i_c * 2)
    eos = tl.load(chunk_ptr + i_c * 2 + 1)
    rows = tl.arange(0, BT)
    tok = bos + rows
    m = tok < eos
    ov = i_v * BV + tl.arange(0, BV)
    mv = m[:, None] & (ov < DV)[None, :]
    h_base = h_ptr + tl.cast(i_c, tl.int64) * HV * DK * DV + i_hv * DK * DV
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    qh = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(DK, BK)):
        ok = i_k * BK + tl.arange(0, BK)
        mk = m[:, None] & (ok < DK)[None, :]
        qb = tl.load(q_ptr + tok[:, None] * sqt + i_h * sqh + ok[None, :], mask=mk, other=0.0).to(tl.float32)
        kb = tl.load(k_ptr + tok[:, None] * skt + i_h * skh + ok[None, :], mask=mk, other=0.0).to(tl.float32)
        hb = tl.load(h_base + ok[:, None] * DV + ov[None, :], mask=(ok < DK)[:, None] & (ov < DV)[None, :],
                     other=0.0)
        qk += tl.dot(qb, tl.trans(kb), input_precision=PREC)
        qh += tl.dot(qb, hb, input_precision=PREC)
    G = tl.load(gcum_ptr + tok * HV + i_hv, mask=m, other=0.0)
    causal = (rows[:, None] >= rows[None, :]) & m[:, None]
    P = qk * tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    v_new = tl.load(vnew_ptr + (tok[:, None] * HV + i_hv) * DV + ov[None, :], mask=mv, other=0.0)
    o = qh * tl.exp(G)[:, None] + tl.dot(P, v_new, input_precision=PREC)
    tl.store(o_ptr + tok[:, None] * sot + i_hv * soh + ov[None, :], o.to(o_ptr.dtype.element_ty), mask=mv)


@functools.lru_cache(maxsize=8)
def _chunk_index(cu_seqlens: tuple[int, ...], slot_ids: tuple[int, ...], BT: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """chunks [NC, 2] (first token, end token) of every chunk; seqs [N, 4] (first token, end token, first chunk,
    slot) of every sequence. Built on the host from the lists; cached, as every GDN layer of a step asks for the
    same ones."""
    chunks, seqs = [], []
    for i, slot in enumerate(slot_ids):
        bos, eos = cu_seqlens[i], cu_seqlens[i + 1]
        seqs.append((bos, eos, len(chunks), slot))
        chunks += [(t, min(t + BT, eos)) for t in range(bos, eos, BT)]
    as_tensor = functools.partial(torch.tensor, dtype=torch.int64)
    return (as_tensor(chunks).to(device, non_blocking=True),
            as_tensor(seqs).to(device, non_blocking=True))


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, cu_seqlens: list[int], slot_ids: list[int],
                           chunk_size: int = 64) -> torch.Tensor:
    T, HV, DV = v.shape
    H, DK = q.shape[1], q.shape[2]
    BT = chunk_size
    assert BT >= 16 and BT & (BT - 1) == 0, "chunk_size must be a power of two >= 16"
    assert HV % H == 0 and DK <= 256, "needs HV a multiple of H and dk <= 256"
    for x in (q, k, v):
        assert x.stride(-1) == 1, "q, k, v need a unit stride on the head dim"
    o = torch.empty((T, HV, DV), dtype=v.dtype, device=v.device)
    N = len(slot_ids)
    if N == 0 or T == 0:
        return o
    chunks, seqs = _chunk_index(tuple(cu_seqlens), tuple(int(s) for s in slot_ids), BT, v.device)
    NC = chunks.shape[0]
    f32 = dict(dtype=torch.float32, device=v.device)
    gcum = torch.empty((T, HV), **f32)
    w = torch.empty((T, HV, DK), **f32)
    u = torch.empty((T, HV, DV), **f32)
    v_new = torch.empty((T, HV, DV), **f32)
    h = torch.empty((NC, HV, DK, DV), **f32)               # state before each chunk
    R = HV // H
    BK = max(16, min(64, triton.next_power_of_2(DK)))      # dk block of the chunk-parallel kernels
    BV = max(16, min(64, triton.next_power_of_2(DV)))
    _chunk_wy_kernel[(NC, HV)](
        k, v, g, beta, gcum, w, u, chunks, HV, R, DK, DV,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        BT=BT, BK=BK, BV=BV, PREC=_DOT, num_warps=4)
    BK_state = max(16, triton.next_power_of_2(DK))         # the whole dk: the state tile lives in registers
    BV_state = max(16, min(32, triton.next_power_of_2(DV)))
    _chunk_state_kernel[(N, HV, triton.cdiv(DV, BV_state))](
        k, w, u, gcum, h, v_new, state, seqs, HV, R, DK, DV,
        k.stride(0), k.stride(1), state.stride(0), state.stride(1), state.stride(2), state.stride(3),
        BT=BT, BK=BK_state, BV=BV_state, PREC=_DOT, num_warps=4)
    _chunk_output_kernel[(NC, HV, triton.cdiv(DV, BV))](
        q, k, gcum, h, v_new, o, chunks, HV, R, DK, DV,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1),
        BT=BT, BK=BK, BV=BV, PREC=_DOT, num_warps=4)
    return o
