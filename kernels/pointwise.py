"""The model's per-token elementwise ops (torch references; fp32 math, output in the input dtype unless said):
the RMSNorm variants of the Qwen hybrid models, the MLP's SiLU-and-mul, and the partial NeoX rotary embedding.

Their Triton kernels, one file each beside this one: norm_triton.py, activation_triton.py, rotary_triton.py.
Qwen3.5 / Qwen3-Next rotate 64 of each head's 256 dims (partial_rotary_factor 0.25); the rest pass through.

l2_norm is scale * x / sqrt(sum(x^2) + 1e-6) over the last dim, in fp32 (HF's and FLA's l2norm; F.normalize clamps
the norm instead, which differs near 0), written as one rms_norm: mean(x^2) + 1e-6/d = (sum(x^2) + 1e-6) / d. Its
Triton kernel reads x in its dtype and writes fp32 (no weight tensor made, no fp32 copy of x: two launches fewer).

apply_rotary: x [T, H, hd] (last dim contiguous); cos, sin [T, 1, rd] fp32 (rd even, <= hd), as qwen3_next.Rotary
and the M-RoPE tables make them. It returns a new [T, H, hd] in x's dtype: dims :rd are x * cos + rotate_half(x) * sin
in fp32 (rotate_half(x1 | x2) = -x2 | x1), dims rd: are x's.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tinyserve.kernels import use_triton


class InputNorm(NamedTuple):
    """An RMSNorm applied to x before a GEMM (kernels.linear's `norm`): x * rstd(x) * scale (scale [K] fp32, 1 + w
    already added)."""
    scale: torch.Tensor
    eps: float


# fp32 inputs up to this many elements go through torch's fused rms_norm (one op instead of ~8: decode steps are
# dominated by per-op overhead); larger ones keep the composite form, which is faster there on CPU.
_FUSED_MAX_NUMEL = 1 << 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = True) -> torch.Tensor:
    """y = x / rms(x) * (1 + w) (zero-centred, every norm but the GDN output norm) or * w (plain)."""
    if use_triton(x):
        from tinyserve.kernels import norm_triton
        return norm_triton.rms_norm(x, weight, eps, zero_centred)
    w = weight if weight.dtype == torch.float32 else weight.float()
    w = 1.0 + w if zero_centred else w
    if x.dtype == torch.float32 and x.numel() <= _FUSED_MAX_NUMEL:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * w).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: rmsnorm(x) * w * silu(gate), normalised over the last dim (one value head)."""
    if use_triton(x):
        from tinyserve.kernels import norm_triton
        return norm_triton.gated_rms_norm(x, gate, weight, eps)
    y = rms_norm(x.float(), weight, eps, zero_centred=False)
    y = y.mul_(F.silu(gate.float()))
    return y.to(x.dtype)


def l2_norm(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale * x / sqrt(sum(x^2) + 1e-6) over the last dim, in fp32 (the module docstring)."""
    if use_triton(x):
        from tinyserve.kernels import norm_triton
        return norm_triton.l2_norm(x, scale)
    d = x.shape[-1]
    w = torch.full((d,), scale * d ** -0.5, dtype=torch.float32, device=x.device)
    return rms_norm(x.float(), w, 1e-6 / d, zero_centred=False)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] with the gate in the first half of the last dim; returns silu(gate) * up in x's dtype."""
    if use_triton(x):
        from tinyserve.kernels import activation_triton
        return activation_triton.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The partial NeoX rotary embedding of x [T, H, hd] by cos, sin [T, 1, rd] (the module docstring)."""
    if use_triton(x):
        from tinyserve.kernels import rotary_triton
        return rotary_triton.apply_rotary(x, cos, sin)
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].float(), x[..., rd:]
    x1, x2 = xr.chunk(2, dim=-1)
    rotated = xr * cos + torch.cat([-x2, x1], dim=-1) * sin
    return torch.cat([rotated.to(x.dtype), xp], dim=-1)
