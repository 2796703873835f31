"""The pure parts and the host pass of `bench/gpu.py --profile`: a step's kernels against the card's roofs.

A decode step (batch 1 at 8K context, batch 8) as the engine runs it, inside its CUDA graph, and one 8K prefill chunk,
kernel by kernel: time, bytes moved, FLOPs, and the fraction of the HBM and tensor-core roofs (table a); their sum
against the measured step, so launch gaps and host work show (table b). The bytes and FLOPs of each kernel come from
a host pass over the same step without its graphs (`recording`: each kernel function's call and its arguments'
shapes, `OP_COSTS`; each aten op that launches a kernel), the times from torch.profiler. A decode step is a run of
1 + n tokens minus a run of 1 (the prefill), over n. Tested on the CPU (tests/test_triton_profile.py); the host pass
also runs there, the Triton kernels interpreted (`bench/gpu.py --profile --dry-run`), which counts the kernels one
step launches.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
import time
from typing import NamedTuple

import torch

class Roofs(NamedTuple):
    card: str
    hbm: float                  # HBM bandwidth, bytes/s
    bf16: float                 # dense tensor-core rate with fp32 accumulation, FLOP/s
    fp8: float                  # the same for FP8 (0: no FP8 tensor cores)


T = 1e12
CARDS = (   # substring of torch.cuda.get_device_name() -> datasheet roofs (dense, no sparsity); first match wins
    ("H200 NVL", Roofs("H200 NVL", 4.8 * T, 835.5 * T, 1671 * T)),
    ("H200", Roofs("H200 SXM", 4.8 * T, 989.5 * T, 1979 * T)),
    ("H100 NVL", Roofs("H100 NVL", 3.9 * T, 835.5 * T, 1671 * T)),
    ("H100 PCIe", Roofs("H100 PCIe", 2.0 * T, 756.5 * T, 1513 * T)),
    ("H100", Roofs("H100 SXM", 3.35 * T, 989.5 * T, 1979 * T)),
    ("B200", Roofs("B200", 8.0 * T, 2250 * T, 4500 * T)),
    ("L40S", Roofs("L40S", 0.864 * T, 362 * T, 733 * T)),
    ("L40", Roofs("L40", 0.864 * T, 181 * T, 362 * T)),
    ("RTX 6000 Ada", Roofs("RTX 6000 Ada", 0.96 * T, 364 * T, 728 * T)),
    ("RTX 4090", Roofs("RTX 4090", 1.008 * T, 165 * T, 330 * T)),       # GeForce: fp32 accumulation at half rate
    ("RTX 5090", Roofs("RTX 5090", 1.792 * T, 209 * T, 419 * T)),
    ("L4", Roofs("L4", 0.3 * T, 121 * T, 242 * T)),
    ("A100-SXM4-80GB", Roofs("A100 SXM 80GB", 2.039 * T, 312 * T, 0)),
    ("A100 80GB PCIe", Roofs("A100 PCIe 80GB", 1.935 * T, 312 * T, 0)),
    ("A100", Roofs("A100 40GB", 1.555 * T, 312 * T, 0)),
)


def roofs_for(device_name: str, copy_bandwidth: float = float("nan")) -> Roofs:
    """The roofs of a card by its name; an unknown card: the measured copy bandwidth and no tensor-core roof."""
    for key, roofs in CARDS:
        if key in device_name:
            return roofs
    return Roofs(f"{device_name} (unknown: measured copy bandwidth)", copy_bandwidth, float("nan"), float("nan"))


class Cost(NamedTuple):
    nbytes: int                 # what a perfect kernel moves to and from memory
    flops: int                  # matrix products only (elementwise work is nothing against either roof)
    fp8: bool = False           # multiplied on FP8 tensor cores (its roof is Roofs.fp8)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _weight(w):
    """(bytes, [N, K], FP8 w8a8) of a linear weight: a tensor or a kernels.fp8_weight.Fp8Weight."""
    if hasattr(w, "scale"):
        return _nbytes(w.weight, w.scale), tuple(w.weight.shape[-2:]), bool(w.act_quant)
    return _nbytes(w), tuple(w.shape), False


def _gemm(a: dict, out_cols_half: bool = False) -> Cost:
    x, wb_shape_fp8 = a["x"], _weight(a.get("weight", a.get("w")))
    wbytes, (N, K), fp8 = wb_shape_fp8
    M = x.numel() // K
    n_out = N // 2 if out_cols_half else N
    return Cost(wbytes + _nbytes(x, a.get("residual")) + M * n_out * x.element_size(), 2 * M * N * K, fp8)


def _attention(a: dict) -> Cost:
    q, kv = a["q"], a["kv_cache"]
    KV, hd = kv.shape[-2], kv.shape[-1]
    per_key = 2 * KV * hd * kv.element_size()
    if "cu_seqlens" in a:                                  # prefill: query j of n sees L - n + j + 1 keys
        cu, lens = a["cu_seqlens"], a["seq_lens"]
        seen = sum((cu[i + 1] - cu[i]) * (L - (cu[i + 1] - cu[i])) + (cu[i + 1] - cu[i]) * (cu[i + 1] - cu[i] + 1)
                   // 2 for i, L in enumerate(lens))
        return Cost(sum(lens) * per_key + 2 * _nbytes(q), 4 * seen * q.shape[1] * hd)
    lens = a["seq_lens"].long()
    rows = a.get("table_rows")
    keys = lens.sum() if rows is None else torch.zeros(int(rows.max()) + 1, dtype=torch.long, device=lens.device) \
        .scatter_reduce(0, rows, lens, "amax").sum()     # a verify's rows share their sequence's keys (L2)
    return Cost(int(keys) * per_key + 2 * _nbytes(q), 4 * int(lens.sum()) * q.shape[1] * hd)


def _gdn(a: dict, chunked: bool = False) -> Cost:
    q, v, state = a["q"], a["v"], a["state"]
    T, HV, dv = v.shape
    dk = q.shape[-1]
    state_bytes = HV * dk * dv * state.element_size()
    io = _nbytes(q, a["k"], v) + _nbytes(v)
    if chunked:    # per token and value head: the chunk's products (kk^T, w, u, q k^T) and the state's (w h, k^T v, q h)
        return Cost(io + 2 * len(a["slot_ids"]) * state_bytes, T * HV * (6 * dk * dv + 2 * 64 * (3 * dk + dv)))
    n = len(a["slot_ids"]) if "slot_ids" in a else a["lay"].in_slots.numel()       # decode / verify
    return Cost(io + (n + T) * state_bytes, 8 * T * HV * dk * dv)


def _conv(a: dict) -> Cost:
    x, w, s = a["x"], a["weight"], a["conv_state"]
    T, C = x.shape
    return Cost(2 * _nbytes(x) + _nbytes(w) + 2 * T * C * (w.shape[1] - 1) * s.element_size(), 0)


def _elementwise(reads: float, writes: float):
    def cost(a: dict) -> Cost:
        x = next(iter(a.values()))
        return Cost(int((reads + writes) * _nbytes(x)), 0)
    return cost


def _experts(a: dict) -> Cost:
    x, ids = a["x"], a["topk_ids"]
    hit = int(ids.unique().numel())
    per_expert = sum(_weight(w)[0] // w.shape[0] for w in (a["w_gate_up"], a["w_down"]))
    (N1, H), (H2, I) = _weight(a["w_gate_up"])[1], _weight(a["w_down"])[1]
    return Cost(hit * per_expert + 2 * _nbytes(x), 2 * ids.numel() * (N1 * H + H2 * I), _weight(a["w_down"])[2])


# the public functions of the Triton modules (what kernels/*.py dispatch to), each with its cost
OP_COSTS = {
    "linear_triton.decode_linear": lambda a: _gemm(a, out_cols_half=bool(a.get("silu_mul"))),
    "fp8_triton.fp8_linear": _gemm,
    "fp8_prefill_triton.fp8_linear": _gemm,
    "norm_triton.rms_norm": _elementwise(1, 1),
    "norm_triton.gated_rms_norm": _elementwise(2, 1),
    "norm_triton.l2_norm": lambda a: Cost(a["x"].numel() * (a["x"].element_size() + 4), 0),      # fp32 out
    "gdn_triton.gdn_gating": lambda a: Cost(_nbytes(a["ba"]) + a["ba"].numel() * 4, 0),          # g, beta fp32
    "attention_triton.store_kv": lambda a: Cost(2 * _nbytes(a["k"]) + 2 * a["k"].numel() * a["pool"].element_size(),
                                                0),
    "activation_triton.silu_and_mul": _elementwise(1, 0.5),
    "rotary_triton.apply_rotary": _elementwise(1, 1),
    "conv_triton.causal_conv1d_decode": _conv,
    "conv_triton.causal_conv1d_verify": _conv,
    "conv_triton.causal_conv1d_prefill": _conv,
    "gdn_triton.recurrent_gated_delta_rule_decode": _gdn,
    "gdn_triton.recurrent_gated_delta_rule_verify": _gdn,
    "gdn_triton.chunk_gated_delta_rule": lambda a: _gdn(a, chunked=True),
    "attention_triton.paged_attention_decode": _attention,
    "attention_triton.paged_attention_prefill": _attention,
    "attention_sdpa.prefill": _attention,
    "moe_triton.fused_experts": _experts,
}
GEMM_OPS = {"linear_triton.decode_linear", "fp8_triton.fp8_linear", "fp8_prefill_triton.fp8_linear",
            "moe_triton.fused_experts", "torch: cuBLAS GEMM"}
TORCH_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "linear", "_linear_pointwise"}   # the last: oneDNN
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def aten_cost(name: str, args: list, out: list) -> Cost:
    """An aten op's bytes: its tensors in and out, where an input many times larger than what the op writes is a
    pool or a table it indexes (counted at 16x the written size at most, a MB at least)."""
    ins = [a for a in args if isinstance(a, torch.Tensor)]
    outs = [o for o in out if isinstance(o, torch.Tensor)]
    if name.endswith("_") and ins:      # in place: reads what it is given, writes as much as its last argument
        return Cost(sum(_nbytes(t) for t in ins[1:]) + _nbytes(ins[-1]), 0)
    written = _nbytes(*outs)
    moved = written + sum(min(_nbytes(t), max(16 * written, 1 << 20)) for t in ins)
    flops = 0
    if name in ("linear", "_linear_pointwise"):           # x [..., K] @ w [N, K]^T
        flops = 2 * ins[0].numel() * ins[1].shape[0]
    elif name in TORCH_GEMMS and len(ins) >= 2:           # a [.., M, K] @ b [.., K, N]
        flops = 2 * ins[-2].numel() * ins[-1].shape[-1]
    return Cost(moved, flops)


class Tally:
    """Per op: calls, bytes, FLOPs and the Triton kernels it launched; and the launches of the whole run."""

    def __init__(self) -> None:
        self.ops: dict[str, list] = {}             # op -> [calls, bytes, flops, fp8, kernel names]
        self.launches: dict[str, int] = {}         # "triton <kernel>" / "torch <aten op>" -> count

    def add(self, op: str, cost: Cost, kernels: tuple[str, ...] = ()) -> None:
        row = self.ops.setdefault(op, [0, 0, 0, False, set()])
        row[0] += 1
        row[1] += cost.nbytes
        row[2] += cost.flops
        row[3] |= cost.fp8
        row[4] |= set(kernels)

    def per_step(self, before: "Tally", steps: int) -> "Tally":
        """(this - before) / steps: what each of `steps` decode steps adds to a run."""
        out = Tally()
        for op, (n, b, f, fp8, ks) in self.ops.items():
            n0, b0, f0 = before.ops.get(op, [0, 0, 0])[:3]
            if n > n0:
                out.ops[op] = [(n - n0) / steps, (b - b0) / steps, (f - f0) / steps, fp8, ks]
        out.launches = {k: (v - before.launches.get(k, 0)) / steps for k, v in self.launches.items()
                        if v > before.launches.get(k, 0)}
        return out


@contextlib.contextmanager
def recording(tally: Tally, model):
    """While inside: every call of an OP_COSTS function and the Triton kernels it launches, and every aten op that
    launches a kernel (the views and allocations do not), added to `tally`: costs wherever they run, launches only
    inside model.forward (what a CUDA graph captures). Aten ops inside an OP_COSTS function count as launches but
    not as bytes (the function's cost counts them)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    stack: list[list[str]] = []
    in_forward, quiet = [0], [0]            # quiet: inside a launch (the interpreter's own ops) or a cost's ops
    patched = []

    def count(key: str) -> None:
        if in_forward[0] and not quiet[0]:
            tally.launches[key] = tally.launches.get(key, 0) + 1
    forward = model.forward

    def counted_forward(*args, **kwargs):
        in_forward[0] += 1
        try:
            return forward(*args, **kwargs)
        finally:
            in_forward[0] -= 1
    for key, cost in OP_COSTS.items():
        mod_name, fn_name = key.split(".")
        mod = importlib.import_module(f"tinyserve.kernels.{mod_name}")
        fn = getattr(mod, fn_name)
        names = list(inspect.signature(fn).parameters)

        def spy(*args, _fn=fn, _key=key, _cost=cost, _names=names, **kwargs):
            stack.append([])
            try:
                return _fn(*args, **kwargs)
            finally:
                kernels = stack.pop()
                quiet[0] += 1
                tally.add(_key, _cost({**dict(zip(_names, args)), **kwargs}), tuple(kernels))
                quiet[0] -= 1
        patched.append((mod, fn_name, fn))
        setattr(mod, fn_name, spy)
    runs = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]

    def launch(self, *args, _run, **kwargs):
        name = self.fn.__name__
        count(f"triton {name}")
        if stack:
            stack[-1].append(name)
        quiet[0] += 1
        try:
            return _run(self, *args, **kwargs)
        finally:
            quiet[0] -= 1

    class AtenOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.__name__.split(".")[0]
            view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
            if not view and name not in ALLOCATIONS and not quiet[0]:
                count(f"torch {name}")
                if not stack:
                    flat = [a for a in args if isinstance(a, torch.Tensor)] + \
                        [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
                    outs = out if isinstance(out, (list, tuple)) else [out]
                    c = aten_cost(name, flat, list(outs))
                    tally.add("torch: cuBLAS GEMM" if name in TORCH_GEMMS else "torch: other ops", c)
            return out
    for cls, run in runs:
        cls.run = functools.partialmethod(launch, _run=run)
    model.forward = counted_forward
    try:
        with AtenOps():
            yield tally
    finally:
        del model.forward
        for cls, run in runs:
            cls.run = run
        for mod, fn_name, fn in patched:
            setattr(mod, fn_name, fn)


def device_op(kernel: str, triton_ops: dict[str, str]) -> str:
    """The table row a device kernel's time goes to: the op that launched it (Triton kernels by name), SDPA's flash
    kernels to attention_sdpa.prefill, cuBLAS's GEMMs, copies, and the rest of torch's kernels."""
    if kernel in triton_ops:
        return triton_ops[kernel]
    low = kernel.lower()
    if "memcpy" in low or "memset" in low:
        return "copies"
    if ("flash" in low or "fmha" in low) and "attention_sdpa.prefill" in triton_ops.values():
        return "attention_sdpa.prefill"
    if re.search(r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitkreduce", low):
        return "torch: cuBLAS GEMM"
    return "torch: other ops"


def profile_rows(tally: Tally, kernel_us: dict[str, float], step_us: float, roofs: Roofs) -> list[tuple]:
    """Table (a)'s rows, the most time first: (op, calls, us, share of the step, MB, GFLOP, GB/s, % of the HBM roof,
    TFLOP/s, % of the tensor-core roof). kernel_us: device time per step by kernel name (empty: host pass only)."""
    owner = {k: op for op, row in tally.ops.items() for k in row[4]}
    time = {}
    for kernel, us in kernel_us.items():
        op = device_op(kernel, owner)
        time[op] = time.get(op, 0.0) + us
    rows = []
    for op in set(tally.ops) | set(time):
        calls, nbytes, flops, fp8, _ = tally.ops.get(op, [0, 0, 0, False, set()])
        us = time.get(op, float("nan"))
        sec = us * 1e-6
        peak = roofs.fp8 if fp8 else roofs.bf16
        rows.append((op, calls, us, us / step_us if step_us else float("nan"), nbytes / 1e6, flops / 1e9,
                     nbytes / sec / 1e9 if sec else float("nan"), nbytes / sec / roofs.hbm if sec else float("nan"),
                     flops / sec / 1e12 if sec else float("nan"), flops / sec / peak if sec and peak else float("nan")))
    return sorted(rows, key=lambda r: (-(r[2] if r[2] == r[2] else -1), -r[4]))


def format_profile(title: str, rows: list[tuple], step_us: float, launches: dict[str, float],
                   kernel_count: float = float("nan")) -> list[str]:
    """Tables (a) and (b) of one phase as lines."""
    out = [title, f"{'op':<44} {'calls':>6} {'us':>9} {'step':>6} {'MB':>9} {'GFLOP':>8} {'GB/s':>7} {'HBM':>5} "
           f"{'TFLOP/s':>8} {'TC':>5}"]

    def pct(v):
        return f"{v:>5.0%}" if v == v else f"{'-':>5}"
    for op, calls, us, share, mb, gf, gbs, hbm, tf, tc in rows:
        out.append(f"{op:<44} {calls:>6.1f} {us:>9.1f} {pct(share)} {mb:>9.2f} {gf:>8.2f} {gbs:>7.0f} {pct(hbm)} "
                   f"{tf:>8.1f} {pct(tc)}")
    kernels = sum(r[2] for r in rows if r[2] == r[2])
    gemm = sum(r[2] for r in rows if r[0] in GEMM_OPS and r[2] == r[2])
    triton = sum(v for k, v in launches.items() if k.startswith("triton "))
    torch_ops = {k[6:]: v for k, v in launches.items() if k.startswith("torch ")}
    out.append(f"(b) launches inside the model's forward (what the CUDA graph holds): {triton:.0f} Triton kernels + "
               f"{sum(torch_ops.values()):.0f} torch ops ("
               + ", ".join(f"{k} {v:.0f}" for k, v in sorted(torch_ops.items(), key=lambda kv: -kv[1])) + ")")
    if kernel_count == kernel_count:
        out.append(f"    kernels on the device per step (the profiler): {kernel_count:.0f}")
    if step_us == step_us and kernels:
        out.append(f"    kernels {kernels:.0f} us of a measured {step_us:.0f} us step: launch gaps and host work "
                   f"{step_us - kernels:.0f} us ({(step_us - kernels) / step_us:.0%}); non-GEMM kernels "
                   f"{(kernels - gemm) / step_us:.0%} of the step (target <= 15% at batch 1)")
    return out


def kernel_times(run) -> tuple[dict[str, float], float, int]:
    """Device time by kernel name (us), the wall time (us) and the number of device kernels of run(), under
    torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6
    times: dict[str, float] = {}
    count = 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.time_range.elapsed_us()
            count += "memcpy" not in e.name.lower() and "memset" not in e.name.lower()
    return times, wall, count


def profile_phase(eng, prompts: list[list[int]], steps: int, device, roofs: Roofs, title: str) -> list[str]:
    """One phase's tables: steps > 0, a decode step (a run of 1 + steps tokens minus a run of 1, over steps);
    steps == 0, the prompts' prefill. The host pass runs without the CUDA graphs, the same kernels eagerly."""
    from tinyserve.sampling import SamplingParams

    def run(n):
        return lambda: eng.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    run(1 + steps)()                                           # warm-up: every kernel compiled, graphs captured
    static = getattr(getattr(eng, "runner", None), "static", None)
    graphs = dict(static.graphs) if static is not None else {}
    if static is not None:
        static.graphs.clear()
    try:
        with recording(Tally(), eng.runner.model) as one:
            run(1)()
        with recording(Tally(), eng.runner.model) as many:
            run(1 + steps)()
    finally:
        if static is not None:
            static.graphs.update(graphs)
    tally = many.per_step(one, steps) if steps else one
    if device.type != "cuda":
        return format_profile(title, profile_rows(tally, {}, float("nan"), roofs), float("nan"), tally.launches)
    k1, w1, c1 = kernel_times(run(1))
    if steps:
        kn, wn, cn = kernel_times(run(1 + steps))
        per_kernel = {k: (v - k1.get(k, 0.0)) / steps for k, v in kn.items() if v > k1.get(k, 0.0)}
        step_us, count = (wn - w1) / steps, (cn - c1) / steps
    else:
        per_kernel, step_us, count = k1, w1, c1
    return format_profile(title, profile_rows(tally, per_kernel, step_us, roofs), step_us, tally.launches, count)


def sweep_tiles(device, say) -> None:
    """The decode GEMM's tiles (BN, split, stages) and the prefill GEMM's (stages, flatten, group_m) around the
    defaults, timed on this card at Qwen3.5-27B's w8a8 shapes: the default against the best (decode in GB/s of the
    weight stream, prefill in TFLOP/s), so the first run on a card can set linear_triton.decode_tiles and
    fp8_prefill_triton.PREFILL_TILES from measurements. A few minutes (each tile shape compiles once)."""
    from triton.testing import do_bench

    from tinyserve.kernels import fp8_prefill_triton as prefill
    from tinyserve.kernels import linear_triton
    from tinyserve.kernels.fp8_weight import Fp8Weight
    g = torch.Generator(device=device).manual_seed(2)
    sms = linear_triton.num_sms(device)

    def weight(N: int, K: int) -> Fp8Weight:
        w = Fp8Weight(N, K, (128, 128), device, act_quant=True)
        w.weight.copy_((torch.randn(N, K, generator=g, device=device) * 64).clamp(-448, 448).to(w.weight.dtype))
        w.scale.fill_(1e-3)
        return w
    for N, K in ((34816, 5120), (5120, 17408), (16384, 5120), (5120, 6144), (14336, 5120)):
        w, x = weight(N, K), torch.randn(1, K, generator=g, device=device).bfloat16()
        default = linear_triton.decode_tiles(N, K, 1, False, sms)
        options = {default, default._replace(num_stages=3), default._replace(num_stages=5)}
        options |= {linear_triton.DecodeTiles(BN, split, 4, 4) for BN in (16, 32, 64) for split in (1, 2, 4)
                    if -(-N // BN) * split >= sms}
        us = {t: do_bench(lambda t=t: linear_triton.decode_linear(x, w, tiles=t)) * 1e3 for t in options}
        best = min(us, key=us.get)
        say(f"decode w8a8 1x{K} @ {N}x{K}: default {tuple(default)} {N * K / us[default] / 1e3:.0f} GB/s; best "
            f"{tuple(best)} {N * K / us[best] / 1e3:.0f} GB/s (BN, split, warps, stages)")
    family = prefill.card_family(device)
    if family is None:
        say("prefill: this card has no TMA family (the pointer kernel's tile_shape stays)")
        return
    base = prefill.PREFILL_TILES[family]
    for M, (N, K) in ((2048, (34816, 5120)), (8192, (34816, 5120)), (8192, (5120, 17408))):
        w, x = weight(N, K), torch.randn(M, K, generator=g, device=device).bfloat16()
        options = {base._replace(num_stages=s, flatten=f, group_m=gm) for s in (base.num_stages - 1, base.num_stages)
                   for f in (True, False) for gm in (8, 16)}
        ms = {}
        for t in options:
            try:
                ms[t] = do_bench(lambda t=t: prefill.fp8_linear(x, w, t))
            except Exception as e:                    # out of shared memory on this card: not a candidate
                say(f"   {tuple(t)}: {type(e).__name__}")
        best = min(ms, key=ms.get)
        say(f"prefill w8a8 {M}x{K} @ {N}x{K}: default {tuple(base)} {2 * M * N * K / ms[base] / 1e9:.0f} TFLOP/s; "
            f"best {tuple(best)} {2 * M * N * K / ms[best] / 1e9:.0f} TFLOP/s (BM, BN, group_m, warps, stages, "
            "flatten)")
