"""The prefill Triton kernels against their torch references: the causal conv1d over packed sequences with per-slot
history (kernels/conv_triton.py) and paged attention of new tokens over their cached context plus themselves
(kernels/attention_triton.py), called through the public functions with the backend forced.

Without CUDA they run in Triton's interpreter on tiny ragged shapes in fp32 and fp16 (with small block sizes, so
sequences span several tiles); with CUDA the same tests run compiled, and the `gpu` tier adds bf16 and the shapes
of Qwen3.5-27B.
"""
from __future__ import annotations

import pytest
import torch

from triton_setup import DEV, ON_GPU, backend, both, gen_, gpu, needs_gpu, paged_kv, rnd, tol  # noqa: E402,F401  (first)
from tinyserve.kernels import attention_sdpa, attention_triton, conv_triton  # noqa: E402
from tinyserve.kernels.attention import paged_attention_prefill  # noqa: E402
from tinyserve.kernels.conv import causal_conv1d_prefill  # noqa: E402


def cumulative(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def close_to_fp32_reference(tri: torch.Tensor, ref32: torch.Tensor, rel: float = 2e-2) -> None:
    """bf16 results: the error against the fp32 reference, relative to the reference's scale."""
    err = (tri.float() - ref32).abs().max().item()
    assert err <= rel * max(ref32.abs().max().item(), 1.0), f"max error {err}"


# ---------------------------------------------------------------------------------------------------------------
# Causal conv1d prefill
# ---------------------------------------------------------------------------------------------------------------
LENS = [1, 2, 3, 7, 40]             # 1 and 2 are shorter than K-1 for K = 4; 40 spans 5 tiles of 8
SLOTS = [7, 0, 3, 5, 2]             # scattered; slots 1, 4, 6, 8 belong to no sequence


def conv_case(lens, K, C, dtype, seed):
    g = gen_(seed)
    weight = rnd(C, K, dtype=dtype, gen=g)
    pool = rnd(9, 2, C, K - 1, dtype=dtype, gen=g)           # [slots, layers, C, K-1]: a layer is a strided view
    state = pool[:, 1]
    T = sum(lens)
    fused = rnd(T, C + 12, dtype=dtype, gen=g)                # the model's x: a column slice of a fused projection
    return fused[:, 12:], weight, state, cumulative(lens)


@pytest.mark.parametrize("K", [2, 3, 4, 5])
def test_conv_prefill(K, monkeypatch):
    monkeypatch.setattr(conv_triton, "PREFILL_BLOCK_C", 16)   # C = 40: blocks of 16, 16 and a partial 8
    x, weight, state, cu = conv_case(LENS, K, 40, torch.float32, seed=K)
    before = state.clone()
    tri, ref, (*_, tri_state, _, _), (*_, ref_state, _, _) = both(
        causal_conv1d_prefill, x, weight, state, cu, SLOTS, clone=(2,))
    torch.testing.assert_close(tri, ref, **tol(torch.float32))
    torch.testing.assert_close(tri_state, ref_state, **tol(torch.float32))
    untouched = [s for s in range(state.shape[0]) if s not in SLOTS]
    assert torch.equal(tri_state[untouched], before[untouched])
    # a sequence shorter than K-1 keeps the tail of its old history, shifted left
    if K - 1 > 1:
        assert torch.equal(tri_state[SLOTS[0], :, :K - 2], before[SLOTS[0], :, 1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_conv_prefill_chunks_continue(dtype):
    """Three prefill calls of the same sequences (chunked prefill, the last chunk shorter than K-1) give the one-pass
    output and state: every call reads the history the previous one wrote. fp16 against an fp32 reference."""
    K, C = 4, 24
    lens = [30, 11]
    x, weight, state, _ = conv_case(lens, K, C, dtype, seed=11)
    slots = [6, 1]
    ref_state = state.float().clone()
    with backend("torch"):
        ref = causal_conv1d_prefill(x.float(), weight.float(), ref_state, cumulative(lens), slots)
    tri_state = state.clone()
    parts = {0: [], 1: []}
    cuts = [(0, 13, 0, 4), (13, 29, 4, 10), (29, 30, 10, 11)]    # [a0, b0) of sequence 0, [a1, b1) of sequence 1
    for a0, b0, a1, b1 in cuts:
        xs = torch.cat([x[a0:b0], x[30 + a1:30 + b1]])
        with backend("triton"):
            out = causal_conv1d_prefill(xs, weight, tri_state, [0, b0 - a0, b0 - a0 + b1 - a1], slots)
        assert out.dtype == dtype
        parts[0].append(out[:b0 - a0])
        parts[1].append(out[b0 - a0:])
    tri = torch.cat(parts[0] + parts[1])
    torch.testing.assert_close(tri, ref.to(dtype), **tol(dtype))
    torch.testing.assert_close(tri_state, ref_state.to(dtype), **tol(dtype))


def test_conv_prefill_default_blocks():
    x, weight, state, cu = conv_case(LENS, 4, 20, torch.float32, seed=5)
    tri, ref, (*_, tri_state, _, _), (*_, ref_state, _, _) = both(
        causal_conv1d_prefill, x, weight, state, cu, SLOTS, clone=(2,))
    torch.testing.assert_close(tri, ref, **tol(torch.float32))
    torch.testing.assert_close(tri_state, ref_state, **tol(torch.float32))


# ---------------------------------------------------------------------------------------------------------------
# Paged attention prefill
# ---------------------------------------------------------------------------------------------------------------
# (cached tokens, new tokens) per sequence; (15, 3): with 16-key blocks the first query's keys end on a block edge
CASES = [(0, 5), (37, 1), (70, 20), (15, 3)]


def paged_prefill_case(cases, page_size, NH, NKV, HD, kv_dtype, q_dtype, seed):
    """A KV pool (a layer view of two) holding each sequence's whole context (cached and new: the new tokens' KV is
    stored before attention) on scattered pages; q of the new tokens packed as a strided view."""
    g = gen_(seed)
    lengths = [c + n for c, n in cases]
    cache, pages, num_pages = paged_kv(lengths, page_size, NKV, HD, kv_dtype, g, spare_pages=3)
    width = max(len(p) for p in pages) + 1                     # a spare column of garbage page ids
    table = torch.tensor([p + [num_pages - 1] * (width - len(p)) for p in pages], dtype=torch.int32, device=DEV)
    cu = cumulative([n for _, n in cases])
    qg = rnd(cu[-1], NH, 2 * HD, dtype=q_dtype, gen=g)         # the model's q: [T, H, query | gate] sliced
    q = qg[..., :HD]
    return q, cache, table, cu, lengths, HD ** -0.5


@pytest.mark.parametrize("gqa,HD", [(1, 24), (2, 40), (3, 32)])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_paged_prefill(page_size, gqa, HD, monkeypatch):
    monkeypatch.setattr(attention_triton, "PREFILL_BLOCKS", (16, 16))  # several query tiles and key blocks
    args = paged_prefill_case(CASES, page_size, 2 * gqa, 2, HD, torch.float32, torch.float32, seed=page_size + gqa)
    tri, ref, *_ = both(paged_attention_prefill, *args)
    assert tri.shape == ref.shape and tri.dtype == torch.float32
    torch.testing.assert_close(tri, ref, **tol(torch.float32))


def test_paged_prefill_default_blocks():
    args = paged_prefill_case(CASES + [(3, 2)], 16, 6, 2, 24, torch.float32, torch.float32, seed=7)
    tri, ref, *_ = both(paged_attention_prefill, *args)
    torch.testing.assert_close(tri, ref, **tol(torch.float32))


@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.float16, torch.float16), (torch.float8_e4m3fn, torch.float32),
                                              (torch.float8_e4m3fn, torch.float16)],
                         ids=["fp16-fp16", "fp8-fp32", "fp8-fp16"])
def test_paged_prefill_low_precision(kv_dtype, q_dtype, monkeypatch):
    """fp16 q (fp16 dots, fp32 softmax) and fp8 e4m3 caches, against the reference in fp32 over the same stored
    values; GQA 3:1 and an odd head dim."""
    monkeypatch.setattr(attention_triton, "PREFILL_BLOCKS", (32, 16))
    q, cache, table, cu, lens, scale = paged_prefill_case(CASES, 16, 6, 2, 40, kv_dtype, q_dtype, seed=3)
    with backend("triton"):
        tri = paged_attention_prefill(q, cache, table, cu, lens, scale)
    with backend("torch"):
        ref = paged_attention_prefill(q.float(), cache.float(), table, cu, lens, scale)
    assert tri.dtype == q_dtype
    torch.testing.assert_close(tri.float(), ref, **tol(q_dtype))


@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                              (torch.float8_e4m3fn, torch.float32)], ids=["fp32", "fp16", "fp8-fp32"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_sdpa_prefill(page_size, kv_dtype, q_dtype):
    """The GPU's prefill through torch SDPA (kernels/attention_sdpa.py; here on the CPU's math kernel): the context
    gathered from its pages, the lower-right causal mask, GQA 3:1; a sequence with no new token is skipped."""
    cases = CASES + [(9, 0)]
    q, cache, table, cu, lens, scale = paged_prefill_case(cases, page_size, 6, 2, 40, kv_dtype, q_dtype, seed=11)
    out = attention_sdpa.prefill(q, cache, table, cu, lens, scale)
    with backend("torch"):
        ref = paged_attention_prefill(q.float(), cache.float(), table, cu, lens, scale)
    assert out.dtype == q_dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, **tol(q_dtype))


def test_sdpa_prefill_only_on_a_gpu_within_its_copy_bound():
    q, cache, table, cu, lens, scale = paged_prefill_case(CASES, 16, 6, 2, 32, torch.float16, torch.float16, seed=12)
    assert not attention_sdpa.usable(q, cache, lens) or ON_GPU             # the CPU: our kernel / the reference
    if ON_GPU:     # 29 query tokens of 6 x 32 fp16: 8x their bytes holds 348 tokens of 2 KV heads' keys and values
        assert attention_sdpa.usable(q, cache, [348]) == attention_sdpa.flash_takes(q, 2)
        assert not attention_sdpa.usable(q, cache, [349])


# ---------------------------------------------------------------------------------------------------------------
# The GPU tier: bf16 and Qwen3.5-27B shapes (conv_dim 10240, width 4; attention 24 q / 4 KV heads of 256)
# ---------------------------------------------------------------------------------------------------------------
@gpu
@needs_gpu
def test_gpu_conv_prefill_qwen35_27b_shapes():
    C, K, bf = 10240, 4, torch.bfloat16
    lens, slots = [2, 1500, 2594], [9, 3, 12]
    g = gen_(20)
    weight = rnd(C, K, dtype=bf, gen=g)
    state = rnd(16, C, K - 1, dtype=bf, gen=g)
    x = rnd(sum(lens), C, dtype=bf, gen=g)
    ref_state = state.clone().float()
    with backend("torch"):
        ref = causal_conv1d_prefill(x.float(), weight.float(), ref_state, cumulative(lens), slots)
    tri_state = state.clone()
    with backend("triton"):
        tri = causal_conv1d_prefill(x, weight, tri_state, cumulative(lens), slots)
    close_to_fp32_reference(tri, ref)
    close_to_fp32_reference(tri_state, ref_state)
    untouched = [s for s in range(16) if s not in slots]
    assert torch.equal(tri_state[untouched], state[untouched])


@gpu
@needs_gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_paged_prefill_qwen35_27b_shapes(page_size, kv_dtype):
    # an 8K-token context + 2K new, a fresh prompt, a one-token extend; (31, 3) starts on a 32-key block edge
    cases = [(8192, 2048), (0, 300), (37, 1), (31, 3)]
    q, cache, table, cu, lens, scale = paged_prefill_case(cases, page_size, 24, 4, 256, kv_dtype, torch.bfloat16,
                                                          seed=page_size)
    with backend("triton"):
        tri = paged_attention_prefill(q, cache, table, cu, lens, scale)     # SDPA where flash takes it
        ours = attention_triton.paged_attention_prefill(q, cache, table, cu, lens, scale)
    with backend("torch"):
        ref = paged_attention_prefill(q.float(), cache.float(), table, cu, lens, scale)
    assert tri.dtype == ours.dtype == torch.bfloat16
    close_to_fp32_reference(tri, ref)
    close_to_fp32_reference(ours, ref)
