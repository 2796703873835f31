"""Paged decode / verify attention on the CPU (attention_cpu.c), reading the keys and values where they lie.

The torch reference (attention.paged_attention_decode) gathers every page of a sequence into one copy per step and
runs SDPA over it behind a mask: at 30K tokens of context that copy and the masked scores were most of a decode step.
The C kernel reads each page in place, the heads of a group sharing each key, and splits a long sequence over the
threads of torch's own OpenMP team. It is built once per machine and source (the C compiler torch.compile already
needs; ~0.3 s) into the cache folder, loaded with ctypes, and called through a torch custom op, so the compiled CPU
steps call it as they would any op. Without a compiler (or for a shape it does not take) the torch reference runs,
with one warning. The pool may hold float32, bfloat16 or float16; queries and outputs are float32 inside.

paged_decode(q, rows, page_table, seq_lens, table_rows, scale): q [N, H, hd]; rows: one layer's pool [pages, 2,
page_size, KV, hd] (any strides but a contiguous hd); page_table [R, width] int32; seq_lens [N] int32; table_rows [N]
int64 (None: row i reads page-table row i).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from tinyserve.kernels.c_build import c_compiler, cache_dir, cpu_id, run

log = logging.getLogger("tinyserve.kernels")
SOURCE = Path(__file__).with_name("attention_cpu.c")
# -ffast-math for the compile only (vectorised expf, reassociated sums): linked with it, gcc adds crtfastmath.o, which
# sets flush-to-zero for the whole process at load time
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC"]
LINK = ["-shared", "-fopenmp", "-lm"]
POOL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel, or None (no C compiler, or the build failed: logged once)."""
    compiler = c_compiler()
    if compiler is None:
        log.warning("no C compiler: CPU decode attention gathers the pages (the slower torch reference)")
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS + LINK).encode() + cpu_id().encode()).hexdigest()[:16]
    target = cache_dir() / f"attention_cpu-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built, obj = Path(tmp) / target.name, Path(tmp) / "attention_cpu.o"
                run([compiler, *FLAGS, "-c", str(SOURCE), "-o", str(obj)])
                run([compiler, str(obj), *LINK, "-o", str(built)])
                os.replace(built, target)             # atomic: another process may be building it too
        except OSError as e:
            log.warning("building %s with %s failed (%s): CPU decode attention gathers the pages (the slower "
                        "torch reference)", SOURCE.name, compiler, e)
            return None
    lib = ctypes.CDLL(str(target))
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


@torch.library.custom_op("tinyserve::paged_decode_cpu", mutates_args=())
def paged_decode(q: torch.Tensor, rows: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                 table_rows: torch.Tensor | None, scale: float) -> torch.Tensor:
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


@paged_decode.register_fake
def _(q, rows, page_table, seq_lens, table_rows, scale):
    return torch.empty_like(q)
