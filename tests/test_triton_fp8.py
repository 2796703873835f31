"""The block-FP8 GEMM (kernels/fp8.py, kernels/fp8_triton.py): the torch reference against an independent float64
computation, the Triton kernel against the reference (under the interpreter here, compiled on a GPU), for both
checkpoint scale layouts (128 x 128 blocks; per-channel, which per-tensor scales become), partial blocks, decode and
prefill row counts, and both ways of multiplying (w8a8, w8a16). The GPU tier adds the Qwen3.5-27B shapes in bf16
and torch's _scaled_mm as a second oracle."""
from __future__ import annotations

import math

import pytest
import torch

from triton_setup import DEV, ON_GPU, both, fp8_dot_tol, gen_, gpu, needs_gpu, tol  # noqa: F401  (first)
from tinyserve.kernels.fp8 import fp8_linear, quantize_activations  # noqa: E402
from tinyserve.kernels.fp8_weight import ACT_GROUP, FP8, FP8_MAX, Fp8Weight  # noqa: E402
from tinyserve.kernels.linear import linear  # noqa: E402


def random_weight(N: int, K: int, block: tuple[int, int], act_quant: bool, gen: torch.Generator) -> Fp8Weight:
    w = Fp8Weight(N, K, block, DEV, act_quant)
    w.weight.copy_((torch.randn(N, K, generator=gen) * 120).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    w.scale.copy_(torch.rand(w.scale.shape, generator=gen) * 0.01 + 1e-4)
    return w


def oracle(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """float64: the activations as the GEMM sees them (quantized per row and 128-group for w8a8) times the
    dequantized weight."""
    xd = x.double()
    if w.act_quant:
        xq, xs = quantize_activations(x)
        xd = xq.double() * xs.double().repeat_interleave(ACT_GROUP, 1)[:, :x.shape[1]]
    return xd @ (w.weight.double() * w.block_scales().double()).t()


SHAPES = [  # (M, N, K, block): decode rows, a few, prefill; K and N with partial blocks
    (1, 40, 300, (128, 128)),
    (5, 130, 256, (128, 128)),
    (3, 70, 200, (1, 200)),           # per-channel scales: one block of one row by all columns
    (4, 33, 129, (16, 128)),
    (20, 64, 128, (128, 128)),
    (70, 96, 384, (32, 256)),
]


@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("M, N, K, block", SHAPES)
def test_reference_against_float64(M, N, K, block, act_quant):
    g = gen_(M * N + K)
    w = random_weight(N, K, block, act_quant, g)
    x = torch.randn(M, K, generator=g).to(DEV)
    with torch.no_grad():
        from triton_setup import backend
        with backend("torch"):
            y = fp8_linear(x, w)
    torch.testing.assert_close(y.double(), oracle(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("M, N, K, block", SHAPES)
def test_triton_against_reference(M, N, K, block, act_quant, dtype):
    g = gen_(7 * M + N)
    w = random_weight(N, K, block, act_quant, g)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEV)
    tri, ref, *_ = both(linear, x, w)                  # through kernels.linear's dispatch
    assert tri.dtype == dtype and tri.shape == (M, N)
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(tri.float() / scale, ref.float() / scale, **fp8_dot_tol(dtype, act_quant))


def test_activation_quantization():
    """Per row and 128-group: scale = amax / 448, values rounded to e4m3; zero groups stay zero."""
    x = torch.randn(3, 300, generator=gen_(1))
    x[1, 128:256] = 0
    x[2, 5] = 1e4                                          # one outlier sets its group's scale
    q, s = quantize_activations(x)
    assert q.dtype == FP8 and q.shape == x.shape and s.shape == (3, math.ceil(300 / ACT_GROUP))
    assert torch.equal(s[2, 0], torch.tensor(1e4) / FP8_MAX) and q.float().abs().max() <= FP8_MAX
    assert torch.all(q[1, 128:256].float() == 0)
    back = q.float() * s.repeat_interleave(ACT_GROUP, 1)[:, :300]
    torch.testing.assert_close(back[0], x[0], rtol=0.07, atol=1e-3)     # e4m3: 3 mantissa bits


def test_empty_batch():
    w = random_weight(16, 128, (128, 128), True, gen_(2))
    tri, ref, *_ = both(fp8_linear, torch.zeros(0, 128, device=DEV), w)
    assert tri.shape == ref.shape == (0, 16)


# ---------------------------------------------------------------------------------------------------------------
# GPU tier: Qwen3.5-27B shapes in bf16, and torch's _scaled_mm where it takes block scales
QWEN_27B = [(5120, 17408 * 2), (17408, 5120), (5120, 10240 + 6144), (6144, 5120), (5120, 12288 + 2048)]


@gpu
@needs_gpu
@pytest.mark.parametrize("act_quant", [True, False], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("M", [1, 8, 512])
@pytest.mark.parametrize("K, N", QWEN_27B)
def test_gpu_27b_shapes(K, N, M, act_quant):
    g = gen_(K + N + M)
    w = random_weight(N, K, (128, 128), act_quant, g)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEV)
    tri, ref, *_ = both(fp8_linear, x, w)
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(tri.float() / scale, ref.float() / scale, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------------------------
# The prefill pair (kernels/fp8_prefill_triton.py): activations quantized once, the persistent TMA GEMM
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_quantization_is_the_reference(dtype):
    """The quantize kernel gives kernels/fp8.quantize_activations' values and scales (scales group-major)."""
    from tinyserve.kernels.fp8_prefill_triton import quantize_groups
    x = torch.randn(37, 384, generator=gen_(3)).to(dtype).to(DEV)
    x[5, 128:256] = 0                                      # an all-zero group: the floor scale, zero values
    q, s = quantize_groups(x)
    rq, rs = quantize_activations(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s.t(), rs)


@pytest.mark.parametrize("family", ["hopper", "blackwell"])
@pytest.mark.parametrize("M, N, K, block, programs", [
    (300, 200, 384, (128, 128), 3),          # partial row and column tiles; 3 programs walk 6 tiles
    (130, 72, 256, (1, 256), 1),             # per-channel scales; one program walks every tile
    (129, 256, 128, (128, 128), 8),          # more programs than tiles
])
def test_prefill_tma_gemm(family, M, N, K, block, programs):
    from tinyserve.kernels import fp8_prefill_triton as prefill
    g = gen_(M + N)
    w = random_weight(N, K, block, True, g)
    x = torch.randn(M, K, generator=g).to(DEV)
    assert prefill.fits(x, w)
    y = prefill.fp8_linear(x, w, prefill.PREFILL_TILES[family], programs=programs)
    from triton_setup import backend
    with backend("torch"):
        ref = fp8_linear(x, w)
    scale = ref.abs().max().item()
    torch.testing.assert_close(y / scale, ref / scale, **fp8_dot_tol(torch.float32, True))


def test_prefill_tma_takes_w8a8_whole_groups_only():
    from tinyserve.kernels import fp8_prefill_triton as prefill
    g = gen_(9)
    x = torch.randn(4, 256, generator=g).to(DEV)
    assert prefill.fits(x, random_weight(64, 256, (128, 128), True, g))
    assert not prefill.fits(x, random_weight(64, 256, (128, 128), False, g))               # w8a16
    assert not prefill.fits(x[:, :200], random_weight(64, 200, (128, 128), True, g))       # a partial group
    assert prefill.card_family(torch.device("cpu")) is None


@gpu
@needs_gpu
@pytest.mark.parametrize("M", [512, 2048])
@pytest.mark.parametrize("K, N", QWEN_27B)
def test_gpu_prefill_tma_27b_shapes(K, N, M):
    """fp8_linear's prefill rows on this card (the TMA pair on sm_90 / sm_120, else the pointer kernel) in bf16."""
    g = gen_(K + N + M)
    w = random_weight(N, K, (128, 128), True, g)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEV)
    tri, ref, *_ = both(fp8_linear, x, w)
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(tri.float() / scale, ref.float() / scale, atol=2e-2, rtol=2e-2)
