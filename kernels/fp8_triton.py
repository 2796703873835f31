"""Triton kernel for kernels/fp8.py: the block-FP8 GEMM y = x W^T with W kept as float8_e4m3fn + block scales.

One program computes a [BM, BN] tile of y and walks K in steps of ACT_GROUP (128) columns, one activation group at a
time. w8a8: the program quantizes its x tile per row (amax / 448, clamped, rounded to e4m3) right after loading it,
so there is no separate quantization kernel or FP8 copy of x; the FP8 x FP8 dot accumulates in fp32 and is scaled by
the row's activation scale and the weight block's scale before it joins the accumulator. w8a16: the FP8 weight tile
is widened to x's dtype and the dot's result scaled by the block's scale. Every N tile quantizes the same x tile
again: BM x 128 divisions against BM x BN x 128 multiply-adds, a 1/BN share.

Which kernel multiplies: 1..16 rows (a decode step) take kernels/linear_triton.py's decode GEMM when they come
through kernels.linear; fp8_prefill_triton.PREFILL_ROWS and more, on a card with TMA (sm_90, sm_120),
kernels/fp8_prefill_triton.py's quantize + persistent TMA GEMM (kernels/fp8.py chooses); everything else this one.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.fp8_weight import ACT_GROUP, AMAX_FLOOR, FP8_MAX, Fp8Weight

_FP8_MAX = tl.constexpr(FP8_MAX)              # a compiled kernel reads module globals only as constexprs
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


@triton.jit
def fp8_group_product(x, w, w_scale, ACT_QUANT: tl.constexpr, PREC: tl.constexpr):
    """One activation group's share of the product: x [BM, 128] (any float dtype) times the FP8 weight tile w
    [128, BN] whose block scales are w_scale [BN], in fp32. w8a8: x is first quantized per row (amax / 448, clamped
    to +-448: no NaN, saturation as on the GPU) and the FP8 x FP8 dot scaled by both scales; w8a16: the weight tile
    is widened to x's dtype. (The fused MoE's FP8 GEMM uses it too.)"""
    if ACT_QUANT:
        xf = x.to(tl.float32)
        x_scale = tl.maximum(tl.max(tl.abs(xf), axis=1), _AMAX_FLOOR) / _FP8_MAX           # [BM]
        xq = tl.clamp(xf / x_scale[:, None], -_FP8_MAX, _FP8_MAX).to(w.dtype)
        return tl.dot(xq, w) * x_scale[:, None] * w_scale[None, :]
    else:
        return tl.dot(x, w.to(x.dtype), input_precision=PREC) * w_scale[None, :]


@triton.jit
def _block_fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, sxm, swn, ssn, ssk, sym,
                           SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, ACT_QUANT: tl.constexpr,
                           PREC: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows, cols, ks = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    row_ok = pid_m * BM + rows < M
    col_ok = pid_n * BN + cols < N
    # 64-bit tile bases, 32-bit offsets inside the tile (a 64-bit offset per element costs registers); the
    # pointers advance by BK columns per step
    x_ptrs = x_ptr + tl.cast(pid_m * BM, tl.int64) * sxm + rows[:, None] * sxm + ks[None, :]
    w_ptrs = w_ptr + tl.cast(pid_n * BN, tl.int64) * swn + cols[None, :] * swn + ks[:, None]    # W^T [BK, BN]
    s_ptrs = s_ptr + ((pid_n * BN + cols) // SCALE_BN) * ssn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:                  # K a multiple of BK (every Qwen3.5 / Qwen3-Next shape): no column masks
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k0
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        w_scale = tl.load(s_ptrs + (k0 // SCALE_BK) * ssk, mask=col_ok, other=0.0)          # [BN]
        acc += fp8_group_product(x, w, w_scale, ACT_QUANT, PREC)
        x_ptrs += BK
        w_ptrs += BK
    y = y_ptr + tl.cast(pid_m * BM, tl.int64) * sym + rows[:, None] * sym + pid_n * BN + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def tile_shape(M: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) for M rows: decode batches are bandwidth-bound (small tiles, many programs
    streaming the weight once), prefill compute-bound (large tiles). Checked with `bench/gpu_check.py --compile`:
    no register spills; 128 x 128 tiles take three pipeline stages only where shared memory allows (Hopper's 228
    KiB; a 4090 or 5090 has 100 KiB)."""
    if M <= 16:
        return 16, 64, 4, 4
    if M <= 64:
        return 64, 64, 4, 3
    big_smem = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return 128, 128, 8, 3 if big_smem else 2


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        BM, BN, warps, stages = tile_shape(M, x.device)
        _block_fp8_gemm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
            x2, w.weight, w.scale, y, M, N, K, x2.stride(0), w.weight.stride(0), w.scale.stride(0),
            w.scale.stride(1), y.stride(0), SCALE_BN=w.block[0], SCALE_BK=w.block[1],
            ACT_QUANT=w.act_quant,
            PREC="ieee" if x.dtype == torch.float32 else "tf32", EVEN_K=K % ACT_GROUP == 0, BM=BM, BN=BN, BK=ACT_GROUP, num_warps=warps, num_stages=stages)
    return y.reshape(*lead, N)
