"""Dense projections (y = x W^T) with the faster of two CPU GEMM routes, chosen by measuring on this CPU.

On CPU, torch's F.linear goes to MKL (sgemm / gemv) and torch's private oneDNN op `mkldnn._linear_pointwise` (what
torch's own CPU compiler emits) to oneDNN. Which is faster depends on the CPU: oneDNN was 2-3x faster than MKL on
AMD EPYC for 8..2000 rows (fp32), while plain F.linear was 9-17% faster on an Intel CPU with AMX. So `calibrate`
times both on the model's own weight shapes at start, separately for one row (a lone decode: a GEMV), a few rows
(a batch of decodes) and many rows (prefill), and `linear` follows its choice. Measured on one Intel CPU here:
MKL's GEMV won for one row, oneDNN for 8 and 256 rows. Until calibrated, oneDNN is used where available. Greedy
tokens do not depend on the route (both are exact GEMMs; only summation order differs). Inside a compiled CPU step
one row is a fused multiply-and-sum instead (see `linear`).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from tinyserve.kernels.fp8 import fp8_linear
from tinyserve.kernels.fp8_weight import Fp8Weight

_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() \
    else None
BUCKETS = {"one": 1, "few": 8, "many": 256}   # row-count buckets and the row count each is timed at
FEW_MAX = 16                                    # "few": 2..16 rows (a batch of decodes); "many": more
_use_onednn = dict.fromkeys(BUCKETS, _onednn_linear is not None)
_calibrated = False                    # once per process: every engine in it then computes the same way


def _onednn_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_onednn_linear is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.dtype == weight.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N], no bias. An Fp8Weight goes to the block-FP8 GEMM."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear(x, weight)
    rows = x.numel() // x.shape[-1]
    if rows == 1 and x.dtype == torch.float32 and x.device.type == "cpu" and torch.compiler.is_compiling():
        # A compiled lone decode (compiled.py): a multiply-and-sum that inductor fuses into the step's own C++, one
        # pass over the weight as any GEMV makes, without a call out of the graph: ~20% more tokens/s than oneDNN's
        # GEMV on a 2-core AMD EPYC (the bench model, fp32).
        return (x.reshape(1, -1) * weight).sum(-1).reshape(*x.shape[:-1], weight.shape[0])
    if _onednn_ok(x, weight):
        if _use_onednn["one" if rows == 1 else "few" if rows <= FEW_MAX else "many"]:
            if torch.compiler.is_compiling():
                return torch.ops.tinyserve.onednn_linear(x, weight)
            return _onednn_linear(x, weight, None, "none", [], "")
    return F.linear(x, weight)


if _onednn_linear is not None:
    # For torch.compile, the oneDNN GEMM as an opaque op: inductor's own lowering of _linear_pointwise wants the
    # weight frozen into the graph (a prepacked copy of every weight, per graph), which we do not do.
    @torch.library.custom_op("tinyserve::onednn_linear", mutates_args=())
    def _onednn_linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, weight, None, "none", [], "")

    @_onednn_linear_op.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.inference_mode()
def calibrate(weights: list[torch.Tensor], repeats: int = 9) -> dict[str, str]:
    """Time F.linear against oneDNN on these weights (CPU) for each row-count bucket, and use the faster route for
    each from now on; once per process (later calls keep the first choice). Returns the choice, e.g.
    {"one": "mkl", "few": "onednn", "many": "onednn"}."""
    global _calibrated
    if _calibrated or not weights or _onednn_linear is None or not _onednn_ok(weights[0][:1], weights[0]):
        return {k: "onednn" if v else "mkl" for k, v in _use_onednn.items()}
    _calibrated = True
    onednn = lambda x, w: _onednn_linear(x, w, None, "none", [], "")  # noqa: E731
    for kind, n in BUCKETS.items():
        inputs = [torch.randn(n, w.shape[1], dtype=w.dtype) for w in weights]

        def run(fn) -> float:
            t0 = time.perf_counter()
            for x, w in zip(inputs, weights):
                fn(x, w)
            return time.perf_counter() - t0
        run(onednn), run(F.linear)                                          # warm both up
        # alternate the two and keep each one's best: another process busy for a moment slows both alike
        best = {"onednn": float("inf"), "mkl": float("inf")}
        for _ in range(repeats):
            best["onednn"] = min(best["onednn"], run(onednn))
            best["mkl"] = min(best["mkl"], run(F.linear))
        _use_onednn[kind] = best["onednn"] < best["mkl"]
    return {k: "onednn" if v else "mkl" for k, v in _use_onednn.items()}
