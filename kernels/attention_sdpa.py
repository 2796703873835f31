"""Prefill attention on a GPU through torch's scaled_dot_product_attention (its flash kernels), for
kernels/attention.py: where torch's flash backend takes the call it is the faster correct kernel (on an H200 our
paged prefill kernel, attention_triton.py, ran at 0.5-0.6x of it for 2048 new tokens after 8192 cached); ours keeps
paged decode, the calls flash does not take, and the CPU.

SDPA wants each sequence's keys and values in one piece: they are gathered from the pages into a contiguous copy in
q's dtype (the new tokens' rows were stored before the attention runs; an FP8 cache is widened, the same values our
kernel reads), and each sequence's n queries attend to its L keys under a lower-right causal mask (query j sees the
first L - n + j + 1 keys), the KV heads shared by their query heads (enable_gqa). The copy is transient memory the
memory plan did not count for attention: it is bounded by MAX_GATHER_PER_QUERY times the call's own q bytes
(tinyserve/plan.py budgets ~20x a token's q bytes for a hybrid layer's prefill intermediates), beyond which, for
long contexts behind short chunks, our kernel runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

MAX_GATHER_PER_QUERY = 8          # the gathered K and V of one sequence: at most this many times q's bytes


def gather_context(kv_cache: torch.Tensor, pages: torch.Tensor, length: int, dtype: torch.dtype):
    """The first `length` keys and values of a sequence whose pages are `pages`, as [1, KV, length, hd] each."""
    kv = kv_cache[pages]                                        # [n_pages, 2, page, KV, hd]
    kv = kv.transpose(0, 1).reshape(2, -1, *kv.shape[-2:])[:, :length]
    k, v = kv.to(dtype).permute(0, 2, 1, 3).unsqueeze(1)        # [2, 1, KV, L, hd] -> two [1, KV, L, hd]
    return k, v


def flash_takes(q: torch.Tensor, kv_heads: int) -> bool:
    """Whether torch's flash backend takes this call's shapes and dtype (head dim, GQA, the device's capability)."""
    T, H, hd = q.shape
    qs = q.new_empty((1, H, 1, hd))
    kvs = q.new_empty((1, kv_heads, 1, hd))
    params = torch.backends.cuda.SDPAParams(qs, kvs, kvs, None, 0.0, True, True)
    return torch.backends.cuda.can_use_flash_attention(params, False)


def usable(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: list[int]) -> bool:
    """Whether `prefill` should run this call: on a GPU, 16-bit queries, flash takes the shapes, and the longest
    sequence's gathered keys and values stay within MAX_GATHER_PER_QUERY times q's bytes."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16) or not seq_lens:
        return False
    kv_heads, hd = kv_cache.shape[-2:]
    gathered = max(seq_lens) * 2 * kv_heads * hd * q.element_size()
    return gathered <= MAX_GATHER_PER_QUERY * q.numel() * q.element_size() and flash_takes(q, kv_heads)


def prefill(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, cu_seqlens: list[int],
            seq_lens: list[int], scale: float) -> torch.Tensor:
    """kernels.attention.paged_attention_prefill (same arguments; kv_cache is one layer's [pages, 2, page, KV, hd])
    through SDPA, one sequence at a time."""
    out = torch.empty_like(q)
    page_size = kv_cache.shape[2]
    for i, L in enumerate(seq_lens):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        n = e - s
        if n == 0:
            continue
        k, v = gather_context(kv_cache, page_table[i, :-(-L // page_size)].long(), L, q.dtype)
        qi = q[s:e].transpose(0, 1).unsqueeze(0)                # [1, H, n, hd]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=causal_lower_right(n, L), scale=scale,
                                           enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1)
    return out
