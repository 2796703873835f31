"""Triton kernels for kernels/pointwise.py: RMSNorm (zero-centred or plain), the gated RMSNorm of the GDN output, and the
l2 norm of the GDN's q and k.

Same signatures and semantics as the torch reference: fp32 math, output in x's dtype (fp32 for l2_norm). One program per row; a row is the last dim, any leading dims (views with a unit last-dim stride
are read in place, as the q/k slices and the z gate of the model are).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def rows3(x: torch.Tensor) -> torch.Tensor:
    """x as [A, B, D] with a unit stride on D, a view when the strides allow it (so per-head slices of a fused
    projection are read in place); row r is x3[r // B, r % B]."""
    if x.dim() == 1:
        x3 = x.view(1, 1, -1)
    elif x.dim() == 2:
        x3 = x.unsqueeze(0)
    else:
        x3 = x.flatten(0, -3) if x.dim() > 3 else x
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def num_warps_for(block: int) -> int:
    return min(max(block // 256, 1), 8)


def rows_per_program(block: int, rows: int) -> int:
    """Short rows (per-head norms: 128 or 256 wide) go several to a program, up to 4096 elements of work."""
    return max(1, min(4096 // block, 16, triton.next_power_of_2(rows)))


@triton.jit
def _row_offsets(r, B, sa, sb):
    """Offsets of rows r (a vector) of an [A, B, D] view with strides (sa, sb, 1)."""
    a, b = r // B, r % B
    return a.to(tl.int64) * sa + b.to(tl.int64) * sb


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, R, B, sxa, sxb, D, eps,
                     ZERO_CENTRED: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BLOCK)
    mask = (r < R)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + _row_offsets(r, B, sxa, sxb)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    if ZERO_CENTRED:
        w = w + 1.0
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + r[:, None].to(tl.int64) * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, R, B, sxa, sxb, sza, szb, D, eps,
                           BR: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BLOCK)
    mask = (r < R)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + _row_offsets(r, B, sxa, sxb)[:, None] + cols[None, :], mask=mask, other=0.0)
    z = tl.load(z_ptr + _row_offsets(r, B, sza, szb)[:, None] + cols[None, :], mask=mask, other=0.0)
    x, z = x.to(tl.float32), z.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None] * w[None, :] * (z / (1.0 + tl.exp(-z)))
    tl.store(y_ptr + r[:, None].to(tl.int64) * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _l2_norm_kernel(x_ptr, y_ptr, R, B, sxa, sxb, D, scale, BR: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BLOCK)
    mask = (r < R)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + _row_offsets(r, B, sxa, sxb)[:, None] + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    inv = scale / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)
    tl.store(y_ptr + r[:, None].to(tl.int64) * D + cols[None, :], x * inv[:, None], mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = True) -> torch.Tensor:
    D = x.shape[-1]
    x3 = rows3(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel():
        R, block = x3.shape[0] * x3.shape[1], triton.next_power_of_2(D)
        br = rows_per_program(block, R)
        _rms_norm_kernel[(triton.cdiv(R, br),)](
            x3, weight.contiguous(), y, R, x3.shape[1], x3.stride(0), x3.stride(1), D, eps,
            ZERO_CENTRED=zero_centred, BR=br, BLOCK=block, num_warps=num_warps_for(block * br))
    return y


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert gate.shape == x.shape, (gate.shape, x.shape)
    D = x.shape[-1]
    x3, z3 = rows3(x), rows3(gate)
    if z3.shape != x3.shape:                       # different view-ability: fall back to the same row layout
        x3, z3 = x.reshape(-1, D).unsqueeze(0).contiguous(), gate.reshape(-1, D).unsqueeze(0).contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel():
        R, block = x3.shape[0] * x3.shape[1], triton.next_power_of_2(D)
        br = rows_per_program(block, R)
        _gated_rms_norm_kernel[(triton.cdiv(R, br),)](
            x3, z3, weight.contiguous(), y, R, x3.shape[1], x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1),
            D, eps, BR=br, BLOCK=block, num_warps=num_warps_for(block * br))
    return y


def l2_norm(x: torch.Tensor, scale: float) -> torch.Tensor:
    """kernels.pointwise.l2_norm: fp32 out, x read in its own dtype and layout."""
    D = x.shape[-1]
    x3 = rows3(x)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if y.numel():
        R, block = x3.shape[0] * x3.shape[1], triton.next_power_of_2(D)
        br = rows_per_program(block, R)
        _l2_norm_kernel[(triton.cdiv(R, br),)](
            x3, y, R, x3.shape[1], x3.stride(0), x3.stride(1), D, float(scale), BR=br, BLOCK=block,
            num_warps=num_warps_for(block * br))
    return y
