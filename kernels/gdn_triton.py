"""Triton kernels for kernels/gdn.py: the recurrent gated delta rule for decode (one token per sequence) and for
speculative verify (1 + k tokens per sequence, the state after each token stored in its own slot), the chunked
form for prefill (chunk_gated_delta_rule, described where its kernels begin below), and the gates (gdn_gating).

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

from tinyserve.kernels.verify_layout import VerifyLayout


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


@triton.jit
def _gating_kernel(ba_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, T, HV, sbt, BR: tl.constexpr, BH: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    heads = tl.arange(0, BH)
    mask = (rows < T)[:, None] & (heads < HV)[None, :]
    base = ba_ptr + rows[:, None].to(tl.int64) * sbt + heads[None, :]
    b = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(base + HV, mask=mask, other=0.0).to(tl.float32)
    a = a + tl.load(dtb_ptr + heads, mask=heads < HV, other=0.0).to(tl.float32)[None, :]
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))        # F.softplus: threshold 20
    decay = tl.exp(tl.load(alog_ptr + heads, mask=heads < HV, other=0.0).to(tl.float32))
    out = rows[:, None].to(tl.int64) * HV + heads[None, :]
    tl.store(g_ptr + out, -decay[None, :] * softplus, mask=mask)
    tl.store(beta_ptr + out, 1.0 / (1.0 + tl.exp(-b)), mask=mask)


def gdn_gating(ba: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.gdn.gdn_gating in one launch: ba [T, 2 HV] (a unit stride on the last dim) -> (g, beta) fp32."""
    T, HV = ba.shape[0], A_log.shape[0]
    if ba.stride(-1) != 1:
        ba = ba.contiguous()
    g = torch.empty((T, HV), dtype=torch.float32, device=ba.device)
    beta = torch.empty_like(g)
    if T:
        BH = triton.next_power_of_2(HV)
        BR = max(1, min(16, 2048 // BH))
        _gating_kernel[(triton.cdiv(T, BR),)](ba, A_log, dt_bias, g, beta, T, HV, ba.stride(0), BR=BR, BH=BH,
                                              num_warps=4)
    return g, beta


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
# Chunked prefill (chunk_gated_delta_rule): the reference's WY form, chunks of BT = 64 tokens, in four kernels.
#
# Sequences are packed along T (cu_seqlens); every sequence is cut into chunks of 64 tokens (its last one partial,
# a chunk never spans two sequences). Per chunk and value head, with G the within-chunk cumsum of g:
#   1. _chunk_solve_kernel   (one program per chunk x value head; the chunk as four 16-row blocks)
#        G = cumsum(g);  A = strict_lower(beta_i k_i.k_j exp(G_i - G_j));  Tm = (I + A)^-1 blockwise, as in
#        flash-linear-attention: the diagonal blocks D_i = (I + A_ii)^-1 by forward substitution on 16x16 tiles,
#        then the blocks below them with dots, Tm_ij = -D_i sum_{j<=l<i} A_il Tm_lj.  Stores G and Tm [T, HV, 64].
#   2. _chunk_wy_kernel      (one program per chunk x value head; apart from 1. as together they hold too many
#        registers)  w = Tm (beta exp(G) k)  [BT, dk];  u = Tm (beta v)  [BT, dv].
#   3. _chunk_state_kernel   (one program per sequence x value head x dv block; loops over the sequence's chunks)
#        reads the initial state from the sequence's slot, then per chunk: h[chunk] = S (the state before it);
#        v_new = u - w S;  S <- exp(G_last) S + k^T (exp(G_last - G) v_new);  writes the final S to the slot.
#        S stays in registers as up to four 64-wide tiles along dk.
#   4. _chunk_output_kernel  (one program per chunk x value head x dv block)
#        o = exp(G) q h[chunk] + (lower_incl_diag(q k^T exp(G_i - G_j))) v_new.
# The (sequence, chunk) index tensors are built on the host from the Python lists (no device -> host sync), once
# per step (every GDN layer of a step shares them). Offsets along T and along the chunks are int64 (T * HV * dv
# passes 2^31 at long prompts). Tiles, warps and stages per target: _chunk_tiles.
#
# Precision. The state S is fp32, and so is what it is computed from: G, Tm, u, and w and v_new to ~16 significant
# bits. Compiled, products of fp32 operands run on the tensor cores as three bf16 products of hi + lo halves
# (Triton's "bf16x3", ~2^-16 relative; "ieee" would run on the FMA units and spill, and tf32 leaves the state
# ~1e-3 off on the GPU tier's shapes): PREC = "bf16x3" for the solve's merges, and with bf16 activations (SPLIT)
# the w, u and state dots split their operands by hand where it is cheapest: w is stored as w_hi and w_lo, Tm, S
# and exp(G_last - G) v_new are split in registers, k is exact in bf16. h and the stored v_new are then bf16: they
# only feed the output kernel, whose result is bf16 anyway, so its dots are plain bf16 ones. The 16x16
# substitution's products are ieee; dots of the activations themselves (k k^T, q k^T) are exact in their dtype.
# Under the interpreter (which computes bf16 wrongly; PREC "ieee") and for fp16 or fp32 activations, w, h and
# v_new are fp32. Emulated in torch on the GPU tier's shapes, the bf16 plan leaves the state ~6e-6 off (the test
# allows 1e-3) and the output 4e-4 of its scale off (2e-2).
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _rows(ptr, tok, m, stride, cols, cmask):
    """The [len(tok), len(cols)] tile ptr[tok * stride + cols], zero where masked."""
    return tl.load(ptr + tok[:, None] * stride + cols[None, :], mask=m[:, None] & cmask[None, :], other=0.0)


@triton.jit
def _store_rows(ptr, tok, m, stride, cols, cmask, x, lo_offset, SPLIT: tl.constexpr):
    """Store x at ptr[tok * stride + cols] in ptr's dtype; with SPLIT also the rounding error x - hi at
    ptr[lo_offset + ...] (x = hi + lo to ~16 bits for bf16)."""
    off = tok[:, None] * stride + cols[None, :]
    mask = m[:, None] & cmask[None, :]
    hi = x.to(ptr.dtype.element_ty)
    tl.store(ptr + off, hi, mask=mask)
    if SPLIT:
        tl.store(ptr + lo_offset + off, (x - hi.to(tl.float32)).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split(x, DT: tl.constexpr):
    """fp32 x as hi + lo in the 16-bit DT (for bf16 the pair holds ~16 significant bits)."""
    hi = x.to(DT)
    return hi, (x - hi.to(tl.float32)).to(DT)


@triton.jit
def _dot3(a_hi, a_lo, b_hi, b_lo):
    """(a_hi + a_lo)(b_hi + b_lo) less a_lo b_lo: three 16-bit tensor-core dots, fp32 accumulation (Triton's
    bf16x3, with the operands split where it suits: once outside a loop, or stored split)."""
    return tl.dot(a_hi, b_hi, tl.dot(a_lo, b_hi, tl.dot(a_hi, b_lo)))


@triton.jit
def _inv_unit_lower16(A0, A1, A2, A3):
    """(I + A)^-1 of four strictly lower triangular 16x16 tiles, by forward substitution in one loop: row i of an
    inverse T is e_i - sum_{j<i} A[i, j] T[j, :], i.e. row i of T - A T while T's later rows are still e_j (as A is
    strictly lower, the product's row i only meets the finished rows). The products are fp32 (ieee) dots. Rows past
    the chunk's real tokens stay e_i (A is zero there)."""
    r = tl.arange(0, 16)
    T0 = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    T1, T2, T3 = T0, T0, T0
    for i in range(1, 16):
        row = r[:, None] == i
        T0 -= tl.where(row, tl.dot(A0, T0, input_precision="ieee"), 0.0)
        T1 -= tl.where(row, tl.dot(A1, T1, input_precision="ieee"), 0.0)
        T2 -= tl.where(row, tl.dot(A2, T2, input_precision="ieee"), 0.0)
        T3 -= tl.where(row, tl.dot(A3, T3, input_precision="ieee"), 0.0)
    return T0, T1, T2, T3


@triton.jit
def _chunk_solve_kernel(k_ptr, g_ptr, b_ptr, gcum_ptr, tm_ptr, chunk_ptr, HV, R, DK,
                        skt, skh, sgt, sgh, sbt, sbh, BK: tl.constexpr, PREC: tl.constexpr):
    """Per (chunk, value head): the within-chunk cumsum G of g, and Tm = (I + A)^-1 for
    A = strict_lower(beta_i k_i.k_j exp(G_i - G_j)), over four 16-row blocks; stores the ten blocks on and below
    Tm's diagonal (fp32; the row of token t at tm[t, head, :]). (Written out rather than in helpers: every
    @triton.jit call costs the interpreter milliseconds.)"""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // R
    bos = tl.load(chunk_ptr + i_c * 2)                           # int64: first token of the chunk
    eos = tl.load(chunk_ptr + i_c * 2 + 1)                       # one past its last token
    r = tl.arange(0, 16)
    t0 = bos + r                                                 # the tokens of the four 16-row blocks
    t1, t2, t3 = t0 + 16, t0 + 32, t0 + 48
    m0, m1, m2, m3 = t0 < eos, t1 < eos, t2 < eos, t3 < eos
    g_base, b_base, G_base = g_ptr + i_hv * sgh, b_ptr + i_hv * sbh, gcum_ptr + i_hv
    g0 = tl.load(g_base + t0 * sgt, mask=m0, other=0.0).to(tl.float32)
    g1 = tl.load(g_base + t1 * sgt, mask=m1, other=0.0).to(tl.float32)
    g2 = tl.load(g_base + t2 * sgt, mask=m2, other=0.0).to(tl.float32)
    g3 = tl.load(g_base + t3 * sgt, mask=m3, other=0.0).to(tl.float32)
    s1 = tl.sum(g0, 0)                                           # G: the cumsum within the block plus the sum
    s2 = s1 + tl.sum(g1, 0)                                      # of the blocks before it
    s3 = s2 + tl.sum(g2, 0)
    G0, G1, G2, G3 = tl.cumsum(g0, 0), tl.cumsum(g1, 0) + s1, tl.cumsum(g2, 0) + s2, tl.cumsum(g3, 0) + s3
    tl.store(G_base + t0 * HV, G0, mask=m0)
    tl.store(G_base + t1 * HV, G1, mask=m1)
    tl.store(G_base + t2 * HV, G2, mask=m2)
    tl.store(G_base + t3 * HV, G3, mask=m3)
    b0 = tl.load(b_base + t0 * sbt, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(b_base + t1 * sbt, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(b_base + t2 * sbt, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(b_base + t3 * sbt, mask=m3, other=0.0).to(tl.float32)

    # k_i k_j^T for the ten blocks on and below the diagonal (dots in k's dtype)
    kk00 = tl.zeros([16, 16], dtype=tl.float32)
    kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33 = kk00, kk00, kk00, kk00, kk00, kk00, kk00, kk00, kk00
    for i_k in range(0, tl.cdiv(DK, BK)):
        ok = i_k * BK + tl.arange(0, BK)
        k_cols, mk = k_ptr + i_h * skh + ok[None, :], (ok < DK)[None, :]
        k0 = tl.load(k_cols + t0[:, None] * skt, mask=m0[:, None] & mk, other=0.0)
        k1 = tl.load(k_cols + t1[:, None] * skt, mask=m1[:, None] & mk, other=0.0)
        k2 = tl.load(k_cols + t2[:, None] * skt, mask=m2[:, None] & mk, other=0.0)
        k3 = tl.load(k_cols + t3[:, None] * skt, mask=m3[:, None] & mk, other=0.0)
        kk00 = tl.dot(k0, tl.trans(k0), kk00, input_precision=PREC)
        kk10 = tl.dot(k1, tl.trans(k0), kk10, input_precision=PREC)
        kk11 = tl.dot(k1, tl.trans(k1), kk11, input_precision=PREC)
        kk20 = tl.dot(k2, tl.trans(k0), kk20, input_precision=PREC)
        kk21 = tl.dot(k2, tl.trans(k1), kk21, input_precision=PREC)
        kk22 = tl.dot(k2, tl.trans(k2), kk22, input_precision=PREC)
        kk30 = tl.dot(k3, tl.trans(k0), kk30, input_precision=PREC)
        kk31 = tl.dot(k3, tl.trans(k1), kk31, input_precision=PREC)
        kk32 = tl.dot(k3, tl.trans(k2), kk32, input_precision=PREC)
        kk33 = tl.dot(k3, tl.trans(k3), kk33, input_precision=PREC)

    # A's blocks A_ij = beta_i k_i.k_j exp(G_i - G_j), the diagonal ones strictly lower; the diagonal blocks of Tm
    # by substitution, then those below: Tm_ij = -D_i sum_{j<=l<i} A_il Tm_lj (with Tm_jj = D_j)
    strict = r[:, None] > r[None, :]
    D0, D1, D2, D3 = _inv_unit_lower16(
        kk00 * b0[:, None] * tl.exp(tl.where(strict, G0[:, None] - G0[None, :], float("-inf"))),
        kk11 * b1[:, None] * tl.exp(tl.where(strict, G1[:, None] - G1[None, :], float("-inf"))),
        kk22 * b2[:, None] * tl.exp(tl.where(strict, G2[:, None] - G2[None, :], float("-inf"))),
        kk33 * b3[:, None] * tl.exp(tl.where(strict, G3[:, None] - G3[None, :], float("-inf"))))
    A10 = kk10 * b1[:, None] * tl.exp(G1[:, None] - G0[None, :])
    A20 = kk20 * b2[:, None] * tl.exp(G2[:, None] - G0[None, :])
    A21 = kk21 * b2[:, None] * tl.exp(G2[:, None] - G1[None, :])
    A30 = kk30 * b3[:, None] * tl.exp(G3[:, None] - G0[None, :])
    A31 = kk31 * b3[:, None] * tl.exp(G3[:, None] - G1[None, :])
    A32 = kk32 * b3[:, None] * tl.exp(G3[:, None] - G2[None, :])
    T10 = -tl.dot(D1, tl.dot(A10, D0, input_precision=PREC), input_precision=PREC)
    T21 = -tl.dot(D2, tl.dot(A21, D1, input_precision=PREC), input_precision=PREC)
    T32 = -tl.dot(D3, tl.dot(A32, D2, input_precision=PREC), input_precision=PREC)
    T20 = -tl.dot(D2, tl.dot(A20, D0, input_precision=PREC) + tl.dot(A21, T10, input_precision=PREC),
                  input_precision=PREC)
    T31 = -tl.dot(D3, tl.dot(A31, D1, input_precision=PREC) + tl.dot(A32, T21, input_precision=PREC),
                  input_precision=PREC)
    T30 = -tl.dot(D3, tl.dot(A30, D0, input_precision=PREC) + tl.dot(A31, T10, input_precision=PREC)
                  + tl.dot(A32, T20, input_precision=PREC), input_precision=PREC)

    tm = tm_ptr + i_hv * 64 + r[None, :]                          # tm: [T, HV, 64]; column block j at + 16 j
    tm0, tm1, tm2, tm3 = tm + t0[:, None] * (HV * 64), tm + t1[:, None] * (HV * 64), \
        tm + t2[:, None] * (HV * 64), tm + t3[:, None] * (HV * 64)
    tl.store(tm0, D0, mask=m0[:, None])
    tl.store(tm1, T10, mask=m1[:, None])
    tl.store(tm1 + 16, D1, mask=m1[:, None])
    tl.store(tm2, T20, mask=m2[:, None])
    tl.store(tm2 + 16, T21, mask=m2[:, None])
    tl.store(tm2 + 32, D2, mask=m2[:, None])
    tl.store(tm3, T30, mask=m3[:, None])
    tl.store(tm3 + 16, T31, mask=m3[:, None])
    tl.store(tm3 + 32, T32, mask=m3[:, None])
    tl.store(tm3 + 48, D3, mask=m3[:, None])


@triton.jit
def _chunk_wy_kernel(k_ptr, v_ptr, b_ptr, gcum_ptr, tm_ptr, w_ptr, u_ptr, chunk_ptr, HV, R, DK, DV, w_lo,
                     skt, skh, svt, svh, sbt, sbh,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                     SPLIT: tl.constexpr):
    """Per (chunk, value head): the WY factors w = Tm (beta exp(G) k) and u = Tm (beta v), u in fp32 and w in w's
    dtype: with SPLIT as w_hi and, w_lo elements further on, w_lo (bf16 halves, the products split too)."""
    i_c = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_h = i_hv // R
    bos = tl.load(chunk_ptr + i_c * 2)
    eos = tl.load(chunk_ptr + i_c * 2 + 1)
    rows = tl.arange(0, BT)
    tok = bos + rows
    m = tok < eos
    lower_blocks = (rows[None, :] // 16 <= rows[:, None] // 16) & m[:, None]          # where tm was stored
    Tm = tl.load(tm_ptr + (tok[:, None] * HV + i_hv) * 64 + rows[None, :], mask=lower_blocks, other=0.0)
    beta = tl.load(b_ptr + tok * sbt + i_hv * sbh, mask=m, other=0.0).to(tl.float32)
    kscale = beta * tl.exp(tl.load(gcum_ptr + tok * HV + i_hv, mask=m, other=0.0))
    DT = w_ptr.dtype.element_ty
    if SPLIT:
        Tm_hi, Tm_lo = _split(Tm, DT)
    k_base, w_base = k_ptr + i_h * skh, w_ptr + i_hv * DK
    for i_k in range(0, tl.cdiv(DK, BK)):
        ok = i_k * BK + tl.arange(0, BK)
        mk = ok < DK
        x = _rows(k_base, tok, m, skt, ok, mk).to(tl.float32) * kscale[:, None]
        if SPLIT:
            x_hi, x_lo = _split(x, DT)
            w = _dot3(Tm_hi, Tm_lo, x_hi, x_lo)
        else:
            w = tl.dot(Tm, x, input_precision=PREC)
        _store_rows(w_base, tok, m, HV * DK, ok, mk, w, w_lo, SPLIT)
    v_base, u_base = v_ptr + i_hv * svh, u_ptr + i_hv * DV
    for i_v in range(0, tl.cdiv(DV, BV)):
        ov = i_v * BV + tl.arange(0, BV)
        mv = ov < DV
        x = _rows(v_base, tok, m, svt, ov, mv).to(tl.float32) * beta[:, None]
        if SPLIT:
            x_hi, x_lo = _split(x, DT)
            u = _dot3(Tm_hi, Tm_lo, x_hi, x_lo)
        else:
            u = tl.dot(Tm, x, input_precision=PREC)
        _store_rows(u_base, tok, m, HV * DV, ov, mv, u, 0, False)


@triton.jit
def _w_times_state(w_base, w_lo, tok, m, stride, ok, mk, S, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """w[tok, ok] S for one dk tile of S; with SPLIT on the pairs (w_hi + w_lo)(S_hi + S_lo) in w's dtype."""
    w = _rows(w_base, tok, m, stride, ok, mk)
    if SPLIT:
        S_hi, S_lo = _split(S, w.dtype)
        wS = _dot3(w, _rows(w_base + w_lo, tok, m, stride, ok, mk), S_hi, S_lo)
    else:
        wS = tl.dot(w, S, input_precision=PREC)
    return wS


@triton.jit
def _state_update(S, decay, k_base, skt, tok, m, ok, mk, v_hi, v_lo, PREC: tl.constexpr, SPLIT: tl.constexpr):
    """decay S + k[tok, ok]^T (v_hi + v_lo) for one dk tile of S (v_lo only with SPLIT); k^T is loaded as such."""
    kt = tl.load(k_base + ok[:, None] + tok[None, :] * skt, mask=mk[:, None] & m[None, :], other=0.0)
    kt = kt.to(v_hi.dtype)
    S = tl.dot(kt, v_hi, S * decay, input_precision=PREC)
    if SPLIT:
        S = tl.dot(kt, v_lo, S, input_precision=PREC)
    return S


@triton.jit
def _chunk_state_kernel(k_ptr, w_ptr, u_ptr, gcum_ptr, h_ptr, vnew_ptr, s_ptr, seq_ptr, HV, R, DK, DV, w_lo,
                        skt, skh, ss0, ss1, ss2, ss3,
                        BT: tl.constexpr, BK: tl.constexpr, NKT: tl.constexpr, BV: tl.constexpr,
                        PREC: tl.constexpr, SPLIT: tl.constexpr):
    """Per (sequence, value head, dv block), sequentially over the sequence's chunks: the state before each chunk
    (h), v_new = u - w S, and the state hand-over; reads the initial state from the sequence's slot and writes the
    final state back to it. S stays fp32 in registers as NKT (up to four) [BK, BV] tiles along dk; with SPLIT the
    dots are on hi + lo pairs in h's dtype, in which k is exact."""
    i_n = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_h = i_hv // R
    DT = h_ptr.dtype.element_ty
    bos = tl.load(seq_ptr + i_n * 4)                             # int64: first token of the sequence
    eos = tl.load(seq_ptr + i_n * 4 + 1)
    chunk0 = tl.load(seq_ptr + i_n * 4 + 2)                      # its first chunk's index among all chunks
    slot = tl.load(seq_ptr + i_n * 4 + 3)
    rows = tl.arange(0, BT)
    ok = tl.arange(0, BK)                                        # dk tile t covers t * BK + ok
    ov = i_v * BV + tl.arange(0, BV)
    mv = ov < DV
    s_base = s_ptr + slot * ss0 + i_hv * ss1 + ov[None, :] * ss3 + ok[:, None] * ss2
    h_base = h_ptr + i_hv * DK * DV + ov[None, :] + ok[:, None] * DV
    k_base, w_base, u_base, v_base = k_ptr + i_h * skh, w_ptr + i_hv * DK, u_ptr + i_hv * DV, vnew_ptr + i_hv * DV
    mkv0, mkv1 = (ok < DK)[:, None] & mv[None, :], (ok + BK < DK)[:, None] & mv[None, :]
    mkv2, mkv3 = (ok + 2 * BK < DK)[:, None] & mv[None, :], (ok + 3 * BK < DK)[:, None] & mv[None, :]
    S0 = tl.load(s_base, mask=mkv0, other=0.0).to(tl.float32)
    S1, S2, S3 = tl.zeros_like(S0), tl.zeros_like(S0), tl.zeros_like(S0)
    if NKT > 1:
        S1 = tl.load(s_base + BK * ss2, mask=mkv1, other=0.0).to(tl.float32)
    if NKT > 2:
        S2 = tl.load(s_base + 2 * BK * ss2, mask=mkv2, other=0.0).to(tl.float32)
    if NKT > 3:
        S3 = tl.load(s_base + 3 * BK * ss2, mask=mkv3, other=0.0).to(tl.float32)
    for c in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + c * BT
        tok = t0 + rows
        m = tok < eos
        h_c = h_base + (chunk0 + c) * HV * DK * DV
        tl.store(h_c, S0.to(DT), mask=mkv0)                     # h: the state before the chunk
        wS = _w_times_state(w_base, w_lo, tok, m, HV * DK, ok, ok < DK, S0, PREC, SPLIT)
        if NKT > 1:
            tl.store(h_c + BK * DV, S1.to(DT), mask=mkv1)
            wS += _w_times_state(w_base, w_lo, tok, m, HV * DK, ok + BK, ok + BK < DK, S1, PREC, SPLIT)
        if NKT > 2:
            tl.store(h_c + 2 * BK * DV, S2.to(DT), mask=mkv2)
            wS += _w_times_state(w_base, w_lo, tok, m, HV * DK, ok + 2 * BK, ok + 2 * BK < DK, S2, PREC, SPLIT)
        if NKT > 3:
            tl.store(h_c + 3 * BK * DV, S3.to(DT), mask=mkv3)
            wS += _w_times_state(w_base, w_lo, tok, m, HV * DK, ok + 3 * BK, ok + 3 * BK < DK, S3, PREC, SPLIT)
        v_new = _rows(u_base, tok, m, HV * DV, ov, mv) - wS                   # [BT, BV] fp32
        tl.store(v_base + tok[:, None] * (HV * DV) + ov[None, :], v_new.to(DT), mask=m[:, None] & mv[None, :])
        G = tl.load(gcum_ptr + tok * HV + i_hv, mask=m, other=0.0)
        G_last = tl.load(gcum_ptr + (tl.minimum(t0 + BT, eos) - 1) * HV + i_hv)
        v_tail = v_new * tl.exp(G_last - G)[:, None]
        v_hi = v_tail.to(DT)
        v_lo = (v_tail - v_hi.to(tl.float32)).to(DT)                          # (used with SPLIT only)
        decay = tl.exp(G_last)
        S0 = _state_update(S0, decay, k_base, skt, tok, m, ok, ok < DK, v_hi, v_lo, PREC, SPLIT)
        if NKT > 1:
            S1 = _state_update(S1, decay, k_base, skt, tok, m, ok + BK, ok + BK < DK, v_hi, v_lo, PREC, SPLIT)
        if NKT > 2:
            S2 = _state_update(S2, decay, k_base, skt, tok, m, ok + 2 * BK, ok + 2 * BK < DK, v_hi, v_lo, PREC,
                               SPLIT)
        if NKT > 3:
            S3 = _state_update(S3, decay, k_base, skt, tok, m, ok + 3 * BK, ok + 3 * BK < DK, v_hi, v_lo, PREC,
                               SPLIT)
    tl.store(s_base, S0.to(s_ptr.dtype.element_ty), mask=mkv0)
    if NKT > 1:
        tl.store(s_base + BK * ss2, S1.to(s_ptr.dtype.element_ty), mask=mkv1)
    if NKT > 2:
        tl.store(s_base + 2 * BK * ss2, S2.to(s_ptr.dtype.element_ty), mask=mkv2)
    if NKT > 3:
        tl.store(s_base + 3 * BK * ss2, S3.to(s_ptr.dtype.element_ty), mask=mkv3)


@triton.jit
def _chunk_output_kernel(q_ptr, k_ptr, gcum_ptr, h_ptr, vnew_ptr, o_ptr, chunk_ptr, HV, R, DK, DV,
                         sqt, sqh, skt, skh, sot, soh,
                         BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Per (chunk, value head, dv block): o = exp(G) q h + lower_incl_diag(q k^T exp(G_i - G_j)) v_new; q k^T is a
    dot in q's dtype, q h and P v_new in h's and v_new's dtype."""
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
        qb = tl.load(q_ptr + tok[:, None] * sqt + i_h * sqh + ok[None, :], mask=mk, other=0.0)
        kb = tl.load(k_ptr + tok[:, None] * skt + i_h * skh + ok[None, :], mask=mk, other=0.0)
        hb = tl.load(h_base + ok[:, None] * DV + ov[None, :], mask=(ok < DK)[:, None] & (ov < DV)[None, :],
                     other=0.0)
        qk = tl.dot(qb, tl.trans(kb), qk, input_precision=PREC)
        qh = tl.dot(qb.to(hb.dtype), hb, qh, input_precision=PREC)
    G = tl.load(gcum_ptr + tok * HV + i_hv, mask=m, other=0.0)
    causal = (rows[:, None] >= rows[None, :]) & m[:, None]
    P = qk * tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))
    v_new = tl.load(vnew_ptr + (tok[:, None] * HV + i_hv) * DV + ov[None, :], mask=mv, other=0.0)
    o = qh * tl.exp(G)[:, None] + tl.dot(P.to(v_new.dtype), v_new, input_precision=PREC)
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


# Compiled or interpreted is fixed when the kernels are defined (TRITON_INTERPRET at import); the precision plan
# follows it, so bench/gpu_check.py --compile, which records the launches on the CPU, compiles the GPU's plan.
_INTERPRETED = not isinstance(_chunk_wy_kernel, triton.runtime.jit.JITFunction)


def _split_dtype(k: torch.Tensor, v: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype whose hi + lo pairs carry the fp32 products of the w, u and state dots (k must be exact in
    it), or None for PREC dots on fp32: bf16 on a GPU with bf16 activations; None under the interpreter, which
    computes bf16 wrongly (a test sets fp16 here to run the split path interpreted)."""
    return torch.bfloat16 if not _INTERPRETED and k.dtype == v.dtype == torch.bfloat16 else None


def _chunk_tiles(capability: tuple[int, int] | None, fp32: bool = False) -> dict:
    """Launch settings of the four chunk kernels for a CUDA capability and fp32 or 16-bit inputs; None (not on CUDA,
    as when bench/gpu_check.py --compile records the launches) gets the portable set. All fit shared memory and
    compile without spills for sm_89, sm_90 and sm_120 (ptxas). The state kernel's dv block is 32 on sm_90, where
    wgmma reads S from shared memory, and 16 elsewhere, where mma.sync holds all of S's dk tile x BV in every warp's
    registers (32 reaches 255 registers on sm_89). Datacenter Blackwell (sm_100 / sm_103): Triton 3.6-3.7 races in a
    tl.dot recurrence over a loop at 4 warps there (triton-lang/triton#10590; flash-linear-attention #945 measured
    its chunk state kernel non-deterministic on B300 at BV 64 / 4 warps and deterministic, and fastest among the
    safe settings, at BV 32 / 2 warps), so the state pass takes BV 32 / 2 warps there, and the output kernel stays
    at 4 warps (fla #1228: 8 warps race in its output kernel). Hopper (H200, Triton 3.6): the output kernel's dk
    loop pipelined (num_stages 2) over fp32 operands (bf16x3 dots) with a partial last dk tile returns NaN or faults
    (illegal address) at dk 80 and 200, and is exact unpipelined: fp32 inputs take num_stages 1 everywhere (the
    GPU's models run bf16). The state kernel there faults at num_stages 1 (dk 128, BV 32, bf16) and is exact at 2."""
    hopper = capability is not None and capability[0] == 9
    datacenter_blackwell = capability is not None and capability[0] == 10
    state = dict(BV=32, num_warps=2, num_stages=2) if datacenter_blackwell else \
        dict(BV=32 if hopper else 16, num_warps=4, num_stages=2)
    return dict(solve=dict(BK=32, num_warps=4),
                wy=dict(BK=32, BV=32, num_warps=4),
                state=state,
                output=dict(BK=64, BV=64, num_warps=4, num_stages=1 if fp32 else 2))


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, cu_seqlens: list[int], slot_ids: list[int],
                           chunk_size: int = 64) -> torch.Tensor:
    """The reference's chunk_gated_delta_rule. The kernels' chunk is 64 tokens whatever chunk_size says (the result
    does not depend on it beyond rounding)."""
    T, HV, DV = v.shape
    H, DK = q.shape[1], q.shape[2]
    BT = 64
    assert HV % H == 0 and DK <= 256, "needs HV a multiple of H and dk <= 256"
    for x in (q, k, v):
        assert x.stride(-1) == 1, "q, k, v need a unit stride on the head dim"
    o = torch.empty((T, HV, DV), dtype=v.dtype, device=v.device)
    N = len(slot_ids)
    if N == 0 or T == 0:
        return o
    chunks, seqs = _chunk_index(tuple(cu_seqlens), tuple(int(s) for s in slot_ids), BT, v.device)
    NC = chunks.shape[0]
    prec = "ieee" if _INTERPRETED else "bf16x3"
    split = _split_dtype(k, v)
    low = split or torch.float32                             # w (hi, lo), h and the stored v_new
    gcum = torch.empty((T, HV), dtype=torch.float32, device=v.device)
    tm = torch.empty((T, HV, BT), dtype=torch.float32, device=v.device)      # (I + A)^-1, each chunk's rows
    w = torch.empty((2 if split else 1, T, HV, DK), dtype=low, device=v.device)
    u = torch.empty((T, HV, DV), dtype=torch.float32, device=v.device)
    v_new = torch.empty((T, HV, DV), dtype=low, device=v.device)
    h = torch.empty((NC, HV, DK, DV), dtype=low, device=v.device)      # the state before each chunk
    R = HV // H
    cap = torch.cuda.get_device_capability(v.device) if v.device.type == "cuda" else None
    tiles = _chunk_tiles(cap, fp32=q.dtype == torch.float32)

    def fit(t: dict) -> dict:                 # blocks no wider than the (power-of-two) head dims, at least 16
        return {key: max(16, min(val, triton.next_power_of_2(DK if key == "BK" else DV))) if key in ("BK", "BV")
                else val for key, val in t.items()}
    solve, wy, st, out = fit(tiles["solve"]), fit(tiles["wy"]), fit(tiles["state"]), fit(tiles["output"])
    _chunk_solve_kernel[(NC, HV)](
        k, g, beta, gcum, tm, chunks, HV, R, DK,
        k.stride(0), k.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), PREC=prec, **solve)
    _chunk_wy_kernel[(NC, HV)](
        k, v, beta, gcum, tm, w, u, chunks, HV, R, DK, DV, T * HV * DK,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0), beta.stride(1),
        BT=BT, PREC=prec, SPLIT=split is not None, **wy)
    BK_state = max(16, min(64, triton.next_power_of_2(DK)))  # the state's dk tiles (up to four)
    _chunk_state_kernel[(N, HV, triton.cdiv(DV, st["BV"]))](
        k, w, u, gcum, h, v_new, state, seqs, HV, R, DK, DV, T * HV * DK,
        k.stride(0), k.stride(1), state.stride(0), state.stride(1), state.stride(2), state.stride(3),
        BT=BT, BK=BK_state, NKT=triton.cdiv(DK, BK_state), PREC=prec, SPLIT=split is not None, **st)
    _chunk_output_kernel[(NC, HV, triton.cdiv(DV, out["BV"]))](
        q, k, gcum, h, v_new, o, chunks, HV, R, DK, DV,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), o.stride(0), o.stride(1),
        BT=BT, PREC=prec, **out)
    return o
