"""The CPU GEMM for packed 4-bit weights (kernels/w4_cpu.c) against its oracles: the torch reference
(kernels.w4.w4_linear_reference: the dequantized weight's F.linear) and the exact product in float64 of the
dequantized weight. int4 symmetric and asymmetric, groups 16 / 32 / 48 / 64 / 128, fp4 (NVFP4), act-order, float32
/ float16 / bfloat16 scales, float32 and bfloat16 activations, 1..16 rows (the GEMM kernel) and a prefill's (the
dequantized blocks and the float GEMM), odd N, stacked experts' views, non-contiguous x, inside torch.compile, and
the AVX2 and portable builds of the same source on this CPU.

Tolerance: the order of the sums. float32 activations: |y - ref| <= 4e-6 * (|x| @ |W|^T) elementwise (~60 ulps of
the sum of the products' magnitudes; the weights themselves are the reference's to the bit, (q - z) * s in float32;
the worst seen here is ~2e-7). A wrong scale, zero or column anywhere is off by ~1/groups of that, thousands of times
more. bfloat16 activations: the kernel rounds each weight to bfloat16 as the reference does and sums in float32, so
the two differ by the sum order and then at most one bfloat16 ulp of the output (2^-7 * |ref|) on top; here
they agree to the bit.
"""
from __future__ import annotations

import itertools
import shutil

import pytest
import torch
import torch.nn.functional as F

from tinyserve.kernels import backend_set_to, w4_cpu
from tinyserve.kernels.linear import linear
from tinyserve.kernels.w4 import w4_linear, w4_linear_reference
from tinyserve.kernels.w4_weight import W4Weight, int8_rounded, pack_codes

pytestmark = pytest.mark.skipif(w4_cpu.library() is None, reason="no C compiler to build the kernel")

F32_TOL, BF16_ULP = 4e-6, 2.0 ** -7       # BF16_ULP: a bfloat16 ulp relative to its value, at most


def make_weight(N: int, K: int, group: int, kind: str = "int4", scale_dtype=torch.float16, asymmetric=False,
                act_order=False, experts: int | None = None, seed: int = 0, blocked: bool = False) -> W4Weight:
    """blocked: in the CPU layout the loader makes (W4Weight.block_rows; where K % 64 == 0, else still rows)."""
    gen = torch.Generator().manual_seed(seed)
    w = W4Weight(N, K, group, kind=kind, scale_dtype=scale_dtype, asymmetric=asymmetric, act_order=act_order,
                 global_scale=0.37 if kind == "fp4" else 1.0, experts=experts)
    lead = () if experts is None else (experts,)
    w.codes.copy_(pack_codes(torch.randint(0, 16, lead + (N, K), generator=gen)))
    w.scales.copy_((torch.rand(lead + (N, K // group), generator=gen) * 0.05 + 0.002).to(scale_dtype))
    if asymmetric:
        w.zeros.copy_(torch.randint(0, 16, lead + (N, K // group), generator=gen))
    if act_order:
        w.perm.copy_(torch.stack([torch.randperm(K, generator=gen) for _ in range(experts or 1)]).squeeze(0))
    if blocked:
        assert w.block_rows() == (K % 64 == 0)
    return w


def dequantized_f64(w: W4Weight) -> torch.Tensor:
    """W in the checkpoint's column order, float64 from the float32 values (what every route multiplies by)."""
    return w.dequantize(torch.float32).double()


def check(y: torch.Tensor, x: torch.Tensor, w: W4Weight) -> None:
    """y against the reference and against the exact product, within the module docstring's bounds."""
    ref = w4_linear_reference(x, w)
    assert y.dtype == x.dtype and y.shape == ref.shape
    wd = dequantized_f64(w)
    magnitude = x.double().abs() @ wd.abs().T
    exact = x.double() @ wd.T
    if x.dtype == torch.float32:
        bounds = [(ref.double(), F32_TOL * magnitude), (exact, F32_TOL * magnitude)]
    else:                           # the exact product of the bfloat16 weights, and the reference's rounding of it
        exact = x.double() @ w.dequantize(torch.bfloat16).double().T
        bounds = [(ref.double(), F32_TOL * magnitude + BF16_ULP * ref.double().abs()),
                  (exact, F32_TOL * magnitude + BF16_ULP / 2 * exact.abs())]
    for other, tol in bounds:
        err = (y.double() - other).abs()
        assert (err <= tol + 1e-30).all(), f"off by {(err / (tol + 1e-30)).max().item():.3g}x the bound"


CASES = [  # N, K, group, kind, scale dtype, asymmetric, act-order
    (37, 256, 32, "int4", torch.float16, False, False),
    (64, 512, 128, "int4", torch.float16, True, False),
    (50, 384, 64, "int4", torch.bfloat16, True, True),
    (24, 256, 128, "int4", torch.float32, False, True),
    (33, 112, 16, "fp4", torch.float32, False, False),          # K % 32 == 16: a half chunk at the end
    (40, 256, 16, "fp4", torch.float16, False, False),
    (19, 208, 16, "int4", torch.bfloat16, True, True),
    (21, 240, 48, "int4", torch.float16, True, False),          # a chunk of 32 columns across two groups
    (9, 60, 6, "int4", torch.float16, True, False),             # a group the vector paths do not take
    (26, 320, 16, "int4", torch.bfloat16, False, False),        # 20 groups a row: 16 scales at once, then 4 masked
]


def python_op(x: torch.Tensor, w: W4Weight) -> torch.Tensor:
    """The op as it runs without a C++ compiler (w4_cpu.py's Python version of w4_cpu.c's C++ half)."""
    return torch.ops.tinyserve.w4_linear_cpu_python(x, w.codes, w.scales, w.zeros, w.perm, w.group,
                                                    w4_cpu.KIND_CODES[w.kind], w.zero_point, w.global_scale,
                                                    w.blocked, w4_cpu.gemm_rows(x, w), w.int8_activations)


OPS = {"op": w4_cpu.w4_linear, "python op": python_op}


def test_the_op_is_built_in_cpp():
    """Where there is a C++ compiler the op is w4_cpu.c's C++ half (~10 us a call less than the Python op)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the Python op runs")
    assert w4_cpu.op_in_cpp()


@pytest.mark.parametrize("N, K, group, kind, sdt, asym, act", CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 31, 150])     # 150: a prefill's path
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("blocked", [False, True], ids=["rows", "blocked"])
def test_matches_the_reference(N, K, group, kind, sdt, asym, act, rows, op, blocked):
    w = make_weight(N, K, group, kind, sdt, asym, act, seed=N + rows, blocked=blocked)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    assert w4_cpu.usable(x, w)
    check(OPS[op](x, w), x, w)


@pytest.mark.parametrize("rows", [1, 4, 11, 40, 150])
@pytest.mark.parametrize("kind, group", [("int4", 32), ("int4", 128), ("fp4", 16)])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("blocked", [False, True], ids=["rows", "blocked"])
def test_bfloat16_activations(rows, kind, group, op, blocked):
    w = make_weight(70, 512, group, kind, torch.bfloat16, asymmetric=kind == "int4", act_order=group == 128,
                    blocked=blocked)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    check(OPS[op](x, w), x, w)


@pytest.mark.parametrize("op", ["tinyserve::w4_linear_cpu", "tinyserve::w4_linear_cpu_python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prefill_path_at_any_row_count(op, dtype):
    """gemm_rows 0: every row count goes to the dequantized blocks and the float GEMM (several blocks of rows)."""
    if op == "tinyserve::w4_linear_cpu" and not w4_cpu.op_in_cpp():
        pytest.skip("no C++ compiler")
    old, w4_cpu.PREFILL_SCRATCH = w4_cpu.PREFILL_SCRATCH, 16 * 256 * 4        # blocks of 16 rows
    try:
        for (N, K, group, kind, sdt, asym, act), blocked in itertools.product(CASES, (False, True)):
            w = make_weight(N, K, group, kind, sdt, asym, act, seed=N, blocked=blocked)
            for rows in (1, 7):
                x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
                y = getattr(torch.ops.tinyserve, op.split("::")[1])(
                    x, w.codes, w.scales, w.zeros, w.perm, group, w4_cpu.KIND_CODES[kind], w.zero_point,
                    w.global_scale, w.blocked, 0, False)
                check(y, x, w)
    finally:
        w4_cpu.PREFILL_SCRATCH = old


def test_the_linear_route_and_leading_dims(monkeypatch):
    """kernels.linear.linear on a W4Weight reaches the kernel (kernels/w4.py routes it), x [B, T, K]."""
    w = make_weight(48, 256, 32, asymmetric=True)
    x = torch.randn(2, 3, 256)
    calls = []
    original = w4_cpu.w4_linear
    monkeypatch.setattr(w4_cpu, "w4_linear", lambda x, w: calls.append(1) or original(x, w))
    y = linear(x, w)
    monkeypatch.undo()
    assert calls and y.shape == (2, 3, 48)
    check(y.reshape(6, 48), x.reshape(6, 256), w)
    with backend_set_to("torch"):                      # the "torch" backend: the reference, not the kernel
        torch.testing.assert_close(w4_linear(x, w), w4_linear_reference(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("blocked", [False, True], ids=["rows", "blocked"])
def test_stacked_experts_views(blocked):
    w = make_weight(42, 256, 32, asymmetric=True, act_order=True, experts=3, blocked=blocked)
    for e in range(3):
        we = w.expert(e)
        assert we.blocked == blocked
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(e))
        assert w4_cpu.usable(x, we)
        check(w4_cpu.w4_linear(x, we), x, we)
    assert not w4_cpu.usable(torch.randn(1, 256), w)         # the stack itself: one expert at a time


def test_blocked_codes_are_the_rows_interleaved():
    """W4Weight.block_rows by hand: a block of 4 rows holds their first 32 bytes, row after row, then their next 32;
    the last N % 4 rows stay rows; row_codes gives the rows back and dequantize the same values."""
    w = make_weight(6, 128, 32, asymmetric=True)          # one block of 4 rows and 2 rows left; 64 bytes a row
    rows = w.codes.clone()
    before = w.dequantize(torch.float32)
    assert w.block_rows() and w.blocked
    assert torch.equal(w.codes[:4].reshape(-1), torch.cat([rows[r, p * 32:(p + 1) * 32] for p in (0, 1)
                                                           for r in range(4)]))
    assert torch.equal(w.codes[4:], rows[4:])
    assert torch.equal(w.row_codes(), rows)
    assert torch.equal(w.dequantize(torch.float32), before)
    for part in (slice(0, 4), slice(1, 6), slice(3, 5), slice(4, 6), slice(5, 6), slice(2, 3)):   # blocks, tail, both
        assert torch.equal(w.row_codes(part), rows[part]), part
        assert torch.equal(w.dequantize(torch.float32, part), before[part]), part
    assert w.block_rows() and torch.equal(w.row_codes(), rows)        # blocked once
    with pytest.raises(AssertionError):
        w.copy_rows(0, make_weight(2, 128, 32, asymmetric=True))       # rows are copied in before blocking
    assert not make_weight(8, 96, 32).block_rows()          # 48 bytes a row: not whole pieces, stays rows


def test_a_weight_it_cannot_read_goes_to_the_reference():
    """Codes whose columns are not contiguous (no loader makes them; a view could): the reference, not a wrong
    answer."""
    w = make_weight(24, 128, 32)
    w.codes = w.codes.T.contiguous().T
    x = torch.randn(2, 128)
    assert not w4_cpu.usable(x, w)
    torch.testing.assert_close(w4_linear(x, w), w4_linear_reference(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("op", OPS)
def test_non_contiguous_x(op):
    w = make_weight(30, 256, 64)
    wide = torch.randn(6, 400)
    for x in (wide[:, 100:356], torch.randn(256, 6).T, torch.randn(6, 512)[:, ::2], torch.randn(3, 2, 256)[:, 1]):
        assert not x.is_contiguous()
        check(OPS[op](x, w), x, w)


@pytest.mark.parametrize("op", OPS)
def test_float16_activations_run_in_float32(op):
    w = make_weight(30, 256, 32)
    x = torch.randn(3, 256).to(torch.float16)
    y = OPS[op](x, w)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, OPS[op](x.float(), w).half(), rtol=0, atol=0)


@pytest.mark.parametrize("kind, group, sdt, asym", [("int4", 32, torch.float16, True), ("int4", 128, torch.bfloat16,
                                                                                         False),
                                                    ("fp4", 16, torch.float32, False), ("int4", 48, torch.float16,
                                                                                        True)])
def test_dequantize_is_the_weights_own(kind, group, sdt, asym):
    """The prefill's dequantized rows are W4Weight.dequantize's values to the bit (float32 and bfloat16)."""
    lib = w4_cpu.library()
    for blocked in (False, True):
        w = make_weight(45, 240 if group == 48 else 256, group, kind, sdt, asym, blocked=blocked)
        for dtype, (r0, r1) in itertools.product((torch.float32, torch.bfloat16), ((5, 41), (0, 45))):
            got = w4_cpu.dequantize(lib, w.codes, w.scales, w.zeros, group, w4_cpu.KIND_CODES[kind], w.zero_point,
                                    w.global_scale, r0, r1, dtype, blocked=w.blocked)
            torch.testing.assert_close(got, w.dequantize(dtype)[r0:r1], rtol=0, atol=0)


def test_inside_a_compiled_function():
    """A compiled step calls the kernel as an op of its graph (not a graph break, not the reference)."""
    from torch._inductor.compile_fx import compile_fx

    w = make_weight(52, 256, 32, asymmetric=True, act_order=True)
    targets = []

    def backend(gm, inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return compile_fx(gm, inputs)

    step = torch.compile(lambda x: torch.relu(linear(x, w)) + 1.0, backend=backend, fullgraph=True, dynamic=True)
    for rows in (1, 3):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(step(x), torch.relu(w4_cpu.w4_linear(x, w)) + 1.0, rtol=0, atol=0)
    op = "tinyserve.w4_linear_cpu" if w4_cpu.op_in_cpp() else "tinyserve.w4_linear_cpu_python"
    assert {op, op + ".default"} & set(targets), targets


# The other paths of the same source, built on this CPU with the wider vector units turned off: what a CPU with
# AVX-512 but no bfloat16 dot products, with AVX2 + FMA, or with neither, runs.
OTHER_BUILDS = {(512, 0): ("-mno-avx512bf16",), (256, 0): ("-mno-avx512f",),
                (0, 0): ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


def test_the_native_build_takes_the_cpus_bfloat16_dots():
    """With AVX512_BF16 the tests above ran bfloat16 x (groups of 64 and 128) through the dot-product path."""
    lib = w4_cpu.library()
    has = any("avx512_bf16" in line.split() for line in w4_cpu.cpu_info() if line.startswith("flags"))
    assert lib.w4_bf16_dots() == int(lib.w4_path() == 512 and has)


@pytest.mark.parametrize("path, dots", sorted(OTHER_BUILDS))
def test_the_other_vector_paths(path, dots):
    native = w4_cpu.library()
    if native.w4_path() < max(path, 256) or (path, dots) == (native.w4_path(), native.w4_bf16_dots()):
        pytest.skip("this CPU builds that path natively (tested above) or cannot build it")
    lib = w4_cpu.build(w4_cpu.FLAGS + OTHER_BUILDS[(path, dots)])
    if lib is None:
        pytest.skip("the C compiler does not take these flags (not x86)")
    assert (lib.w4_path(), lib.w4_bf16_dots()) == (path, dots)
    for (N, K, group, kind, sdt, asym, act), blocked in itertools.product(CASES, (False, True)):
        w = make_weight(N, K, group, kind, sdt, asym, act, seed=N, blocked=blocked)
        for rows in (1, 2, 5, 16):
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
                y = w4_cpu.gemm(lib, x, w.codes, w.scales, w.zeros, w.perm, group, w4_cpu.KIND_CODES[kind],
                                w.zero_point, w.global_scale, w.blocked)
                check(y, x, w)
                if kind == "int4":                 # int8 activations: block_q8 (AVX2) or the portable sums
                    y = w4_cpu.gemm(lib, x, w.codes, w.scales, w.zeros, w.perm, group, 0, w.zero_point, 1.0,
                                    w.blocked, True)
                    w.int8_activations = True
                    check_int8(y, x, w)
                    w.int8_activations = False


def test_without_a_compiler_the_reference_runs(monkeypatch, tmp_path):
    w = make_weight(20, 128, 32)
    x = torch.randn(2, 128)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))          # nothing built there yet
    w4_cpu.build.cache_clear()
    try:
        assert not w4_cpu.usable(x, w)
        y = w4_linear(x, w)
    finally:
        monkeypatch.undo()
        w4_cpu.build.cache_clear()
    torch.testing.assert_close(y, w4_linear_reference(x, w), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# int8 activations (model.int8_activations): x rounded per group to int8 steps, the products summed in integers

INT4_CASES = [c for c in CASES if c[3] == "int4"]      # groups 32 and 64 * k (vectors), 16, 48 and 6 (portable sums)


def int8_exact(x: torch.Tensor, w: W4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The product of x rounded as model.int8_activations defines it (each group of the weight's sorted columns:
    q = round(x * (127 / amax)) in float32, ties to even, step amax / 127) and the dequantized W, in float64 from
    q and the step (no float32 rounding of q * step); and |x rounded| @ |W|^T, the size of its sums."""
    xs = (x.float() if w.perm is None else x.float().index_select(-1, w.perm))
    groups = xs.reshape(*xs.shape[:-1], -1, w.group)
    amax = groups.abs().amax(-1, keepdim=True)
    q = torch.round(groups * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax)))
    rounded = (q.double() * (amax / 127.0).double()).reshape(xs.shape)
    if w.perm is not None:
        rounded = torch.empty_like(rounded).index_copy_(-1, w.perm, rounded)
    wd = dequantized_f64(w)
    return rounded @ wd.T, rounded.abs() @ wd.abs().T


def check_int8(y: torch.Tensor, x: torch.Tensor, w: W4Weight) -> None:
    """y against the exact product of the rounded x and against the torch reference (w4_linear_reference rounds x
    with int8_rounded): float32 x within F32_TOL of the sums' size; bfloat16 x, whose y is rounded to bfloat16, plus
    an ulp of it."""
    exact, magnitude = int8_exact(x, w)
    ref = w4_linear_reference(x, w).double()
    assert y.dtype == x.dtype and y.shape == exact.shape
    ulp = BF16_ULP * exact.abs() if x.dtype == torch.bfloat16 else 0
    for other in (exact, ref):
        err = (y.double() - other).abs()
        tol = F32_TOL * magnitude + ulp
        assert (err <= tol + 1e-30).all(), f"off by {(err / (tol + 1e-30)).max().item():.3g}x the bound"


def int8_weight(*args, **kw) -> W4Weight:
    w = make_weight(*args, **kw)
    w.int8_activations = True
    return w


@pytest.mark.parametrize("N, K, group, kind, sdt, asym, act", INT4_CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 200])      # 200: past INT8_GEMM_ROWS, the rounded x's GEMM
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("blocked", [False, True], ids=["rows", "blocked"])
def test_int8_activations_match_their_oracle(N, K, group, kind, sdt, asym, act, rows, op, blocked):
    assert (rows > w4_cpu.INT8_GEMM_ROWS) == (rows == 200)
    w = int8_weight(N, K, group, kind, sdt, asym, act, seed=N + rows, blocked=blocked)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
    assert w4_cpu.usable(x, w)
    check_int8(OPS[op](x, w), x, w)


@pytest.mark.parametrize("rows", [1, 6, 200])
@pytest.mark.parametrize("group, act", [(32, False), (128, True), (48, False)])
def test_int8_activations_from_bfloat16(rows, group, act):
    w = int8_weight(70, 384, group, "int4", torch.bfloat16, asymmetric=True, act_order=act, blocked=True)
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    check_int8(w4_cpu.w4_linear(x, w), x, w)


@pytest.mark.parametrize("group, act", [(32, False), (64, True), (128, False), (48, True), (16, False)])
def test_int8_rounding_is_int8_rounded(group, act):
    """A weight that picks one column per output row (code zero + 1 there, the zero elsewhere, scale 1): y is x
    rounded, each value its integer times its step. bfloat16 values of x hit exact halves (amax / 2 is 63.5 steps:
    ties to even), and a group of zeros stays zero. The torch reference gives int8_rounded's values to the bit (one
    float32 product each); the kernel within a tenth of a step of them (it takes the codes' offset off at the end:
    the sums of the codes as stored, less z times the sum of x, round apart), where a value rounded the other way
    would be a whole step off."""
    K = 256 if group != 48 else 240
    w = make_weight(K, K, group, "int4", torch.float32, act_order=act, seed=3)
    codes = torch.full((K, K), 8)
    codes[torch.arange(K), torch.arange(K) if w.perm is None else torch.argsort(w.perm)] = 9
    w.codes.copy_(pack_codes(codes))
    w.scales.fill_(1.0)
    w.int8_activations = True
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).float()
    x[1, :] = x[1, 0] / 2                          # every value half of one, 63.5 steps where that one is
    x[1, 0] *= 2                                   # the group's largest
    first_group = w.perm[:group] if act else torch.arange(group)      # the first group of the sorted columns
    x[2, first_group] = 0
    xs = x if w.perm is None else x.index_select(-1, w.perm)

    def in_x_order(t: torch.Tensor) -> torch.Tensor:   # sorted columns (act-order) back to x's
        return t if w.perm is None else torch.empty_like(t).index_copy_(-1, w.perm, t)
    expected = in_x_order(int8_rounded(xs, group))
    steps = in_x_order(xs.view(5, K // group, group).abs().amax(-1, keepdim=True).expand(5, K // group, group)
                       .reshape(5, K) / 127)
    assert torch.equal(expected[2, first_group], torch.zeros(group))
    assert torch.equal(w4_linear_reference(x, w), expected)
    off = (w4_cpu.w4_linear(x, w) - expected).abs()
    assert bool((off <= steps / 10).all()), f"{(off / steps.clamp_min(1e-30)).max():.3f} of a step off"


def test_int8_activations_leave_nvfp4_to_the_float_path():
    """int8 activations take int4 weights: an fp4 weight with the flag is not the kernel's (the float reference
    runs: its activations stay float), and the C kernel refuses the call by itself (code 2)."""
    w = int8_weight(40, 256, 16, "fp4", torch.float16)
    x = torch.randn(2, 256)
    assert not w4_cpu.usable(x, w)
    torch.testing.assert_close(w4_linear(x, w), F.linear(x, w.dequantize(torch.float32)), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="code 2"):
        w4_cpu.gemm(w4_cpu.library(), x, w.codes, w.scales, w.zeros, w.perm, 16, 1, w.zero_point, w.global_scale,
                    w.blocked, True)
