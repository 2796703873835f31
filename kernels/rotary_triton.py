"""Triton kernel for kernels/pointwise.py (apply_rotary): partial NeoX rotary, one read and one write of each head, fp32 math.

One program per (token, block of heads): it loads the token's cos / sin halves once for all its heads, turns
the two halves of the rotary dims and copies the dims past them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, HD, HALF, sxt, sxh, sct, syt, syh,
                   BH: tl.constexpr, BHALF: tl.constexpr, BPASS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    mh = h < H
    d = tl.arange(0, BHALF)
    md = d < HALF
    c1 = tl.load(cos_ptr + t * sct + d, mask=md, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + t * sct + HALF + d, mask=md, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + t * sct + d, mask=md, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + t * sct + HALF + d, mask=md, other=0.0)[None, :]
    m = mh[:, None] & md[None, :]
    x_row = x_ptr + t * sxt + h[:, None] * sxh
    y_row = y_ptr + t * syt + h[:, None] * syh
    x1 = tl.load(x_row + d[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF + d[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(y_row + d[None, :], (x1 * c1 - x2 * s1).to(y_ptr.dtype.element_ty), mask=m)
    tl.store(y_row + HALF + d[None, :], (x2 * c2 + x1 * s2).to(y_ptr.dtype.element_ty), mask=m)
    if BPASS > 0:                                       # the dims past the rotary ones, copied
        p = 2 * HALF + tl.arange(0, BPASS)
        mp = mh[:, None] & (p < HD)[None, :]
        tl.store(y_row + p[None, :], tl.load(x_row + p[None, :], mask=mp, other=0.0), mask=mp)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    T, H, HD = x.shape
    rd = cos.shape[-1]
    assert x.stride(-1) == 1 and rd % 2 == 0 and rd <= HD and cos.dtype == sin.dtype == torch.float32
    cos, sin = cos.reshape(T, rd), sin.reshape(T, rd)
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    y = torch.empty((T, H, HD), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    BH = min(triton.next_power_of_2(H), 16)
    _rotary_kernel[(T, triton.cdiv(H, BH))](
        x, cos, sin, y, H, HD, rd // 2, x.stride(0), x.stride(1), cos.stride(0), y.stride(0), y.stride(1),
        BH=BH, BHALF=triton.next_power_of_2(rd // 2), BPASS=triton.next_power_of_2(HD - rd) if HD > rd else 0,
        num_warps=4)
    return y
