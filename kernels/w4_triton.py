"""Triton kernels for 4-bit weights kept packed (kernels/w4_weight.W4Weight): y = x W^T with W read as 4-bit codes
and group scales and dequantized in registers, never in memory (but for the scratch path of long prefills).

The layout is the one every loader writes (w4_weight's docstring): codes uint8 [N, K/2], byte j of a row holding
column 2j in its low nibble and 2j + 1 in its high one, scales (and zeros) [N, K/group]. The kernels read it as it
is, so nothing is repacked (and nothing is held twice): a K step of BK columns is a [BK/2, BN] tile of bytes,
contiguous along K for each output column (16-byte cp.async copies, pipelined like linear_triton.py's weights).
Rather than interleaving the two nibbles back into K order (a shuffle of the whole weight tile), the step's x tile
is split into its even and odd columns (a [BM, BK] tile, a few KB, split in registers) and the step is two dots:
    x[:, 0::2] @ lo + x[:, 1::2] @ hi        lo, hi [BK/2, BN]: the low and high nibbles, dequantized.
Scales and zeros are loaded once per group and step: a step spans BK / group groups (an [A, BN] tile broadcast over
each group's rows by a reshape of registers) or lies inside one (group a multiple of BK: one [1, BN] row).

A decode streams the weight, and at a card's full bandwidth leaves few instructions per weight element to make it:
(weight elements per SM per clock at full bandwidth against 128 lanes) about 20 on an RTX 4090, 15 on an RTX 5090,
5 on an H100 SXM, 3.5 on an H200. So no int -> float conversion instruction (a quarter of the FP32 rate or less),
and three ways to make a tile, chosen per weight and x dtype (`dequant_mode`):
- SCALE_AFTER (int4, 16-bit x, a K step inside one group: GPTQ / AWQ g128, channel-wise): the code OR-ed into the
  mantissa of a 16-bit float is 2^m + q exactly (128 + q in bf16, 1024 + q in fp16); subtracting 2^m + z, two
  codes an instruction (Triton keeps 16-bit values in pairs), leaves q - z exactly in x's dtype; the dot sums
  x (q - z) in fp32 and the group's scale multiplies the sums, once per output and step. The weights are never
  rounded, so this is closer to the exact product than the reference (which rounds (q - z) * s to x's dtype) by
  that rounding.
- X16 (int4, scales already in x's dtype: compressed-tensors keeps the model's): (q - z) * s in x's dtype, which
  rounds the exact product once: the reference's weights exactly.
- F32 (fp4; int4 with scales of another dtype at groups below BK; fp32 x): per weight in fp32, rounded once to x's
  dtype, the reference's weights (fp4 up to its global scale, below). int4: the code OR-ed into the mantissa of
  2^23 is the float 2^23 + q, and subtracting 2^23 + z leaves q - z. fp4 (NVFP4's E2M1: sign bit 3, magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6): the three magnitude bits shifted into an fp32's exponent and mantissa are the value
  times 2^-126 exactly (codes 0 and 1 land on fp32 subnormals, which the GPU's FMUL keeps: Triton's code has no
  flush-to-zero), the sign bit into the sign, and one multiply by 2^126 restores it; the global scale is folded
  into the group scale (once per group), so a weight may differ from the reference's (E2M1 * s) * global_scale by
  one fp32 rounding before its rounding to x's dtype.
The compiled K loops (sm_90 and sm_120, cuobjdump) spend about 8 (SCALE_AFTER), 9 (X16), 10 (F32 int4) and 11
(fp4) instructions per weight element and thread, most of them Triton's byte unpacking (PRMT / LOP3 per byte, not
per word): within the consumer cards' budgets, over Hopper's. The device run measures what that costs
(bench/gpu_check.py: the 4-bit decode rows against the copy bandwidth); the next step there is the nibble
unpacking in inline PTX (two codes per LOP3 on 32-bit words, ~1.5 instructions a weight), with this code kept as
the interpreter's and the tests' path.

Act-order (perm): the weight's columns were sorted by group at load, so y = x[:, perm] @ W_sorted^T: x's columns
are gathered once before the GEMM (`_act_order`: M x K elements), and a fused norm's scale with them. Gathered
inside the K loop, x's load waited on perm's each step: two dependent global loads the pipeliner left
unpipelined in the compiled kernel. The MoE's grouped GEMM gathers in the loop (each expert has its own perm, and
the pairs' rows are gathered there anyway).

Kernels:
1. _w4_decode_gemm_kernel: the decode GEMM of kernels/linear_triton.py for 1..16 rows: BM = 16 (every row count
   runs the same instructions, so a row's sums never depend on the rows with it), BK = 128, BN and the split-K
   count from N, K and the SM count alone (`w4_decode_tiles`: 8 KB of packed bytes a step at its widest, as
   linear_triton's tiles stream, and at least 32 columns: 16 would leave two of the four warps repeating the other
   two's mma tiles); linear_triton's second kernel adds the K slices in order (no atomics), and its epilogue fuses
   norm / silu_mul / residual, rounding where the separate ops round. A sibling kernel rather than a third weight
   kind inside linear_triton's: the 4-bit tile needs its own pointers (half-width rows, group scales and zeros),
   the split x tile and two dots, which in the FP8 kernel would double its arguments and hide its K loop;
   everything around the K loop is shared (`_row_rstd`, `_finish_slice`, `_split_sum_kernel`, the tile rule's
   constants).
2. _w4_gemm_kernel: more rows (prefill), the same tile product inside a [BM, BN] output tile (`prefill_tiles`).
3. _w4_dequant_kernel + torch's matmul: from SCRATCH_ROWS rows the weight is dequantized (F32: the reference's
   values) into a scratch of at most SCRATCH_BYTES, a block of output rows at a time, and multiplied by cuBLAS, as
   vLLM does for AWQ from 256 tokens: a long prefill is compute-bound, cuBLAS's GEMM beats a tile that spends
   instructions dequantizing, and one dequantization is a small share of M times more multiply-adds.
   SCRATCH_ROWS = 256 is that literature default, to be measured on the device (bench/gpu_check.py "w4 prefill"
   rows: both paths at the same rows, and the crossover after the table).
The fused MoE's grouped GEMM over 4-bit experts (kernels/moe_triton.py) uses the same tile product.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tinyserve.kernels.linear_triton import (BK as DECODE_BK, BM as DECODE_BM, DECODE_ROWS, MIN_STEPS_PER_SPLIT,
                                             PROGRAMS_PER_SM, DecodeTiles, _finish_slice, _row_rstd,
                                             _split_sum_kernel, num_sms)
from tinyserve.kernels.w4_weight import W4Weight

if TYPE_CHECKING:
    from tinyserve.kernels.pointwise import InputNorm

STEP_BYTES = 8192           # packed weight bytes a decode program streams a K step (linear_triton's 8 KB tiles)
MIN_BN = 32                 # the decode tile's floor: 4 warps x mma's 8 columns (w4_decode_tiles)
PREFILL_BK = 64             # K step of the prefill and MoE tiles: x [128, 64] + codes [32, 64] a stage (18 KB)
SCRATCH_ROWS = 256          # rows from which scratch + cuBLAS replaces the in-tile kernel (to measure on the device)
SCRATCH_BYTES = 64 << 20    # the dequantized scratch's bound: output rows are dequantized and multiplied in blocks
_MAGIC = tl.constexpr(8388608.0)          # 2^23: the float whose mantissa's low bits are an OR-ed integer
_MAGIC_BITS = tl.constexpr(0x4B000000)    # its bits
_TWO_126 = tl.constexpr(2.0 ** 126)       # fp32 exponent bias - 1: an E2M1 code's bits placed in an fp32 are this small


F32, SCALE_AFTER, X16 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)      # dequant_mode's answers


def dequant_mode(w: W4Weight, x_dtype: torch.dtype, bk: int) -> int:
    """How the GEMM kernels make a tile's weights (the module docstring: the instruction budget of a decode):
    SCALE_AFTER  int4, 16-bit x, K steps of bk inside one group (group a multiple of bk: GPTQ / AWQ g128 at the
                 decode's bk = 128, channel-wise): q - z exactly in x's dtype, dotted, and the fp32 sums scaled.
                 No rounding of (q - z) * s: closer to the exact product than the reference by its rounding;
    X16          int4, scales already in x's dtype (compressed-tensors keeps the model's): (q - z) * s in x's dtype,
                 which rounds the exact product once, as the reference does;
    F32          everything else (fp4, fp16 scales with bf16 x at groups below bk, fp32 x): fp32 arithmetic per
                 weight, rounded once to x's dtype (the reference's numbers)."""
    if w.kind == "fp4" or x_dtype not in (torch.bfloat16, torch.float16):
        return F32.value
    if w.group % bk == 0:
        return SCALE_AFTER.value
    return X16.value if w.scales.dtype == x_dtype else F32.value


def takes(w: W4Weight) -> bool:
    """Whether these kernels read w (w4_linear; groups that fit no K step, neither a power of two nor a multiple of
    128, go to the torch reference: kernels/w4.py)."""
    return supports(w, DECODE_BK) and supports(w, PREFILL_BK)


def supports(w: W4Weight, bk: int) -> bool:
    """Whether the kernels read w with K steps of bk columns: each step holds whole groups or lies inside one (every
    power-of-two group, and groups that are multiples of bk: channel-wise scales at K a multiple of 128), and the
    buffers' last dimensions are contiguous, codes in rows (not the CPU's blocks). Other weights go to the torch
    reference."""
    return ((w.group % bk == 0 or bk % w.group == 0) and not w.blocked and w.codes.stride(-1) == 1
            and w.scales.stride(-1) == 1
            and (w.zeros is None or w.zeros.stride(-1) == 1))


def _groups_per_step(w: W4Weight, bk: int) -> int:
    return max(1, bk // w.group)


# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _grouped(v, zero, s, A: tl.constexpr, ZERO: tl.constexpr):
    """(v - zero) * s (ZERO) or v * s: v [R, BN], zero and s [A, BN], each broadcast over the R / A consecutive rows
    of its group (A == 1: one group for every row; a reshape of registers otherwise)."""
    if A == 1:
        out = (v - zero) * s if ZERO else v * s
    else:
        rows: tl.constexpr = v.shape[0]
        cols: tl.constexpr = v.shape[1]
        v3 = tl.reshape(v, (A, rows // A, cols))
        w3 = (v3 - zero[:, None, :]) * s[:, None, :] if ZERO else v3 * s[:, None, :]
        out = tl.reshape(w3, (rows, cols))
    return out


@triton.jit
def _dequantized(c, s, zf, HIGH: tl.constexpr, FP4: tl.constexpr, A: tl.constexpr):
    """The low (HIGH: high) nibble of each byte c (uint32 0..255) [BK/2, BN] -> its weight in fp32: (q - z) * s
    (int4) or E2M1[q] * s (fp4, s with the global scale folded in). s, zf [A, BN]: the scale and 2^23 + zero of
    each of the A groups the rows span."""
    if FP4:          # sign (bit 3 of the nibble) to bit 31, magnitude (bits 0-2) to bits 22-24: the value x 2^-126
        bits = ((c << (18 if HIGH else 22)) & 0x01C00000) | ((c << (24 if HIGH else 28)) & 0x80000000)
        v = bits.to(tl.float32, bitcast=True) * _TWO_126
    else:            # 2^23 + q, exactly
        q = (c >> 4) if HIGH else (c & 15)
        v = (q | _MAGIC_BITS).to(tl.float32, bitcast=True)
    return _grouped(v, zf, s, A, not FP4)


@triton.jit
def k_masks(k0, k_ok, js, gs, row_ok, col_ok, K, GROUP: tl.constexpr, EVEN_K: tl.constexpr):
    """The masks of one K step: x [BM, BK], the code bytes [BK/2, BN], the groups' scales [A, BN] (also the MoE
    kernel's, moe_triton.py). EVEN_K (K a multiple of BK: every Qwen3.5 / Qwen3-Next shape): the rows and columns
    alone."""
    if EVEN_K:
        x_mask = row_ok[:, None]
        c_mask = col_ok[None, :]
        g_mask = col_ok[None, :]
    else:
        x_mask = row_ok[:, None] & k_ok[None, :]
        c_mask = (k0 // 2 + js < K // 2)[:, None] & col_ok[None, :]
        g_mask = (k0 // GROUP + gs < K // GROUP)[:, None] & col_ok[None, :]
    return x_mask, c_mask, g_mask


@triton.jit
def _codes16(c, HIGH: tl.constexpr, dtype: tl.constexpr):
    """The low (HIGH: high) nibble of each byte c (uint16 0..255) as the 16-bit float 2^m + q, exactly: the code
    OR-ed into the mantissa of 128 (bf16, 7 mantissa bits) or 1024 (fp16, 10). One integer instruction for two
    codes (Triton keeps 16-bit values in pairs)."""
    q = (c >> 4) if HIGH else (c & 15)
    return (q | (0x4300 if dtype == tl.bfloat16 else 0x6400)).to(dtype, bitcast=True)


@triton.jit
def w4_tile_product(xe, xo, c_ptrs, c_mask, s_ptrs, z_ptrs, g_mask, zero_point, global_scale,
                    FP4: tl.constexpr, HAS_ZEROS: tl.constexpr, A: tl.constexpr, MODE: tl.constexpr,
                    PREC: tl.constexpr):
    """One K step's share of x W^T in fp32 [BM, BN]: xe, xo [BM, BK/2] the step's even and odd columns of x;
    c_ptrs [BK/2, BN] its bytes of W^T (c_mask: rows past K / columns past N read as 0); s_ptrs, z_ptrs [A, BN]
    the scales (and zeros) of the A groups it spans (g_mask). MODE (`dequant_mode`): how the weights are made."""
    codes = tl.load(c_ptrs, mask=c_mask, other=0)
    s = tl.load(s_ptrs, mask=g_mask, other=0.0)
    if MODE == F32:
        s = s.to(tl.float32)
        if FP4:
            s = s * global_scale
            zf = s                              # unused
        elif HAS_ZEROS:
            zf = tl.load(z_ptrs, mask=g_mask, other=0).to(tl.float32) + _MAGIC
        else:
            zf = tl.zeros_like(s) + (zero_point + _MAGIC)
        c = codes.to(tl.uint32)
        lo = _dequantized(c, s, zf, False, FP4, A).to(xe.dtype)
        hi = _dequantized(c, s, zf, True, FP4, A).to(xe.dtype)
        acc = tl.dot(xe, lo, input_precision=PREC) + tl.dot(xo, hi, input_precision=PREC)
    else:                                       # int4, x 16-bit: q - z exact in x's dtype, in register pairs
        dt: tl.constexpr = xe.dtype
        magic: tl.constexpr = 128.0 if dt == tl.bfloat16 else 1024.0
        if HAS_ZEROS:
            zf = (tl.load(z_ptrs, mask=g_mask, other=0).to(tl.float32) + magic).to(dt)
        else:
            zf = (tl.zeros(s.shape, dtype=tl.float32) + (zero_point + magic)).to(dt)
        c = codes.to(tl.uint16)
        if MODE == SCALE_AFTER:                 # one group: its scale multiplies the dot's fp32 sums
            lo = _codes16(c, False, dt) - zf
            hi = _codes16(c, True, dt) - zf
            acc = (tl.dot(xe, lo) + tl.dot(xo, hi)) * s.to(tl.float32)
        else:                                   # X16: scales of x's dtype, (q - z) * s rounded once as in fp32
            lo = _grouped(_codes16(c, False, dt), zf, s, A, True)
            hi = _grouped(_codes16(c, True, dt), zf, s, A, True)
            acc = tl.dot(xe, lo) + tl.dot(xo, hi)
    return acc


@triton.jit
def even_odd(x):
    """x [R, BK] -> (x[:, 0::2], x[:, 1::2]), each [R, BK/2] (a split of registers: no memory traffic)."""
    r: tl.constexpr = x.shape[0]
    c: tl.constexpr = x.shape[1]
    return tl.split(tl.reshape(x, (r, c // 2, 2)))


@triton.jit
def _w4_decode_gemm_kernel(x_ptr, c_ptr, s_ptr, z_ptr, nw_ptr, r_ptr, y_ptr, part_ptr,
                           M, N, K, K_SLICE, UP_ROW, sxm, scn, ssn, szn, srm, sym, eps, zero_point, global_scale,
                           FP4: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, A: tl.constexpr,
                           MODE: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
                           SPLIT: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BM)
    row_ok = rows < M
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    js = tl.arange(0, BK // 2)
    gs = tl.arange(0, A)
    if NORM:
        rstd = _row_rstd(x_ptr, rows, row_ok, sxm, K, eps, BM=BM, BK=BK)
    k_start = pid_k * K_SLICE
    k_end = tl.minimum(K, k_start + K_SLICE)
    c_ptrs = c_ptr + cols.to(tl.int64)[None, :] * scn + (k_start // 2 + js)[:, None]      # W^T bytes [BK/2, BN]
    s_row = s_ptr + cols.to(tl.int64)[None, :] * ssn + gs[:, None]                         # [A, BN]
    z_row = z_ptr + cols.to(tl.int64)[None, :] * szn + gs[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_start, k_end, BK):
        k_ok = k0 + ks < K
        x_mask, c_mask, g_mask = k_masks(k0, k_ok, js, gs, row_ok, col_ok, K, GROUP, EVEN_K)
        x = tl.load(x_ptr + rows[:, None] * sxm + (k0 + ks)[None, :], mask=x_mask, other=0.0)
        if NORM:
            nw = tl.load(nw_ptr + k0 + ks, mask=k_ok, other=0.0)
            x = (x.to(tl.float32) * rstd[:, None] * nw[None, :]).to(x_ptr.dtype.element_ty)
        xe, xo = even_odd(x)
        g0 = k0 // GROUP
        acc += w4_tile_product(xe, xo, c_ptrs, c_mask, s_row + g0, z_row + g0, g_mask, zero_point, global_scale,
                               FP4, HAS_ZEROS, A, MODE, PREC)
        if SILU_MUL:
            acc_up += w4_tile_product(xe, xo, c_ptrs + UP_ROW * scn, c_mask, s_row + UP_ROW * ssn + g0,
                                      z_row + UP_ROW * szn + g0, g_mask, zero_point, global_scale,
                                      FP4, HAS_ZEROS, A, MODE, PREC)
        c_ptrs += BK // 2
    _finish_slice(acc, acc_up, part_ptr, r_ptr, y_ptr, pid_k, M, N, rows, row_ok, cols, col_ok, srm, sym,
                  SPLIT=SPLIT, SILU_MUL=SILU_MUL, RESIDUAL=RESIDUAL)


@triton.jit
def _w4_gemm_kernel(x_ptr, c_ptr, s_ptr, z_ptr, y_ptr, M, N, K, sxm, scn, ssn, szn, sym,
                    zero_point, global_scale, FP4: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr,
                    A: tl.constexpr, MODE: tl.constexpr, PREC: tl.constexpr, EVEN_K: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # program_id(0) walks the row tiles: the programs that run together share one column tile, so its weight
    # comes from memory once and from L2 for the other row tiles
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    js = tl.arange(0, BK // 2)
    gs = tl.arange(0, A)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sxm
    c_ptrs = c_ptr + cols.to(tl.int64)[None, :] * scn + js[:, None]                       # W^T bytes [BK/2, BN]
    s_row = s_ptr + cols.to(tl.int64)[None, :] * ssn + gs[:, None]
    z_row = z_ptr + cols.to(tl.int64)[None, :] * szn + gs[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x_mask, c_mask, g_mask = k_masks(k0, k0 + ks < K, js, gs, row_ok, col_ok, K, GROUP, EVEN_K)
        x = tl.load(x_rows + (k0 + ks)[None, :], mask=x_mask, other=0.0)
        xe, xo = even_odd(x)
        g0 = k0 // GROUP
        acc += w4_tile_product(xe, xo, c_ptrs, c_mask, s_row + g0, z_row + g0, g_mask, zero_point, global_scale,
                               FP4, HAS_ZEROS, A, MODE, PREC)
        c_ptrs += BK // 2
    y = y_ptr + rows.to(tl.int64)[:, None] * sym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _w4_dequant_kernel(c_ptr, s_ptr, z_ptr, w_ptr, N, K, scn, ssn, szn, swn, zero_point, global_scale,
                       FP4: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP: tl.constexpr, A: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr):
    """W[n, k] in w's dtype for BN output rows and BK columns (in the weight's own, sorted order), written along K:
    the low and high nibbles joined back in K order ([BK/2, BN, 2] to columns 2j, 2j + 1)."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    js = tl.arange(0, BK // 2)
    gs = tl.arange(0, A)
    col_ok = cols < N
    c_mask = (k0 // 2 + js < K // 2)[:, None] & col_ok[None, :]
    g_mask = (k0 // GROUP + gs < K // GROUP)[:, None] & col_ok[None, :]
    codes = tl.load(c_ptr + cols.to(tl.int64)[None, :] * scn + (k0 // 2 + js)[:, None], mask=c_mask, other=0)
    g = k0 // GROUP + gs[:, None]
    s = tl.load(s_ptr + cols.to(tl.int64)[None, :] * ssn + g, mask=g_mask, other=0.0).to(tl.float32)
    if FP4:
        s = s * global_scale
        zf = s
    elif HAS_ZEROS:
        zf = tl.load(z_ptr + cols.to(tl.int64)[None, :] * szn + g, mask=g_mask, other=0).to(tl.float32) + _MAGIC
    else:
        zf = tl.zeros_like(s) + (zero_point + _MAGIC)
    out_ty = w_ptr.dtype.element_ty
    c = codes.to(tl.uint32)
    lo = _dequantized(c, s, zf, False, FP4, A).to(out_ty)                        # [BK/2, BN]
    hi = _dequantized(c, s, zf, True, FP4, A).to(out_ty)
    w = tl.join(lo, hi)                                                          # [BK/2, BN, 2]
    k = k0 + 2 * js[:, None, None] + tl.arange(0, 2)[None, None, :]
    tl.store(w_ptr + cols.to(tl.int64)[None, :, None] * swn + k, w, mask=c_mask[:, :, None])


# ---------------------------------------------------------------------------------------------------------------
class _Args(NamedTuple):
    """What the linear kernels take of a 2-D W4Weight: its buffers (a placeholder for absent zeros) and
    constexprs."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    szn: int
    constexprs: dict


def _args(w: W4Weight, bk: int, x: torch.Tensor) -> _Args:
    zeros = w.zeros if w.zeros is not None else w.scales          # a placeholder: never read
    return _Args(w.codes, w.scales, zeros, w.zeros.stride(-2) if w.zeros is not None else 0,
                 dict(FP4=w.kind == "fp4", HAS_ZEROS=w.zeros is not None, GROUP=w.group,
                      A=_groups_per_step(w, bk), MODE=dequant_mode(w, x.dtype, bk)))


def _act_order(x2: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """x's columns in the weight's sorted order (act-order: y = x[:, perm] @ W_sorted^T), one small gather before
    the GEMM: gathered inside the K loop, x's loads would wait on perm's each step (two dependent global loads the
    pipeliner does not prefetch: the compiled decode kernel showed them unpipelined)."""
    return x2 if w.perm is None else x2.index_select(1, w.perm)


def _prec(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def fits(x: torch.Tensor, w: W4Weight) -> bool:
    """Whether the decode kernel takes x @ w^T (kernels/linear_triton.fits for a W4Weight): 1..DECODE_ROWS rows,
    a 2-D weight of contiguous rows whose groups fit the K step, x in a 16-bit dtype (fp32 only interpreted: the
    tests' oracle precision; on a GPU fp32 goes through the scratch and cuBLAS)."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (1 <= rows <= DECODE_ROWS and w.codes.dim() == 2
            and w.in_features == x.shape[-1] and supports(w, DECODE_BK)
            and (x.dtype in (torch.bfloat16, torch.float16) or (x.dtype == torch.float32 and not x.is_cuda)))


def w4_decode_tiles(N: int, K: int, two_halves: bool, sms: int) -> DecodeTiles:
    """linear_triton.decode_tiles's rule for a 4-bit weight: the widest tile that streams STEP_BYTES a K step (128
    columns of BK / 2 bytes; 64 per half with silu_mul), narrowed while it makes fewer than PROGRAMS_PER_SM
    programs per SM, down to MIN_BN; then K split in powers of two. Its floor is not linear_triton's 16 columns: a
    16-column tile streams 1 KB a step (a fourth of a 16-bit one's at the same width) and leaves two of the four
    warps computing the same mma tiles as the other two (mma's n is 8), dequantizing the same weights twice."""
    widest = STEP_BYTES // (DECODE_BK // 2) // (2 if two_halves else 1)
    target = PROGRAMS_PER_SM * sms
    BN = widest
    while BN > MIN_BN and triton.cdiv(N, BN) < target:
        BN //= 2
    tiles, steps, split = triton.cdiv(N, BN), triton.cdiv(K, DECODE_BK), 1
    while tiles * split < target and steps >= 2 * split * MIN_STEPS_PER_SPLIT:
        split *= 2
    return DecodeTiles(BN=BN, split=split, num_warps=4, num_stages=4)


def decode_linear(x: torch.Tensor, w: W4Weight, norm: "InputNorm | None" = None, silu_mul: bool = False,
                  residual: torch.Tensor | None = None, tiles: DecodeTiles | None = None) -> torch.Tensor:
    """kernels.linear's fused projection for 1..DECODE_ROWS rows and a 4-bit weight (linear_triton.decode_linear's
    contract); `tiles` overrides w4_decode_tiles (tests, bench/gpu_check.py)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = _act_order(x.reshape(-1, K), w)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if norm is not None and w.perm is not None:     # the norm's scale follows x's columns (rstd does not change)
        norm = norm._replace(scale=norm.scale.index_select(0, w.perm))
    M = x2.shape[0]
    N = w.shape[0] // 2 if silu_mul else w.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    t = tiles or w4_decode_tiles(N, K, silu_mul, num_sms(x.device))
    k_slice = triton.cdiv(triton.cdiv(K, DECODE_BK), t.split) * DECODE_BK
    split = triton.cdiv(K, k_slice)                    # slices that are not empty
    r2 = residual.reshape(M, N) if residual is not None else y
    part = torch.empty((split, M, 2 * N if silu_mul else N), dtype=torch.float32, device=x.device) \
        if split > 1 else y
    nw = norm.scale if norm is not None else y
    a = _args(w, DECODE_BK, x2)
    _w4_decode_gemm_kernel[(triton.cdiv(N, t.BN), split)](
        x2, a.codes, a.scales, a.zeros, nw, r2, y, part, M, N, K, k_slice, N if silu_mul else 0,
        x2.stride(0), a.codes.stride(0), a.scales.stride(0), a.szn, r2.stride(0), y.stride(0),
        norm.eps if norm is not None else 0.0, w.zero_point, w.global_scale, **a.constexprs,
        NORM=norm is not None, SILU_MUL=silu_mul, RESIDUAL=residual is not None, SPLIT=split, PREC=_prec(x),
        EVEN_K=K % DECODE_BK == 0, BM=DECODE_BM, BN=t.BN, BK=DECODE_BK, num_warps=t.num_warps,
        num_stages=t.num_stages)
    if split > 1:
        BN_SUM = min(256, triton.next_power_of_2(N))
        _split_sum_kernel[(triton.cdiv(N, BN_SUM),)](
            part, r2, y, M, N, r2.stride(0), y.stride(0), SPLIT=split, SILU_MUL=silu_mul,
            RESIDUAL=residual is not None, BM=DECODE_BM, BN=BN_SUM, num_warps=4)
    return y.reshape(*lead, N)


def prefill_tiles(M: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) of the in-tile kernel for M rows. A stage is the x tile [BM, 64] and the
    bytes [32, BN] (18 KB at 128 x 64): three in a 4090's or 5090's 100 KB, four in Hopper's 228. Compiled
    (`bench/gpu_check.py --compile`): 128 x 128 spills on every card (the dequantized tiles beside a 128 x 128
    accumulator: 255 registers and 16-104 B of stack), 128 x 64 at 8 warps does not (172 registers), but for the
    fp32 dequantization at small groups on sm_120 (32 B)."""
    if M <= 16:
        return 16, 64, 4, 4
    if M <= 64:
        return 64, 64, 4, 3
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return 128, 64, 8, 4 if hopper else 3


def prefill_linear(x2: torch.Tensor, w: W4Weight, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x2 [M, K] (unit stride on K) @ W^T -> [M, N] in x's dtype, the weight dequantized inside each tile."""
    M, K = x2.shape
    N = w.shape[0]
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    if M == 0:
        return y
    x2 = _act_order(x2, w)
    BM, BN, warps, stages = tiles or prefill_tiles(M, x2.device)
    a = _args(w, PREFILL_BK, x2)
    _w4_gemm_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        x2, a.codes, a.scales, a.zeros, y, M, N, K, x2.stride(0), a.codes.stride(0), a.scales.stride(0),
        a.szn, y.stride(0), w.zero_point, w.global_scale, **a.constexprs, PREC=_prec(x2),
        EVEN_K=K % PREFILL_BK == 0, BM=BM, BN=BN, BK=PREFILL_BK, num_warps=warps, num_stages=stages)
    return y


def dequantize(w: W4Weight, dtype: torch.dtype, rows: slice | None = None) -> torch.Tensor:
    """W (or its output rows `rows`) in dtype, columns in the weight's sorted order (act-order not undone: the
    scratch path gathers x instead): W4Weight.dequantize on the GPU, one kernel."""
    codes = w.codes if rows is None else w.codes[rows]
    N, K = codes.shape[0], codes.shape[1] * 2
    out = torch.empty((N, K), dtype=dtype, device=codes.device)
    if N == 0:
        return out
    scales = w.scales if rows is None else w.scales[rows]
    zeros = (w.zeros if rows is None else w.zeros[rows]) if w.zeros is not None else out
    BN, BK = 32, 128
    A = _groups_per_step(w, BK)
    _w4_dequant_kernel[(triton.cdiv(N, BN), triton.cdiv(K, BK))](
        codes, scales, zeros, out, N, K, codes.stride(0), scales.stride(0),
        zeros.stride(0) if w.zeros is not None else 0, out.stride(0), w.zero_point, w.global_scale,
        FP4=w.kind == "fp4", HAS_ZEROS=w.zeros is not None, GROUP=w.group, A=A, BN=BN, BK=BK, num_warps=4)
    return out


def scratch_linear(x2: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """x2 [M, K] @ W^T through cuBLAS: blocks of output rows dequantized into a scratch of at most SCRATCH_BYTES
    and multiplied by torch's matmul; act-order gathers x's columns once (y = x[:, perm] @ W_sorted^T)."""
    M, K = x2.shape
    N = w.shape[0]
    xg = _act_order(x2, w)
    block = max(128, SCRATCH_BYTES // (K * x2.element_size()) // 128 * 128)
    if block >= N:
        return F.linear(xg, dequantize(w, x2.dtype))
    y = torch.empty((M, N), dtype=x2.dtype, device=x2.device)
    for r0 in range(0, N, block):
        rows = slice(r0, min(N, r0 + block))
        y[:, rows] = F.linear(xg, dequantize(w, x2.dtype, rows))
    return y


def w4_linear(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """kernels/w4.w4_linear on the GPU: x [..., K] @ W^T -> [..., N] in x's dtype. 1..DECODE_ROWS rows: the decode
    kernel; up to SCRATCH_ROWS: the in-tile kernel; from there (and fp32 x on a GPU): scratch + cuBLAS. For a
    weight it `takes`."""
    lead, K = x.shape[:-1], x.shape[-1]
    N = w.shape[0]
    if fits(x, w):
        return decode_linear(x, w)
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] >= SCRATCH_ROWS or (x.is_cuda and x.dtype == torch.float32):
        y = scratch_linear(x2, w)
    else:
        y = prefill_linear(x2, w)
    return y.reshape(*lead, N)
