"""RMSNorm variants of the Qwen hybrid models (torch reference; fp32 math, output in the input dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.kernels import use_triton

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
    """scale * x / sqrt(sum(x^2) + 1e-6) over the last dim, in fp32 (HF's and FLA's l2norm; F.normalize clamps the
    norm instead, which differs near 0). Written as one rms_norm: mean(x^2) + 1e-6/d = (sum(x^2) + 1e-6) / d. The
    Triton kernel reads x in its dtype and writes fp32 (no weight tensor made, no fp32 copy of x: two launches
    fewer per call)."""
    if use_triton(x):
        from tinyserve.kernels import norm_triton
        return norm_triton.l2_norm(x, scale)
    d = x.shape[-1]
    w = torch.full((d,), scale * d ** -0.5, dtype=torch.float32, device=x.device)
    return rms_norm(x.float(), w, 1e-6 / d, zero_centred=False)
