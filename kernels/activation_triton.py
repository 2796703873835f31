"""Triton kernel for kernels/pointwise.py (silu_and_mul): fused SiLU-and-mul (one read of gate | up, one write), fp32 math."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.norm_triton import _row_offsets, rows3, rows_per_program


@triton.jit
def _silu_and_mul_kernel(x_ptr, y_ptr, R, B, sxa, sxb, I, BR: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (r < R)[:, None] & (cols < I)[None, :]
    base = x_ptr + _row_offsets(r, B, sxa, sxb)[:, None] + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + I, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + r[:, None].to(tl.int64) * I + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    I = x.shape[-1] // 2
    x3 = rows3(x)
    y = torch.empty(x.shape[:-1] + (I,), dtype=x.dtype, device=x.device)
    if y.numel():
        R, block = x3.shape[0] * x3.shape[1], min(triton.next_power_of_2(I), 1024)
        br = rows_per_program(block, R)
        _silu_and_mul_kernel[(triton.cdiv(R, br), triton.cdiv(I, block))](
            x3, y, R, x3.shape[1], x3.stride(0), x3.stride(1), I, BR=br, BLOCK=block, num_warps=4)
    return y
