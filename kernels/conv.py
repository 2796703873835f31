"""Causal depthwise conv1d of the GDN layers, over packed sequences, with a per-slot conv state.

The conv state of a sequence is its last K-1 *pre-conv* inputs, shape [conv_dim, K-1], kept in a pool indexed by
state slot (`conv_state[slot]`), so prefill chunks and decode steps continue exactly where the last one stopped.

The prefill (causal_conv1d_prefill): x [T, C] packed sequences, weight [C, K], conv_state [slots, C, K-1] (read,
then updated in place); returns silu(conv(x)) [T, C]. Sequence i covers x[cu_seqlens[i]:cu_seqlens[i+1]] and
continues slot_ids[i]; snapshots: (sequence i, offset o, slot): the history after sequence i's first o tokens is also
written to `slot` (as gdn.chunk_gated_delta_rule's snapshots).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from tinyserve.kernels import PoolLayer, use_triton
from tinyserve.kernels.gdn import slot_run
from tinyserve.kernels.verify_layout import VerifyLayout, pad_to_layout


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | PoolLayer,
                          cu_seqlens: list[int], slot_ids: list[int],
                          snapshots: Sequence[tuple[int, int, int]] = ()) -> torch.Tensor:
    """x [T, C], weight [C, K], conv_state [slots, C, K-1] -> [T, C] (the module docstring)."""
    conv_state = PoolLayer.of(conv_state).rows
    if use_triton(x):
        assert not snapshots, "the Triton prefill takes no snapshots inside a chunk (gdn.snapshot_alignment)"
        from tinyserve.kernels import conv_triton
        return conv_triton.causal_conv1d_prefill(x, weight, conv_state, cu_seqlens, slot_ids)
    K = weight.shape[1]
    out = torch.empty_like(x)
    for i, slot in enumerate(slot_ids):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        history = conv_state[slot].to(x.dtype)                     # [C, K-1]
        window = torch.cat([history, x[s:e].t()], dim=1)           # [C, K-1+L]
        L = e - s
        y = window[:, :L] * weight[:, :1]              # the K taps as K multiply-adds (a depthwise F.conv1d costs
        for tap in range(1, K):                        # several times more on the CPU)
            y.addcmul_(window[:, tap:tap + L], weight[:, tap:tap + 1])
        out[s:e] = F.silu(y.t())
        for _, offset, snap in (t for t in snapshots if t[0] == i):   # the K-1 inputs before the offset
            conv_state[snap] = window[:, offset:offset + K - 1].to(conv_state.dtype)
        conv_state[slot] = window[:, -(K - 1):].to(conv_state.dtype)
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | PoolLayer,
                         slot_ids: torch.Tensor) -> torch.Tensor:
    """One new token per sequence: x [N, C]; conv_state [slots, C, K-1] updated in place. Returns [N, C]."""
    pool = PoolLayer.of(conv_state)
    if use_triton(x):
        from tinyserve.kernels import conv_triton
        return conv_triton.causal_conv1d_decode(x, weight, pool.rows, slot_ids)
    # a run of slots is a view; otherwise a gather and a scatter (index_select: a fraction of indexing's cost)
    first = slot_run(slot_ids, pool.pool)
    rows = pool.rows.narrow(0, first, slot_ids.numel()) if first is not None else \
        pool.rows.index_select(0, slot_ids)
    window = torch.cat([rows.to(x.dtype), x.unsqueeze(-1)], dim=-1)                                 # [N, C, K]
    if first is not None:
        rows.copy_(window[..., 1:])
    else:
        pool.put((slot_ids,), window[..., 1:])
    return F.silu(torch.linalg.vecdot(window, weight))


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | PoolLayer,
                         lay: VerifyLayout) -> torch.Tensor:
    """Speculative verify: the decode conv (the same per-token sum) over each sequence's 1 + k tokens at once,
    keeping the history after every token in its own slot (lay: kernels.verify_layout.VerifyLayout). x [T, C]."""
    pool = PoolLayer.of(conv_state)
    if use_triton(x):
        from tinyserve.kernels import conv_triton
        return conv_triton.causal_conv1d_verify(x, weight, pool.rows, lay)
    C, K = weight.shape
    hist = pool.rows.index_select(0, lay.in_slots).to(x.dtype)                           # [N, C, K-1]
    window = torch.cat([hist, pad_to_layout(x, lay).transpose(1, 2)], dim=-1)           # [N, C, K-1+L]
    out = F.silu(torch.linalg.vecdot(window.unfold(2, K, 1), weight[:, None, :]))       # [N, C, L]
    after = window.unfold(2, K - 1, 1)[:, :, 1:]                  # [N, C, L, K-1]: the history after token t
    pool.put((lay.out_slots,), lay.unpad(after.transpose(1, 2)))
    return lay.unpad(out.transpose(1, 2))
