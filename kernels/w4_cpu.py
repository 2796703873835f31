"""y = x W^T on the CPU for 4-bit weights kept packed (kernels/w4_weight.py), activations float32 or bfloat16
(w4_cpu.c): the codes are read in place and dequantized in registers, the products summed in float32. No activation
is quantized: the result is the dequantized checkpoint's product up to the order of the sums (the torch reference,
kernels/w4.py's w4_linear_reference, is the oracle: tests/test_w4_cpu.py). With model.int8_activations (int4
weights: W4Weight.int8_activations) each row of x is rounded to int8 per group first (w4_weight.int8_rounded) and
the codes are multiplied by those integers (w4_cpu.c's block_q8), as llama.cpp's Q4_0 multiplies Q8_0 activations.
With bfloat16 activations on a CPU that has bfloat16 dot products (AVX512_BF16), the weights are made as bfloat16,
as the reference rounds them, and multiplied by those (each product exact in float32, twice the float32 path's per
instruction): a batch of decodes is bound by the kernel's arithmetic, which this halves.

Built once per machine and source into the cache folder: the kernel with the C compiler torch.compile already
needs (-march=native: AVX-512, AVX2 + FMA or portable C), and the torch op around it (`tinyserve::w4_linear_cpu`)
from the same file compiled as C++ against torch's headers, so that a call from a compiled graph costs ~2 us more
than the kernel rather than ~10 us through a Python op and ctypes (58 calls a decode step of the bench model). No
C++ compiler or headers: the same op in Python (`w4_linear_cpu_python`), one warning. No C compiler: `usable` is
False and kernels/w4.py runs the reference, one warning. The loader interleaves each weight's blocks of rows in
place (`block_weights`: W4Weight.block_rows), so that the kernel reads a block as one stream; nothing else is
prepared per weight (a row block's scales and zeros are converted to float32 in L1), so it costs no memory.

Up to GEMM_ROWS rows of x (a decode step's batch, a NEXTN verify) go through the GEMM kernel, which reads W once per
call; more (a prefill) dequantize W a block of rows at a time into a float scratch multiplied by oneDNN's GEMM
(`prefill`), which computes faster at that size. The kernel against the float32 GEMMs on the memory-bound bench
model's shapes: bench/w4_gemm.py; its figures in docs/benchmarks.md.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from tinyserve.kernels import ONEDNN_DTYPES, ONEDNN_LINEAR
from tinyserve.kernels.c_build import build_library, cpu_info
from tinyserve.kernels.w4_weight import W4Weight, int8_rounded

log = logging.getLogger("tinyserve.kernels")
SOURCE = Path(__file__).with_name("w4_cpu.c")
# -ffast-math left out on purpose: the sums stay in the order the C code writes them
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC")
LINK = ("-shared", "-fopenmp", "-lm")          # -lm: nearbyintf where the CPU has no rounding instruction
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}      # w4_cpu.c's F32, BF16, F16
KIND_CODES = {"int4": 0, "fp4": 1}
PREFILL_SCRATCH = 4 << 20   # bytes of W dequantized at a time for a prefill (stays in L2 / L3 for the GEMM)
ERRORS = {1: "a shape it does not take", 2: "a dtype or kind it does not take", 3: "out of memory",
          4: "rows out of range"}


# Rows of x up to which the GEMM kernel runs; more: dequantized blocks and oneDNN's GEMM (`prefill`). Measured on a
# 2-core Zen 4 (bench/w4_gemm.py's shapes): float32, the kernel was faster up to 128 rows and within 5% at 256;
# bfloat16, oneDNN's GEMM runs on the CPU's bfloat16 dot products (AVX512_BF16, AMX) at twice the float32 rate and
# was faster than the kernel's float32 products from 32 rows (1.3x; 2x from 64); the kernel's own bfloat16 dot
# products (groups of 64 and 128) kept it ahead up to 32 rows (at 48 oneDNN won on gate_up, 1.3x, and lost on down).
# Without those instructions bfloat16 takes the kernel up to 128 rows. On an AVX2-only CPU (2-core AMD EPYC 7001):
# float32, the kernel was faster up to 40 rows (1.06x), even at 48, and the dequantized blocks faster from 56 (1.06x;
# 1.39x at 128); bfloat16 (no fast bfloat16 GEMM there), the kernel 1.2-1.4x faster from 16 to 128 rows.
_FLAGS = set().union(*(line.split() for line in cpu_info() if line.startswith("flags")))
_BF16_DOTS = bool({"avx512_bf16", "amx_bf16"} & _FLAGS)
GEMM_ROWS = {torch.float32: 128 if "avx512f" in _FLAGS else 48, torch.bfloat16: 16 if _BF16_DOTS else 128}
KERNEL_DOTS_ROWS = 32       # bfloat16 x through the kernel's own dot products (w4_cpu.c's block_bf)
# int8 activations (w4_cpu.c's block_q8, AVX2): on the 2-core AMD EPYC 7001 the kernel was faster than the dequantized
# blocks (x rounded in float32, oneDNN's float32 GEMM) 1.83x at 32 rows, 1.23x at 96, 1.05x at 192, even at 256,
# 0.93x at 512 (bench/w4_gemm.py's three shapes, group 128). Unmeasured on AVX-512 CPUs, which run the same code.
INT8_GEMM_ROWS = 192


def gemm_rows(x: torch.Tensor, w: W4Weight) -> int:
    """Rows of x up to which this call goes through the GEMM kernel."""
    if w.int8_activations:
        return INT8_GEMM_ROWS
    if x.dtype == torch.bfloat16 and w.group % 64 == 0 and kernel_dots():
        return KERNEL_DOTS_ROWS
    return GEMM_ROWS.get(x.dtype, GEMM_ROWS[torch.float32])


@functools.cache
def build(flags: tuple[str, ...] = FLAGS, with_op: bool = True) -> ctypes.CDLL | None:
    """w4_cpu.c compiled with these flags (the tests add -mno-avx512f etc. to check the other paths on this CPU) and
    loaded; with_op: with the torch op (only the library the engine uses: an op is registered once per process).
    None (logged once) when there is no C compiler or the build fails."""
    try:
        target = build_library("w4_cpu", SOURCE, flags, LINK, "W4_TORCH_OP" if with_op else None)
    except OSError as e:
        log.warning("building %s failed (%s): 4-bit weights are dequantized block by block (the slower torch "
                    "reference)", SOURCE.name, e)
        return None
    lib = ctypes.CDLL(str(target))                    # with the op: its registration runs here
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.w4_gemm.argtypes = [p, i32, i64, p, i64, i32, p, i64, p, i32, i64, p, i64, p, i32, i32, i32, i32, i32, f32,
                            i32, i32]
    lib.w4_gemm.restype = i32
    lib.w4_dequant.argtypes = [p, i64, p, i32, i64, p, i64, i32, i32, i32, i32, i32, f32, i32, i32, p, i32, i32]
    lib.w4_dequant.restype = i32
    lib.w4_path.restype = i32
    lib.w4_bf16_dots.restype = i32
    return lib


def library() -> ctypes.CDLL | None:
    return build(FLAGS)


@torch.compiler.assume_constant_result         # a compiled step asks once, while it is traced
def built() -> bool:
    return library() is not None


@torch.compiler.assume_constant_result
def op_in_cpp() -> bool:
    """Whether the library registered tinyserve::w4_linear_cpu (C++); else the Python op runs."""
    return library() is not None and hasattr(library(), "w4_torch_op")


@torch.compiler.assume_constant_result
def kernel_dots() -> bool:
    """Whether the library has the bfloat16 dot products (w4_cpu.c's block_bf)."""
    return library() is not None and bool(library().w4_bf16_dots())


def usable(x: torch.Tensor, w: W4Weight) -> bool:
    """Can the kernel take this call? (the CPU, a float x, one 2-D weight (an expert's view is one) whose rows are
    contiguous, and adjacent when blocked, a built library)."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and w.codes.dim() == 2 and w.kind in KIND_CODES
            and not (w.int8_activations and w.kind != "int4")
            and x.shape[-1] == w.in_features and w.codes.stride(1) == 1 and w.scales.stride(1) == 1
            and (not w.blocked or w.codes.is_contiguous())
            and (w.zeros is None or w.zeros.stride(1) == 1) and (w.perm is None or w.perm.stride(0) == 1)
            and built())


def block_weights(module: torch.nn.Module) -> int:
    """Every W4Weight of module in the layout the kernel reads best (W4Weight.block_rows: each block of rows one
    stream), where the library is built (the reference reads either layout); how many were blocked."""
    if not built():
        return 0
    return sum(w.block_rows() for w in module.modules() if isinstance(w, W4Weight))


def w4_linear(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype (call when `usable(x, w)`)."""
    # int4's global scale is 1: a constant, not a float a compiled graph would take as an input (and .item())
    args = (x, w.codes, w.scales, w.zeros, w.perm, w.group, KIND_CODES[w.kind], w.zero_point,
            w.global_scale if w.kind == "fp4" else 1.0, w.blocked, gemm_rows(x, w), w.int8_activations)
    if op_in_cpp():
        return torch.ops.tinyserve.w4_linear_cpu(*args)
    return torch.ops.tinyserve.w4_linear_cpu_python(*args)


def _raise(code: int, what: str, x: torch.Tensor, codes: torch.Tensor, group: int) -> None:
    raise ValueError(f"w4_cpu.c refused the {what} (code {code}: {ERRORS.get(code, '?')}): x {tuple(x.shape)} "
                     f"{x.dtype}, W [{codes.shape[0]}, {codes.shape[1] * 2}], group {group}")


def gemm(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
         perm: torch.Tensor | None, group: int, kind: int, zero_point: int, global_scale: float,
         blocked: bool, int8_x: bool = False) -> torch.Tensor:
    """The GEMM kernel of `lib` on x [M, K] (float32 or bfloat16, rows of contiguous columns): y [M, N] in x's
    dtype, whatever M. blocked: the codes' blocks of rows interleaved (W4Weight.block_rows); int8_x: x rounded to
    int8 per group (int4 weights; w4_weight.int8_rounded), the products summed in integers."""
    M, K = x.shape
    N = codes.shape[0]
    y = x.new_empty((M, N))
    code = lib.w4_gemm(x.data_ptr(), DTYPES[x.dtype], x.stride(0), y.data_ptr(), N, M, codes.data_ptr(),
                       codes.stride(0), scales.data_ptr(), DTYPES[scales.dtype], scales.stride(0),
                       None if zeros is None else zeros.data_ptr(), 0 if zeros is None else zeros.stride(0),
                       None if perm is None else perm.data_ptr(), N, K, group, kind, zero_point, global_scale,
                       blocked, int8_x)
    if code:
        _raise(code, "GEMM", x, codes, group)
    return y


def dequantize(lib: ctypes.CDLL, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
               kind: int, zero_point: int, global_scale: float, r0: int, r1: int, dtype: torch.dtype, blocked: bool,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows r0 .. r1-1 of W in dtype (float32 or bfloat16), columns in the weight's own (act-order sorted) order:
    each value (q - z) * s or (E2M1[q] * s) * global_scale in float32, rounded once, as W4Weight.dequantize."""
    N, K = codes.shape[0], codes.shape[1] * 2
    out = torch.empty((r1 - r0, K), dtype=dtype) if out is None else out[: r1 - r0]
    code = lib.w4_dequant(codes.data_ptr(), codes.stride(0), scales.data_ptr(), DTYPES[scales.dtype],
                          scales.stride(0), None if zeros is None else zeros.data_ptr(),
                          0 if zeros is None else zeros.stride(0), N, K, group, kind, zero_point, global_scale,
                          r0, r1, out.data_ptr(), DTYPES[dtype], blocked)
    if code:
        _raise(code, "dequantization", out, codes, group)
    return out


def _float_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The float GEMM a prefill's dequantized block goes through: oneDNN where torch has it (kernels/linear.py
    measured it 2-3x faster than MKL on AMD EPYC for 8..2000 rows) where it takes x's dtype, else F.linear."""
    if ONEDNN_LINEAR is not None and x.dtype in ONEDNN_DTYPES:
        return ONEDNN_LINEAR(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def prefill(lib: ctypes.CDLL, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None, perm: torch.Tensor | None, group: int, kind: int, zero_point: int,
            global_scale: float, blocked: bool, int8_x: bool = False) -> torch.Tensor:
    """Many rows of x [M, K]: W dequantized PREFILL_SCRATCH bytes of rows at a time (in x's dtype, as the reference
    rounds it), each block multiplied by the float GEMM; x's columns gathered once under act-order (int8_x: then
    rounded to int8 per group, in float32, what the kernel's integers multiply)."""
    N = codes.shape[0]
    xs = x.index_select(1, perm) if perm is not None else x
    if int8_x:
        xs = int8_rounded(xs, group)
    M, K = xs.shape
    rows = max(16, min(N, PREFILL_SCRATCH // (K * xs.element_size())))
    if rows >= N:
        return _float_gemm(xs, dequantize(lib, codes, scales, zeros, group, kind, zero_point, global_scale, 0, N,
                                          xs.dtype, blocked))
    y = xs.new_empty((M, N))
    scratch = xs.new_empty((rows, K))
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        block = dequantize(lib, codes, scales, zeros, group, kind, zero_point, global_scale, r0, r1, xs.dtype,
                           blocked, scratch)
        y[:, r0:r1] = _float_gemm(xs, block)
    return y


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """x as [M, K], float32 or bfloat16 (float16: float32 inside), each row's columns contiguous."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if x2.dtype is not torch.float32 and x2.dtype is not torch.bfloat16:
        x2 = x2.float()
    if x2.stride(1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < x2.shape[1]):
        x2 = x2.contiguous()
    return x2


def _w4_prefill_cpu(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    perm: torch.Tensor | None, group: int, kind: int, zero_point: int, global_scale: float,
                    blocked: bool, gemm_rows: int, int8_x: bool) -> torch.Tensor:
    y = prefill(library(), _rows_of(x), codes, scales, zeros, perm, group, kind, zero_point, global_scale, blocked,
                int8_x)
    return y.to(x.dtype).reshape(*x.shape[:-1], codes.shape[0])


def _w4_linear_cpu_python(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                          perm: torch.Tensor | None, group: int, kind: int, zero_point: int, global_scale: float,
                          blocked: bool, gemm_rows: int, int8_x: bool) -> torch.Tensor:
    """The op in Python (without a C++ compiler): what w4_cpu.c's C++ half does."""
    x2 = _rows_of(x)
    if x2.shape[0] > gemm_rows:
        y = prefill(library(), x2, codes, scales, zeros, perm, group, kind, zero_point, global_scale, blocked,
                    int8_x)
    else:
        y = gemm(library(), x2, codes, scales, zeros, perm, group, kind, zero_point, global_scale, blocked,
                 int8_x)
    return y.to(x.dtype).reshape(*x.shape[:-1], codes.shape[0])


# The ops, all defined here (with their shapes for torch.compile): w4_linear_cpu, implemented by the C++ half of
# w4_cpu.c when its library loads; w4_linear_cpu_python, the same in Python (no C++ compiler); w4_prefill_cpu, which
# both call for many rows. Library ops rather than torch.library.custom_op: its wrappers cost ~3 us a call more
# (kernels/linear.py).
SCHEMA = ("(Tensor x, Tensor codes, Tensor scales, Tensor? zeros, Tensor? perm, int group, int kind, int zero_point, "
          "float global_scale, bool blocked, int gemm_rows, bool int8_x) -> Tensor")
_lib = torch.library.Library("tinyserve", "FRAGMENT")
for _name, _impl in (("w4_linear_cpu", None), ("w4_linear_cpu_python", _w4_linear_cpu_python),
                     ("w4_prefill_cpu", _w4_prefill_cpu)):
    _lib.define(_name + SCHEMA)
    if _impl is not None:
        _lib.impl(_name, _impl, "CPU")

    @torch.library.register_fake(f"tinyserve::{_name}", lib=_lib)
    def _(x, codes, scales, zeros, perm, group, kind, zero_point, global_scale, blocked, gemm_rows, int8_x):
        return x.new_empty((*x.shape[:-1], codes.shape[0]))
