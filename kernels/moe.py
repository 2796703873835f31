"""The routed experts of a sparse MoE layer (torch reference): softmax top-k routing and the experts' SwiGLU MLPs.

Expert weights are stacked: w_gate_up [E, 2I, H] (each expert's gate rows, then its up rows) and w_down [E, H, I].
Token t goes to experts topk_ids[t, :] with weights topk_weights[t, :]; its routed output is
sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j]. Either stack may be an
Fp8Weight with an experts dimension (an FP8 checkpoint's experts kept FP8): each expert multiplies as a linear
weight of kernels/fp8.py does (w8a16: by the dequantized weight; w8a8: activations quantized per row and 128-group);
or a W4Weight with one (a 4-bit checkpoint's experts), multiplied as kernels/w4.py multiplies a linear weight.

The reference loops over the experts hit in this step (not over tokens): each one runs two dense GEMMs on the rows
routed to it. That is the fast CPU path; it reads the expert counts on the host (one sync), which the Triton path in
moe_triton.py (CUDA) avoids: it sorts the (token, expert) pairs by expert on the device and runs one grouped GEMM
over all experts.
"""
from __future__ import annotations

import torch

from tinyserve.kernels import use_triton
from tinyserve.kernels.pointwise import silu_and_mul
from tinyserve.kernels.fp8_weight import Fp8Weight
from tinyserve.kernels.linear import linear
from tinyserve.kernels.w4_weight import W4Weight


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in fp32, the top_k largest (renormalised to sum to 1 when `renormalize`).
    router_logits [T, E] -> (topk_weights [T, top_k] fp32, topk_ids [T, top_k] int32), largest first."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def _expert(w: torch.Tensor | Fp8Weight | W4Weight, e: int) -> torch.Tensor | Fp8Weight | W4Weight:
    return w.expert(e) if isinstance(w, (Fp8Weight, W4Weight)) else w[e]


def fused_experts(x: torch.Tensor, w_gate_up: torch.Tensor | Fp8Weight | W4Weight,
                  w_down: torch.Tensor | Fp8Weight | W4Weight,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed part of the MoE layer: x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I] (tensors, or stacked
    Fp8Weights or W4Weights), topk_weights [T, k] (fp32), topk_ids [T, k] (int) -> [T, H] in fp32 (the caller adds
    the shared expert and rounds once). The experts' GEMMs run in x's dtype; the weighted sum over a token's experts
    is fp32."""
    if use_triton(x):
        from tinyserve.kernels import moe_triton
        return moe_triton.fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids)
    T, k = topk_ids.shape
    out = torch.zeros((T, w_down.shape[1]), dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    token_of = order // k
    flat_weights = topk_weights.reshape(-1)
    start = 0
    for e, n in enumerate(counts):                        # loop over experts hit in this step, not over tokens
        if n == 0:
            continue
        idx = order[start:start + n]
        tok = token_of[start:start + n]
        start += n
        y = linear(silu_and_mul(linear(x[tok], _expert(w_gate_up, e))), _expert(w_down, e))
        out.index_add_(0, tok, y.float() * flat_weights[idx].unsqueeze(-1))
    return out
