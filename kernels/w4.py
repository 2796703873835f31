"""The GEMM y = x W^T for 4-bit weights kept packed (kernels/w4_weight.py), activations in their own dtype.

The torch reference dequantizes a block of W4_BLOCK_ROWS output rows at a time and multiplies it with F.linear:
exactly the dequantized checkpoint's product (what the tests compare the engine against), without ever holding
the whole dequantized weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.kernels import use_cpu_kernel, use_triton
from tinyserve.kernels.w4_weight import W4Weight, int8_rounded

W4_BLOCK_ROWS = 1024           # output rows dequantized at a time by the reference (a few MB at K = 5120)


def w4_linear(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype."""
    if use_triton(x):                       # CUDA: kernels/w4_triton.py (decode, in-tile prefill, scratch + cuBLAS)
        from tinyserve.kernels import w4_triton
        if w4_triton.takes(w):
            return w4_triton.w4_linear(x, w)
    if use_cpu_kernel(x):                   # CPU: kernels/w4_cpu.py (the codes read in place; C)
        from tinyserve.kernels import w4_cpu
        if w4_cpu.usable(x, w):
            return w4_cpu.w4_linear(x, w)
    return w4_linear_reference(x, w)


def w4_linear_reference(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """Block by block: each block of output rows dequantized (in fp32, rounded once to x's dtype) and multiplied.
    With int8 activations: x rounded (`int8_rounded`, groups in the weight's sorted column order), in float32."""
    N, K = w.shape[-2], w.shape[-1]
    x2 = x.reshape(-1, K)
    if w.int8_activations and w.kind == "int4":
        x2 = int8_rounded(x2 if w.perm is None else x2.index_select(-1, w.perm), w.group)
        if w.perm is not None:                 # back to the checkpoint's column order, which dequantize gives
            x2 = torch.empty_like(x2).index_copy_(-1, w.perm, x2)
    y = torch.empty((x2.shape[0], N), dtype=x2.dtype, device=x.device)
    for r0 in range(0, N, W4_BLOCK_ROWS):
        rows = slice(r0, min(N, r0 + W4_BLOCK_ROWS))
        y[:, rows] = F.linear(x2, w.dequantize(x2.dtype, rows))
    return y.to(x.dtype).reshape(*x.shape[:-1], N)
