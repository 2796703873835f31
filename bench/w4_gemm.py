"""The CPU GEMM for packed 4-bit weights (kernels/w4_cpu.c) against tinyserve's float32 routes, on the weight shapes
of bench/common.py's MEMORY_BOUND model (~190M parameters, the decode that is bound by reading its weights).

For each projection shape, rows of x (1, 2, 4, 8, 16: decode batches; 256: a prefill chunk) and group size: the 4-bit
op as a compiled graph calls it (torch.ops.tinyserve.w4_linear_cpu), float32 F.linear (MKL) and oneDNN
(kernels/linear.py's two CPU routes, the faster one counted), and the torch reference (w4_linear_reference). Each
weight is one of enough copies to pass the last-level cache twice over, cycled, so every call reads its weight from
memory as a decode step does (the model's 4-bit weights are ~3x this CPU's L3). GB/s: the packed bytes (codes,
scales, zeros) read per second, against this machine's read bandwidth (a sum over a 512 MB tensor) and copy bandwidth
(a torch copy, read + write).

A last table: every projection of one decode step of the whole model in order (12 layers and the lm_head), the
4-bit op against the faster float32 route: what the engine's decode can at most gain from its GEMMs.

Timing on a shared machine: every measurement of a table takes its turn in each round (a burst of another process's
load slows one round of all of them, not all rounds of one), and each figure is the best of the rounds; the line at
the end says how many cores other processes used meanwhile.

  python bench/w4_gemm.py                 # both group sizes, all shapes (~5 minutes on 2 cores)
  python bench/w4_gemm.py --groups 32 --rows 1 8 --rounds 15 --no-reference
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MEMORY_BOUND, CpuMeter, fmt_table, load_average  # noqa: E402
from tinyserve.kernels import w4_cpu  # noqa: E402
from tinyserve.kernels.w4 import w4_linear_reference  # noqa: E402
from tinyserve.kernels.w4_weight import W4Weight, pack_codes  # noqa: E402

COLD_BYTES = 2 * 32 << 20          # cycle through copies of at least this many bytes (twice a 32 MB L3)
_onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def model_shapes(spec=MEMORY_BOUND) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of each projection of the model (models/qwen3_next.py's engine layout)."""
    H, I = spec.hidden_size, spec.intermediate_size
    kd = spec.linear_num_key_heads * spec.linear_key_head_dim
    vd = spec.linear_num_value_heads * spec.linear_value_head_dim
    hd = spec.head_dim
    return {"gdn in_proj_qkvz": (2 * kd + 2 * vd, H), "gdn in_proj_ba": (2 * spec.linear_num_value_heads, H),
            "gdn out_proj": (H, vd),
            "attn qkv_proj": (spec.num_attention_heads * 2 * hd + 2 * spec.num_key_value_heads * hd, H),
            "attn o_proj": (H, spec.num_attention_heads * hd), "mlp gate_up": (2 * I, H), "mlp down": (H, I),
            "lm_head": (spec.vocab_size, H)}


def step_shapes(spec=MEMORY_BOUND) -> list[tuple[int, int]]:
    """The projections of one decode step in order (3 linear-attention layers, then a full-attention one)."""
    s = model_shapes(spec)
    out = []
    for i in range(spec.num_hidden_layers):
        if (i + 1) % 4 == 0:
            out += [s["attn qkv_proj"], s["attn o_proj"]]
        else:
            out += [s["gdn in_proj_qkvz"], s["gdn in_proj_ba"], s["gdn out_proj"]]
        out += [s["mlp gate_up"], s["mlp down"]]
    return out + [s["lm_head"]]


def random_w4(N: int, K: int, group: int, gen: torch.Generator) -> W4Weight:
    """A GPTQ-like weight: int4 codes, float16 scales, symmetric (zero 8)."""
    w = W4Weight(N, K, group, kind="int4", scale_dtype=torch.float16)
    w.codes.copy_(pack_codes(torch.randint(0, 16, (N, K), generator=gen)))
    w.scales.copy_((torch.rand(N, K // group, generator=gen) * 0.01 + 1e-3).half())
    w4_cpu.block_weights(w)                 # the layout the loader gives the CPU kernel
    return w


def w4_call(w: W4Weight):
    """x -> the op's call as a compiled graph makes it (kernels/w4_cpu.py's w4_linear adds ~5 us of Python in eager
    code)."""
    op = torch.ops.tinyserve.w4_linear_cpu.default if w4_cpu.op_in_cpp() else \
        torch.ops.tinyserve.w4_linear_cpu_python.default
    args = (w.codes, w.scales, w.zeros, w.perm, w.group, w4_cpu.KIND_CODES[w.kind], w.zero_point, w.global_scale,
            w.blocked, w4_cpu.GEMM_ROWS[torch.float32], False)
    return lambda x: op(x, *args)


def f32_routes(x: torch.Tensor) -> dict:
    routes = {"mkl": lambda w: F.linear(x, w)}
    if _onednn is not None:
        routes["onednn"] = lambda w: _onednn(x, w, None, "none", [], "")
    return routes


def memory_bandwidth() -> tuple:
    """Two timed callables: a sum over 512 MB (read) and a 256 MB copy (read + write); their bytes."""
    a, b = torch.ones(128 << 20), torch.empty(64 << 20)
    return (lambda: a.sum(), a.numel() * 4), (lambda: b.copy_(a[: b.numel()]), 2 * b.numel() * 4)


class Timings:
    """Named measurements taken in turns: each round runs every one once; `best` keeps each one's fastest."""

    def __init__(self) -> None:
        self.runs: dict = {}

    def add(self, key, fn, calls: int = 1) -> None:
        self.runs[key] = (fn, calls)

    def measure(self, rounds: int) -> dict:
        for fn, _ in self.runs.values():                    # warm up: oneDNN's primitives, the library, the pages
            fn()
        best = dict.fromkeys(self.runs, float("inf"))
        for _ in range(rounds):
            for key, (fn, calls) in self.runs.items():
                t = time.perf_counter()
                fn()
                best[key] = min(best[key], (time.perf_counter() - t) / calls)
        return best


def cycling(fn, items: list, calls: int):
    """fn over the items, `calls` calls in all (cycling through them)."""
    def run():
        for i in range(calls):
            fn(items[i % len(items)])
    return run


@torch.inference_mode()
def shape_table(shapes: dict, group: int, rows_list: list[int], rounds: int, reference: bool,
                gen: torch.Generator, dtype: torch.dtype) -> tuple[list, float, float]:
    t = Timings()
    (read_fn, read_bytes), (copy_fn, copy_bytes) = memory_bandwidth()
    t.add("read", read_fn)
    t.add("copy", copy_fn)
    sizes = {}
    for name, (N, K) in shapes.items():
        w4s = [random_w4(N, K, group, gen) for _ in range(max(2, -(-COLD_BYTES // (N * K // 2))))]
        f32s = [torch.randn(N, K, generator=gen) * 0.02 for _ in range(max(2, -(-COLD_BYTES // (N * K * 4))))]
        sizes[name] = w4s[0].nbytes()
        calls = [w4_call(w) for w in w4s]
        for rows in rows_list:
            x = torch.randn(rows, K, generator=gen)
            x4 = x.to(dtype)
            big = rows > 16                                 # compute-bound: a few calls are enough
            n4, nf = (3, 2) if big else (len(calls), len(f32s))
            t.add((name, rows, "w4"), cycling(lambda call, x=x4: call(x), calls, n4), n4)
            for route, fn in f32_routes(x).items():
                t.add((name, rows, route), cycling(fn, f32s, nf), nf)
            if reference:
                t.add((name, rows, "reference"), cycling(lambda w, x=x4: w4_linear_reference(x, w), w4s, 2), 2)
    best = t.measure(rounds)
    read_bw, copy_bw = read_bytes / best["read"] / 1e9, copy_bytes / best["copy"] / 1e9
    out = []
    for name, (N, K) in shapes.items():
        for rows in rows_list:
            w4 = best[(name, rows, "w4")]
            route = min((r for r in ("mkl", "onednn") if (name, rows, r) in best), key=lambda r: best[(name, rows, r)])
            f32 = best[(name, rows, route)]
            gbs = sizes[name] / w4 / 1e9
            ref = best.get((name, rows, "reference"))
            out.append((name, f"{N}x{K}", str(rows), f"{w4 * 1e6:.0f}", f"{gbs:.1f}", f"{100 * gbs / read_bw:.0f}%",
                        f"{f32 * 1e6:.0f} ({route})", f"{f32 / w4:.2f}", f"{ref * 1e6:.0f}" if ref else "-"))
    return out, read_bw, copy_bw


@torch.inference_mode()
def step_table(group: int, rows_list: list[int], rounds: int, gen: torch.Generator, read_bw: float,
               dtype: torch.dtype) -> list:
    """One decode step's projections (the whole model), 4-bit against float32's faster route."""
    shapes = step_shapes()
    w4s = [random_w4(N, K, group, gen) for N, K in shapes]
    f32s = [torch.randn(N, K, generator=gen) * 0.02 for N, K in shapes]
    w4_bytes, f32_bytes = sum(w.nbytes() for w in w4s), sum(w.numel() * 4 for w in f32s)
    t = Timings()
    for rows in rows_list:
        xs = {K: torch.randn(rows, K, generator=gen) for K in {k for _, k in shapes}}
        calls = [(w4_call(w), xs[w.in_features].to(dtype)) for w in w4s]
        t.add((rows, "w4"), lambda calls=calls: [call(x) for call, x in calls])
        for route in f32_routes(xs[shapes[0][1]]):
            routes = [(f32_routes(xs[w.shape[1]])[route], w) for w in f32s]
            t.add((rows, route), lambda routes=routes: [fn(w) for fn, w in routes])
    best = t.measure(rounds)
    out = []
    for rows in rows_list:
        w4 = best[(rows, "w4")]
        f32 = min(v for (r, route), v in best.items() if r == rows and route != "w4")
        out.append((str(rows), f"{w4 * 1e3:.2f}", f"{w4_bytes / w4 / 1e9:.1f}", f"{w4_bytes / read_bw / 1e6:.2f}",
                    f"{f32 * 1e3:.2f}", f"{f32_bytes / f32 / 1e9:.1f}", f"{f32 / w4:.2f}"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 256])
    ap.add_argument("--shapes", nargs="+", help="names from: " + ", ".join(model_shapes()))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-reference", action="store_true", help="leave out the (slow) torch reference")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="x's dtype for the 4-bit op (the float32 routes stay float32)")
    ap.add_argument("--no-step", action="store_true", help="leave out the whole-step table")
    args = ap.parse_args()
    if not w4_cpu.built():
        raise SystemExit("kernels/w4_cpu.c did not build (no C compiler?)")
    gen, dtype = torch.Generator().manual_seed(0), getattr(torch, args.dtype)
    meter, load = CpuMeter().start(), load_average()
    path = {512: "AVX-512", 256: "AVX2+FMA", 0: "portable C"}[w4_cpu.library().w4_path()]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, kernel path {path}, op in "
          f"{'C++' if w4_cpu.op_in_cpp() else 'Python'}; best of {args.rounds} rounds; load before: {load}\n")
    shapes = {k: v for k, v in model_shapes().items() if not args.shapes or k in args.shapes}
    for group in args.groups:
        rows, read_bw, copy_bw = shape_table(shapes, group, args.rows, args.rounds, not args.no_reference, gen,
                                               dtype)
        print(f"int4, group {group}, float16 scales, {args.dtype} x; memory: read {read_bw:.1f} GB/s, copy {copy_bw:.1f} "
              f"GB/s (read + write)")
        print(fmt_table(rows, ("projection", "N x K", "rows", "w4 us", "w4 GB/s", "of read bw", "f32 us (route)",
                               "f32 / w4", "reference us")))
        print()
        if not args.no_step:
            step = step_table(group, [n for n in args.rows if n <= 16], args.rounds, gen, read_bw, dtype)
            print(f"one decode step's projections (the whole model: {len(step_shapes())} GEMMs), group {group}:")
            print(fmt_table(step, ("rows", "w4 ms", "w4 GB/s", "w4 at read bw ms", "f32 ms", "f32 GB/s",
                                   "f32 / w4")))
            print()
    print(f"other processes used {meter.others_cores():.2f} cores on average while this ran (load after: "
          f"{load_average()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
