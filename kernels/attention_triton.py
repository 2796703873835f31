"""Triton kernel for kernels/attention.py: paged attention decode with split-K ("flash decoding") and GQA grouping.

Stage 1: one program per (sequence, KV head, split) covers the q heads of that KV head (padded to 16 rows for
tl.dot) over its split of the context, reading keys and values token by token through the page table (so every
page size, 1 / 16 / 64, takes the same path), with an online softmax in fp32; it writes the normalised partial
output and its log-sum-exp (base 2). Stage 2: one program per (sequence, q head) merges the splits. The split
count comes from the longest context and the device's SM count; each sequence divides its own length by it, so
short sequences leave their last splits empty (lse = -inf, weight 0). KV in any float dtype (bf16, fp16, fp32,
fp8 e4m3): keys and values are converted to q's dtype before the dots (fp32 dots are ieee, not TF32).
A speculative verify runs through the same kernels: each of its tokens is a row with its own length (position + 1)
reading its sequence's page-table row (table_rows). The rows of one sequence are neighbours in the grid's first
dimension, which varies fastest, so they read each KV block at about the same time and L2 serves the repeats.
store_kv writes a step's keys and values into their pages in one launch.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tinyserve.kernels.tiles import prefill_tiles

SPLIT_MIN_TOKENS = 256      # no split is made shorter than this (tests lower it to reach many splits)
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4         # aim: this many stage-1 programs per SM, splitting long contexts to get there


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132                                            # the interpreter: as an H100/H200 would split


def num_splits(max_len: int, num_seqs: int, kv_heads: int, device: torch.device) -> int:
    by_len = triton.cdiv(max(max_len, 1), SPLIT_MIN_TOKENS)
    by_grid = triton.cdiv(PROGRAMS_PER_SM * _num_sms(device), max(num_seqs * kv_heads, 1))
    return max(1, min(by_len, by_grid, MAX_SPLITS))


NO_MASK, BOUND, CAUSAL = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)   # _attend_block's key masks


@triton.jit
def _decode_split_kernel(q_ptr, kv_ptr, pt_ptr, rows_ptr, lens_ptr, o_ptr, lse_ptr, scale_log2, G, HD, NUM_SPLITS,
                         sqn, sqh, skp, skv, sks, skh, spt, son, soh, sos, sln, slh,
                         PAGE: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                         IEEE: tl.constexpr, TABLE_ROWS: tl.constexpr):
    i_n = tl.program_id(0)
    i_kv = tl.program_id(1)
    i_s = tl.program_id(2)
    seq_len = tl.load(lens_ptr + i_n)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BN) * BN
    start = i_s * split_len
    end = tl.minimum(start + split_len, seq_len)
    h = tl.arange(0, BH)
    head = i_kv * G + h
    mh = h < G
    d = tl.arange(0, BD)
    md = d < HD
    q = tl.load(q_ptr + i_n.to(tl.int64) * sqn + head[:, None] * sqh + d[None, :],
                mask=mh[:, None] & md[None, :], other=0.0)                       # [BH, BD], q's dtype
    m = tl.full([BH], float("-inf"), tl.float32)
    l = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BD], tl.float32)
    if TABLE_ROWS:
        pt_row = pt_ptr + tl.load(rows_ptr + i_n).to(tl.int64) * spt
    else:
        pt_row = pt_ptr + i_n.to(tl.int64) * spt
    for s in range(start, end, BN):
        acc, l, m = _attend_block(acc, l, m, q, kv_ptr, pt_row, s, end, h, i_kv * skh, d, md, scale_log2,
                                  skv, skp, sks, PAGE=PAGE, BN=BN, MASK=BOUND, IEEE=IEEE)
    has = l > 0
    o = acc / tl.where(has, l, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(o_ptr + i_n.to(tl.int64) * son + head[:, None] * soh + i_s * sos + d[None, :], o,
             mask=mh[:, None] & md[None, :])
    tl.store(lse_ptr + i_n.to(tl.int64) * sln + head * slh + i_s, lse, mask=mh)


@triton.jit
def _decode_merge_kernel(o_part_ptr, lse_ptr, out_ptr, HD, NUM_SPLITS, son, soh, sos, sln, slh, sout_n, sout_h,
                         BS: tl.constexpr, BD: tl.constexpr):
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    s = tl.arange(0, BS)
    d = tl.arange(0, BD)
    ms = s < NUM_SPLITS
    lse = tl.load(lse_ptr + i_n.to(tl.int64) * sln + i_h * slh + s, mask=ms, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)                                                         # 0 for empty splits
    o = tl.load(o_part_ptr + i_n.to(tl.int64) * son + i_h * soh + s[:, None] * sos + d[None, :],
                mask=ms[:, None] & (d < HD)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    y = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + i_n.to(tl.int64) * sout_n + i_h * sout_h + d, y.to(out_ptr.dtype.element_ty), mask=d < HD)


def paged_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, max_len: int, scale: float,
                           table_rows: torch.Tensor | None = None) -> torch.Tensor:
    N, H, HD = q.shape
    _, two, page_size, KV, hd_kv = kv_cache.shape
    assert two == 2 and hd_kv == HD and H % KV == 0 and q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    G = H // KV
    out = torch.empty_like(q)
    if N == 0:
        return out
    S = num_splits(max_len, N, KV, q.device)
    o_part = torch.empty((N, H, S, HD), dtype=torch.float32, device=q.device)
    lse = torch.empty((N, H, S), dtype=torch.float32, device=q.device)
    BD = triton.next_power_of_2(HD)
    BH = max(16, triton.next_power_of_2(G))
    BN = 32 if BD >= 256 else 64
    _decode_split_kernel[(N, KV, S)](
        q, kv_cache, page_table, page_table if table_rows is None else table_rows, seq_lens, o_part, lse,
        scale * 1.4426950408889634, G, HD, S,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        page_table.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        PAGE=page_size, BH=BH, BN=BN, BD=BD, IEEE=q.dtype == torch.float32, TABLE_ROWS=table_rows is not None,
        num_warps=4, num_stages=2)
    _decode_merge_kernel[(N, H)](
        o_part, lse, out, HD, S, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), BS=triton.next_power_of_2(S), BD=BD, num_warps=4)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Prefill: the new tokens of each sequence attend causally to its cached context plus themselves
# ---------------------------------------------------------------------------------------------------------------
# One program per (query tile, KV head). A query tile is BQ consecutive new tokens of one sequence; its rows are
# (token, q head of this KV head) pairs, row r = token r // G, head r % G, so the G heads sharing a KV head share
# every key/value block read (BM = BQ * G rows, padded to a power of two). Keys and values are read block by block
# through the page table (token slot page * PAGE + offset), as in decode, with an online softmax in fp32 (log2
# units). The query at row r sits at absolute position ctx + token (ctx = seq_len - new tokens); the tile sees keys
# 0 .. ctx + last token. Blocks wholly at or below the tile's first position need no mask (the first loop); the
# blocks after it take the causal mask (the second loop).
PREFILL_BLOCKS: tuple[int, int] | None = None     # (rows BM, keys BN); None: by head dim (tests set small ones)


@triton.jit
def _attend_block(acc, l, m, q, kv_ptr, pt_row, s, end, qpos, kv_off, d, md, scale_log2, skv, skp, sks,
                  PAGE: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr):
    """One step of the online softmax over keys s .. s+BN-1 read through a page-table row: returns the updated
    (acc, l, m). MASK: NO_MASK (a block wholly visible), BOUND (keys from `end` on hidden: decode's last block) or
    CAUSAL (and each query row sees keys up to its position qpos)."""
    pos = s + tl.arange(0, BN)
    mp = pos < end
    page = tl.load(pt_row + pos // PAGE, mask=mp, other=0).to(tl.int64)
    base = page * skp + (pos % PAGE) * sks + kv_off                              # [BN]
    mkv = mp[:, None] & md[None, :]
    k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=mkv, other=0.0).to(tl.float32).to(q.dtype)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * scale_log2                                                         # [rows, BN], log2 units
    if MASK == CAUSAL:
        qk = tl.where(mp[None, :] & (pos[None, :] <= qpos[:, None]), qk, float("-inf"))
    elif MASK == BOUND:
        qk = tl.where(mp[None, :], qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, axis=1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    v = tl.load(kv_ptr + skv + base[:, None] + d[None, :], mask=mkv, other=0.0).to(tl.float32).to(q.dtype)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    l = l * alpha + tl.sum(p, axis=1)
    return acc, l, m_new


@triton.jit
def _prefill_kernel(q_ptr, kv_ptr, pt_ptr, meta_ptr, o_ptr, scale_log2, num_tiles, num_seqs, G, HD,
                    sqt, sqh, skp, skv, sks, skh, spt, sot, soh,
                    PAGE: tl.constexpr, BQ: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                    IEEE: tl.constexpr):
    # meta (int32): tile_seq [num_tiles] | tile_start [num_tiles] | cu_seqlens [num_seqs+1] | seq_lens [num_seqs]
    i_t = tl.program_id(0)
    i_kv = tl.program_id(1)
    seq = tl.load(meta_ptr + i_t)
    j0 = tl.load(meta_ptr + num_tiles + i_t)
    bos = tl.load(meta_ptr + 2 * num_tiles + seq)
    n = tl.load(meta_ptr + 2 * num_tiles + seq + 1) - bos
    seq_len = tl.load(meta_ptr + 2 * num_tiles + num_seqs + 1 + seq)
    ctx = seq_len - n                                                            # cached tokens before the new
    r = tl.arange(0, BM)
    tok = j0 + r // G
    mr = (r < BQ * G) & (tok < n)
    head = i_kv * G + r % G
    # padding rows take the tile's first position: they see a key in every block the loops visit, so never NaN
    qpos = tl.where(mr, ctx + tok, ctx + j0)
    d = tl.arange(0, BD)
    md = d < HD
    q_rows = (bos + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * sqt + head[:, None] * sqh + d[None, :], mask=mr[:, None] & md[None, :],
                other=0.0)                                                       # [BM, BD], q's dtype
    pt_row = pt_ptr + seq.to(tl.int64) * spt
    kv_off = i_kv * skh
    end = ctx + tl.minimum(j0 + BQ, n)                                           # keys 0 .. end-1 are visible
    full = (ctx + j0 + 1) // BN * BN                                             # blocks below: no mask needed
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    for s in range(0, full, BN):
        acc, l, m = _attend_block(acc, l, m, q, kv_ptr, pt_row, s, end, qpos, kv_off, d, md, scale_log2,
                                  skv, skp, sks, PAGE=PAGE, BN=BN, MASK=NO_MASK, IEEE=IEEE)
    for s in range(full, end, BN):
        acc, l, m = _attend_block(acc, l, m, q, kv_ptr, pt_row, s, end, qpos, kv_off, d, md, scale_log2,
                                  skv, skp, sks, PAGE=PAGE, BN=BN, MASK=CAUSAL, IEEE=IEEE)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(o_ptr + q_rows[:, None] * sot + head[:, None] * soh + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mr[:, None] & md[None, :])


def _prefill_blocks(BD: int) -> tuple[int, int, int]:
    """(rows BM, keys BN, num_warps) for a padded head dim. Checked by compiling for sm_90a without a device
    (ptxas -v, bf16 q): hd 256 -> 198 registers, no spills, 96 KiB shared (64 KiB with fp8 KV), so it also fits
    the ~100 KiB of sm_86/89; hd 128 -> 160 registers; hd 64 -> 120. fp32 q (ieee dots, tests only) spills."""
    if PREFILL_BLOCKS is not None:
        return (*PREFILL_BLOCKS, 4)
    if BD > 256:
        return 32, 16, 8
    if BD == 256:
        return 64, 32, 8
    if BD == 128:
        return 128, 32, 8
    return 128, 64, 8


def paged_attention_prefill(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor,
                            cu_seqlens: list[int], seq_lens: list[int], scale: float) -> torch.Tensor:
    T, H, HD = q.shape
    _, two, page_size, KV, hd_kv = kv_cache.shape
    assert two == 2 and hd_kv == HD and H % KV == 0 and kv_cache.stride(-1) == 1
    if q.stride(-1) != 1:
        q = q.contiguous()
    G = H // KV
    out = torch.empty((T, H, HD), dtype=q.dtype, device=q.device)
    N = len(seq_lens)
    BD = max(16, triton.next_power_of_2(HD))
    BM, BN, warps = _prefill_blocks(BD)
    BM = max(BM, triton.next_power_of_2(G))             # at least one token's heads per tile
    BQ = BM // G                                        # tokens per tile
    meta, num_tiles = prefill_tiles(cu_seqlens, seq_lens, BQ, q.device)
    if not num_tiles:
        return out
    _prefill_kernel[(num_tiles, KV)](
        q, kv_cache, page_table, meta, out, scale * 1.4426950408889634, num_tiles, N, G, HD,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        page_table.stride(0), out.stride(0), out.stride(1),
        PAGE=page_size, BQ=BQ, BM=BM, BN=BN, BD=BD, IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=2)
    return out


@triton.jit(do_not_specialize=["layer"])             # one variant for every layer
def _store_kv_kernel(k_ptr, v_ptr, slot_ptr, pool_ptr, layer, W, skt, svt, sp0, sp1, sp2, sp3,
                     PAGE: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < W
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dst = pool_ptr + (slot // PAGE) * sp0 + layer * sp1 + (slot % PAGE) * sp3 + cols
    k = tl.load(k_ptr + t.to(tl.int64) * skt + cols, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t.to(tl.int64) * svt + cols, mask=ok, other=0.0).to(tl.float32)
    if FP8:                                      # saturate as torch's conversion does (Triton's would not)
        k = tl.clamp(k, -448.0, 448.0)
        v = tl.clamp(v, -448.0, 448.0)
    tl.store(dst, k.to(pool_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + sp2, v.to(pool_ptr.dtype.element_ty), mask=ok)


def store_kv(k: torch.Tensor, v: torch.Tensor, pool: torch.Tensor, layer: int, slot_mapping: torch.Tensor) -> None:
    """kernels.attention.store_kv in one launch: token t's k and v [KV, hd] rows into the pool [pages, layers, 2,
    page, KV, hd] at slot slot_mapping[t] of `layer` (the reference indexes, stacks and puts: six launches)."""
    T, KV, hd = k.shape
    W = KV * hd
    k2, v2 = k.reshape(T, W), v.reshape(T, W)
    k2 = k2 if k2.stride(-1) == 1 else k2.contiguous()
    v2 = v2 if v2.stride(-1) == 1 else v2.contiguous()
    assert pool.stride(-1) == 1 and pool.stride(-2) == hd, "a pool row's heads must be contiguous"
    if T:
        BLOCK = min(1024, triton.next_power_of_2(W))
        _store_kv_kernel[(T, triton.cdiv(W, BLOCK))](
            k2, v2, slot_mapping, pool, layer, W, k2.stride(0), v2.stride(0), pool.stride(0), pool.stride(1),
            pool.stride(2), pool.stride(3), PAGE=pool.shape[3], FP8=pool.dtype == torch.float8_e4m3fn, BLOCK=BLOCK,
            num_warps=4)

