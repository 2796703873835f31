"""Paged decode / verify attention on the CPU (attention_cpu.c), reading the keys and values where they lie.

The torch reference (attention.paged_attention_decode) gathers every page of a sequence into one copy per step and
runs SDPA over it behind a mask: at 30K tokens of context that copy and the masked scores were most of a decode step.
The C kernel reads each page in place, the heads of a group sharing each key, and splits a long sequence over the
threads of torch's own OpenMP team. It is built once per machine, source and torch (the C compiler torch.compile
already needs) into the cache folder with its torch op (`tinyserve::paged_decode_cpu`, the same file compiled as C++
against torch's headers: ~8 s of the build, the kernel ~0.3 s), so the compiled CPU steps call it as they would any
op: one sequence of the bench model's shapes, 19-22 us a call, against 13-19 us for the kernel called through ctypes.
Without a C++ compiler the same op runs in Python around a ctypes call (`paged_decode_cpu_python`: 37-42 us, one
warning); without a C compiler (or for a shape it does not take) the torch reference runs, with one
warning. The pool may hold float32, bfloat16 or float16; queries and outputs are float32 inside.

paged_decode(q, rows, page_table, seq_lens, table_rows, scale): q [N, H, hd]; rows: one layer's pool [pages, 2,
page_size, KV, hd] (any strides but a contiguous hd); page_table [R, width] int32; seq_lens [N] int32; table_rows [N]
int64 (None: row i reads page-table row i).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from tinyserve.kernels.c_build import build_library

log = logging.getLogger("tinyserve.kernels")
SOURCE = Path(__file__).with_name("attention_cpu.c")
# -ffast-math for the compile only (vectorised expf, reassociated sums): linked with it, gcc adds crtfastmath.o, which
# sets flush-to-zero for the whole process at load time
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC"]
LINK = ["-shared", "-fopenmp", "-lm"]
POOL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel and, where a C++ compiler and torch's headers are there, its op; None (no C compiler, or the
    build failed: logged once)."""
    try:
        target = build_library("attention_cpu", SOURCE, FLAGS, LINK, "ATTN_TORCH_OP")
    except OSError as e:
        log.warning("building %s failed (%s): CPU decode attention gathers the pages (the slower torch reference)",
                    SOURCE.name, e)
        return None
    lib = ctypes.CDLL(str(target))                    # with the op: its registration runs here
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.paged_decode.argtypes = [p, p, p, i32, i64, i64, i64, i64, p, i64, p, p, i32, i32, i32, i32, i32,
                                 ctypes.c_float]
    lib.paged_decode.restype = i32
    return lib


@torch.compiler.assume_constant_result         # a compiled step asks once, while it is traced
def built() -> bool:
    return library() is not None


def usable(q: torch.Tensor, rows: torch.Tensor) -> bool:
    """Can the kernel take this call? (the CPU, a pool dtype it reads, and a built library)."""
    return q.device.type == "cpu" and rows.dtype in POOL_DTYPES and built()


@torch.compiler.assume_constant_result
def op_in_cpp() -> bool:
    """Whether the library registered tinyserve::paged_decode_cpu (C++); else the Python op runs."""
    return library() is not None and hasattr(library(), "attention_torch_op")


def paged_decode(q: torch.Tensor, rows: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                 table_rows: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The kernel through its op (call when `usable(q, rows)`): [N, H, hd] in q's dtype."""
    if op_in_cpp():
        return torch.ops.tinyserve.paged_decode_cpu(q, rows, page_table, seq_lens, table_rows, scale)
    return torch.ops.tinyserve.paged_decode_cpu_python(q, rows, page_table, seq_lens, table_rows, scale)


def _paged_decode_python(q: torch.Tensor, rows: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                         table_rows: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The op in Python (without a C++ compiler): what attention_cpu.c's C++ half does."""
    qf = q.float().contiguous()
    out = torch.empty_like(qf)
    table = page_table.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    which = table_rows.to(torch.int64).contiguous() if table_rows is not None else None
    N, H, hd = q.shape
    sp, sk, st, sh, sd = rows.stride()
    assert sd == 1, "the pool's head_dim must be contiguous"
    code = library().paged_decode(qf.data_ptr(), out.data_ptr(), rows.data_ptr(), POOL_DTYPES[rows.dtype], sp, sk,
                                  st, sh, table.data_ptr(), table.stride(0),
                                  which.data_ptr() if which is not None else None, lens.data_ptr(), N, H,
                                  rows.shape[3], hd, rows.shape[2], float(scale))
    if code:
        raise ValueError(f"attention_cpu.c refused the call (code {code}): H {H}, KV {rows.shape[3]}, hd {hd}, "
                         f"page size {rows.shape[2]}")
    return out.to(q.dtype)


# The ops (with their shapes for torch.compile): paged_decode_cpu, implemented by the C++ half of attention_cpu.c
# when its library loads, and paged_decode_cpu_python, the same in Python. Library ops rather than
# torch.library.custom_op: its wrappers cost ~3 us a call more (kernels/linear.py).
SCHEMA = "(Tensor q, Tensor rows, Tensor page_table, Tensor seq_lens, Tensor? table_rows, float scale) -> Tensor"
_lib = torch.library.Library("tinyserve", "FRAGMENT")
for _name, _impl in (("paged_decode_cpu", None), ("paged_decode_cpu_python", _paged_decode_python)):
    _lib.define(_name + SCHEMA)
    if _impl is not None:
        _lib.impl(_name, _impl, "CPU")

    @torch.library.register_fake(f"tinyserve::{_name}", lib=_lib)
    def _(q, rows, page_table, seq_lens, table_rows, scale):
        return torch.empty_like(q)
