"""FP8 linear weights kept as FP8 in memory, in the checkpoints' block-FP8 format (the GEMM is kernels/fp8.py).

A weight W [N, K] is stored as float8_e4m3fn values times a float32 scale per (block_n x block_k) block:
W[n, k] = weight[n, k] * scale[n // block_n, k // block_k]. Qwen's `quant_method: fp8` and compressed-tensors'
block strategy use 128 x 128 blocks; per-channel scales are blocks of (1, K), a per-tensor scale becomes per-channel.
Half the bytes of bf16 on the device, which is what lets a 27B model fit a 48 GB card.
"""
from __future__ import annotations

import math

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # largest finite float8_e4m3fn
ACT_GROUP = 128          # activation quantization group (columns), also the GEMM's K tile
AMAX_FLOOR = 1e-10       # an all-zero group gets a tiny scale instead of a division by zero


def scale_block_ok(block: tuple[int, int], in_features: int) -> bool:
    """Whether the GEMM can read scales of this block shape: a K block that is whole activation groups or covers K."""
    return block[1] % ACT_GROUP == 0 or block[1] >= in_features


class Fp8Weight(nn.Module):
    """A linear weight [N, K] held as float8_e4m3fn with block scales (buffers `weight` and `scale`).

    With `experts`, a stack of E such weights (a MoE layer's experts): weight [E, N, K], scale [E, ceil(N / bn),
    ceil(K / bk)], every expert blocked on its own rows; `expert(e)` is one of them as a 2-D Fp8Weight."""

    def __init__(self, out_features: int, in_features: int, block: tuple[int, int], device,
                 act_quant: bool, experts: int | None = None) -> None:
        super().__init__()
        assert scale_block_ok(block, in_features), (block, in_features)
        self.block = block
        self.act_quant = act_quant
        lead = () if experts is None else (experts,)
        self.register_buffer("weight", torch.empty(lead + (out_features, in_features), dtype=FP8, device=device))
        self.register_buffer("scale", torch.empty(lead + (math.ceil(out_features / block[0]),
                                                          math.ceil(in_features / block[1])),
                                                  dtype=torch.float32, device=device))

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def expert(self, e: int) -> "Fp8Weight":
        """Expert e of a stacked weight: a 2-D Fp8Weight over views of this one's buffers (nothing is copied)."""
        assert self.weight.dim() == 3, "not a stacked experts weight"
        view = Fp8Weight.__new__(Fp8Weight)
        nn.Module.__init__(view)
        view.block, view.act_quant = self.block, self.act_quant
        view.register_buffer("weight", self.weight[e])
        view.register_buffer("scale", self.scale[e])
        return view

    def block_scales(self) -> torch.Tensor:
        """The scale of every element: [N, K] float32 ([E, N, K] for stacked experts)."""
        N, K = self.weight.shape[-2:]
        b0, b1 = self.block
        return self.scale.repeat_interleave(b0, -2)[..., :N, :].repeat_interleave(b1, -1)[..., :K]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W in `dtype` (computed in fp32, then rounded once, as dequantizing at load does)."""
        return (self.weight.float() * self.block_scales()).to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, block={self.block}, {'w8a8' if self.act_quant else 'w8a16'}"
