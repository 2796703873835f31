"""Shared set-up of the Triton kernel tests: import this module before any kernel module.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1); with CUDA they run compiled. Exposes
ON_GPU, DEV and the comparison helpers every Triton test file uses.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch

# Interpreted or compiled is decided when a @triton.jit function is defined, so TRITON_INTERPRET is set before any
# kernel module is imported. triton itself is usually imported already (transformers imports torch._dynamo, which
# imports triton when it is installed), and its own @jit helpers (tl.sum, tl.max, tl.cdiv, ...) were then built for
# compiling, which the interpreter cannot call: they are rebuilt as interpreted functions (triton internals; triton
# is pinned in the test extra). Kernel modules defined earlier in the other mode are defined again.
ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")


def _interpret_triton_language() -> None:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    made: dict[int, InterpretedFunction] = {}
    for name, mod in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            for attr, obj in list(vars(mod).items()):
                if isinstance(obj, JITFunction):
                    setattr(mod, attr, made.setdefault(id(obj), InterpretedFunction(obj.fn)))


def _round_fp8_like_the_gpu() -> None:
    """The interpreter rounds fp32 -> fp8e4nv wrongly for ~2.5% of values (a mantissa carry into the exponent is
    dropped): route that one conversion through torch, which rounds to nearest
    even as the GPU does. Kernels clamp to +-448 before converting, so saturation never matters."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    original = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):
        if dst == tl.float8e4nv and src in (tl.float32, tl.float16):
            values = torch.from_numpy(np.frombuffer(data.tobytes(), dtype=np.float32 if src == tl.float32
                                                    else np.float16).reshape(data.shape).copy())
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(data, src, dst, rounding_mode)
    interpreter._convert_float = convert


@contextlib.contextmanager
def bf16_like_the_gpu() -> Iterator[None]:
    """While the block runs, the interpreter computes bf16 as the GPU does (a no-op compiled): a conversion to bf16
    rounds to nearest even (the interpreter truncates), a tl.dot of bf16 operands multiplies their values exactly
    and sums in fp32, and a bf16 add, subtract or multiply rounds the fp32 result once to bf16 (the interpreter acts
    on the raw 16-bit patterns for both: errors of 1e10). Opt-in, for the test files that run kernels on bf16
    tensors (tests/test_triton_w4.py); it patches triton internals, as the fp8 shim above does (triton is pinned)."""
    if ON_GPU:
        yield
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    convert, dot, binary = interpreter._convert_float, builder.create_dot, builder.binary_op

    def as_f32(h):                                              # a bf16 TensorHandle's values, as float32
        return (h.data.astype(np.uint32) << 16).view(np.float32)

    def to_bf16(values):                                        # float32 -> bf16 bits, nearest even (torch)
        f32 = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    def convert_bf16(data, src, dst, rounding_mode):
        if dst == tl.bfloat16 and src in (tl.float32, tl.float16):
            return to_bf16(data.astype(np.float32))
        return convert(data, src, dst, rounding_mode)

    def dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 in (a.dtype.scalar, b.dtype.scalar):
            a = interpreter.TensorHandle(as_f32(a) if a.dtype.scalar == tl.bfloat16 else a.data, tl.float32)
            b = interpreter.TensorHandle(as_f32(b) if b.dtype.scalar == tl.bfloat16 else b.data, tl.float32)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def binary_bf16(self, lhs, rhs, op):
        if lhs.dtype.scalar == tl.bfloat16 and op in (np.add, np.subtract, np.multiply, np.divide):
            return interpreter.TensorHandle(to_bf16(op(as_f32(lhs), as_f32(rhs))), tl.bfloat16)
        return binary(self, lhs, rhs, op)
    interpreter._convert_float, builder.create_dot, builder.binary_op = convert_bf16, dot_bf16, binary_bf16
    try:
        yield
    finally:
        interpreter._convert_float, builder.create_dot, builder.binary_op = convert, dot, binary


if not ON_GPU:
    _interpret_triton_language()
    _round_fp8_like_the_gpu()
# Kernel modules defined earlier in the other mode are defined again, twice over: a module that imports another's
# @triton.jit helper (moe_triton imports fp8_triton's) then holds the new one whatever the order of the first pass.
for _ in range(2):
    for _name in [n for n in sys.modules if n.startswith("tinyserve.kernels.") and n.endswith("_triton")]:
        importlib.reload(sys.modules[_name])


import tinyserve.kernels as kernels  # noqa: E402

DEV = "cuda" if ON_GPU else "cpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA device")


backend = kernels.backend_set_to


def both(fn, *args, clone=()):
    """fn's result under the Triton kernel and under the torch reference, each on its own copies of the args at
    the positions in `clone` (state pools updated in place). Returns (triton_out, torch_out, tri_args, ref_args)."""
    tri_args = [a.clone() if i in clone else a for i, a in enumerate(args)]
    ref_args = [a.clone() if i in clone else a for i, a in enumerate(args)]
    with backend("triton"):
        tri = fn(*tri_args)
    with backend("torch"):
        ref = fn(*ref_args)
    return tri, ref, tri_args, ref_args


def rnd(*shape, dtype=torch.float32, gen=None, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def gen_(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tol(dtype):
    return {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}[dtype]


def fp8_dot_tol(dtype, act_quant: bool) -> dict:
    """tol(dtype), but for an FP8 x FP8 dot (w8a8) compiled on a GPU at least 1e-3 of the output's scale: Hopper's FP8
    tensor-core dot keeps only ~14 bits of its sum inside an instruction (DeepSeek-V3 report, section 3.3.2; the
    kernels add each 128-wide group's dot into an fp32 accumulator). Measured on an H200 with fp32 activations:
    2.7e-4 of the scale where tiles of 64 rows and more take wgmma; fp32's own tolerance is 2e-5."""
    t = tol(dtype)
    if act_quant and ON_GPU:
        t = {key: max(val, 1e-3) for key, val in t.items()}
    return t


def paged_kv(lengths: list[int], page_size: int, NKV: int, HD: int, kv_dtype, gen, spare_pages: int):
    """A KV pool (one layer's view of a two-layer pool) holding each sequence's context of lengths[i] random
    tokens on scattered pages, with spare_pages pages no sequence uses. Returns (cache, pages per sequence,
    number of pages)."""
    from tinyserve.kernels.attention import store_kv
    n_pages = [-(-L // page_size) for L in lengths]
    num_pages = sum(n_pages) + spare_pages
    perm = torch.randperm(num_pages, generator=gen).tolist()
    pages = []
    for n in n_pages:
        pages.append(perm[:n])
        perm = perm[n:]
    pool = torch.zeros(num_pages, 2, 2, page_size, NKV, HD, dtype=kv_dtype, device=DEV)
    cache = pool[:, 1]
    for p, L in zip(pages, lengths):
        slots = torch.tensor([p[i // page_size] * page_size + i % page_size for i in range(L)], device=DEV)
        store_kv(rnd(L, NKV, HD, gen=gen), rnd(L, NKV, HD, gen=gen), cache, slots)
    return cache, pages, num_pages

