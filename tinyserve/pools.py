"""The device memory a step reads and writes: the paged KV cache of the full-attention layers (KVPool, with a
reference-counted PageAllocator) and the recurrent-state pool of the GDN layers (StatePool).

KV: page-major, [num_pages, num_layers, 2 (k, v), page_size, kv_heads, head_dim]: every layer of one page is one
contiguous span, so moving a page to the host or to a file is a single copy. One layer's view `pool.layer(l)` is
[num_pages, 2, page_size, kv_heads, head_dim] (what the attention kernels take).

State: one slot per running sequence (plus snapshot slots for the prefix cache), slot-major so one slot (every GDN
layer's conv and SSM state) is one contiguous span per tensor: conv [slots, gdn_layers, conv_dim, K-1] in the model
dtype, ssm [slots, gdn_layers, v_heads, dk, dv] in fp32. The model takes per-layer views `conv[:, l]`, `ssm[:, l]`
and indexes them by slot. Free working slots are kept in order and alloc() hands out the lowest: requests admitted
together get consecutive slots, which the decode kernels update through a view (slot swaps of NEXTN verifies and
out-of-order finishes would otherwise scatter them for good).
"""
from __future__ import annotations

import bisect
from typing import Callable

import torch


class KVPool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device) -> None:
        self.num_pages, self.page_size, self.num_layers = num_pages, page_size, num_layers
        self.dtype = dtype
        # one page past the allocator's: the scratch page, written by the padding rows and tokens of a static
        # decode / verify batch (static.StaticStep); never handed out, never cached
        self.scratch_page = num_pages
        self.buffer = torch.zeros((num_pages + 1, max(num_layers, 1), 2, page_size, num_kv_heads, head_dim),
                                  dtype=dtype, device=device)

    def layer(self, i: int) -> torch.Tensor:
        return self.buffer[:, i]

    @property
    def allocated(self) -> bool:
        return self.buffer.dim() != 2

    def deallocate(self) -> None:
        """Give the pool's memory back (idle release); every page's content is lost. The page count stays."""
        if not self.allocated:
            return
        self._shape = self.buffer.shape
        self.buffer = torch.empty((self.num_pages, 0), dtype=self.dtype, device=self.buffer.device)

    def allocate(self) -> None:
        """Allocate the pool again after deallocate() (zeros)."""
        self.buffer = torch.zeros(self._shape, dtype=self.dtype, device=self.buffer.device)

    @property
    def bytes_per_page(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PageAllocator:
    """Hands out page ids; a page shared by several owners (running requests, the radix cache) is reference
    counted and returns to the free list only when the last owner lets go."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))     # pop() hands out low ids first
        # called with pages about to be handed out (to be written): orders them after any tier copy still reading
        # them (copies.py; the engine sets it, a no-op otherwise)
        self.fence: Callable[[list[int]], None] = lambda pages: None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages with refcount 1, or None (nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n:][::-1]          # the lowest free ids, as pop() would give them
        del self._free[len(self._free) - n:]
        for p in pages:
            self.refcount[p] = 1
        self.fence(pages)
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"retain of free page {p}"
            self.refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            assert self.refcount[p] > 0, f"double free of page {p}"
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self._free.append(p)


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
        self._free = list(range(num_slots))                   # ascending: alloc() hands out the lowest
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
        slot = self._free.pop(0) if self._free else None
        if slot is not None:
            self.fence([slot])
        return slot

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"double free of state slot {slot}"
        bisect.insort(self._free, slot)                     # in order (the module docstring)

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
