"""The block-FP8 GEMM y = x W^T (torch reference) for linear weights kept FP8 (kernels/fp8_weight.py).

Two ways to multiply, chosen per weight (`act_quant`):
- w8a8 (act_quant, the checkpoints' `activation_scheme: dynamic`): activations are quantized on the fly to FP8 per
  row and per group of ACT_GROUP (128) columns, scale = amax / 448, and each group's FP8 x FP8 products are summed
  in fp32 and scaled by both scales. GPUs with FP8 tensor cores (sm_89 and later) run this.
- w8a16: the weight is dequantized (tile by tile in the kernel, which scales after each group's dot) and multiplied
  with the activations as they are. The torch reference equals dequantizing at load exactly: the tests compare the
  engine with the dequantized checkpoint through it. Serving uses w8a8 (tinyserve/plan.py fp8_weights_for); Triton
  has no e4m3 type before sm_89, so older GPUs dequantize at load instead.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tinyserve.kernels import use_triton
from tinyserve.kernels.fp8_weight import ACT_GROUP, AMAX_FLOOR, FP8, FP8_MAX, Fp8Weight


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 values [M, K], fp32 scales [M, ceil(K / ACT_GROUP)]), one scale per row and group."""
    M, K = x.shape
    groups = math.ceil(K / ACT_GROUP)
    xf = F.pad(x.float(), (0, groups * ACT_GROUP - K)).view(M, groups, ACT_GROUP)
    scale = xf.abs().amax(-1).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(M, groups * ACT_GROUP)[:, :K], scale


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype."""
    if use_triton(x):
        from tinyserve.kernels import fp8_prefill_triton, fp8_triton
        tiles = fp8_prefill_triton.tiles_for(x, w)
        if tiles is not None:              # a prefill chunk on a card with TMA: quantize once, the persistent GEMM
            y = fp8_prefill_triton.fp8_linear(x.reshape(-1, x.shape[-1]), w, tiles)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        return fp8_triton.fp8_linear(x, w)
    if not w.act_quant:
        return F.linear(x, w.dequantize(x.dtype))
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.weight.shape[0]
    xq, xs = quantize_activations(x.reshape(-1, K))
    groups = xs.shape[1]
    # per (row, group) partial products, each exact in fp32 (FP8 x FP8), then both scales and the sum over groups
    xg = F.pad(xq.float(), (0, groups * ACT_GROUP - K)).view(xq.shape[0], groups, ACT_GROUP).transpose(0, 1)
    wg = F.pad(w.weight.float(), (0, groups * ACT_GROUP - K)).view(N, groups, ACT_GROUP).permute(1, 2, 0)
    partial = torch.bmm(xg, wg)                                                    # [groups, M, N]
    b0, b1 = w.block
    group_cols = torch.arange(groups, device=x.device) * ACT_GROUP // b1         # scale column of each group
    ws = w.scale[:, group_cols].repeat_interleave(b0, 0)[:N].t()                  # [groups, N]
    y = (partial * xs.t()[:, :, None] * ws[:, None, :]).sum(0)
    return y.to(x.dtype).reshape(*lead, N)
