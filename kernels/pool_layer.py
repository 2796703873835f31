"""One layer of a pool laid out [rows, layers, ...]: the KV pool (rows are pages) and the GDN state pools (rows are
state slots) hold every layer of a row together, so a row moves to and from the cache tiers in one piece.

A kernel reads the layer through `rows` (a view) and writes it through `put`, which indexes the whole pool with the
layer as one more index. Written so, a compiled step (torch.compile / inductor) updates the rows in place; a write
into the layer's view makes inductor copy the whole layer (the whole KV or state pool, every step) around it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class PoolLayer(NamedTuple):
    pool: torch.Tensor          # [rows, layers, ...]
    layer: int

    @staticmethod
    def of(x: "torch.Tensor | PoolLayer") -> "PoolLayer":
        """x as a PoolLayer: a plain tensor [rows, ...] is a pool of one layer."""
        return x if isinstance(x, PoolLayer) else PoolLayer(x.unsqueeze(1), 0)

    @property
    def rows(self) -> torch.Tensor:
        """The layer [rows, ...], a view."""
        return self.pool.select(1, self.layer)

    def put(self, index: tuple[torch.Tensor | int, ...], values: torch.Tensor) -> None:
        """rows[index] = values (advanced indexing; ints select), written through the whole pool."""
        first = index[0]
        full = [first, torch.full_like(first, self.layer)]
        full += [torch.full_like(first, i) if isinstance(i, int) else i for i in index[1:]]
        self.pool.index_put_(tuple(full), values.to(self.pool.dtype))
