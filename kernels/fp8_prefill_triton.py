"""Triton kernels for kernels/fp8.py's prefill rows (w8a8, PREFILL_ROWS rows and more): the activations
quantized once by their own kernel, then a persistent block-FP8 GEMM that reads both operands through TMA
descriptors.

A prefill chunk multiplies thousands of rows: the GEMM is bound by the tensor cores, and what keeps them busy is
feeding them whole tiles from shared memory without the threads spending their time on address arithmetic. So:
1. _quantize_groups_kernel: x [M, K] -> FP8 values [M, K] and fp32 scales [K / 128, M] (one per row and 128-column
   group, amax / 448, clamped to +-448: kernels/fp8.quantize_activations exactly). The scales are stored group-major
   so the GEMM reads each step's BM scales as one contiguous vector. One pass over x: 3 bytes moved per element
   against the GEMM's 2 N flops per element (x quantized per N tile in the GEMM, as kernels/fp8_triton.py does for
   fewer rows, repeats the work N / BN times).
2. _fp8_gemm_tma_kernel: as many programs as SMs, each walking the output tiles in GROUP_M-row groups (neighbouring
   programs share the same x rows and weight columns in L2); per tile, the K loop loads the x tile and the weight
   tile with TMA (cp.async.bulk.tensor: one instruction per tile, out-of-range rows read as zeros), multiplies them
   FP8 x FP8 (wgmma on Hopper, mma.sync on sm_120), and adds each 128-column group's product into the fp32
   accumulator after scaling it by the row scales and the weight block's scale. The product is scaled before it
   joins the accumulator, so the tensor cores never sum more than one group (Hopper's FP8 sum keeps ~14 bits inside
   an instruction; DeepSeek-V3's "promotion" every 128).

Tile configurations per card family (`PREFILL_TILES`, bench/gpu_check.py --compile shows each fits its shared memory
without spills): Hopper (sm_90: 228 KB of shared memory, 132 SMs) takes 128 x 128 tiles four stages deep (4 x 32 KB)
at 8 warps, two warpgroups of wgmma 64 x 128; consumer Blackwell (sm_120: ~100 KB) the same tiles three stages deep.
A 128 x 256 tile would halve the weight reloads but its two fp32 accumulators (the running sum and the group's
product) spill at 255 registers a thread (ptxas, sm_90). Ada (sm_89) has no TMA: it keeps kernels/fp8_triton.py's
pointer kernel (128 x 128, two stages in its 100 KB).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tinyserve.kernels.fp8_weight import ACT_GROUP, AMAX_FLOOR, FP8, FP8_MAX, Fp8Weight
from tinyserve.kernels.linear_triton import num_sms

PREFILL_ROWS = 512          # rows from which the quantize + TMA pair takes over from the one-pass pointer kernel
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


class PrefillTiles(NamedTuple):
    BM: int
    BN: int
    group_m: int            # output tile rows walked together (L2 reuse of the weight columns)
    num_warps: int
    num_stages: int
    flatten: bool           # one software pipeline over every tile's K steps (the next tile's loads overlap the
                            # epilogue), at the cost of registers and ~32 KB of shared memory


PREFILL_TILES = {           # compiled (ptxas): sm_90 164 KB shared, 241 registers; sm_120 74 KB, 252; no spills
    "hopper": PrefillTiles(BM=128, BN=128, group_m=8, num_warps=8, num_stages=4, flatten=True),     # H100, H200
    "blackwell": PrefillTiles(BM=128, BN=128, group_m=8, num_warps=8, num_stages=3, flatten=True),  # RTX 5090
}


def card_family(device: torch.device) -> str | None:
    """"hopper" (sm_90), "blackwell" (consumer Blackwell, sm_120), or None: this GEMM's families, with TMA."""
    if device.type != "cuda":
        return None
    major = torch.cuda.get_device_capability(device)[0]
    return {9: "hopper", 12: "blackwell"}.get(major)


# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, M, K, sxm, sqm, ssg, BR: tl.constexpr, G: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    group = tl.program_id(1)
    cols = group * G + tl.arange(0, G)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * sxm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR) / _FP8_MAX
    q = tl.clamp(x / scale[:, None], -_FP8_MAX, _FP8_MAX)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * sqm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + group * ssg + rows, scale, mask=rows < M)


@triton.jit
def _tile_of(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Output tile number -> (row tile, column tile), GROUP_M row tiles at a time down each column."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % rows_here, (tile % per_group) // rows_here


@triton.jit
def _fp8_gemm_tma_kernel(x_desc, w_desc, xs_ptr, ws_ptr, y_ptr, M, N, K, programs, ssg, wsn, wsk, sym,
                         SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, GROUP_M: tl.constexpr,
                         FLATTEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, programs, flatten=FLATTEN):
        pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, GROUP_M)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        row_ok, col_ok = rows < M, cols < N
        w_scale_row = ws_ptr + (cols // SCALE_BN) * wsn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = x_desc.load([pid_m * BM, k0])
            w = w_desc.load([pid_n * BN, k0])
            x_scale = tl.load(xs_ptr + (k0 // BK) * ssg + rows, mask=row_ok, other=0.0)
            w_scale = tl.load(w_scale_row + (k0 // SCALE_BK) * wsk, mask=col_ok, other=0.0)
            acc += tl.dot(x, w.T) * x_scale[:, None] * w_scale[None, :]
        y = y_ptr + rows[:, None].to(tl.int64) * sym + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------------------------
def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (FP8 values [M, K], fp32 scales [ceil(K / 128), M]): kernels/fp8.quantize_activations, its
    scales transposed."""
    M, K = x.shape
    groups = triton.cdiv(K, ACT_GROUP)
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    s = torch.empty((groups, M), dtype=torch.float32, device=x.device)
    if M:
        BR = 16
        _quantize_groups_kernel[(triton.cdiv(M, BR), groups)](
            x, q, s, M, K, x.stride(0), q.stride(0), s.stride(0), BR=BR, G=ACT_GROUP, num_warps=4)
    return q, s


def tiles_for(x: torch.Tensor, w: Fp8Weight) -> PrefillTiles | None:
    """The tiles this pair multiplies x [..., K] @ w^T with on x's card, or None where it does not (fewer than
    PREFILL_ROWS rows, a card without TMA, what `fits` refuses)."""
    family = card_family(x.device)
    if family is None or x.numel() < PREFILL_ROWS * x.shape[-1] or x.stride(-1) != 1 or not fits(x, w):
        return None
    return PREFILL_TILES[family]


def fits(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether this pair takes x [M, K] @ w^T: w8a8, K whole groups (TMA rows are 16-byte aligned), a 2-D weight of
    contiguous rows."""
    K = x.shape[-1]
    return (w.act_quant and K % ACT_GROUP == 0 and w.weight.dim() == 2 and w.weight.stride(1) == 1
            and w.weight.stride(0) == K and w.weight.data_ptr() % 16 == 0)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, tiles: PrefillTiles, programs: int | None = None) -> torch.Tensor:
    """x [M, K] (unit stride on K) @ W^T -> [M, N] in x's dtype, with the tiles of the card's family; `programs`
    (default: one per SM) sets the persistent grid (the tests take fewer than the tiles, so each walks several)."""
    M, K = x.shape
    N = w.weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    xq, xs = quantize_groups(x)
    t = tiles
    x_desc = TensorDescriptor.from_tensor(xq, [t.BM, ACT_GROUP])
    w_desc = TensorDescriptor.from_tensor(w.weight, [t.BN, ACT_GROUP])
    tiles_total = triton.cdiv(M, t.BM) * triton.cdiv(N, t.BN)
    grid = min(tiles_total, programs or num_sms(x.device))
    _fp8_gemm_tma_kernel[(grid,)](
        x_desc, w_desc, xs, w.scale, y, M, N, K, grid, xs.stride(0), w.scale.stride(0), w.scale.stride(1),
        y.stride(0), SCALE_BN=w.block[0], SCALE_BK=w.block[1], GROUP_M=t.group_m, FLATTEN=t.flatten, BM=t.BM,
        BN=t.BN, BK=ACT_GROUP, num_warps=t.num_warps, num_stages=t.num_stages)
    return y
