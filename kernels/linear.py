"""Dense projections (y = x W^T) with the fastest CPU GEMM this torch build offers.

On CPU, torch's F.linear goes to MKL sgemm, which is slow for the small row counts of decode batches on some
CPUs (measured 2-3x slower than oneDNN on AMD EPYC for 8..2000 rows, fp32). oneDNN's linear (the op torch's own
CPU compiler emits) is used there; single rows stay on MKL's gemv, which is as fast or faster.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN_MIN_ROWS = 1       # oneDNN streams the weights ~2x faster than MKL gemv too (decode is bandwidth-bound)
_onednn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() \
    else None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T -> [..., N], no bias."""
    if (_onednn_linear is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
            and x.dtype == weight.dtype and x.numel() >= _ONEDNN_MIN_ROWS * x.shape[-1]):
        return _onednn_linear(x, weight, None, "none", [], "")
    return F.linear(x, weight)
