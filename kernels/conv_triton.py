"""Triton kernels for kernels/conv.py: the causal depthwise conv1d (+ SiLU) for decode and for speculative verify,
with the per-slot conv state (the last K-1 pre-conv inputs, [slots, C, K-1]).

One kernel serves both. A program owns one sequence and a block of channels. It first loads the sequence's whole
input window into registers, [BC, K-1 + L] (its slot's history, then its L new tokens), and only then, after a
barrier, stores: the state after token t goes to that token's slot, which may be the slot the history came from
(verify: the first token's slot is the sequence's own; decode: always). Output and state columns are picked from the window by
position, so no register shifting is needed. A slot id < 0 means padding: zero history, nothing stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.verify_layout import VerifyLayout
from tinyserve.kernels.tiles import prefill_tiles


@triton.jit
def _columns(tile, start, BK: tl.constexpr, BW: tl.constexpr):
    """tile[:, start + j] for j in [0, BK) (zero past the tile) -> [BC, BK]."""
    j = tl.arange(0, BK)
    w = tl.arange(0, BW)
    sel = w[None, None, :] == (start + j)[None, :, None]
    return tl.sum(tl.where(sel, tile[:, None, :], 0.0), axis=2)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, s_ptr, o_ptr, in_slot_ptr, out_slot_ptr, rows_ptr, L, T, C,
                 sxt, sw0, sw1, ss0, ss1, ss2, sot,
                 K: tl.constexpr, VERIFY: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BW: tl.constexpr):
    i_n = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    w = tl.arange(0, BW)                              # window column: < K-1 history, then token w - (K-1)
    slot_in = tl.load(in_slot_ptr + i_n).to(tl.int64)
    is_hist = w < K - 1
    hist = tl.load(s_ptr + slot_in * ss0 + c[:, None].to(tl.int64) * ss1 + w[None, :] * ss2,
                   mask=mc[:, None] & is_hist[None, :] & (slot_in >= 0), other=0.0).to(tl.float32)
    p = w - (K - 1)
    if VERIFY:
        rows = tl.load(rows_ptr + i_n.to(tl.int64) * L + p, mask=(p >= 0) & (p < L), other=T).to(tl.int64)
    else:
        rows = tl.where(p == 0, i_n, T).to(tl.int64)
    x = tl.load(x_ptr + rows[None, :] * sxt + c[:, None], mask=mc[:, None] & ((p >= 0) & (rows < T))[None, :],
                other=0.0).to(tl.float32)
    tile = hist + x                                   # [BC, BW], disjoint masks
    # The first token's state may go to the slot the history came from, and a thread may store a state column
    # (in the [BC, BK] layout) that another thread has yet to load (in the [BC, BW] one, when BW != BK: a
    # verify): a CTA-wide barrier orders every load of the old history before the first store (as in prefill).
    tl.debug_barrier()

    j = tl.arange(0, BK)
    weight = tl.load(w_ptr + c[:, None] * sw0 + j[None, :] * sw1, mask=mc[:, None] & (j < K)[None, :],
                     other=0.0).to(tl.float32)
    for t in range(L):
        if VERIFY:
            row = tl.load(rows_ptr + i_n.to(tl.int64) * L + t).to(tl.int64)
        else:
            row = i_n.to(tl.int64)
        real = row < T
        acc = tl.sum(_columns(tile, t, BK, BW) * weight, axis=1)        # inputs t-(K-1) .. t
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(o_ptr + row * sot + c, y.to(o_ptr.dtype.element_ty), mask=mc & real)
        after = _columns(tile, t + 1, BK, BW)                           # inputs t-(K-2) .. t: the new history
        slot_out = tl.load(out_slot_ptr + row, mask=real, other=-1).to(tl.int64)
        tl.store(s_ptr + slot_out * ss0 + c[:, None].to(tl.int64) * ss1 + j[None, :] * ss2,
                 after.to(s_ptr.dtype.element_ty),
                 mask=mc[:, None] & (j < K - 1)[None, :] & real & (slot_out >= 0))


def _launch(x, weight, conv_state, in_slots, out_slots, rows, L: int, N: int, verify: bool) -> torch.Tensor:
    T, C = x.shape
    K = weight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    BC = min(triton.next_power_of_2(C), 128)
    _conv_kernel[(N, triton.cdiv(C, BC))](
        x, weight, conv_state, out, in_slots, out_slots, rows, L, T, C,
        x.stride(0), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), out.stride(0),
        K=K, VERIFY=verify, BC=BC, BK=triton.next_power_of_2(K), BW=triton.next_power_of_2(K - 1 + L),
        num_warps=4)
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         slot_ids: torch.Tensor) -> torch.Tensor:
    return _launch(x, weight, conv_state, slot_ids, slot_ids, slot_ids, 1, x.shape[0], verify=False)


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         lay: VerifyLayout) -> torch.Tensor:
    N, L = lay.rows.shape
    return _launch(x, weight, conv_state, lay.in_slots, lay.out_slots, lay.rows.contiguous(), L, N, verify=True)


# ---------------------------------------------------------------------------------------------------------------
# Prefill: packed ragged sequences, each continuing its slot's history
# ---------------------------------------------------------------------------------------------------------------
# A program owns one tile of PREFILL_BLOCK_T consecutive tokens of one sequence and a block of PREFILL_BLOCK_C
# channels. Output token t needs inputs t-(K-1) .. t of its sequence: tap k of the tile is the [BT, BC] slice of
# inputs shifted by k - (K-1), read from x where the position is >= 0 and from the slot's old history (column
# K-1+pos) where it is < 0 (disjoint masks, so the two loads add). The shifted slices overlap, so x is read from
# DRAM about once and K times from cache.
#
# The state race. Only positions -(K-1) .. -1 come from the old history, and since BT >= K-1 only a sequence's
# first tile (start 0) reads them. That same program is the only one that writes the slot's new state (the
# sequence's last K-1 inputs: from x, or for a sequence shorter than K-1 partly from the old history shifted
# left), so no other program reads the slot while or after it is written (sequences of one batch own distinct
# slots). Inside the program, a thread may store a state column that another thread has yet to load (a short
# sequence's new state is its old history shifted left, and the tap loads use another layout), so a barrier
# (tl.debug_barrier: a CTA-wide bar.sync, which also orders the threads' memory accesses) separates every load of
# the old state from the first store of the new one.
PREFILL_BLOCK_T = 8        # tokens per tile (must be >= K-1)
PREFILL_BLOCK_C = 256      # channels per program


@triton.jit
def _prefill_kernel(x_ptr, w_ptr, s_ptr, o_ptr, meta_ptr, num_tiles, num_seqs, C,
                    sxt, sw0, sw1, ss0, ss1, ss2, sot,
                    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr):
    # meta (int32): tile_seq [num_tiles] | tile_start [num_tiles] | cu_seqlens [num_seqs+1] | slots [num_seqs]
    i_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = c < C
    seq = tl.load(meta_ptr + i_t)
    t0 = tl.load(meta_ptr + num_tiles + i_t)
    bos = tl.load(meta_ptr + 2 * num_tiles + seq).to(tl.int64)
    L = tl.load(meta_ptr + 2 * num_tiles + seq + 1) - bos.to(tl.int32)
    slot = tl.load(meta_ptr + 2 * num_tiles + num_seqs + 1 + seq).to(tl.int64)
    s_row = s_ptr + slot * ss0 + c.to(tl.int64) * ss1                              # [BC]: the slot's history

    j = tl.arange(0, BT)
    t = t0 + j                                                                     # token positions in the sequence
    acc = tl.zeros([BT, BC], tl.float32)
    for k in tl.static_range(K):
        p = t - (K - 1) + k                                                        # input position of tap k
        xin = tl.load(x_ptr + (bos + p)[:, None] * sxt + c[None, :],
                      mask=((p >= 0) & (p < L))[:, None] & mc[None, :], other=0.0).to(tl.float32)
        if t0 < K - 1:                                                             # only the first tile
            xin += tl.load(s_row[None, :] + (K - 1 + p)[:, None] * ss2,
                           mask=(p < 0)[:, None] & mc[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c * sw0 + k * sw1, mask=mc, other=0.0).to(tl.float32)
        acc += xin * w[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(o_ptr + (bos + t)[:, None] * sot + c[None, :], y.to(o_ptr.dtype.element_ty),
             mask=(t < L)[:, None] & mc[None, :])

    if t0 == 0:
        # the new state: window column L + h of [old history | inputs], h in [0, K-1)
        h = tl.arange(0, BH)
        mh = (h < K - 1)[None, :] & mc[:, None]
        hp = L - (K - 1) + h                                                       # input position
        new = tl.load(x_ptr + (bos + hp)[None, :] * sxt + c[:, None], mask=mh & (hp >= 0)[None, :],
                      other=0.0).to(tl.float32)
        new += tl.load(s_row[:, None] + (K - 1 + hp)[None, :] * ss2, mask=mh & (hp < 0)[None, :],
                       other=0.0).to(tl.float32)
        tl.debug_barrier()                                 # every read of the old state is done before any store
        tl.store(s_row[:, None] + h[None, :] * ss2, new.to(s_ptr.dtype.element_ty), mask=mh)


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                          cu_seqlens: list[int], slot_ids: list[int]) -> torch.Tensor:
    T, C = x.shape
    K = weight.shape[1]
    BT = PREFILL_BLOCK_T
    assert 2 <= K and K - 1 <= BT, "the first tile must cover the whole history"
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((T, C), dtype=x.dtype, device=x.device)
    N = len(slot_ids)
    meta, num_tiles = prefill_tiles(cu_seqlens, slot_ids, BT, x.device)
    if not num_tiles:
        return out
    BC = min(PREFILL_BLOCK_C, triton.next_power_of_2(C))
    _prefill_kernel[(num_tiles, triton.cdiv(C, BC))](
        x, weight, conv_state, out, meta, num_tiles, N, C,
        x.stride(0), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), out.stride(0),
        K=K, BT=BT, BC=BC, BH=triton.next_power_of_2(K - 1), num_warps=4)
    return out
