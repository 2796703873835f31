"""The decode GEMM (kernels/linear_triton.py) through kernels.linear's dispatch, against the torch reference (the
separate ops: rms_norm, the GEMM, silu_and_mul, the residual add): FP8 weights (w8a8 and w8a16, block and
per-channel scales) and plain weights, every fused part alone and together, one K slice and several (split-K with
the second kernel), partial column tiles and K not a multiple of 128. Under the interpreter here (fp32, fp16);
compiled on a GPU, where the `gpu` tier adds Qwen3.5-27B's and Qwen3.5-35B-A3B's decode shapes in bf16."""
from __future__ import annotations

import pytest
import torch

from triton_setup import DEV, ON_GPU, both, fp8_dot_tol, gen_, gpu, needs_gpu, rnd, tol  # noqa: F401  (first)
from tinyserve.kernels import linear_triton  # noqa: E402
from tinyserve.kernels.fp8_weight import FP8, FP8_MAX, Fp8Weight  # noqa: E402
from tinyserve.kernels.linear import InputNorm, linear  # noqa: E402
from tinyserve.kernels.linear_triton import DecodeTiles, decode_tiles  # noqa: E402

pytestmark = pytest.mark.slow          # the interpreter: left out of the quick tier with the other Triton files


def fp8_weight(N: int, K: int, block: tuple[int, int], act_quant: bool, g: torch.Generator) -> Fp8Weight:
    w = Fp8Weight(N, K, block, DEV, act_quant)
    w.weight.copy_((torch.randn(N, K, generator=g) * 120).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    w.scale.copy_(torch.rand(w.scale.shape, generator=g) * 0.01 + 1e-4)
    return w


def make_weight(kind: str, N: int, K: int, dtype: torch.dtype, g: torch.Generator):
    if kind == "plain":
        return rnd(N, K, dtype=dtype, gen=g, scale=K ** -0.5)
    block = {"w8a8": (128, 128), "w8a16": (128, 128), "w8a8-channel": (1, K), "w8a16-16x128": (16, 128)}[kind]
    return fp8_weight(N, K, block, kind.startswith("w8a8"), g)


def check(tri: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, kind: str) -> None:
    assert tri.dtype == ref.dtype and tri.shape == ref.shape
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(tri.float() / scale, ref.float() / scale,
                               **fp8_dot_tol(dtype, kind.startswith("w8a8")))


FUSED = {"plain": {}, "norm": {"norm": True}, "silu_mul": {"silu_mul": True}, "residual": {"residual": True},
         "norm+silu_mul": {"norm": True, "silu_mul": True}, "all": {"norm": True, "silu_mul": True, "residual": True}}


def fused_args(which: dict, M: int, N: int, K: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    out = {}
    if which.get("norm"):
        out["norm"] = InputNorm(1.0 + rnd(K, gen=g, scale=0.1), 1e-6)
    if which.get("silu_mul"):
        out["silu_mul"] = True
    if which.get("residual"):
        out["residual"] = rnd(M, N // 2 if which.get("silu_mul") else N, dtype=dtype, gen=g)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["plain", "w8a8", "w8a16", "w8a8-channel", "w8a16-16x128"])
@pytest.mark.parametrize("fused", list(FUSED))
def test_decode_gemm_against_reference(kind, fused, dtype):
    """Every weight kind with every fused part, 3 rows, N with a partial column tile, K with a partial group."""
    g = gen_(len(kind) * 31 + len(fused))
    M, N, K = 3, 80, 300
    w = make_weight(kind, N, K, dtype, g)
    x = rnd(M, K, dtype=dtype, gen=g)
    kw = fused_args(FUSED[fused], M, N, K, dtype, g)
    assert linear_triton.fits(x, w)
    tri, ref, *_ = both(lambda *a: linear(*a, **kw), x, w)
    check(tri, ref, dtype, kind)


@pytest.mark.parametrize("kind", ["plain", "w8a8", "w8a16"])
@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("fused", ["plain", "all"])
def test_split_k(kind, split, fused):
    """K cut into slices whose sums the second kernel adds in order: the same result as one slice."""
    g = gen_(split * 7 + len(kind))
    M, N, K = 2, 48, 384 * split // 2 + 128
    w = make_weight(kind, N, K, torch.float32, g)
    x = rnd(M, K, gen=g)
    kw = fused_args(FUSED[fused], M, N, K, torch.float32, g)
    one = DecodeTiles(BN=16, split=1, num_warps=4, num_stages=2)
    many = one._replace(split=split)
    from triton_setup import backend
    with backend("triton"):
        whole = linear_triton.decode_linear(x, w, tiles=one, **kw)
        sliced = linear_triton.decode_linear(x, w, tiles=many, **kw)
    with backend("torch"):
        ref = linear(x, w, **kw)
    check(sliced, ref, torch.float32, kind)
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["plain", "w8a8"])
def test_rows_do_not_change_with_the_batch(kind):
    """Batch invariance: a row's result is the same bits alone and among 16 rows (the tiles depend on N, K and the
    card, never on the row count)."""
    g = gen_(5)
    N, K = 64, 512
    w = make_weight(kind, N, K, torch.float16, g)
    x = rnd(16, K, dtype=torch.float16, gen=g)
    norm = InputNorm(1.0 + rnd(K, gen=g, scale=0.1), 1e-6)
    from triton_setup import backend
    with backend("triton"):
        batch = linear(x, w, norm=norm)
        alone = [linear(x[i:i + 1], w, norm=norm) for i in (0, 7, 15)]
    for i, row in zip((0, 7, 15), alone):
        assert torch.equal(row[0], batch[i])


def test_leading_dims_and_views():
    """x [2, 2, K] from a strided view: the rows of a fused projection's slice, read in place."""
    g = gen_(6)
    K, N = 256, 40
    w = make_weight("w8a8", N, K, torch.float32, g)
    x = rnd(2, 2, K + 64, gen=g)[..., 64:]
    tri, ref, *_ = both(linear, x, w)
    assert tri.shape == (2, 2, N)
    check(tri, ref, torch.float32, "w8a8")


def test_what_it_takes():
    g = gen_(7)
    w = make_weight("plain", 32, 64, torch.float16, g)
    assert linear_triton.fits(rnd(16, 64, dtype=torch.float16, gen=g), w)
    assert not linear_triton.fits(rnd(17, 64, dtype=torch.float16, gen=g), w)          # prefill rows
    assert not linear_triton.fits(rnd(1, 64, gen=g), w)                                # dtypes differ
    assert not linear_triton.fits(rnd(0, 64, dtype=torch.float16, gen=g), w)
    assert linear_triton.fits(rnd(1, 64, dtype=torch.float16, gen=g), make_weight("w8a16", 32, 64, None, g))


def test_tiles_fill_the_card():
    """At least PROGRAMS_PER_SM programs per SM where K allows; the widest tile that gets there, K split only when
    16 columns do not, each slice MIN_STEPS_PER_SPLIT steps or more."""
    for N, K, wb, two in [(5120, 17408, 1, False), (5120, 6144, 1, False), (34816 // 2, 5120, 1, True),
                          (96, 5120, 2, False), (2048, 512, 1, False), (248320, 5120, 2, False),
                          (16384, 5120, 1, False)]:
        for sms in (128, 132, 170):
            t = decode_tiles(N, K, wb, two, sms)
            target = linear_triton.PROGRAMS_PER_SM * sms
            programs = -(-N // t.BN) * t.split
            steps = -(-K // linear_triton.BK)
            assert t.split == 1 or steps >= t.split * linear_triton.MIN_STEPS_PER_SPLIT
            assert programs >= target or steps < 2 * t.split * linear_triton.MIN_STEPS_PER_SPLIT
            assert t.BN * linear_triton.BK * wb * (2 if two else 1) <= 8192 and t.BN >= 16
            assert t.split == 1 or t.BN == 16                       # narrower tiles before a second kernel
            wider = 2 * t.BN
            assert wider * linear_triton.BK * wb * (2 if two else 1) > 8192 or -(-N // wider) < target


# ---------------------------------------------------------------------------------------------------------------
# GPU tier: the decode shapes of Qwen3.5-27B and Qwen3.5-35B-A3B in bf16, against the reference in fp32
QWEN35_27B = {"gate_up": (2 * 17408, 5120), "down": (5120, 17408), "gdn in": (10240 + 6144, 5120),
              "gdn out": (5120, 6144), "attn qkv": (12288 + 2048, 5120), "attn out": (5120, 6144)}
QWEN35_35B = {"shared gate_up": (2 * 512, 2048), "shared down": (2048, 512), "gdn in": (8192 + 4096, 2048),
              "gdn out": (2048, 4096), "attn qkv": (8192 + 1024, 2048), "attn out": (2048, 4096)}


@gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["plain", "w8a8", "w8a16"])
@pytest.mark.parametrize("M", [1, 8, 16])
@pytest.mark.parametrize("shape", [("27B", k, v) for k, v in QWEN35_27B.items()] +
                         [("35B-A3B", k, v) for k, v in QWEN35_35B.items()], ids=lambda s: f"{s[0]} {s[1]}")
def test_gpu_decode_shapes(shape, M, kind):
    _, name, (N, K) = shape
    g = gen_(N + K + M)
    bf = torch.bfloat16
    w = make_weight(kind, N, K, bf, g)
    x = rnd(M, K, dtype=bf, gen=g)
    which = {"norm": name.endswith(("in", "qkv", "gate_up")), "silu_mul": name.endswith("gate_up"),
             "residual": name.endswith(("out", "down"))}
    kw = fused_args(which, M, N, K, bf, g)
    from triton_setup import backend
    with backend("triton"):
        tri = linear(x, w, **kw)
    with backend("torch"):
        ref = linear(x.float(), w if kind != "plain" else w.float(),
                     **{k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    scale = ref.abs().max().item()
    torch.testing.assert_close(tri.float() / scale, ref / scale, atol=2e-2, rtol=2e-2)
