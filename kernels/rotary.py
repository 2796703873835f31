"""Partial NeoX rotary embedding (torch reference): the first rotary_dim dims of each head turn as two halves.

Qwen3.5 / Qwen3-Next rotate 64 of each head's 256 dims (partial_rotary_factor 0.25); the rest pass through.
"""
from __future__ import annotations

import torch

from tinyserve.kernels import use_triton


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, hd] (last dim contiguous); cos, sin [T, 1, rd] fp32 (rd even, <= hd), as qwen3_next.Rotary.cos_sin and
    the M-RoPE tables make them. Returns a new [T, H, hd] in x's dtype: dims :rd are x * cos + rotate_half(x) * sin
    in fp32 (rotate_half(x1 | x2) = -x2 | x1), dims rd: are x's."""
    if use_triton(x):
        from tinyserve.kernels import rotary_triton
        return rotary_triton.apply_rotary(x, cos, sin)
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].float(), x[..., rd:]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated.to(x.dtype), xp], dim=-1)
