"""Recurrent-state pool of the GDN layers: one slot per running sequence (plus snapshot slots for the prefix cache).

Slot-major layout so one slot (every GDN layer's conv and SSM state) is one contiguous span per tensor:
conv [slots, gdn_layers, conv_dim, K-1] in the model dtype, ssm [slots, gdn_layers, v_heads, dk, dv] in fp32.
The model takes per-layer views `conv[:, l]`, `ssm[:, l]` and indexes them by slot.
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch


class StatePool:
    def __init__(self, num_slots: int, num_layers: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
                 dk: int, dv: int, conv_dtype: torch.dtype, device, num_snapshot_slots: int = 0) -> None:
        # slots [0, num_slots) are working slots of running requests; the rest hold prefix-cache snapshots
        self.num_slots, self.num_snapshot_slots = num_slots, num_snapshot_slots
        total, L = num_slots + num_snapshot_slots, max(num_layers, 1)
        # one slot past them all: the scratch slot, read and written by the padding rows and tokens of a static
        # decode / verify batch (static.StaticStep), never handed out; conv / ssm, what everything else indexes, are views without it
        self.conv_all = torch.zeros((total + 1, L, conv_dim, conv_kernel - 1), dtype=conv_dtype, device=device)
        self.ssm_all = torch.zeros((total + 1, L, num_v_heads, dk, dv), dtype=torch.float32, device=device)
        self.conv, self.ssm, self.scratch_slot = self.conv_all[:total], self.ssm_all[:total], total
        self._free = list(range(num_slots - 1, -1, -1))
        self._free_snapshots = list(range(total - 1, num_slots - 1, -1))
        # called with slots about to be written (handed out, copied or zeroed into): orders the write after any tier
        # copy still reading them (copies.py; the engine sets it, a no-op otherwise)
        self.fence: Callable[[list[int]], None] = lambda slots: None

    @property
    def allocated(self) -> bool:
        return self.ssm.dim() != 2

    def deallocate(self) -> None:
        """Give the pool's memory back (idle release); every slot's content is lost. The slot counts stay."""
        if not self.allocated:
            return
        self._shapes = (self.conv.shape, self.ssm.shape)
        self.conv = torch.empty((self.conv.shape[0], 0), dtype=self.conv.dtype, device=self.conv.device)
        self.ssm = torch.empty((self.ssm.shape[0], 0), dtype=self.ssm.dtype, device=self.ssm.device)
        self.conv_all, self.ssm_all = self.conv, self.ssm                  # (the scratch slot goes too)

    def allocate(self) -> None:
        """Allocate the pool again after deallocate() (zeros)."""
        (n, *conv), (_, *ssm) = self._shapes                               # (+ the scratch slot)
        self.conv_all = torch.zeros((n + 1, *conv), dtype=self.conv.dtype, device=self.conv.device)
        self.ssm_all = torch.zeros((n + 1, *ssm), dtype=self.ssm.dtype, device=self.ssm.device)
        self.conv, self.ssm = self.conv_all[:n], self.ssm_all[:n]

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[0].numel() * self.conv.element_size() + self.ssm[0].numel() * self.ssm.element_size())

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        slot = self._free.pop() if self._free else None
        if slot is not None:
            self.fence([slot])
        return slot

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"double free of state slot {slot}"
        # kept in descending order, so alloc() hands out the lowest free slot: requests admitted together get
        # consecutive slots, which the decode kernels update through a view (slot swaps of NEXTN verifies and
        # out-of-order finishes would otherwise scatter them for good)
        bisect.insort(self._free, slot, key=lambda s: -s)

    @property
    def num_free_snapshots(self) -> int:
        return len(self._free_snapshots)

    def alloc_snapshot(self) -> int | None:
        slot = self._free_snapshots.pop() if self._free_snapshots else None
        if slot is not None:
            self.fence([slot])
        return slot

    def free_snapshot(self, slot: int) -> None:
        assert slot >= self.num_slots and slot not in self._free_snapshots, f"bad snapshot free {slot}"
        self._free_snapshots.append(slot)

    def zero(self, slot: int) -> None:
        self.fence([slot])
        self.conv[slot].zero_()
        self.ssm[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        self.fence([dst])
        self.conv[dst].copy_(self.conv[src])
        self.ssm[dst].copy_(self.ssm[src])
