"""Triton kernels for kernels/linear.py: the decode GEMM, y = x W^T for 1 to DECODE_ROWS rows, with what surrounds
a projection in the model fused into it.

A decode step reads every weight once and multiplies it by a handful of rows: the GEMM is a stream over the weight,
and its speed is how close that stream comes to the card's memory bandwidth. So the kernel is built around the
weight, not the rows:
- one program owns BN output columns and one slice of K (split-K); the row block is always BM = 16 (tl.dot's least),
  the real rows masked, so every row count of 1..16 runs the same instructions and a row's sums do not depend on how
  many rows came with it (batch invariance);
- the programs are at least PROGRAMS_PER_SM times the card's SMs: BN and the split count are chosen from N, K and
  the SM count alone (`decode_tiles`), never from M. With more than one split each program writes fp32 partial sums
  and a second kernel adds them in split order (deterministic: no atomics) and applies the epilogue;
- weight tiles are loaded along K, the weight's contiguous dimension, in 16-byte vectors that Triton's pipeliner
  turns into asynchronous copies num_stages deep (bench/gpu_check.py --compile prints the widest load of each
  variant).
Weights: FP8 with block scales (kernels/fp8_weight.Fp8Weight; w8a8 quantizes each row's 128-column group in the
program, as kernels/fp8_triton.py does, w8a16 widens the weight tile), or 16-bit tensors (bf16 / fp16, the dtype of
x). fp32 weights run here only under the interpreter (the tests' oracle precision); on a GPU cuBLAS keeps them.
4-bit weights (kernels/w4_weight.W4Weight) run the same design in a sibling kernel, kernels/w4_triton.py (its K loop
dequantizes packed codes; the tiles, the split-K sum and this epilogue are these): `fits` and `decode_linear` take
them too.

Fused, each optional (the unfused path rounds between steps, and so does this one, so both give the same values):
- norm: x is RMS-normalised first, x * rstd(x) * scale (an RMSNorm by its scale, 1 + w already added); each program
  computes its rows' rstd over the whole of K (the rows are a few KB, read from L2), rounds the normalised tile to
  x's dtype as a separate norm would, and goes on (w8a8: quantizes it);
- silu_mul: W is a gate_up weight [2I, K]; the program multiplies the gate rows and the up rows of its columns and
  writes silu(gate) * up [M, I] (each rounded to x's dtype first, as silu_and_mul reads them);
- residual: writes residual + x W^T (the product rounded to x's dtype first, as the separate add reads it).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import torch
import triton
import triton.language as tl

from tinyserve.kernels.fp8_triton import fp8_group_product
from tinyserve.kernels.fp8_weight import ACT_GROUP, Fp8Weight

if TYPE_CHECKING:
    from tinyserve.kernels.pointwise import InputNorm

DECODE_ROWS = 16            # rows this kernel takes (tl.dot's least M); more go to the prefill GEMMs
BM = 16
BK = ACT_GROUP              # one activation group (and one FP8 scale column) per K step
PROGRAMS_PER_SM = 2         # at least this many programs per SM: a card's whole bandwidth needs several in flight
MIN_STEPS_PER_SPLIT = 4     # a K slice is at least 4 steps of BK: shorter slices cannot fill the pipeline


class DecodeTiles(NamedTuple):
    BN: int                 # output columns per program (of each half, with silu_mul)
    split: int              # K slices; > 1: partial sums and a second kernel
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132                      # the interpreter and --compile: as an H100 / H200 would tile


def decode_tiles(N: int, K: int, weight_bytes: int, two_halves: bool, sms: int) -> DecodeTiles:
    """BN and the split count for an [N, K] weight of weight_bytes per element as the dot reads it (1: FP8 w8a8; 2:
    bf16 / fp16, and FP8 w8a16, whose tile is widened in registers: 64 columns spill there on sm_120). The widest
    column tile of at most 8 KB a K step (64 columns of FP8, 32 of 16-bit; half that per half with silu_mul, whose
    program reads two) that still makes PROGRAMS_PER_SM programs per SM; where even 16 columns do not, K is split in
    powers of two until they do or the slices get short. Narrower tiles before splits: a split costs the second
    kernel's launch. Four stages of (x tile 4 KB + weight tiles <= 8 KB) fit every card's shared memory (100 KB on a
    4090 / 5090)."""
    widest = max(16, (8192 // BK) // weight_bytes // (2 if two_halves else 1))
    target = PROGRAMS_PER_SM * sms
    BN = widest
    while BN > 16 and triton.cdiv(N, BN) < target:
        BN //= 2
    tiles, steps, split = triton.cdiv(N, BN), triton.cdiv(K, BK), 1
    while tiles * split < target and steps >= 2 * split * MIN_STEPS_PER_SPLIT:
        split *= 2
    return DecodeTiles(BN=BN, split=split, num_warps=4, num_stages=4)


# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _row_rstd(x_ptr, rows, row_ok, sxm, K, eps, BM: tl.constexpr, BK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each of the rows, over all K columns, in fp32."""
    ks = tl.arange(0, BK)
    ss = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(x_ptr + rows[:, None] * sxm + (k0 + ks)[None, :], mask=row_ok[:, None] & (k0 + ks < K)[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _weight_product(x, w_ptrs, s_ptrs, mask, col_ok, FP8: tl.constexpr, ACT_QUANT: tl.constexpr,
                    PREC: tl.constexpr):
    """x [BM, BK] times the weight tile at w_ptrs (W^T [BK, BN]), fp32. FP8: scaled by the block scales at s_ptrs."""
    w = tl.load(w_ptrs, mask=mask, other=0.0)
    if FP8:
        w_scale = tl.load(s_ptrs, mask=col_ok, other=0.0)
        return fp8_group_product(x, w, w_scale, ACT_QUANT, PREC)
    else:
        return tl.dot(x, w, input_precision=PREC)


@triton.jit
def _finish(acc, acc_up, r_ptr, y_ptr, rows, row_ok, cols, col_ok, srm, sym,
            SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr):
    """The epilogue on fp32 sums [BM, BN]: silu(gate) * up, + residual, each step rounded to y's dtype as the
    separate kernels would round it; stores y."""
    out_ty = y_ptr.dtype.element_ty
    y = acc
    if SILU_MUL:
        gate = acc.to(out_ty).to(tl.float32)
        up = acc_up.to(out_ty).to(tl.float32)
        y = gate / (1.0 + tl.exp(-gate)) * up
    mask = row_ok[:, None] & col_ok[None, :]
    if RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * srm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y.to(out_ty).to(tl.float32) + r
    tl.store(y_ptr + rows[:, None] * sym + cols[None, :], y.to(out_ty), mask=mask)


@triton.jit
def _finish_slice(acc, acc_up, part_ptr, r_ptr, y_ptr, pid_k, M, N, rows, row_ok, cols, col_ok, srm, sym,
                  SPLIT: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr):
    """A decode GEMM's K slice done: unsplit, the epilogue; else its partial sums part[pid_k, row, col] (the up
    half at col + N) for _split_sum_kernel."""
    if SPLIT == 1:
        _finish(acc, acc_up, r_ptr, y_ptr, rows, row_ok, cols, col_ok, srm, sym, SILU_MUL=SILU_MUL, RESIDUAL=RESIDUAL)
    else:
        width = 2 * N if SILU_MUL else N
        p = part_ptr + (pid_k * M + rows)[:, None].to(tl.int64) * width + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        tl.store(p, acc, mask=mask)
        if SILU_MUL:
            tl.store(p + N, acc_up, mask=mask)


@triton.jit
def _decode_gemm_kernel(x_ptr, w_ptr, ws_ptr, nw_ptr, r_ptr, y_ptr, part_ptr,
                        M, N, K, K_SLICE, UP_ROW, sxm, swn, wsn, wsk, srm, sym, eps,
                        FP8: tl.constexpr, ACT_QUANT: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                        NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr, SPLIT: tl.constexpr,
                        PREC: tl.constexpr, EVEN_K: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BM)
    row_ok = rows < M
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    if NORM:
        rstd = _row_rstd(x_ptr, rows, row_ok, sxm, K, eps, BM=BM, BK=BK)
    k_start = pid_k * K_SLICE
    k_end = tl.minimum(K, k_start + K_SLICE)
    x_ptrs = x_ptr + rows[:, None] * sxm + (k_start + ks)[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * swn + (k_start + ks)[:, None]          # W^T tile [BK, BN]
    s_row = ws_ptr + (cols // SCALE_BN) * wsn                   # the columns' block-scale rows (FP8)
    up_s_row = ws_ptr + ((cols + UP_ROW) // SCALE_BN) * wsn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        if EVEN_K:                   # K a multiple of BK (every Qwen3.5 / Qwen3-Next shape): no column masks
            x_mask = row_ok[:, None]
            w_mask = col_ok[None, :]
        else:
            k_ok = k0 + ks < K
            x_mask = row_ok[:, None] & k_ok[None, :]
            w_mask = k_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if NORM:
            nw = tl.load(nw_ptr + k0 + ks, mask=k0 + ks < K, other=0.0)
            x = (x.to(tl.float32) * rstd[:, None] * nw[None, :]).to(x_ptr.dtype.element_ty)
        s_col = (k0 // SCALE_BK) * wsk
        acc += _weight_product(x, w_ptrs, s_row + s_col, w_mask, col_ok, FP8, ACT_QUANT, PREC)
        if SILU_MUL:
            acc_up += _weight_product(x, w_ptrs + UP_ROW * swn, up_s_row + s_col, w_mask, col_ok, FP8, ACT_QUANT,
                                      PREC)
        x_ptrs += BK
        w_ptrs += BK
    _finish_slice(acc, acc_up, part_ptr, r_ptr, y_ptr, pid_k, M, N, rows, row_ok, cols, col_ok, srm, sym,
                  SPLIT=SPLIT, SILU_MUL=SILU_MUL, RESIDUAL=RESIDUAL)


@triton.jit
def _split_sum_kernel(part_ptr, r_ptr, y_ptr, M, N, srm, sym, SPLIT: tl.constexpr, SILU_MUL: tl.constexpr,
                      RESIDUAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The K slices' partial sums added in slice order, then the epilogue."""
    rows = tl.arange(0, BM)
    row_ok = rows < M
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    width = 2 * N if SILU_MUL else N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(SPLIT):
        p = part_ptr + (s * M + rows)[:, None].to(tl.int64) * width + cols[None, :]
        acc += tl.load(p, mask=mask, other=0.0)
        if SILU_MUL:
            acc_up += tl.load(p + N, mask=mask, other=0.0)
    _finish(acc, acc_up, r_ptr, y_ptr, rows, row_ok, cols, col_ok, srm, sym, SILU_MUL=SILU_MUL, RESIDUAL=RESIDUAL)


# ---------------------------------------------------------------------------------------------------------------
def _weight_tensor(weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    return weight.weight if isinstance(weight, Fp8Weight) else weight


def fits(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> bool:
    """Whether this kernel takes x @ weight^T: 1..DECODE_ROWS rows, a 2-D weight read along K; FP8, or 16-bit of
    x's dtype (fp32 only interpreted: on a GPU cuBLAS multiplies fp32 faster than an FMA loop would). A 4-bit weight
    has its own (w4_triton.fits)."""
    w = _weight_tensor(weight)
    rows = x.numel() // max(x.shape[-1], 1)
    if not 1 <= rows <= DECODE_ROWS or w.dim() != 2 or w.stride(-1) != 1 or w.shape[1] != x.shape[-1]:
        return False
    if isinstance(weight, Fp8Weight):
        return True
    return w.dtype == x.dtype and (w.dtype in (torch.bfloat16, torch.float16) or
                                   (w.dtype == torch.float32 and not x.is_cuda))


def decode_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, norm: "InputNorm | None" = None,
                  silu_mul: bool = False, residual: torch.Tensor | None = None,
                  tiles: DecodeTiles | None = None) -> torch.Tensor:
    """kernels.linear's fused projection for 1..DECODE_ROWS rows (see the module docstring); `tiles` overrides
    decode_tiles (tests, and bench/gpu_check.py's sweep). A W4Weight has a sibling kernel (w4_triton.decode_linear)."""
    fp8 = isinstance(weight, Fp8Weight)
    w = _weight_tensor(weight)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    widened = fp8 and not weight.act_quant              # w8a16: the FP8 tile is widened to 16 bits in registers
    t = tiles or decode_tiles(N, K, 2 if widened else w.element_size(), silu_mul, num_sms(x.device))
    k_slice = triton.cdiv(triton.cdiv(K, BK), t.split) * BK
    split = triton.cdiv(K, k_slice)                    # slices that are not empty
    r2 = residual.reshape(M, N) if residual is not None else y
    part = torch.empty((split, M, 2 * N if silu_mul else N), dtype=torch.float32, device=x.device) \
        if split > 1 else y
    scale = weight.scale if fp8 else y
    nw = norm.scale if norm is not None else y
    _decode_gemm_kernel[(triton.cdiv(N, t.BN), split)](
        x2, w, scale, nw, r2, y, part, M, N, K, k_slice, N if silu_mul else 0,
        x2.stride(0), w.stride(0), scale.stride(0) if fp8 else 0, scale.stride(1) if fp8 else 0,
        r2.stride(0), y.stride(0), norm.eps if norm is not None else 0.0,
        FP8=fp8, ACT_QUANT=fp8 and weight.act_quant, SCALE_BN=weight.block[0] if fp8 else 1,
        SCALE_BK=weight.block[1] if fp8 else BK, NORM=norm is not None, SILU_MUL=silu_mul,
        RESIDUAL=residual is not None, SPLIT=split, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        EVEN_K=K % BK == 0, BM=BM, BN=t.BN, BK=BK, num_warps=t.num_warps, num_stages=t.num_stages)
    if split > 1:
        BN_SUM = min(256, triton.next_power_of_2(N))
        _split_sum_kernel[(triton.cdiv(N, BN_SUM),)](
            part, r2, y, M, N, r2.stride(0), y.stride(0), SPLIT=split, SILU_MUL=silu_mul,
            RESIDUAL=residual is not None, BM=BM, BN=BN_SUM, num_warps=4)
    return y.reshape(*lead, N)
