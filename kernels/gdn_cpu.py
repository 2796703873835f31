"""One decode token of the gated delta rule on the CPU (gdn_cpu.c): each head's state read once and written once.

Built once per machine, source and torch into the cache folder with its torch op (`tinyserve::gdn_decode_cpu`, the
same file compiled as C++ against torch's headers), so eager and compiled steps call the same kernel: a decode and a
NEXTN verify give the same numbers either way. Without a C++ compiler, kernels/gdn.py's torch reference runs
instead (a warning at start); so it does for what the kernel does not take: a state pool not float32 (on the CPU
it always is), heads of more than MAX_DV values.

decode(q, k, v, g, beta, pool, in_rows, out_rows) -> o [N, HV, dv] in v's dtype: sequence n's state is read from
row in_rows[n] of `pool` (a PoolLayer of float32 states [rows, layers, HV, dk, dv]) and the state after the token
written to row out_rows[n], in place (the op's schema says it writes the pool: a compiled step calls it on the pool
itself, which inductor neither copies nor reorders). A decode reads and writes the same row; a verify's token writes
its own slot (no sequence's out row is another's in row: the kernel runs them at once).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from tinyserve.kernels import PoolLayer
from tinyserve.kernels.c_build import build_library

log = logging.getLogger("tinyserve.kernels")
SOURCE = Path(__file__).with_name("gdn_cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC"]        # no -ffast-math: the sums in the order written
LINK = ["-shared", "-fopenmp", "-lm"]
MAX_DV = 256                                                   # gdn_cpu.c's


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel with its op; None (no compiler, or the build failed: logged once)."""
    fallback = "the CPU's GDN decode runs the torch reference"
    try:
        target = build_library("gdn_cpu", SOURCE, FLAGS, LINK, "GDN_TORCH_OP", without_op=fallback)
        lib = ctypes.CDLL(str(target))                         # with the op: its registration runs here
    except OSError as e:
        log.warning("building %s failed (%s): %s", SOURCE.name, e, fallback)
        return None
    if not hasattr(lib, "gdn_torch_op"):                       # built earlier without its op: no op to call
        log.warning("%s was built without its torch op (no C++ compiler or torch headers): %s", SOURCE.name,
                    fallback)
        return None
    return lib


@torch.compiler.assume_constant_result         # a compiled step asks once, while it is traced
def built() -> bool:
    return library() is not None


def usable(v: torch.Tensor, pool: PoolLayer) -> bool:
    """Can the kernel take this call? (the CPU, a float32 state pool whose rows' heads are contiguous, a built
    library)."""
    p = pool.pool
    return (v.device.type == "cpu" and p.dtype == torch.float32 and p.dim() == 5 and v.shape[-1] <= MAX_DV
            and p.stride(4) == 1 and p.stride(3) == p.shape[4] and p.stride(2) == p.shape[3] * p.shape[4]
            and built())


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, pool: PoolLayer,
           in_rows: torch.Tensor, out_rows: torch.Tensor) -> torch.Tensor:
    """The kernel through its op (call when `usable(v, pool)`); see the module docstring."""
    return torch.ops.tinyserve.gdn_decode_cpu(pool.pool, pool.layer, q, k, v, g, beta, in_rows, out_rows)


# The op's schema and shape for torch.compile; its CPU kernel is registered by the C++ half of gdn_cpu.c when the
# library loads. A library op rather than torch.library.custom_op: its wrappers cost a few us a call more.
_lib = torch.library.Library("tinyserve", "FRAGMENT")
_lib.define("gdn_decode_cpu(Tensor(a!) pool, int layer, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, "
            "Tensor in_rows, Tensor out_rows) -> Tensor")


@torch.library.register_fake("tinyserve::gdn_decode_cpu", lib=_lib)
def _(pool, layer, q, k, v, g, beta, in_rows, out_rows):
    return torch.empty_like(v)
