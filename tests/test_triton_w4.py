"""The 4-bit weight GEMMs (kernels/w4_triton.py, and the 4-bit experts of kernels/moe_triton.py) against the torch
reference (kernels/w4.w4_linear_reference, W4Weight.dequantize, kernels/moe.py), under the interpreter here and
compiled on a GPU: int4 symmetric and asymmetric at groups 32 / 64 / 128 / 256, fp4 (NVFP4, group 16, a global
scale), act-order permutations, fp16 / bf16 / fp32 scales, fp32 / fp16 / bf16 activations (bf16 interpreted through
triton_setup.bf16_like_the_gpu), each of the three ways a tile is dequantized (w4_triton.dequant_mode); the decode
GEMM for 1..16 rows with every fused option through kernels.linear's dispatch, split-K on and off, batch invariance;
the in-tile prefill kernel at each of its tile shapes, the scratch + cuBLAS path (its dequantization kernel equal to
W4Weight.dequantize), w4_linear's routing between the three; the fused MoE with 4-bit experts. The `gpu` tier adds
Qwen3.5-27B / 35B-A3B shapes in bf16."""
from __future__ import annotations

import pytest
import torch

from triton_setup import (DEV, ON_GPU, backend, bf16_like_the_gpu, both, gen_, gpu, needs_gpu, rnd,  # noqa: F401
                          tol)  # (first)
from tinyserve.kernels import linear_triton, w4_triton  # noqa: E402
from tinyserve.kernels.linear import InputNorm, linear  # noqa: E402
from tinyserve.kernels.linear_triton import DecodeTiles  # noqa: E402
from tinyserve.kernels.moe import fused_experts, route  # noqa: E402
from tinyserve.kernels.w4 import w4_linear, w4_linear_reference  # noqa: E402
from tinyserve.kernels.w4_weight import W4Weight, pack_codes  # noqa: E402

pytestmark = pytest.mark.slow          # the interpreter: left out of the quick tier with the other Triton files


@pytest.fixture(autouse=True)
def _bf16_as_on_the_gpu():
    with bf16_like_the_gpu():
        yield


# (id, W4Weight options): each dequantization mode, both zero conventions, every scale dtype, groups below, at and
# above the decode's 128-column K step, act-order, fp4
WEIGHTS = {
    "int4-g32-sym-fp16": dict(group=32, scale_dtype=torch.float16),
    "int4-g64-asym-bf16": dict(group=64, scale_dtype=torch.bfloat16, asymmetric=True),
    "int4-g128-sym-fp16": dict(group=128, scale_dtype=torch.float16),
    "int4-g128-asym-act-fp32": dict(group=128, scale_dtype=torch.float32, asymmetric=True, act_order=True),
    "int4-g256-asym-fp16": dict(group=256, scale_dtype=torch.float16, asymmetric=True),
    "int4-g32-act-bf16": dict(group=32, scale_dtype=torch.bfloat16, act_order=True, zero_point=7),
    "fp4-g16": dict(group=16, kind="fp4", scale_dtype=torch.float32, global_scale=0.37),
}


def w4_weight(N: int, K: int, g: torch.Generator, experts: int | None = None, **options) -> W4Weight:
    """Random codes (random bytes: every code in both nibbles), zeros and act-order permutations; scales sized so a
    row's products sum to about one (K^-0.5)."""
    w = W4Weight(N, K, device=DEV, experts=experts, **options)
    lead = () if experts is None else (experts,)
    w.codes.copy_(torch.randint(0, 256, (*lead, N, K // 2), generator=g, dtype=torch.uint8))
    scale = K ** -0.5 / (3.0 if w.kind == "fp4" else 5.0) / (w.global_scale if w.kind == "fp4" else 1.0)
    w.scales.copy_((torch.rand(w.scales.shape, generator=g) + 0.5) * scale)
    if w.zeros is not None:
        w.zeros.copy_(torch.randint(0, 16, w.zeros.shape, generator=g))
    if w.perm is not None:
        w.perm.copy_(torch.stack([torch.randperm(K, generator=g) for _ in range(experts or 1)]).reshape(w.perm.shape))
    return w


def check(tri: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Relative to the output's scale, the dtype's rounding (tl.dot and torch sum in different orders)."""
    assert tri.dtype == ref.dtype and tri.shape == ref.shape
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(tri.float() / scale, ref.float() / scale, **tol(dtype))


FUSED = {"plain": {}, "norm": {"norm": True}, "silu_mul": {"silu_mul": True}, "residual": {"residual": True},
         "all": {"norm": True, "silu_mul": True, "residual": True}}


def fused_args(which: dict, M: int, N: int, K: int, dtype: torch.dtype, g: torch.Generator) -> dict:
    out = {}
    if which.get("norm"):
        out["norm"] = InputNorm(1.0 + rnd(K, gen=g, scale=0.1), 1e-6)
    if which.get("silu_mul"):
        out["silu_mul"] = True
    if which.get("residual"):
        out["residual"] = rnd(M, N // 2 if which.get("silu_mul") else N, dtype=dtype, gen=g)
    return out


def dtype_id(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]


# --- the layout the kernels read ---------------------------------------------------------------------------------


def test_reference_reads_the_layout():
    """The oracle itself: W4Weight.dequantize's formula and nibble order on a hand-made row (the kernels are checked
    against it everywhere below)."""
    w = W4Weight(1, 32, 32, asymmetric=True, scale_dtype=torch.float32, act_order=True)
    q = torch.arange(32) % 16
    w.codes.copy_(pack_codes(q[None]))
    assert w.codes[0, 0] == 0x10 and w.codes[0, 7] == 0xFE            # column 2j low nibble, 2j + 1 high
    w.scales.fill_(0.5)
    w.zeros.fill_(3)
    w.perm.copy_(torch.arange(32).flip(0))
    expect = ((q - 3) * 0.5).float()
    assert torch.equal(w.dequantize(torch.float32)[0], expect.flip(0))  # column j of the sorted weight -> perm[j]
    f = W4Weight(1, 16, 16, kind="fp4", scale_dtype=torch.float32, global_scale=2.0)
    f.codes.copy_(pack_codes(torch.arange(16)[None]))
    f.scales.fill_(0.25)
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6])
    assert torch.equal(f.dequantize(torch.float32)[0], e2m1 * 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("which", list(WEIGHTS))
def test_dequantize_kernel_equals_the_reference(which, dtype):
    """The scratch path's dequantization: W4Weight.dequantize's values in the weight's sorted column order (fp4: its
    global scale folded into the group scale, so a value may differ in the last place before its rounding)."""
    g = gen_(len(which) + 3)
    w = w4_weight(40, 512, g, **WEIGHTS[which])
    with backend("triton"):
        got = w4_triton.dequantize(w, dtype)
        rows = w4_triton.dequantize(w, dtype, slice(8, 24))
    ref = w.dequantize(dtype)
    ref = ref[:, w.perm] if w.perm is not None else ref
    if w.kind == "fp4":
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7 if dtype == torch.bfloat16 else 2e-6,
                                   atol=0)
    else:
        assert torch.equal(got, ref)
    assert torch.equal(rows, got[8:24])


# --- the decode GEMM -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", list(FUSED))
@pytest.mark.parametrize("which", list(WEIGHTS))
def test_decode_gemm_fp32(which, fused):
    """Every weight with every fused part, fp32 activations (the interpreter's exact dots: the reference's numbers
    up to summation order): 3 rows, N with a partial column tile, K with a partial 128-column step where the group
    allows."""
    g = gen_(len(which) * 31 + len(fused))
    opts = WEIGHTS[which]
    M, N, K = 3, 80, 320 if opts["group"] <= 64 else 512
    w = w4_weight(N, K, g, **opts)
    x = rnd(M, K, gen=g)
    kw = fused_args(FUSED[fused], M, N, K, torch.float32, g)
    assert w4_triton.fits(x, w)
    tri, ref, *_ = both(lambda *a: linear(*a, **kw), x, w)
    check(tri, ref, torch.float32)


@pytest.mark.parametrize("fused", ["plain", "all"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("which", list(WEIGHTS))
def test_decode_gemm_16_bit(which, dtype, fused):
    """16-bit activations: each dequantization mode as the device runs it (SCALE_AFTER: int4 at groups of 128 and
    more; X16: scales in x's dtype; F32 otherwise), 5 rows."""
    g = gen_(len(which) * 7 + len(fused) + dtype.itemsize)
    opts = WEIGHTS[which]
    M, N, K = 5, 48, 384 if opts["group"] <= 128 else 512
    w = w4_weight(N, K, g, **opts)
    x = rnd(M, K, dtype=dtype, gen=g)
    kw = fused_args(FUSED[fused], M, N, K, dtype, g)
    tri, ref, *_ = both(lambda *a: linear(*a, **kw), x, w)
    check(tri, ref, dtype)


def test_each_dequantization_mode_is_tested():
    """The 16-bit test above meets all three modes (a refactor that drops one from WEIGHTS fails here)."""
    modes = {w4_triton.dequant_mode(w4_weight(32, 256, gen_(1), **o), dt, w4_triton.DECODE_BK)
             for o in WEIGHTS.values() for dt in (torch.float16, torch.bfloat16)}
    assert modes == {w4_triton.F32.value, w4_triton.SCALE_AFTER.value, w4_triton.X16.value}


@pytest.mark.parametrize("M", [1, 2, 7, 16])
def test_every_row_count(M):
    """1..16 rows, all fused, the norm's rstd over K rows the interpreter masks."""
    g = gen_(M)
    N, K = 64, 256
    w = w4_weight(N, K, g, **WEIGHTS["int4-g64-asym-bf16"])
    x = rnd(M, K, dtype=torch.float16, gen=g)
    kw = fused_args(FUSED["all"], M, N, K, torch.float16, g)
    tri, ref, *_ = both(lambda *a: linear(*a, **kw), x, w)
    check(tri, ref, torch.float16)


@pytest.mark.parametrize("which", ["int4-g32-sym-fp16", "int4-g128-asym-act-fp32", "fp4-g16"])
@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("fused", ["plain", "all"])
def test_split_k(which, split, fused):
    """K cut into slices (the partial sums added in order by linear_triton's second kernel): the reference's result,
    and one slice's up to fp32 summation order."""
    g = gen_(split * 7 + len(which))
    M, N, K = 2, 48, 128 * (2 * split + 1)
    w = w4_weight(N, K, g, **WEIGHTS[which])
    x = rnd(M, K, gen=g)
    kw = fused_args(FUSED[fused], M, N, K, torch.float32, g)
    one = DecodeTiles(BN=32, split=1, num_warps=4, num_stages=2)
    with backend("triton"):
        whole = w4_triton.decode_linear(x, w, tiles=one, **kw)
        sliced = w4_triton.decode_linear(x, w, tiles=one._replace(split=split), **kw)
    with backend("torch"):
        ref = linear(x, w, **kw)
    check(sliced, ref, torch.float32)
    torch.testing.assert_close(sliced, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("which", ["int4-g32-sym-fp16", "int4-g64-asym-bf16", "int4-g128-sym-fp16", "fp4-g16",
                                   "int4-g32-act-bf16"])
def test_rows_do_not_change_with_the_batch(which):
    """Batch invariance: a row's result is the same bits alone and among 16 rows, in each dequantization mode (the
    tiles depend on N, K and the card, never on the row count), with split-K and the norm."""
    g = gen_(len(which))
    N, K = 64, 512
    w = w4_weight(N, K, g, **WEIGHTS[which])
    x = rnd(16, K, dtype=torch.bfloat16, gen=g)
    norm = InputNorm(1.0 + rnd(K, gen=g, scale=0.1), 1e-6)
    for tiles in (None, DecodeTiles(BN=32, split=2, num_warps=4, num_stages=2)):
        with backend("triton"):
            batch = w4_triton.decode_linear(x, w, norm=norm, tiles=tiles)
            alone = [w4_triton.decode_linear(x[i:i + 1], w, norm=norm, tiles=tiles) for i in (0, 7, 15)]
        for i, row in zip((0, 7, 15), alone):
            assert torch.equal(row[0], batch[i])


def test_leading_dims_and_views():
    """x [2, 2, K] from a strided view (a fused projection's slice) and an act-order weight: the rows read in
    place, the columns gathered through perm."""
    g = gen_(6)
    K, N = 256, 40
    w = w4_weight(N, K, g, **WEIGHTS["int4-g32-act-bf16"])
    x = rnd(2, 2, K + 64, gen=g)[..., 64:]
    tri, ref, *_ = both(linear, x, w)
    assert tri.shape == (2, 2, N)
    check(tri, ref, torch.float32)


def test_tiles_stream_whole_steps():
    """w4_decode_tiles: 8 KB of packed weight a K step at its widest, at least MIN_BN columns (no two warps on the
    same mma tiles), narrowed only while it makes too few programs, then K split while each slice keeps
    MIN_STEPS_PER_SPLIT steps; never a function of the row count (it is not an argument)."""
    for N, K, two in [(5120, 17408, False), (17408, 5120, True), (5120, 6144, False), (16384, 5120, False),
                      (12288, 2048, False), (512, 2048, True), (2048, 512, False), (96, 5120, False)]:
        for sms in (128, 132, 170):
            t = w4_triton.w4_decode_tiles(N, K, two, sms)
            target = linear_triton.PROGRAMS_PER_SM * sms
            programs = -(-N // t.BN) * t.split
            steps = -(-K // w4_triton.DECODE_BK)
            assert w4_triton.MIN_BN <= t.BN and t.BN * (2 if two else 1) * w4_triton.DECODE_BK // 2 <= \
                w4_triton.STEP_BYTES
            assert t.split == 1 or steps >= t.split * linear_triton.MIN_STEPS_PER_SPLIT
            assert programs >= target or steps < 2 * t.split * linear_triton.MIN_STEPS_PER_SPLIT
            assert t.split == 1 or t.BN == w4_triton.MIN_BN          # narrower tiles before a second kernel
            wider = 2 * t.BN
            assert wider * (2 if two else 1) * w4_triton.DECODE_BK // 2 > w4_triton.STEP_BYTES or \
                -(-N // wider) < target


def test_what_the_decode_kernel_takes():
    g = gen_(7)
    w = w4_weight(32, 256, g, **WEIGHTS["int4-g128-sym-fp16"])
    assert w4_triton.fits(rnd(16, 256, dtype=torch.bfloat16, gen=g), w)
    assert not w4_triton.fits(rnd(17, 256, dtype=torch.bfloat16, gen=g), w)       # prefill rows
    assert not w4_triton.fits(rnd(0, 256, dtype=torch.bfloat16, gen=g), w)
    assert not w4_triton.fits(rnd(1, 128, dtype=torch.bfloat16, gen=g), w)        # K differs
    assert w4_triton.fits(rnd(1, 256, gen=g), w) != ON_GPU                        # fp32: interpreted only
    odd = w4_weight(32, 192, g, group=96, scale_dtype=torch.float16)                 # a group no K step fits
    assert not w4_triton.supports(odd, w4_triton.DECODE_BK) and not w4_triton.fits(rnd(1, 192, gen=g), odd)
    stacked = w4_weight(32, 256, g, experts=2, **WEIGHTS["int4-g128-sym-fp16"])
    assert not w4_triton.fits(rnd(1, 256, dtype=torch.bfloat16, gen=g), stacked)
    plain = rnd(32, 256, gen=g)                                   # the other weights keep their route
    assert linear_triton.fits(rnd(3, 256, gen=g), plain) != ON_GPU


def test_unsupported_group_runs_the_reference():
    """A group that fits no K step (96: neither a power of two nor a multiple of 128) goes to the torch reference
    from w4_linear, decode rows and prefill rows alike."""
    g = gen_(8)
    w = w4_weight(24, 192, g, group=96, scale_dtype=torch.float16, asymmetric=True)
    for M in (2, 40):
        x = rnd(M, 192, gen=g)
        tri, ref, *_ = both(w4_linear, x, w)
        assert torch.equal(tri, ref)


# --- prefill: the in-tile kernel and scratch + cuBLAS ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("which", list(WEIGHTS))
def test_prefill_in_tile(which, dtype):
    """The in-tile kernel at each of prefill_tiles' shapes (forced: 16 x 64, 64 x 64, 128 x 64), 70 rows (a partial
    row tile), N and (where the group allows) K with partial tiles."""
    g = gen_(len(which) * 3 + dtype.itemsize)
    opts = WEIGHTS[which]
    M, N, K = 70, 80, 320 if opts["group"] <= 64 else 512
    w = w4_weight(N, K, g, **opts)
    x = rnd(M, K, dtype=dtype, gen=g)
    with backend("torch"):
        ref = w4_linear(x, w)
    for tiles in [(16, 64, 4, 4), (64, 64, 4, 3), (128, 64, 8, 3)]:
        with backend("triton"):
            tri = w4_triton.prefill_linear(x, w, tiles)
        check(tri, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("which", ["int4-g32-sym-fp16", "int4-g128-asym-act-fp32", "fp4-g16"])
def test_prefill_scratch(which, dtype, monkeypatch):
    """Scratch + cuBLAS (here torch's CPU matmul): in one block, and in blocks of 128 output rows (SCRATCH_BYTES
    forced small) whose products land in their columns; act-order gathers x once."""
    g = gen_(len(which) + dtype.itemsize)
    M, N, K = 33, 300, 256
    w = w4_weight(N, K, g, **WEIGHTS[which])
    x = rnd(M, K, dtype=dtype, gen=g)
    with backend("torch"):
        ref = w4_linear(x, w)
    for scratch_bytes in (w4_triton.SCRATCH_BYTES, 128 * K * x.element_size()):
        monkeypatch.setattr(w4_triton, "SCRATCH_BYTES", scratch_bytes)
        with backend("triton"):
            tri = w4_triton.scratch_linear(x, w)
        check(tri, ref, dtype)


def test_w4_linear_routes(monkeypatch):
    """kernels/w4.w4_linear on the Triton backend: 1..16 rows the decode kernel, then the in-tile kernel, from
    SCRATCH_ROWS rows scratch + cuBLAS; each through the public function, against the reference."""
    g = gen_(9)
    N, K = 40, 256
    w = w4_weight(N, K, g, **WEIGHTS["int4-g64-asym-bf16"])
    monkeypatch.setattr(w4_triton, "SCRATCH_ROWS", 48)
    ran = []
    for name in ("decode_linear", "prefill_linear", "scratch_linear"):
        fn = getattr(w4_triton, name)
        monkeypatch.setattr(w4_triton, name, lambda *a, _fn=fn, _name=name, **k: ran.append(_name) or _fn(*a, **k))
    for M, path in [(1, "decode_linear"), (16, "decode_linear"), (17, "prefill_linear"), (47, "prefill_linear"),
                    (48, "scratch_linear"), (60, "scratch_linear")]:
        ran.clear()
        x = rnd(M, K, dtype=torch.float16, gen=g)
        tri, ref, *_ = both(w4_linear, x, w)
        assert ran == [path], (M, ran)
        check(tri, ref, torch.float16)


def test_prefill_rows_through_linear():
    """More than 16 rows with every fused part: kernels.linear runs the separate ops, the GEMM through w4_linear's
    in-tile kernel."""
    g = gen_(10)
    M, N, K = 20, 64, 256
    w = w4_weight(N, K, g, **WEIGHTS["int4-g128-sym-fp16"])
    x = rnd(M, K, dtype=torch.float16, gen=g)
    kw = fused_args(FUSED["all"], M, N, K, torch.float16, g)
    assert not w4_triton.fits(x, w)
    tri, ref, *_ = both(lambda *a: linear(*a, **kw), x, w)
    check(tri, ref, torch.float16)


# --- the fused MoE with 4-bit experts ------------------------------------------------------------------------------


def w4_experts(E: int, H: int, I: int, which: str, g: torch.Generator) -> tuple[W4Weight, W4Weight]:
    """Stacked 4-bit experts: gate_up [E, 2I, H], down [E, H, I] (the down group capped at I)."""
    opts = dict(WEIGHTS[which])
    down = dict(opts, group=min(opts["group"], I))
    return w4_weight(2 * I, H, g, experts=E, **opts), w4_weight(H, I, g, experts=E, **down)


MOE_CASES = [  # (T, E, top_k, H, I, weights, dtype): decode, ragged groups, several blocks per expert
    (1, 4, 2, 128, 64, "int4-g32-sym-fp16", torch.float32),
    (5, 4, 2, 256, 64, "int4-g128-asym-act-fp32", torch.float16),
    (17, 8, 2, 192, 96, "int4-g32-act-bf16", torch.bfloat16),
    (40, 4, 4, 128, 64, "fp4-g16", torch.bfloat16),
    (40, 4, 2, 128, 64, "int4-g64-asym-bf16", torch.float32),
    (9, 4, 2, 256, 128, "int4-g128-sym-fp16", torch.bfloat16),
]


@pytest.mark.parametrize("T, E, top_k, H, I, which, dtype", MOE_CASES,
                         ids=[f"{c[0]}-{c[5]}-{dtype_id(c[6])}" for c in MOE_CASES])
def test_moe_w4_experts(T, E, top_k, H, I, which, dtype):
    """The routed experts through moe.fused_experts: the grouped GEMM over packed experts (each expert's own
    scales, zeros and perm) against the reference's loop over experts (kernels.linear on W4Weight.expert(e))."""
    g = gen_(T * 10 + E + H)
    w_gate_up, w_down = w4_experts(E, H, I, which, g)
    x = rnd(T, H, dtype=dtype, gen=g)
    topk_weights, topk_ids = route(torch.randn(T, E, generator=g).to(DEV), top_k, True)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    assert tri.dtype == torch.float32 and tri.shape == (T, H)
    check(tri, ref, dtype)


@pytest.mark.parametrize("rows_per_expert", [1, 40, 200])
def test_moe_w4_every_tile_shape(rows_per_expert, monkeypatch):
    """Each of moe_triton.tile_shape's choices forced on the same problem, with w4_tile_shape's tile beside it;
    experts no token picks are never read (their codes' scales NaN)."""
    from tinyserve.kernels import moe_triton
    tiles = moe_triton.tile_shape(rows_per_expert * 4, 4)
    monkeypatch.setattr(moe_triton, "tile_shape", lambda pairs, num_experts: tiles)
    T, E, H, I = 21, 6, 128, 64
    g = gen_(rows_per_expert)
    w_gate_up, w_down = w4_experts(E, H, I, "int4-g64-asym-bf16", g)
    x = rnd(T, H, dtype=torch.float16, gen=g)
    topk_ids = torch.tensor([[0, 3]] * 15 + [[3, 5]] * 6, dtype=torch.int32).to(DEV)     # experts 1, 2, 4 unused
    topk_weights = torch.rand(T, 2, generator=g).to(DEV)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    check(tri, ref, torch.float16)
    for w in (w_gate_up, w_down):
        w.scales[[1, 2, 4]] = float("nan")
    with backend("triton"):
        assert torch.isfinite(fused_experts(x, w_gate_up, w_down, topk_weights, topk_ids)).all()


def test_moe_w4_gate_up_with_a_16_bit_down():
    """One GEMM of the layer 4-bit, the other a plain tensor (and the other way round): they share the pairs' BM."""
    T, E, H, I, top_k = 12, 4, 128, 64, 2
    g = gen_(12)
    w_gate_up, w_down = w4_experts(E, H, I, "int4-g128-sym-fp16", g)
    plain_gate_up, plain_down = w_gate_up.dequantize(torch.float16), w_down.dequantize(torch.float16)
    x = rnd(T, H, dtype=torch.float16, gen=g)
    topk_weights, topk_ids = route(torch.randn(T, E, generator=g).to(DEV), top_k, True)
    for pair in [(w_gate_up, plain_down), (plain_gate_up, w_down)]:
        tri, ref, *_ = both(fused_experts, x, *pair, topk_weights, topk_ids)
        check(tri, ref, torch.float16)


# --- GPU tier: Qwen3.5-27B and 35B-A3B shapes in bf16 -----------------------------------------------------------
QWEN35_27B = {"gate_up": (2 * 17408, 5120), "down": (5120, 17408), "gdn in": (10240 + 6144, 5120),
              "gdn out": (5120, 6144), "attn qkv": (12288 + 2048, 5120), "attn out": (5120, 6144)}
GPU_WEIGHTS = ["int4-g128-sym-fp16", "int4-g32-act-bf16", "fp4-g16"]


@gpu
@needs_gpu
@pytest.mark.parametrize("which", GPU_WEIGHTS)
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("name", list(QWEN35_27B))
def test_gpu_decode_shapes(name, M, which):
    N, K = QWEN35_27B[name]
    g = gen_(N + K + M)
    w = w4_weight(N, K, g, **WEIGHTS[which])
    x = rnd(M, K, dtype=torch.bfloat16, gen=g)
    which_fused = {"norm": name.endswith(("in", "qkv", "gate_up")), "silu_mul": name.endswith("gate_up"),
                   "residual": name.endswith(("out", "down"))}
    kw = fused_args(which_fused, M, N, K, torch.bfloat16, g)
    with backend("triton"):
        tri = linear(x, w, **kw)
    with backend("torch"):
        ref = linear(x.float(), w, **{k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    scale = ref.abs().max().item()
    torch.testing.assert_close(tri.float() / scale, ref / scale, atol=2e-2, rtol=2e-2)


@gpu
@needs_gpu
@pytest.mark.parametrize("M", [100, 300, 2048])
@pytest.mark.parametrize("name", ["gate_up", "down"])
def test_gpu_prefill_shapes(name, M):
    """In-tile (100 rows) and scratch + cuBLAS (300, 2048) at the 27B's MLP shapes."""
    N, K = QWEN35_27B[name]
    g = gen_(N + M)
    w = w4_weight(N, K, g, **WEIGHTS["int4-g128-sym-fp16"])
    x = rnd(M, K, dtype=torch.bfloat16, gen=g)
    with backend("triton"):
        tri = w4_linear(x, w)
    ref = w4_linear_reference(x.float(), w)
    scale = ref.abs().max().item()
    torch.testing.assert_close(tri.float() / scale, ref / scale, atol=2e-2, rtol=2e-2)


@gpu
@needs_gpu
@pytest.mark.parametrize("T", [1, 8, 512])
def test_gpu_qwen3_5_moe_shapes(T):
    """Qwen3.5-35B-A3B's experts as a GPTQ int4 g128 checkpoint holds them (256 experts, top 8), bf16."""
    E, H, I, top_k = 256, 2048, 512, 8
    g = gen_(T)
    w_gate_up, w_down = w4_experts(E, H, I, "int4-g128-sym-fp16", g)
    x = rnd(T, H, dtype=torch.bfloat16, gen=g)
    topk_weights, topk_ids = route(torch.randn(T, E, generator=g).to(DEV), top_k, True)
    tri, ref, *_ = both(fused_experts, x, w_gate_up, w_down, topk_weights, topk_ids)
    scale = ref.abs().max().item()
    torch.testing.assert_close(tri / scale, ref / scale, atol=2e-2, rtol=2e-2)
