"""RMSNorm variants of the Qwen hybrid models (torch reference; fp32 math, output in the input dtype)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = True) -> torch.Tensor:
    """y = x / rms(x) * (1 + w) (zero-centred, every norm but the GDN output norm) or * w (plain)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    y = y * (1.0 + w) if zero_centred else y * w
    return y.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: rmsnorm(x) * w * silu(gate), normalised over the last dim (one value head)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y * weight.float() * F.silu(gate.float())
    return y.to(x.dtype)
