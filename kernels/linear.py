"""Dense projections (y = x W^T), with what surrounds them in the model (the input's RMSNorm, silu_and_mul, the
residual add) as options of `linear`. On a GPU a decode step's 1..16 rows run as one Triton kernel each
(kernels/linear_triton.py), FP8 weights through the block-FP8 GEMMs (kernels/fp8.py) otherwise; on the CPU the
faster of two GEMM routes, chosen by measuring on this CPU.

On CPU, torch's F.linear goes to MKL (sgemm / gemv) and torch's private oneDNN op `mkldnn._linear_pointwise` (what
torch's own CPU compiler emits) to oneDNN. Which is faster depends on the CPU: oneDNN was 2-3x faster than MKL on
AMD EPYC for 8..2000 rows (fp32), while plain F.linear was 9-17% faster on an Intel CPU with AMX. So `calibrate`
times both on the model's own weight shapes at start, separately for one row (a lone decode: a GEMV), a few rows
(a batch of decodes) and many rows (prefill), and `linear` follows its choice. Measured on one Intel CPU here:
MKL's GEMV won for one row, oneDNN for 8 and 256 rows. Until calibrated, oneDNN is used where available. Greedy
tokens do not depend on the route (both are exact GEMMs; only summation order differs). Inside a compiled CPU step
one or two rows are a fused multiply-and-sum instead (`_multiply_and_sum`).

oneDNN also has a third route: a copy of each weight laid out ahead of time in its own blocked format (`pack`). It
reads that ~1.4x faster than the plain [N, K] weight it reorders on every call, for 2 to 8 rows (a batch of decodes,
a NEXTN verify), on a 2-core AMD EPYC; the plain weight stays for one row and for whatever else reads it, so the
copy costs the weights' size again. `calibrate` times it too when the caller can spare the memory.
"""
from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tinyserve.kernels import ONEDNN_DTYPES, ONEDNN_LINEAR, use_triton
from tinyserve.kernels.pointwise import InputNorm, rms_norm, silu_and_mul
from tinyserve.kernels.fp8 import fp8_linear
from tinyserve.kernels.fp8_weight import Fp8Weight
from tinyserve.kernels.w4 import w4_linear
from tinyserve.kernels.w4_weight import W4Weight


# oneDNN keeps each GEMM it has set up, per row count and weight shape (~0.6 MB each), in two caches of 1,024 by
# default: prefill chunks of every length grew a server's memory by ~600 MB before they filled. The steady shapes
# (each weight shape x the decode batch sizes) stay well under this bound; the variable ones are evicted. Read at
# oneDNN's first use, so here; a value set in the environment wins.
CACHED_GEMMS = 256
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(CACHED_GEMMS))
os.environ.setdefault("LRU_CACHE_CAPACITY", str(CACHED_GEMMS))         # ideep's, inside torch

BUCKETS = {"one": 1, "few": 8, "many": 256}   # row-count buckets and the row count each is timed at
FEW_MAX = 16                                    # "few": 2..16 rows (a batch of decodes); "many": more
FUSED_ROWS = 2                  # rows a compiled lone sequence's step multiplies in its own code (_multiply_and_sum)
_fused_rows = 1                 # FUSED_ROWS while such a step is traced (`fused_rows`); a batch of any size: 1
ROUTES = ("onednn", "onednn-packed", "mkl")
_route = dict.fromkeys(BUCKETS, "onednn" if ONEDNN_LINEAR is not None else "mkl")
_calibrated = False                    # once per process: every engine in it then computes the same way
_packed: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}   # (data_ptr, shape) of a live weight -> its copy


def _onednn_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype in ONEDNN_DTYPES
            and x.dtype == weight.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight | W4Weight, norm: InputNorm | None = None,
           silu_mul: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N], no bias. An Fp8Weight goes to the block-FP8 GEMM, a W4Weight to
    the 4-bit one (kernels/w4.py).

    What surrounds a projection in the model, each optional, in this order: `norm`, x RMS-normalised first
    (rms_norm by the norm's scale); `silu_mul`, the weight is a gate_up [2I, K] and the result silu(gate) * up
    [..., I]; `residual`, residual + the product. On a GPU a decode step's rows (1..16) run all of it as one
    kernel (kernels/linear_triton.py: the decode GEMM, at the memory's bandwidth); otherwise the separate ops."""
    if use_triton(x) and (decode := _decode_kernel(x, weight)) is not None:
        return decode(x, weight, norm, silu_mul, residual)
    if norm is not None or silu_mul or residual is not None:
        y = linear(rms_norm(x, norm.scale, norm.eps, zero_centred=False) if norm is not None else x, weight)
        y = silu_and_mul(y) if silu_mul else y
        return residual + y if residual is not None else y
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight)
    if isinstance(weight, W4Weight):
        return w4_linear(x, weight)
    rows = x.numel() // x.shape[-1]
    # is_dynamo_compiling: true in the code dynamo traces alone (is_compiling is one flag for the whole process, set
    # on the engine thread's eager steps too while a graph compiles on another thread: compiled.py)
    traced = torch.compiler.is_dynamo_compiling()
    if rows <= _fused_rows and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and traced:
        return _multiply_and_sum(x, weight, rows)
    if _onednn_ok(x, weight) and _route[_bucket(rows)] != "mkl":
        if traced:
            return torch.ops.tinyserve.onednn_linear(x, weight)
        return _onednn(x, weight)
    return F.linear(x, weight)


def _decode_kernel(x: torch.Tensor, weight: torch.Tensor | Fp8Weight | W4Weight):
    """The GPU decode kernel that takes these rows and this weight, or None (then the separate ops run)."""
    if isinstance(weight, W4Weight):           # the 4-bit sibling of the decode kernel
        from tinyserve.kernels import w4_triton as kernel
    else:
        from tinyserve.kernels import linear_triton as kernel
    return kernel.decode_linear if kernel.fits(x, weight) else None


@contextlib.contextmanager
def fused_rows(fixed_rows: bool) -> Iterator[None]:
    """While a CPU step is compiled: with fixed_rows (one sequence, a row count the graph fixes) up to FUSED_ROWS
    rows are multiplied in the step's own code; otherwise one. A graph for any batch size must not branch on its
    symbolic row count, which would specialize it to the size it was traced at."""
    global _fused_rows
    before, _fused_rows = _fused_rows, FUSED_ROWS if fixed_rows else 1
    try:
        yield
    finally:
        _fused_rows = before


def traced_routes() -> dict[str, str]:
    """The route of each row-count bucket as a compiled graph holds it: MKL or oneDNN (whether oneDNN reads the
    packed copy is decided inside its op, at run time)."""
    return {kind: "mkl" if r == "mkl" else "onednn" for kind, r in _route.items()}


def _multiply_and_sum(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """A compiled lone decode, or a lone 2-token verify (compiled.py): a multiply-and-sum per row that inductor fuses
    into the step's own C++, one pass over the weight for both rows, without a call out of the graph. On a 2-core AMD
    EPYC (fp32): ~20% more tokens/s than oneDNN's GEMV for one row (the bench model); for two rows 1.08x one row's
    time where oneDNN takes 1.3x (0.76 GB of weights). bfloat16 (a 4-bit model's lm_head and GDN in_proj_ba): the
    products and sums in float32 as oneDNN's, and no ~50 us call per tiny projection (the 4-bit bench model's step of
    one request: 6.7-7.7 ms before, 6.1-7.2 ms after, alternated in process)."""
    x2 = x.reshape(rows, -1)
    y = torch.stack([(x2[r] * weight).sum(-1) for r in range(rows)]) if rows > 1 else (x2 * weight).sum(-1)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _bucket(rows: int) -> str:
    return "one" if rows == 1 else "few" if rows <= FEW_MAX else "many"


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's GEMM, on the weight's packed copy where the row count's route says so and the weight has one."""
    if _route[_bucket(x.numel() // x.shape[-1])] == "onednn-packed":
        weight = _packed.get((weight.data_ptr(), tuple(weight.shape)), weight)
    return ONEDNN_LINEAR(x, weight, None, "none", [], "")


def _pack_one(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, BUCKETS["few"])


def pack(weights: list[torch.Tensor]) -> int:
    """Give each weight its packed copy if a route of `calibrate`'s choice uses one; returns the bytes added. A copy
    is found by its weight's address and lives as long as its weight (a new model's weights at the same address get
    their own), so a weight must not move after this (build.py places the weights on huge pages first)."""
    if "onednn-packed" not in _route.values():
        return 0
    added = 0
    for w in weights:
        key = (w.data_ptr(), tuple(w.shape))
        if key not in _packed and _onednn_ok(w[:1], w):
            _packed[key] = _pack_one(w)
            weakref.finalize(w, _packed.pop, key, None)
            added += w.numel() * w.element_size()
    return added


if ONEDNN_LINEAR is not None:
    # For torch.compile, the oneDNN GEMM as an opaque op: inductor's own lowering of _linear_pointwise wants the
    # weight frozen into the graph (a prepacked copy of every weight, per graph), which we do not do. Defined on a
    # Library rather than with torch.library.custom_op: ~3 us less per call (its wrappers), some 40 calls a step.
    _lib = torch.library.Library("tinyserve", "FRAGMENT")
    _lib.define("onednn_linear(Tensor x, Tensor weight) -> Tensor")
    _lib.impl("onednn_linear", lambda x, weight: _onednn(x, weight), "CPU")

    @torch.library.register_fake("tinyserve::onednn_linear", lib=_lib)
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.inference_mode()
def calibrate(weights: list[torch.Tensor], repeats: int = 9, may_pack: bool = False) -> dict[str, str]:
    """Time F.linear against oneDNN on these weights (CPU) for each row-count bucket, and oneDNN on packed copies
    of them for several rows when `may_pack` (the caller can spare the weights' size again), and use the fastest
    route for each from now on; once per process (later calls keep the first choice). Returns the choice, e.g.
    {"one": "mkl", "few": "onednn-packed", "many": "onednn"}; `pack` then makes the copies."""
    global _calibrated
    if _calibrated or not weights or ONEDNN_LINEAR is None or not _onednn_ok(weights[0][:1], weights[0]):
        return dict(_route)
    _calibrated = True
    packed = [_pack_one(w) for w in weights] if may_pack else []
    routes = {"onednn": lambda x, i: ONEDNN_LINEAR(x, weights[i], None, "none", [], ""),
              "onednn-packed": lambda x, i: ONEDNN_LINEAR(x, packed[i], None, "none", [], ""),
              "mkl": lambda x, i: F.linear(x, weights[i])}
    for kind, n in BUCKETS.items():
        inputs = [torch.randn(n, w.shape[1], dtype=w.dtype) for w in weights]
        timed = [r for r in ROUTES if r != "onednn-packed" or (packed and n > 1)]

        def run(fn) -> float:
            t0 = time.perf_counter()
            for i, x in enumerate(inputs):
                fn(x, i)
            return time.perf_counter() - t0
        for r in timed:                                                     # warm each up
            run(routes[r])
        # take turns and keep each one's best: another process busy for a moment slows them alike
        best = dict.fromkeys(timed, float("inf"))
        for _ in range(repeats):
            for r in timed:
                best[r] = min(best[r], run(routes[r]))
        _route[kind] = min(timed, key=best.get)
    return dict(_route)
