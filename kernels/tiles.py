"""The work list of a prefill kernel: a packed batch cut into tiles of a few tokens of one sequence each."""
from __future__ import annotations

import torch


def prefill_tiles(cu_seqlens: list[int], per_sequence: list[int], tile: int,
                  device: torch.device) -> tuple[torch.Tensor | None, int]:
    """(meta, number of tiles): meta is one int32 tensor on `device`, [tile's sequence | tile's first token within
    it | cu_seqlens | per_sequence] (a slot id or a context length per sequence), made by one host -> device copy
    with nothing read back; None when the batch has no tokens."""
    n = len(per_sequence)
    tile_seq, tile_start = [], []
    for i in range(n):
        for s in range(0, cu_seqlens[i + 1] - cu_seqlens[i], tile):
            tile_seq.append(i)
            tile_start.append(s)
    if not tile_seq:
        return None, 0
    meta = torch.tensor(tile_seq + tile_start + list(cu_seqlens[:n + 1]) + list(per_sequence), dtype=torch.int32)
    return meta.to(device, non_blocking=True), len(tile_seq)
