"""The CPU decode / verify attention kernel (kernels/attention_cpu.c) against its oracle, the torch reference
(kernels.attention.paged_attention_decode on the "torch" backend): every pool dtype the CPU serves, page sizes 1 / 16
/ 64, grouped and plain heads, scattered pages, verify rows, a long sequence split over threads, padding rows of
length 0, the op in C++ and in Python, and the fallbacks when no C++ or no C compiler is there."""
from __future__ import annotations

import pytest
import torch

from tinyserve.kernels import attention_cpu, backend_set_to
from tinyserve.kernels.attention import paged_attention_decode

pytestmark = pytest.mark.skipif(attention_cpu.library() is None, reason="no C compiler to build the kernel")


def pool_and_table(lens: list[int], ps: int, KV: int, hd: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-L // ps) for L in lens)
    n_pages = sum(-(-L // ps) for L in lens) + 3
    pool = torch.randn(n_pages, 2, ps, KV, hd, generator=gen).to(dtype)
    order = torch.randperm(n_pages, generator=gen).tolist()
    table, k = [], 0
    for L in lens:
        used = -(-L // ps)
        table.append(order[k:k + used] + [0] * (width - used))
        k += used
    return pool, torch.tensor(table, dtype=torch.int32)


def both(q, pool, table, lens, max_len, rows=None):
    scale = q.shape[-1] ** -0.5
    out = paged_attention_decode(q, pool, table, lens, max_len, scale, rows)
    with backend_set_to("torch"):
        ref = paged_attention_decode(q, pool, table, lens, max_len, scale, rows)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ps", [1, 16, 64])
@pytest.mark.parametrize("H, KV, hd", [(8, 2, 64), (4, 4, 32), (16, 4, 128), (6, 2, 96)])   # 96: a block and a tail
def test_decode_and_verify_match_the_reference(dtype, ps, H, KV, hd):
    lens = [1, 37, 300]
    pool, table = pool_and_table(lens, ps, KV, hd, dtype, seed=ps * H)
    q = torch.randn(len(lens), H, hd, generator=torch.Generator().manual_seed(1))
    out, ref = both(q, pool, table, torch.tensor(lens, dtype=torch.int32), max(lens))
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)
    # a speculative verify: three rows of the last sequence at its last three positions (each sees up to itself)
    rows, vlens = torch.tensor([2, 2, 2]), torch.tensor([298, 299, 300], dtype=torch.int32)
    out, ref = both(q, pool, table, vlens, 300, rows)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_layer_of_the_page_major_pool(dtype):
    """The engine's pool holds every attention layer in each page ([pages, layers, 2, ps, KV, hd]): a layer is a
    strided view, read in place."""
    lens = [50, 700]
    pool, table = pool_and_table(lens, 16, 2, 64, dtype, seed=11)
    layered = torch.stack([torch.randn_like(pool.float()).to(dtype), pool, torch.randn_like(pool.float()).to(dtype)],
                          dim=1)                           # [pages, 3 layers, 2, ps, KV, hd]
    view = layered[:, 1]
    assert not view.is_contiguous()
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(3))
    out, ref = both(q, view, table, torch.tensor(lens, dtype=torch.int32), 700)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def test_one_long_sequence_split_over_threads():
    """Fewer (row, kv head) items than threads: each item's keys are split and the parts joined by their maxima."""
    pool, table = pool_and_table([5000], 16, 2, 64, torch.float32, seed=7)
    q = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    torch.set_num_threads(5)
    try:
        out, ref = both(q, pool, table, torch.tensor([5000], dtype=torch.int32), 5000)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-5)


def test_a_row_of_length_zero_gives_zeros():
    """A padding row (the static steps' scratch rows) reads nothing and writes zeros, never NaN."""
    pool, table = pool_and_table([16, 16], 16, 2, 32, torch.float32, seed=3)
    q = torch.randn(2, 4, 32)
    out = paged_attention_decode(q, pool, table, torch.tensor([16, 0], dtype=torch.int32), 16, 0.2)
    assert torch.isfinite(out).all() and (out[1] == 0).all()


def test_inside_a_compiled_function():
    pool, table = pool_and_table([40, 77], 16, 2, 32, torch.float32, seed=4)
    q = torch.randn(2, 4, 32)
    lens = torch.tensor([40, 77], dtype=torch.int32)
    compiled = torch.compile(lambda q: paged_attention_decode(q, pool, table, lens, 77, 0.2), dynamic=True)
    with backend_set_to("torch"):
        ref = paged_attention_decode(q, pool, table, lens, 77, 0.2)
    torch.testing.assert_close(compiled(q), ref, atol=2e-6, rtol=2e-5)


def test_without_a_compiler_the_reference_runs(monkeypatch, tmp_path):
    pool, table = pool_and_table([40], 16, 2, 32, torch.float32, seed=5)
    q = torch.randn(1, 4, 32)
    lens = torch.tensor([40], dtype=torch.int32)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))          # nothing built there yet
    attention_cpu.library.cache_clear()
    try:
        assert attention_cpu.library() is None
        out = paged_attention_decode(q, pool, table, lens, 40, 0.2)
    finally:
        monkeypatch.undo()
        attention_cpu.library.cache_clear()
    with backend_set_to("torch"):
        torch.testing.assert_close(out, paged_attention_decode(q, pool, table, lens, 40, 0.2))


def test_the_python_op_is_the_cpp_op():
    """paged_decode_cpu (C++) and paged_decode_cpu_python (its fallback) call the same kernel: the same bits."""
    assert attention_cpu.op_in_cpp(), "the library was built without its C++ op (is a C++ compiler there?)"
    pool, table = pool_and_table([3, 90, 200], 16, 2, 64, torch.bfloat16, seed=6)
    q = torch.randn(3, 8, 64).bfloat16()
    lens, rows = torch.tensor([3, 90, 200], dtype=torch.int32), torch.tensor([0, 1, 2])
    for table_rows in (None, rows):
        args = (q, pool, table, lens, table_rows, 0.125)
        assert torch.equal(torch.ops.tinyserve.paged_decode_cpu(*args),
                           torch.ops.tinyserve.paged_decode_cpu_python(*args))


def test_without_a_cpp_compiler_the_python_op_runs(monkeypatch, tmp_path):
    pool, table = pool_and_table([40, 100], 16, 2, 32, torch.float32, seed=8)
    q = torch.randn(2, 4, 32)
    lens = torch.tensor([40, 100], dtype=torch.int32)
    monkeypatch.setenv("CXX", "/nonexistent/c++")               # the C++ half's compiler: not there
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))          # nothing built there yet
    attention_cpu.library.cache_clear()
    try:
        assert attention_cpu.library() is not None and not attention_cpu.op_in_cpp()
        out = paged_attention_decode(q, pool, table, lens, 100, 0.2)
    finally:
        monkeypatch.undo()
        attention_cpu.library.cache_clear()
    with backend_set_to("torch"):
        torch.testing.assert_close(out, paged_attention_decode(q, pool, table, lens, 100, 0.2),
                                   atol=2e-6, rtol=2e-5)
