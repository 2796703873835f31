"""One decode token of the gated delta rule on the CPU (gdn_cpu.c): each head's state read once and written once.

Built once per machine, source and torch into the cache folder with its torch op (`tinyserve::gdn_decode_cpu`, the
same file compiled as C++ against torch's headers), so eager and compiled steps call the same kernel: a decode and a
NEXTN verify give the same numbers either way. Without a C++ compiler (or for a shape or state dtype it does not
take) kernels/gdn.py's torch reference runs instead, with one warning.

decode(q, k, v, g, beta, states, rows) -> (o [N, HV, dv] in v's dtype, next [N, HV, dk, dv] float32): sequence n's
state is states[rows[n]] ([rows, HV, dk, dv] float32, each row's heads contiguous); next holds the states after the
token, for the caller to write where they go (PoolLayer.put: a compiled step writes the pool in place).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from tinyserve.kernels.c_build import build_library

log = logging.getLogger("tinyserve.kernels")
SOURCE = Path(__file__).with_name("gdn_cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC"]        # no -ffast-math: the sums in the order written
LINK = ["-shared", "-fopenmp", "-lm"]
MAX_DV = 256                                                   # gdn_cpu.c's


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernel with its op; None (no compiler, or the build failed: logged once)."""
    try:
        target = build_library("gdn_cpu", SOURCE, FLAGS, LINK, "GDN_TORCH_OP")
        lib = ctypes.CDLL(str(target))                         # with the op: its registration runs here
    except OSError as e:
        log.warning("building %s failed (%s): the CPU's GDN decode runs the torch reference", SOURCE.name, e)
        return None
    if not hasattr(lib, "gdn_torch_op"):
        log.warning("%s built without its torch op (no C++ compiler or torch headers): the CPU's GDN decode runs "
                    "the torch reference", SOURCE.name)
        return None
    return lib


@torch.compiler.assume_constant_result         # a compiled step asks once, while it is traced
def built() -> bool:
    return library() is not None


def usable(v: torch.Tensor, states: torch.Tensor) -> bool:
    """Can the kernel take this call? (the CPU, a float32 state pool whose rows' heads are contiguous, a built
    library)."""
    return (v.device.type == "cpu" and states.dtype == torch.float32 and v.shape[-1] <= MAX_DV
            and states.stride(3) == 1 and states.stride(2) == states.shape[3]
            and states.stride(1) == states.shape[2] * states.shape[3] and built())


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           states: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel through its op (call when `usable(v, states)`); see the module docstring."""
    return torch.ops.tinyserve.gdn_decode_cpu(q, k, v, g, beta, states, rows)


# The op's schema and shapes for torch.compile; its CPU kernel is registered by the C++ half of gdn_cpu.c when the
# library loads. A library op rather than torch.library.custom_op: its wrappers cost a few us a call more.
_lib = torch.library.Library("tinyserve", "FRAGMENT")
_lib.define("gdn_decode_cpu(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor states, Tensor rows) "
            "-> (Tensor, Tensor)")


@torch.library.register_fake("tinyserve::gdn_decode_cpu", lib=_lib)
def _(q, k, v, g, beta, states, rows):
    N, HV, dv = v.shape
    return v.new_empty(N, HV, dv), states.new_empty(N, HV, q.shape[-1], dv)
