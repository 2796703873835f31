"""Triton path for kernels/moe.py: the routed experts as two grouped GEMMs over (token, expert) pairs sorted by
expert, with no host sync (CUDA-graph safe).

1. align_pairs: the T * top_k pairs (pair p = token p // top_k, slot p % top_k) are sorted by expert with torch ops
   on the device, and each expert's group is padded to a multiple of BM rows, so that every BM-row block of the
   sorted list belongs to one expert. Outputs: sorted_ids (pair ids, the sentinel P = T * top_k in padding rows),
   expert_ids (one per block) and the padded length (a 1-element device tensor). The buffers are sized by the upper
   bound P + min(E, P) * (BM - 1) (only experts that are hit get padding), so nothing is read back to the host;
   the programs of blocks past the padded length return at once.
2. _moe_gemm_kernel: one program = one BM-row block (one expert) x one BN slice of the output. It gathers its rows
   of A by pair id (A row = pair // A_ROW_DIV: the token's row of x for gate_up, the pair's own row of the
   activation for down), multiplies by the expert's weight [N, K] (read transposed, as kernels/fp8_triton.py does),
   accumulates in fp32, optionally scales each row by its routing weight, and writes row `pair` of a [P, N] output.
3. gate_up GEMM -> silu_and_mul (kernels/pointwise.py) -> down GEMM with the routing weights -> the top_k rows of
   each token summed in fp32 (a fixed-order reshape + sum: no atomics, so results do not depend on scheduling).

Experts kept FP8 (a stacked kernels/fp8_weight.Fp8Weight) go through _moe_fp8_gemm_kernel, the same grouped GEMM with
the K loop of kernels/fp8_triton.py: BK = ACT_GROUP (128), one activation group and one scale column per step, the
expert's block scales indexed by expert. w8a8: the gathered A rows are quantized per row and 128-group in the
kernel (amax / 448, clamped to +-448, rounded to e4m3) and the FP8 x FP8 dot is scaled by both scales; w8a16: the
weight tile is widened to A's dtype and the dot scaled by the block's scale. The two GEMMs of a layer may differ
(one FP8, one not); they share BM, which the pair alignment is padded to.

Experts kept 4-bit (a stacked kernels/w4_weight.W4Weight: GPTQ / AWQ / compressed-tensors int4, NVFP4) go through
_moe_w4_gemm_kernel, the same grouped GEMM whose K loop is kernels/w4_triton.py's: the expert's packed bytes
[BK/2, BN] loaded along K and dequantized in registers (its group scales and zeros once per group), the gathered A
tile split into its even and odd columns for the low and high nibbles' two dots, and under act-order the A columns
gathered through the expert's perm in the K loop (each expert has its own; the linear GEMMs gather x once before
theirs instead: here the A load then waits on the perm load each step, a cost for the device run to measure).
Either GEMM of a layer may be 4-bit, FP8 or 16-bit independently of the other.

The GEMMs multiply in the input dtype (bf16 / fp16 tensor cores on a GPU; fp32 in IEEE precision, not TF32, as
torch's fp32 GEMMs by default) with fp32 accumulation; BK is the same for every tile shape, so a row's K-summation
order does not change with the batch size. Intermediates, in x's dtype: gate_up [P, 2I], the activation [P, I] and
the weighted down rows [P, H] (rounded after weighting; the reference rounds before), then the fp32 sum [T, H].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.pointwise import silu_and_mul
from tinyserve.kernels.fp8_weight import ACT_GROUP, Fp8Weight
from tinyserve.kernels.fp8_triton import fp8_group_product
from tinyserve.kernels.w4_triton import PREFILL_BK as W4_BK, dequant_mode, even_odd, supports as w4_supports
from tinyserve.kernels.w4_triton import k_masks, w4_tile_product
from tinyserve.kernels.w4_weight import W4Weight

BK = 64                       # K step of every tile shape (fixed: see the module docstring)


@triton.jit
def _expert_block(sorted_ids_ptr, expert_ids_ptr, N, P, BM: tl.constexpr, BN: tl.constexpr):
    """This program's block: its BM (token, expert) pair ids (padding rows hold the sentinel P), their one expert,
    and its BN output columns, with the masks of both."""
    pairs = tl.load(sorted_ids_ptr + tl.program_id(0) * BM + tl.arange(0, BM))
    expert = tl.load(expert_ids_ptr + tl.program_id(0)).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    return pairs, pairs < P, expert, cols, cols < N


@triton.jit
def _store_block(acc, y_ptr, rw_ptr, pairs, row_ok, cols, col_ok, sym, MUL_ROUTED_WEIGHT: tl.constexpr):
    """The block's rows of y, scaled by their routing weights first when asked (the down projection)."""
    if MUL_ROUTED_WEIGHT:
        acc *= tl.load(rw_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    y = y_ptr + pairs.to(tl.int64)[:, None] * sym + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, y_ptr, rw_ptr, sorted_ids_ptr, expert_ids_ptr, padded_len_ptr,
                     N, K, P, sam, swe, swn, sym,
                     A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, PREC: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    if tl.program_id(0) * BM >= tl.load(padded_len_ptr):
        return                                          # a block past the padded length (the buffer's bound)
    pairs, row_ok, expert, cols, col_ok = _expert_block(sorted_ids_ptr, expert_ids_ptr, N, P, BM=BM, BN=BN)
    ks = tl.arange(0, BK)
    a_base = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * sam
    w_base = w_ptr + expert * swe + cols.to(tl.int64)[None, :] * swn     # W_e^T tile [BK, BN]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + ks) < K
        a = tl.load(a_base + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc += tl.dot(a, w.to(a.dtype), input_precision=PREC)
    _store_block(acc, y_ptr, rw_ptr, pairs, row_ok, cols, col_ok, sym, MUL_ROUTED_WEIGHT=MUL_ROUTED_WEIGHT)


@triton.jit
def _moe_fp8_gemm_kernel(a_ptr, w_ptr, s_ptr, y_ptr, rw_ptr, sorted_ids_ptr, expert_ids_ptr, padded_len_ptr,
                         N, K, P, sam, swe, swn, sse, ssn, ssk, sym,
                         A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, PREC: tl.constexpr,
                         SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, ACT_QUANT: tl.constexpr,
                         EVEN_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    if tl.program_id(0) * BM >= tl.load(padded_len_ptr):
        return                                          # a block past the padded length (the buffer's bound)
    pairs, row_ok, expert, cols, col_ok = _expert_block(sorted_ids_ptr, expert_ids_ptr, N, P, BM=BM, BN=BN)
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * sam + ks[None, :]
    w_ptrs = w_ptr + expert * swe + cols.to(tl.int64)[None, :] * swn + ks[:, None]      # W_e^T tile [BK, BN]
    s_ptrs = s_ptr + expert * sse + (cols // SCALE_BN) * ssn                              # the expert's scale rows
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:                  # K a multiple of BK (the Qwen3.5 / Qwen3-Next expert shapes): no column masks
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        w_scale = tl.load(s_ptrs + (k0 // SCALE_BK) * ssk, mask=col_ok, other=0.0)          # [BN]
        acc += fp8_group_product(a, w, w_scale, ACT_QUANT, PREC)
        a_ptrs += BK
        w_ptrs += BK
    _store_block(acc, y_ptr, rw_ptr, pairs, row_ok, cols, col_ok, sym, MUL_ROUTED_WEIGHT=MUL_ROUTED_WEIGHT)


@triton.jit
def _moe_w4_gemm_kernel(a_ptr, c_ptr, s_ptr, z_ptr, perm_ptr, y_ptr, rw_ptr, sorted_ids_ptr, expert_ids_ptr,
                        padded_len_ptr, N, K, P, sam, sce, scn, sse, ssn, sze, szn, spe, sym, zero_point, global_scale,
                        A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, PREC: tl.constexpr,
                        FP4: tl.constexpr, HAS_ZEROS: tl.constexpr, PERM: tl.constexpr, GROUP: tl.constexpr,
                        A: tl.constexpr, MODE: tl.constexpr, EVEN_K: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr):
    if tl.program_id(0) * BM >= tl.load(padded_len_ptr):
        return                                          # a block past the padded length (the buffer's bound)
    pairs, row_ok, expert, cols, col_ok = _expert_block(sorted_ids_ptr, expert_ids_ptr, N, P, BM=BM, BN=BN)
    ks = tl.arange(0, BK)
    js = tl.arange(0, BK // 2)
    gs = tl.arange(0, A)
    a_rows = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * sam
    c_ptrs = c_ptr + expert * sce + cols.to(tl.int64)[None, :] * scn + js[:, None]       # W_e^T bytes [BK/2, BN]
    s_row = s_ptr + expert * sse + cols.to(tl.int64)[None, :] * ssn + gs[:, None]         # the expert's [A, BN]
    z_row = z_ptr + expert * sze + cols.to(tl.int64)[None, :] * szn + gs[:, None]
    perm_row = perm_ptr + expert * spe
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = k0 + ks < K
        a_mask, c_mask, g_mask = k_masks(k0, k_ok, js, gs, row_ok, col_ok, K, GROUP, EVEN_K)
        if PERM:                    # act-order: the expert's sorted columns are A's columns perm_e[k]
            ka = tl.load(perm_row + k0 + ks, mask=k_ok, other=0)
        else:
            ka = k0 + ks
        a = tl.load(a_rows + ka[None, :], mask=a_mask, other=0.0)
        ae, ao = even_odd(a)
        g0 = k0 // GROUP
        acc += w4_tile_product(ae, ao, c_ptrs, c_mask, s_row + g0, z_row + g0, g_mask, zero_point, global_scale,
                               FP4, HAS_ZEROS, A, MODE, PREC)
        c_ptrs += BK // 2
    _store_block(acc, y_ptr, rw_ptr, pairs, row_ok, cols, col_ok, sym, MUL_ROUTED_WEIGHT=MUL_ROUTED_WEIGHT)


def tile_shape(pairs: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) by the mean rows per expert: few rows (decode) -> the smallest M tile a GPU
    dot takes and narrow N slices (many programs streaming each expert's weight once); more -> larger tiles."""
    rows = pairs / num_experts
    if rows <= 16:
        return 16, 64, 4, 4
    if rows <= 96:
        return 32, 64, 4, 4
    return 64, 128, 8, 3


def fp8_tile_shape(BM: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) of the FP8 GEMM for the BM tile_shape chose (both GEMMs of a layer share
    it). The FP8 weight tile is half the bytes of a bf16 one, so the 128-column K step still fits three stages of
    the prefill tile in a 4090's or 5090's 100 KiB of shared memory (72 KiB; checked with
    `bench/gpu_check.py --compile`: no spills)."""
    return (BM, 64, 4, 4) if BM <= 32 else (BM, 128, 8, 3)


def w4_tile_shape(BM: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) of the 4-bit GEMM for the BM tile_shape chose. A stage holds the A tile
    [BM, 64] and the expert's bytes [32, BN] (12 KB at 64 x 128): three stages fit every card (checked with
    `bench/gpu_check.py --compile`)."""
    return (BM, 64, 4, 4) if BM <= 32 else (BM, 128, 8, 3)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, BM: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's group padded to a multiple of BM, with device ops only.
    Returns (sorted_ids int32 [bound] (pair ids; P in padding rows), expert_ids int32 [bound // BM],
    padded_len int32 [1]) with bound = P + min(E, P) * (BM - 1) rounded up to BM."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    bound = triton.cdiv(P + min(num_experts, P) * (BM - 1), BM) * BM
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BM - 1) // BM * BM
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)                   # pair ids by expert, ascending within an expert
    experts_sorted = flat[order]
    rank = torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[experts_sorted]   # place within its expert
    dest = (padded_end - padded)[experts_sorted] + rank
    sorted_ids = torch.full((bound,), P, dtype=torch.int32, device=dev).scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, bound, BM, device=dev)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor | Fp8Weight, out: torch.Tensor, a_row_div: int, routed_weights,
                  sorted_ids: torch.Tensor, expert_ids: torch.Tensor, padded_len: torch.Tensor,
                  tiles: tuple[int, int, int, int]) -> None:
    if isinstance(w, Fp8Weight):
        return _grouped_fp8_gemm(a, w, out, a_row_div, routed_weights, sorted_ids, expert_ids, padded_len,
                                 fp8_tile_shape(tiles[0]))
    if isinstance(w, W4Weight):
        return _grouped_w4_gemm(a, w, out, a_row_div, routed_weights, sorted_ids, expert_ids, padded_len,
                                w4_tile_shape(tiles[0]))
    BM, BN, warps, stages = tiles
    N, K = w.shape[1], w.shape[2]
    grid = (expert_ids.numel(), triton.cdiv(N, BN))
    _moe_gemm_kernel[grid](
        a, w, out, routed_weights if routed_weights is not None else out, sorted_ids, expert_ids, padded_len,
        N, K, out.shape[0], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=routed_weights is not None,
        PREC="ieee" if a.dtype == torch.float32 else "tf32",      # fp32: exact products, as torch's default GEMM
        BM=BM, BN=BN, BK=BK, num_warps=warps, num_stages=stages)


def _grouped_fp8_gemm(a: torch.Tensor, w: Fp8Weight, out: torch.Tensor, a_row_div: int, routed_weights,
                      sorted_ids: torch.Tensor, expert_ids: torch.Tensor, padded_len: torch.Tensor,
                      tiles: tuple[int, int, int, int]) -> None:
    BM, BN, warps, stages = tiles
    weight, scale = w.weight, w.scale
    N, K = weight.shape[1], weight.shape[2]
    grid = (expert_ids.numel(), triton.cdiv(N, BN))
    _moe_fp8_gemm_kernel[grid](
        a, weight, scale, out, routed_weights if routed_weights is not None else out, sorted_ids, expert_ids,
        padded_len, N, K, out.shape[0], a.stride(0), weight.stride(0), weight.stride(1), scale.stride(0),
        scale.stride(1), scale.stride(2), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=routed_weights is not None,
        PREC="ieee" if a.dtype == torch.float32 else "tf32", SCALE_BN=w.block[0], SCALE_BK=w.block[1],
        ACT_QUANT=w.act_quant, EVEN_K=K % ACT_GROUP == 0, BM=BM, BN=BN, BK=ACT_GROUP, num_warps=warps,
        num_stages=stages)


def _grouped_w4_gemm(a: torch.Tensor, w: W4Weight, out: torch.Tensor, a_row_div: int, routed_weights,
                     sorted_ids: torch.Tensor, expert_ids: torch.Tensor, padded_len: torch.Tensor,
                     tiles: tuple[int, int, int, int]) -> None:
    BM, BN, warps, stages = tiles
    N, K = w.shape[1], w.shape[2]
    zeros = w.zeros if w.zeros is not None else w.scales          # placeholders: never read
    perm = w.perm if w.perm is not None else w.scales
    grid = (expert_ids.numel(), triton.cdiv(N, BN))
    _moe_w4_gemm_kernel[grid](
        a, w.codes, w.scales, zeros, perm, out, routed_weights if routed_weights is not None else out, sorted_ids,
        expert_ids, padded_len, N, K, out.shape[0], a.stride(0), w.codes.stride(0), w.codes.stride(1),
        w.scales.stride(0), w.scales.stride(1), zeros.stride(0) if w.zeros is not None else 0,
        zeros.stride(1) if w.zeros is not None else 0, perm.stride(0) if w.perm is not None else 0, out.stride(0),
        w.zero_point, w.global_scale,
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=routed_weights is not None, PREC="ieee" if a.dtype == torch.float32
        else "tf32", FP4=w.kind == "fp4", HAS_ZEROS=w.zeros is not None, PERM=w.perm is not None, GROUP=w.group,
        A=max(1, W4_BK // w.group), MODE=dequant_mode(w, a.dtype, W4_BK), EVEN_K=K % W4_BK == 0, BM=BM, BN=BN,
        BK=W4_BK, num_warps=warps, num_stages=stages)


def _rows_contiguous(t: torch.Tensor | Fp8Weight | W4Weight, dtype: torch.dtype
                     ) -> torch.Tensor | Fp8Weight | W4Weight:
    """t with rows of unit stride (an Fp8Weight is); a W4Weight whose groups fit no K step of the 4-bit GEMM
    (w4_triton.supports: groups neither a power of two nor a multiple of 64; no checkpoint of this family has
    one) dequantized to dtype for the call."""
    if isinstance(t, W4Weight):
        return t if w4_supports(t, W4_BK) else t.dequantize(dtype)
    return t if isinstance(t, Fp8Weight) or t.stride(-1) == 1 else t.contiguous()


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight | W4Weight,
                  w_down: torch.Tensor | Fp8Weight | W4Weight, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    T, k = topk_ids.shape
    E, H = w_gate_up.shape[0], w_down.shape[1]
    if T == 0:
        return torch.zeros((0, H), dtype=torch.float32, device=x.device)
    x, w_gate_up, w_down = (_rows_contiguous(t, x.dtype) for t in (x, w_gate_up, w_down))
    P = T * k
    tiles = tile_shape(P, E)
    sorted_ids, expert_ids, padded_len = align_pairs(topk_ids, E, tiles[0])
    gate_up = torch.empty((P, w_gate_up.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, gate_up, k, None, sorted_ids, expert_ids, padded_len, tiles)
    act = silu_and_mul(gate_up)                          # [P, I]
    down = torch.empty((P, H), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w_down, down, 1, topk_weights.reshape(-1).float().contiguous(), sorted_ids, expert_ids,
                  padded_len, tiles)
    return down.view(T, k, H).sum(1, dtype=torch.float32)
