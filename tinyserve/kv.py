"""Paged KV cache of the full-attention layers: the page pool, a reference-counted page allocator.

Layout is page-major, [num_pages, num_layers, 2 (k, v), page_size, kv_heads, head_dim]: every layer of one page is
one contiguous span, so moving a page to the host or to a file is a single copy. One layer's view
`pool.layer(l)` is [num_pages, 2, page_size, kv_heads, head_dim] (what the attention kernels take).
"""
from __future__ import annotations

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
        pages = [self._free.pop() for _ in range(n)]
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
