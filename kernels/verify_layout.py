"""The layout of a step's speculative-verify sequences (1 + k tokens each, padded to one length), shared by the
GDN and conv kernels (state after every token in its own slot) and the attention (each token a causal decode row)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyLayout:
    """The speculative-verify sequences of a step, padded to [N, L] (L: the longest, 1 + its drafts).

    rows[i, t] is the token row (counted from the first verify token) of token t of sequence i, or T, an all-zero
    padding row, past its end: a zero token leaves the GDN state and its conv history untouched. `valid` lists the
    flat indices i * L + t of the real tokens, which in this order are the token rows 0..T-1. Sequence i reads its
    state from in_slots[i]; the state after its token t goes to its own slot (out_slots, one per real token).
    For attention each token is a decode row over its sequence's pages (token_seq) that sees its position + 1 keys
    (token_lens), which makes it causal."""
    rows: torch.Tensor           # [N, L] int64
    valid: torch.Tensor | None   # [T] int64; None when every sequence has L tokens (no padding: views, no gathers)
    in_slots: torch.Tensor       # [N] int64
    out_slots: torch.Tensor      # [T] int64
    token_seq: torch.Tensor      # [T] int64: the sequence of each token
    token_lens: torch.Tensor     # [T] int32: the keys each token sees (its position + 1)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] -> the [T, ...] real tokens in token order."""
        flat = x.flatten(0, 1)
        return flat if self.valid is None else flat[self.valid]


def verify_layout(cu_seqlens: list[int], seq_lens: list[int], in_slots: list[int], out_slots: list[list[int]],
                  device) -> VerifyLayout:
    """The layout of verify sequences packed by cu_seqlens, sequence i's context being seq_lens[i] tokens after
    the step (its verified tokens last)."""
    n = [cu_seqlens[i + 1] - cu_seqlens[i] for i in range(len(in_slots))]
    L, T = max(n), cu_seqlens[-1]
    rows = [[cu_seqlens[i] + t if t < n[i] else T for t in range(L)] for i in range(len(n))]
    valid = None if T == L * len(n) else torch.tensor([i * L + t for i in range(len(n)) for t in range(n[i])],
                                                      device=device)
    return VerifyLayout(torch.tensor(rows, device=device), valid,
                        torch.tensor(in_slots, device=device),
                        torch.tensor([s for i, slots in enumerate(out_slots) for s in slots[:n[i]]], device=device),
                        torch.tensor([i for i in range(len(n)) for _ in range(n[i])], device=device),
                        torch.tensor([seq_lens[i] - n[i] + t + 1 for i in range(len(n)) for t in range(n[i])],
                                     dtype=torch.int32, device=device))


def pad_to_layout(x: torch.Tensor, lay: VerifyLayout) -> torch.Tensor:
    """[T, ...] token rows -> [N, L, ...] (zeros past each sequence's end)."""
    if lay.valid is None:
        return x.reshape(lay.rows.shape + x.shape[1:])
    return torch.cat([x, x.new_zeros((1,) + x.shape[1:])])[lay.rows]
