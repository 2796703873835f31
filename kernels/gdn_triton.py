"""Triton kernels for kernels/gdn.py: the recurrent gated delta rule for decode (one token per sequence) and for
speculative verify (1 + k tokens per sequence, the state after each token stored in its own slot).

One kernel serves both. A program owns one (sequence, value head, dv block) and keeps its [dk, BV] slice of the
fp32 state in registers across the sequence's tokens: it reads the slice once from the sequence's slot and writes
it after every token to that token's slot (decode: the same slot). The state pool is [slots, HV, dk, dv] in any
float dtype (math in fp32); a slot id < 0 means padding: nothing is read (zero state) and nothing is stored, so
padded rows of a captured graph are harmless. The per-token math is the reference's, in the same order:
S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q.
"""
from __future__ import annotations

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
