"""Paged attention for the full-attention layers (torch reference).

KV cache of one layer: [num_pages, 2, page_size, kv_heads, head_dim] (a view into the page-major pool, see
tinyserve/pools.py). A token's KV lives at flat slot `page * page_size + offset`. Each sequence has a row of the page
table [N, max_pages] (int32) listing its pages in order; `seq_lens[i]` is its context length after this step, and
its new tokens are the last `q_len` positions of that context (causal).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.kernels import PoolLayer, use_cpu_kernel, use_triton


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | PoolLayer,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, KV, hd] at flat slots slot_mapping [T] (int64) of one layer's cache."""
    kv = PoolLayer.of(kv_cache)
    if use_triton(k):
        from tinyserve.kernels import attention_triton
        return attention_triton.store_kv(k, v, kv.pool, kv.layer, slot_mapping)
    page_size = kv.pool.shape[3]
    pages, offsets = slot_mapping // page_size, slot_mapping % page_size
    kv.put((pages[:, None], torch.arange(2, device=k.device)[None, :], offsets[:, None]), torch.stack([k, v], 1))


def _gather_kv(kv_cache: torch.Tensor, pages: torch.Tensor, length: int, dtype: torch.dtype):
    kv = kv_cache[pages]                                   # [n_pages, 2, ps, KV, hd]
    kv = kv.transpose(0, 1).reshape(2, -1, *kv.shape[-2:])[:, :length]
    return kv[0].to(dtype), kv[1].to(dtype)                # [L, KV, hd] each


def paged_attention_prefill(q: torch.Tensor, kv_cache: torch.Tensor | PoolLayer, page_table: torch.Tensor,
                            cu_seqlens: list[int], seq_lens: list[int], scale: float) -> torch.Tensor:
    """New tokens (any count per sequence, q [T, H, hd] packed) attend causally to their context: [T, H, hd]."""
    kv_cache = PoolLayer.of(kv_cache).rows
    if use_triton(q):
        from tinyserve.kernels import attention_sdpa, attention_triton
        if attention_sdpa.usable(q, kv_cache, seq_lens):      # torch's flash kernels, where they take the call
            return attention_sdpa.prefill(q, kv_cache, page_table, cu_seqlens, seq_lens, scale)
        return attention_triton.paged_attention_prefill(q, kv_cache, page_table, cu_seqlens, seq_lens, scale)
    out = torch.empty_like(q)
    page_size = kv_cache.shape[2]
    attend = _attend_split if q.device.type == "cpu" else _attend_masked
    for i in range(len(seq_lens)):
        s, e, L = cu_seqlens[i], cu_seqlens[i + 1], seq_lens[i]
        if e == s:                                       # no new token: nothing to attend (flash divides by it)
            continue
        n_pages = (L + page_size - 1) // page_size
        k, v = _gather_kv(kv_cache, page_table[i, :n_pages].long(), L, q.dtype)
        o = attend(q[s:e].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                   v.transpose(0, 1).unsqueeze(0), scale)
        out[s:e] = o[0].transpose(0, 1)
    return out


def _attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, H, n, hd], the last n positions of k, v [1, KV, L, hd]: query j sits at position L - n + j and sees
    keys 0 .. L - n + j (an [n, L] mask)."""
    n, L = q.shape[2], k.shape[2]
    mask = torch.arange(L, device=q.device).unsqueeze(0) <= torch.arange(L - n, L, device=q.device).unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def _attend_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """_attend_masked without the mask, on the CPU: the keys before the chunk are all seen and the chunk's own are
    seen causally, so each part runs torch's CPU flash kernel as it is (no [n, L] mask built and read per chunk:
    at 30K tokens of context the mask was a third of the prefill), and the two are joined by their log-sum-exps."""
    n, L = q.shape[2], k.shape[2]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    new, lse_new = flash(q, k[:, :, L - n:], v[:, :, L - n:], 0.0, True, scale=scale)[:2]
    if L == n:
        return new
    old, lse_old = flash(q, k[:, :, :L - n], v[:, :, :L - n], 0.0, False, scale=scale)[:2]
    top = torch.maximum(lse_old, lse_new)
    w_old, w_new = torch.exp(lse_old - top).unsqueeze(-1), torch.exp(lse_new - top).unsqueeze(-1)
    return ((old.float() * w_old + new.float() * w_new) / (w_old + w_new)).to(q.dtype)


def row_groups(table_rows: torch.Tensor, q: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """(first row, end row, page-table row) of each run of rows reading one page-table row, on the CPU, where
    reading the ids is free; None on a GPU or in a compiled step (each row gathers its own keys: no host read)."""
    if q.device.type != "cpu" or torch.compiler.is_dynamo_compiling():
        return None
    rows, groups, start = table_rows.tolist(), [], 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or rows[end] != rows[start]:
            groups.append((start, end, rows[start]))
            start = end
    return groups


def paged_attention_decode(q: torch.Tensor, kv_cache: torch.Tensor | PoolLayer, page_table: torch.Tensor,
                           seq_lens: torch.Tensor, max_len: int, scale: float,
                           table_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One query row per sequence, all rows at once: row i sees keys 0 .. seq_lens[i]-1 of its pages. q [N, H, hd];
    seq_lens [N] (int32, each <= max_len); returns [N, H, hd]. table_rows [N] (int64): row i reads page-table row
    table_rows[i] (a speculative verify: each token is a row over its sequence's pages, its length its position
    + 1, which makes it causal); None: row i."""
    kv_cache = PoolLayer.of(kv_cache).rows
    if use_triton(q):
        from tinyserve.kernels import attention_triton
        return attention_triton.paged_attention_decode(q, kv_cache, page_table, seq_lens, max_len, scale,
                                                       table_rows)
    if use_cpu_kernel(q):
        from tinyserve.kernels import attention_cpu     # the pages read in place (C; this function is its oracle)
        if attention_cpu.usable(q, kv_cache):
            return attention_cpu.paged_decode(q, kv_cache, page_table, seq_lens, table_rows, scale)
    N, H, hd = q.shape
    page_size = kv_cache.shape[2]
    n_pages = (max_len + page_size - 1) // page_size
    groups = row_groups(table_rows, q) if table_rows is not None else None
    if groups is not None:          # a sequence's rows share its keys and values: gathered once, as in prefill
        out = torch.empty_like(q)
        for start, end, row in groups:
            k, v = _gather_kv(kv_cache, page_table[row, :n_pages].long(), n_pages * page_size, q.dtype)
            mask = torch.arange(k.shape[0], device=q.device) < seq_lens[start:end, None]          # [n, L]
            o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1).unsqueeze(0),
                                               k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out
    if table_rows is not None:
        page_table = page_table[table_rows]
    kv = kv_cache[page_table[:, :n_pages].long()]          # [N, n_pages, 2, ps, KV, hd]
    KV = kv.shape[-2]
    kv = kv.transpose(1, 2).reshape(N, 2, n_pages * page_size, KV, hd)
    k = kv[:, 0].transpose(1, 2).to(q.dtype)               # [N, KV, Lmax, hd]
    v = kv[:, 1].transpose(1, 2).to(q.dtype)
    mask = torch.arange(n_pages * page_size, device=q.device).unsqueeze(0) < seq_lens.unsqueeze(1)   # [N, Lmax]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale,
                                       enable_gqa=True)    # [N, H, 1, hd]
    return o.squeeze(2)
