"""SiLU-and-mul, the MLP activation: [..., 2I] (gate | up) -> silu(gate) * up [..., I] (torch reference)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.kernels import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] with the gate in the first half of the last dim; returns silu(gate) * up in x's dtype."""
    if use_triton(x):
        from tinyserve.kernels import activation_triton
        return activation_triton.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
