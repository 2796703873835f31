"""The GPU check to run first on a CUDA machine (a few minutes; needs CUDA, torch and triton, nothing else of
tinyserve's dependencies, and no install of tinyserve):

    python3 bench/gpu_check.py            # from the repository root; PYTHONUNBUFFERED=1 to watch it live

1. The Triton kernel tests, compiled on the device (tests/test_triton_*.py: the tiny ragged tier on CUDA,
   then the `gpu` tier with bf16 and Qwen3.5-27B shapes), in a subprocess, so a device fault there cannot spoil
   the timings. The test that runs a whole model (it needs the full test environment) is left out.
2. One CUDA graph: a GDN decode layer's kernels and a paged attention decode, captured and replayed (no host sync
   inside), against the same calls run eagerly.
3. Per-kernel timings, Triton against the torch reference on the same CUDA tensors, on Qwen3.5-27B shapes (hidden
   5120, MLP 17408, GDN 16 key / 48 value heads of 128, conv_dim 10240, attention 24 q / 4 KV heads of 256), with
   each kernel's max error against the reference computed in fp32 and its effective bandwidth. One table. The
   decode GEMM (kernels/linear_triton.py) at every projection of a 27B and a 35B-A3B decode step with what
   kernels.linear fuses there ("decode ..." rows: its GB/s against the card's bandwidth is the number to read).
   4-bit weights (kernels/w4_triton.py): a copy's bandwidth first ("copy" row), the 4-bit decode GEMM at the same
   projections ("w4 decode ..."), the prefill through the in-tile kernel and through scratch + cuBLAS at 64..2048
   rows ("w4 prefill ..."), the fused MoE with 4-bit experts ("moe w4 ..."); after the table, each 4-bit decode
   row as a fraction of the copy bandwidth (target 85%) and the rows from which scratch + cuBLAS wins.
4. The Qwen3.5-27B vision tower on one 1024x1024 image in bf16 (random weights): time and peak memory.

Everything printed also goes to $OUT/gpu_check.txt when OUT is set (tests/gpu.sh sets it).

    python3 bench/gpu_check.py --skip-tests --only w4 copy     # the 4-bit rows and their summary (~1 minute)
    python3 bench/gpu_check.py --skip-tests --only copy --w4-sweep   # + the 4-bit decode tiles, default vs best

Without a GPU:
    .venv/bin/python bench/gpu_check.py --compile   # every kernel variant of section 3 compiled for sm_90/89/120
                                                    # with the ptxas in the triton wheel: shared memory, registers,
                                                    # spills, the widest global load (16B: vectorised; tma)
    .venv/bin/python bench/gpu_check.py --compile --only decode "fp8 prefill"   # the cases so named
    .venv/bin/python bench/gpu_check.py --dry-run   # section 3 on tiny shapes under the interpreter (the script)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOG: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LOG.append(line)


def import_kernels_from_the_tree() -> None:
    """Make `tinyserve.kernels` importable from this checkout without installing the package (the device machine
    has torch and triton but not tinyserve's other dependencies): pyproject maps it to the top-level kernels/."""
    try:
        import tinyserve.kernels  # noqa: F401
        return
    except ImportError:
        pass
    sys.path.insert(0, str(ROOT))
    import tinyserve
    for name, folder in (("tinyserve.kernels", ROOT / "kernels"), ("tinyserve.models", ROOT / "models")):
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        setattr(tinyserve, name.split(".")[1], mod)


# ---------------------------------------------------------------------------------------------------------------
# 1. tests
# ---------------------------------------------------------------------------------------------------------------
def run_tests() -> int:
    say("== 1. tests/test_triton_*.py on the device")
    t0 = time.time()
    proc = subprocess.run([sys.executable, __file__, "--pytest"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    for line in out[-60:] if proc.returncode else out[-3:]:
        say("   " + line)
    say(f"   exit {proc.returncode} in {time.time() - t0:.0f} s")
    return proc.returncode


def pytest_main() -> int:
    import pytest
    import_kernels_from_the_tree()
    files = sorted(str(f) for f in (ROOT / "tests").glob("test_triton_*.py"))
    return pytest.main(["-q", "-rfEs", "--noconftest", "-p", "no:cacheprovider", "-o", "addopts=", "-x",
                        "--timeout", "240", "-k", "not greedy_tokens", *files])


# ---------------------------------------------------------------------------------------------------------------
# shapes and cases
# ---------------------------------------------------------------------------------------------------------------
HIDDEN, MLP = 5120, 17408
NK, NV, DK, DV, CONV, KW = 16, 48, 128, 128, 10240, 4
NH, NKV, HD, ROTARY = 24, 4, 256, 64
TOKENS = (1, 32, 2048)                    # rows of the norm / activation cases (decode, a batch, a prefill chunk)
DECODE_N = (1, 8, 32)                     # sequences of the GDN / conv decode cases
VERIFY = ((1, 4), (8, 4))                 # (sequences, tokens each) of the verify cases: NEXTN with 3 drafts
PAGED = None                              # (kv dtype, page size, sequences, context) per case; None: paged_cases
ACT = None                                # activation dtype; None: bf16
GEMM_ROWS = (1, 8, 2048)                  # rows of the block-FP8 GEMM cases (decode, a batch, a prefill chunk)
GEMMS = ((HIDDEN, 2 * MLP), (MLP, HIDDEN), (HIDDEN, 2 * NK * DK + 2 * NV * DV), (NV * DV, HIDDEN))   # (K, N)
PREFILL = ((2048,), (1000, 2900, 196))    # sequence lengths of the chunked GDN and conv prefill cases
PREFILL_ATTN = None                       # (kv dtype, page size, cached tokens, new tokens) per case; None: below
DECODE_ROWS = (1, 8)                      # rows of the decode GEMM cases (kernels/linear_triton.py)
# (model, projection, N, K, what is fused): each projection of a decode step as kernels.linear runs it
DECODE_GEMMS = (("27B", "gate_up", 2 * MLP, HIDDEN, "norm+silu"), ("27B", "down", HIDDEN, MLP, "residual"),
                ("27B", "gdn in", 2 * NK * DK + 2 * NV * DV, HIDDEN, "norm"), ("27B", "gdn out", HIDDEN, NV * DV,
                                                                               "residual"),
                ("27B", "attn qkv", 2 * NH * HD + 2 * NKV * HD, HIDDEN, "norm"), ("27B", "lm_head", 248320, HIDDEN, ""),
                ("35B-A3B", "shared gate_up", 2 * 512, 2048, "norm+silu"), ("35B-A3B", "shared down", 2048, 512,
                                                                             "residual"),
                ("35B-A3B", "gdn in", 12288, 2048, "norm"), ("35B-A3B", "attn out", 2048, 4096, "residual"))
EMPTY_WEIGHTS = False                     # --compile: big weights left unfilled (nothing is launched)
PREFILL_GEMM_ROWS = (2048,)               # rows of the explicit TMA GEMM cases (CPU only: on a GPU fp8_linear's own)


def prefill_attn_cases(bf, fp8):
    return [(bf, 16, (0,), (8192,)), (bf, 16, (8192,), (2048,)), (fp8, 16, (8192,), (2048,)),
            (bf, 64, (30000, 0, 37), (2048, 300, 1)), (bf, 1, (4096,), (512,))]


def paged_cases(bf, fp8):
    return [(bf, 16, 1, 1024), (bf, 16, 1, 32768), (bf, 16, 8, 8192), (bf, 16, 16, 16384),
            (bf, 1, 8, 8192), (bf, 64, 8, 8192), (fp8, 16, 8, 8192), (fp8, 16, 16, 16384)]


def shrink_for_compile() -> None:
    """--compile: the real head dims and dtypes (they set the kernels' constexprs), short contexts and few rows."""
    global TOKENS, DECODE_N, PAGED, GEMM_ROWS, PREFILL, PREFILL_ATTN, DECODE_ROWS, EMPTY_WEIGHTS
    import torch
    bf, fp8 = torch.bfloat16, torch.float8_e4m3fn
    global PREFILL_GEMM_ROWS
    TOKENS, DECODE_N, GEMM_ROWS, PREFILL = (1, 64), (1,), (1, 64, 256), ((70,),)
    DECODE_ROWS, EMPTY_WEIGHTS = (1,), True         # every row count of 1..16 runs the same variant
    PREFILL_GEMM_ROWS = (512,)
    global W4_PREFILL_ROWS
    W4_PREFILL_ROWS = (64, 200)                     # the in-tile kernel's two prefill tiles
    PREFILL_ATTN = [(bf, 16, (64,), (70,)), (fp8, 16, (64,), (70,)), (bf, 1, (3,), (5,)), (bf, 64, (64,), (70,))]
    PAGED = [(bf, 16, 1, 64), (bf, 1, 1, 64), (bf, 64, 1, 128), (fp8, 16, 1, 64), (torch.float32, 16, 1, 64)]


def shrink_for_dry_run() -> None:
    """--dry-run: the same script on tiny shapes on the CPU under Triton's interpreter (checks the script)."""
    global HIDDEN, MLP, NK, NV, DK, DV, CONV, NH, NKV, HD, TOKENS, DECODE_N, VERIFY, PAGED, ACT, GEMM_ROWS, GEMMS
    global PREFILL, PREFILL_ATTN, ROTARY, DECODE_GEMMS, PREFILL_GEMM_ROWS
    HIDDEN, MLP, NK, NV, DK, DV, NH, NKV, HD, ROTARY = 64, 48, 2, 4, 16, 16, 4, 2, 32, 8
    DECODE_GEMMS = (("tiny", "gate_up", 96, 256, "norm+silu"), ("tiny", "down", 40, 384, "residual"),
                    ("tiny", "gdn in", 80, 128, "norm"))
    PREFILL_GEMM_ROWS = (130,)
    global W4_PREFILL_ROWS
    W4_PREFILL_ROWS = (20, 70)
    CONV = 2 * NK * DK + NV * DV
    TOKENS, DECODE_N, VERIFY = (1, 3), (1, 2), ((2, 3),)
    GEMM_ROWS, GEMMS, PREFILL = (1, 5), ((HIDDEN, 2 * MLP), (MLP, HIDDEN)), ((5, 70),)
    import torch
    PREFILL_ATTN = [(torch.float32, 16, (20, 0), (7, 5)), (torch.float8_e4m3fn, 1, (9,), (4,))]
    ACT = torch.float32                   # the interpreter computes bf16 on raw bits
    PAGED = [(torch.float32, 16, 2, 40), (torch.float32, 1, 1, 20), (torch.float8_e4m3fn, 16, 2, 40)]


def backend(name: str):
    import tinyserve.kernels as kernels            # importable only once import_kernels_from_the_tree ran
    return kernels.backend_set_to(name)


class Case:
    """One benchmark row: `make()` gives the arguments, of which those at `mutable` (state pools, updated in place)
    are cloned for each use; `nbytes` is the memory traffic a perfect kernel moves; `ref32` computes the output in
    fp32 with the torch reference."""

    def __init__(self, op: str, shape: str, make, fn, nbytes: int, ref32, mutable: tuple[int, ...] = (),
                 targets: tuple[int, ...] | None = None) -> None:
        self.op, self.shape, self.make, self.fn, self.nbytes, self.ref32 = op, shape, make, fn, nbytes, ref32
        self.mutable = mutable
        self.targets = targets            # --compile: the architectures its variants are for (None: every one)

    def args(self, args):
        return tuple(a.clone() if i in self.mutable else a for i, a in enumerate(args))


def cases(dev):
    import torch
    from tinyserve.kernels.attention import paged_attention_decode, paged_attention_prefill
    from tinyserve.kernels.conv import causal_conv1d_decode, causal_conv1d_prefill, causal_conv1d_verify
    from tinyserve.kernels.fp8 import fp8_linear
    from tinyserve.kernels.fp8_weight import Fp8Weight
    from tinyserve.kernels.gdn import (chunk_gated_delta_rule, gdn_gating, recurrent_gated_delta_rule_decode,
                                       recurrent_gated_delta_rule_verify)
    from tinyserve.kernels.pointwise import apply_rotary, gated_rms_norm, l2_norm, rms_norm, silu_and_mul
    from tinyserve.kernels.verify_layout import verify_layout
    bf = ACT or torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    out = []
    for T in TOKENS:
        x, w = rnd(T, HIDDEN), rnd(HIDDEN, dtype=torch.float32, scale=0.1)
        out.append(Case("rms_norm", f"[{T}, {HIDDEN}]", lambda x=x, w=w: (x, w, 1e-6), rms_norm, 4 * x.numel(),
                        lambda x, w, e: rms_norm(x.float(), w, e)))
        qg = rnd(T, NH, 2 * HD)
        q = qg.split([HD, HD], dim=-1)[0]
        out.append(Case("rms_norm q-heads", f"[{T}, {NH}, {HD}] strided", lambda q=q, w=w: (q, w[:HD], 1e-6),
                        rms_norm, 4 * q.numel(), lambda x, w, e: rms_norm(x.float(), w, e)))
        o = rnd(T, NV, DV)
        z = rnd(T, 2 * NV * DV)[:, NV * DV:].reshape(T, NV, DV)
        out.append(Case("gated_rms_norm", f"[{T}, {NV}, {DV}]", lambda o=o, z=z, w=w: (o, z, w[:DV], 1e-6),
                        gated_rms_norm, 6 * o.numel(), lambda x, z, w, e: gated_rms_norm(x.float(), z.float(), w, e)))
        h = rnd(T, 2 * MLP, scale=3.0)
        out.append(Case("silu_and_mul", f"[{T}, 2x{MLP}]", lambda h=h: (h,), silu_and_mul, 3 * h.numel(),
                        lambda x: silu_and_mul(x.float())))
        u = rnd(T, 2 * NK * DK + NV * DV)[:, :NK * DK].reshape(T, NK, DK)       # q of the conv's output, in place
        out.append(Case("l2_norm q", f"[{T}, {NK}, {DK}] strided", lambda u=u: (u, DK ** -0.5), l2_norm,
                        u.numel() * (2 + 4), lambda x, s: l2_norm(x.float(), s)))
        ba = rnd(T, 2 * NV, scale=3.0)
        a_log = torch.log(torch.rand(NV, generator=g, device=dev) * 15 + 1)
        out.append(Case("gdn_gating", f"[{T}, 2x{NV}]", lambda a=(ba, a_log, rnd(NV, dtype=torch.float32)): a,
                        lambda *a: torch.cat(gdn_gating(*a)), ba.numel() * (2 + 4),
                        lambda b, al, dt: torch.cat(gdn_gating(b.float(), al, dt))))
        pos = torch.arange(T, device=dev, dtype=torch.float32)[:, None] * 0.01
        cos, sin = pos.expand(T, ROTARY).cos()[:, None], pos.expand(T, ROTARY).sin()[:, None]
        qr = rnd(T, NH, HD)
        out.append(Case("rotary", f"[{T}, {NH}, {HD}] rd={ROTARY}", lambda a=(qr, cos, sin): a, apply_rotary,
                        2 * qr.numel() * qr.element_size(), lambda x, c, s: apply_rotary(x.float(), c, s)))

    state_bytes = NV * DK * DV * 4
    for N in DECODE_N:
        slots = torch.randperm(2 * N, device=dev)[:N]
        pool = rnd(2 * N, NV, DK, DV, dtype=torch.float32, scale=0.1)
        q = torch.nn.functional.normalize(rnd(N, NK, DK, dtype=torch.float32), dim=-1) * DK ** -0.5
        k = torch.nn.functional.normalize(rnd(N, NK, DK, dtype=torch.float32), dim=-1)
        v, gate = rnd(N, NV, DV), -torch.rand(N, NV, generator=g, device=dev) * 0.5
        beta = torch.rand(N, NV, generator=g, device=dev)
        out.append(Case("gdn decode", f"N={N}", lambda a=(q, k, v, gate, beta, pool, slots): a,
                        recurrent_gated_delta_rule_decode, 2 * N * state_bytes,
                        lambda q, k, v, g_, b, s, i: recurrent_gated_delta_rule_decode(q, k, v.float(), g_, b, s, i),
                        mutable=(5,)))
        cpool = rnd(2 * N, CONV, KW - 1)
        x, cw = rnd(N, CONV), rnd(CONV, KW)
        out.append(Case("conv decode", f"N={N} C={CONV}", lambda a=(x, cw, cpool, slots): a, causal_conv1d_decode,
                        N * CONV * 2 * (2 * (KW - 1) + 2),
                        lambda x, w, s, i: causal_conv1d_decode(x.float(), w.float(), s.float(), i), mutable=(2,)))
    for N, L in VERIFY:
        cu = [i * L for i in range(N + 1)]
        ins = list(range(N))
        outs = [[i] + list(range(N + i * (L - 1), N + (i + 1) * (L - 1))) for i in range(N)]
        lay = verify_layout(cu, [L] * N, ins, outs, dev)
        nslots = N * L
        pool = rnd(nslots, NV, DK, DV, dtype=torch.float32, scale=0.1)
        T = N * L
        q = torch.nn.functional.normalize(rnd(T, NK, DK, dtype=torch.float32), dim=-1) * DK ** -0.5
        k = torch.nn.functional.normalize(rnd(T, NK, DK, dtype=torch.float32), dim=-1)
        v, gate = rnd(T, NV, DV), -torch.rand(T, NV, generator=g, device=dev) * 0.5
        beta = torch.rand(T, NV, generator=g, device=dev)
        out.append(Case("gdn verify", f"N={N} x {L} tokens", lambda a=(q, k, v, gate, beta, pool, lay): a,
                        recurrent_gated_delta_rule_verify, (N + T) * state_bytes,
                        lambda q, k, v, g_, b, s, l: recurrent_gated_delta_rule_verify(q, k, v.float(), g_, b, s, l),
                        mutable=(5,)))
        cpool, x, cw = rnd(nslots, CONV, KW - 1), rnd(T, CONV), rnd(CONV, KW)
        out.append(Case("conv verify", f"N={N} x {L} tokens", lambda a=(x, cw, cpool, lay): a, causal_conv1d_verify,
                        (N + T) * CONV * (KW - 1) * 2 + 2 * T * CONV * 2,
                        lambda x, w, s, l: causal_conv1d_verify(x.float(), w.float(), s.float(), l), mutable=(2,)))

    for lens in PREFILL:
        cu = [sum(lens[:i]) for i in range(len(lens) + 1)]
        T, N = cu[-1], len(lens)
        slots = list(range(1, 2 * N, 2))
        pool = rnd(2 * N, NV, DK, DV, dtype=torch.float32, scale=0.1)
        q = torch.nn.functional.normalize(rnd(T, NK, DK, dtype=torch.float32), dim=-1).to(bf) * DK ** -0.5
        k = torch.nn.functional.normalize(rnd(T, NK, DK, dtype=torch.float32), dim=-1).to(bf)
        v, gate = rnd(T, NV, DV), -torch.rand(T, NV, generator=g, device=dev) * 0.5
        beta = torch.rand(T, NV, generator=g, device=dev)
        out.append(Case("gdn prefill", f"{'+'.join(map(str, lens))} tokens",
                        lambda a=(q, k, v, gate, beta, pool, cu, slots): a, chunk_gated_delta_rule,
                        T * (2 * NK * DK + 2 * NV * DV) * 2 + 2 * N * state_bytes,
                        lambda q, k, v, g_, b, s, c, i: chunk_gated_delta_rule(q.float(), k.float(), v.float(), g_,
                                                                               b, s, c, i),
                        mutable=(5,)))

        x, cw = rnd(T, CONV), rnd(CONV, KW)
        cpool = rnd(2 * N, CONV, KW - 1)
        out.append(Case("conv prefill", f"{'+'.join(map(str, lens))} tokens",
                        lambda a=(x, cw, cpool, cu, slots): a, causal_conv1d_prefill, 2 * T * CONV * 2,
                        lambda x, w, s, c, i: causal_conv1d_prefill(x.float(), w.float(), s.float(), c, i),
                        mutable=(2,)))

    for kv_dtype, page, cached, new_tokens in PREFILL_ATTN or prefill_attn_cases(bf, torch.float8_e4m3fn):
        N = len(cached)
        lens = [c + n for c, n in zip(cached, new_tokens)]
        npg = max(-(-n // page) for n in lens)
        cache = rnd(N * npg + 1, 2, page, NKV, HD, dtype=torch.float32).to(kv_dtype)
        table = torch.randperm(N * npg + 1, device=dev)[:N * npg].view(N, npg).to(torch.int32)
        cu = [sum(new_tokens[:i]) for i in range(N + 1)]
        q = rnd(cu[-1], NH, HD)
        name = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", torch.float32: "fp32"}[kv_dtype]
        out.append(Case(f"paged prefill {name} p{page}", "+".join(f"{c}:{n}" for c, n in zip(cached, new_tokens)),
                        lambda a=(q, cache, table, cu, lens, HD ** -0.5): a, paged_attention_prefill,
                        sum(lens) * 2 * NKV * HD * cache.element_size() + 2 * q.numel() * q.element_size(),
                        lambda q, c, t, cu_, l, s: paged_attention_prefill(q.float(), c.float(), t, cu_, l, s)))

    for M in GEMM_ROWS:                                 # block-FP8 GEMM: w8a8 (sm_89+) and w8a16
        for K, N in GEMMS:
            for act_quant in (True, False):
                w = Fp8Weight(N, K, (128, 128), dev, act_quant)
                w.weight.copy_((torch.randn(N, K, generator=g, device=dev) * 100).clamp(-448, 448).to(w.weight.dtype))
                w.scale.copy_(torch.rand(w.scale.shape, generator=g, device=dev) * 1e-3)
                x = rnd(M, K)
                out.append(Case(f"fp8 gemm {'w8a8' if act_quant else 'w8a16'}", f"{M}x{K} @ {N}x{K}",
                                lambda a=(x, w): a, fp8_linear, N * K + w.scale.numel() * 4 + (M * K + M * N) * 2,
                                lambda x, w: fp8_linear(x.float(), w)))

    out += gemm_cases(dev, g, rnd)
    out += w4_cases(dev, g, rnd)

    # MoE experts kept FP8 (Qwen3.5-35B-A3B-FP8: hidden 2048, expert width 512, 256 experts, top 8, 128 x 128
    # blocks): routed experts through both grouped GEMMs. On the CPU (--compile records the launches, --dry-run
    # interprets) 8 experts: their count sets no constexpr, only the rows per expert, which GEMM_ROWS then take
    # through every tile shape.
    from tinyserve.kernels.moe import fused_experts, route
    moe_h, moe_i, top_k = (2048, 512, 8) if ACT is None else (HIDDEN, MLP, 2)
    moe_e = 256 if dev.type == "cuda" else 8
    for act_quant in (True, False):
        stacks = (Fp8Weight(2 * moe_i, moe_h, (128, 128), dev, act_quant, experts=moe_e),
                  Fp8Weight(moe_h, moe_i, (128, 128), dev, act_quant, experts=moe_e))
        for w in stacks:
            w.weight.copy_((torch.randn(w.shape, generator=g, device=dev) * 100).clamp(-448, 448).to(w.weight.dtype))
            w.scale.copy_(torch.rand(w.scale.shape, generator=g, device=dev) * 1e-3)
        for T in GEMM_ROWS + ((4096,) if dev.type == "cuda" else ()):      # 4096: 128 rows per expert
            x = rnd(T, moe_h)
            topk_weights, topk_ids = route(rnd(T, moe_e, dtype=torch.float32), top_k, True)
            hit = topk_ids.unique().numel()
            out.append(Case(f"moe fp8 {'w8a8' if act_quant else 'w8a16'}", f"T={T} E={moe_e} top{top_k}",
                            lambda a=(x, *stacks, topk_weights, topk_ids): a, fused_experts,
                            hit * sum(w.weight[0].numel() + w.scale[0].numel() * 4 for w in stacks)
                            + T * moe_h * 2 * 2,
                            lambda x, wgu, wd, tw, ti: fused_experts(x.float(), wgu, wd, tw, ti)))

    from tinyserve.kernels.attention import store_kv
    from tinyserve.kernels import PoolLayer

    def stored(k, v, pool, slots):                      # the pool after the write (layer 1 of 2)
        store_kv(k, v, PoolLayer(pool, 1), slots)
        return pool
    for kv_dtype in (bf, torch.float8_e4m3fn):
        for T in TOKENS:
            pool = rnd(T + 2, 2, 2, 16, NKV, HD, dtype=torch.float32).to(kv_dtype)
            k, v = rnd(T, NKV, HD), rnd(T, NKV, HD)
            slots = torch.randperm(16 * (T + 2), device=dev)[:T]
            out.append(Case(f"store_kv {'fp8' if kv_dtype != bf else 'bf16'} pool", f"T={T}",
                            lambda a=(k, v, pool, slots): a, stored,
                            2 * k.numel() * (k.element_size() + pool.element_size()),
                            lambda k, v, p, s: stored(k.float(), v.float(), p.float(), s), mutable=(2,)))

    for kv_dtype, page, N, ctx in PAGED or paged_cases(bf, torch.float8_e4m3fn):
        npg = -(-ctx // page)
        cache = rnd(N * npg + 1, 2, page, NKV, HD, dtype=torch.float32).to(kv_dtype)
        table = torch.randperm(N * npg + 1, device=dev)[:N * npg].view(N, npg).to(torch.int32)
        lens = torch.full((N,), ctx, dtype=torch.int32, device=dev)
        lens[0] = max(1, ctx // 3)                              # one shorter sequence: empty splits
        q = rnd(N, NH, HD)
        name = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", torch.float32: "fp32"}[kv_dtype]
        out.append(Case(f"paged decode {name} p{page}", f"N={N} ctx={ctx}",
                        lambda a=(q, cache, table, lens, ctx, HD ** -0.5): a, paged_attention_decode,
                        int(lens.sum().item()) * 2 * NKV * HD * cache.element_size(),
                        lambda q, c, t, l, m, s: paged_attention_decode(q.float(), c.float(), t, l, m, s)))
        if N == 1 or name == "fp32":       # a NEXTN verify over the same context: each token a row (table_rows)
            L = VERIFY[0][1]
            vlens = (lens[:1] - L + 1 + torch.arange(L, device=dev, dtype=torch.int32)).clamp(min=1)
            vrows = torch.zeros(L, dtype=torch.long, device=dev)
            out.append(Case(f"paged verify {name} p{page}", f"{L} tokens ctx={int(lens[0])}",
                            lambda a=(rnd(L, NH, HD), cache, table, vlens, ctx, HD ** -0.5, vrows): a,
                            paged_attention_decode, int(lens[0]) * 2 * NKV * HD * cache.element_size(),
                            lambda q, c, t, l, m, s, r: paged_attention_decode(q.float(), c.float(), t, l, m, s, r)))
    return out


def gemm_cases(dev, g, rnd) -> list[Case]:
    """The decode GEMM (kernels/linear_triton.py) at each projection of a decode step with what kernels.linear fuses
    into it there, for FP8 weights (w8a8, w8a16) and bf16 ones; the prefill TMA GEMM (kernels/fp8_prefill_triton.py)
    for the device's family (on the CPU: every family, each compiled for its own architecture)."""
    import torch
    from tinyserve.kernels import fp8_prefill_triton as prefill
    from tinyserve.kernels import use_triton
    from tinyserve.kernels.fp8 import fp8_linear
    from tinyserve.kernels.fp8_weight import Fp8Weight
    from tinyserve.kernels.linear import InputNorm, linear
    bf = ACT or torch.bfloat16

    def fp8_weight(N, K, act_quant):
        w = Fp8Weight(N, K, (128, 128), dev, act_quant)
        if not EMPTY_WEIGHTS:
            w.weight.copy_((torch.randn(N, K, generator=g, device=dev) * 100).clamp(-448, 448).to(w.weight.dtype))
            w.scale.copy_(torch.rand(w.scale.shape, generator=g, device=dev) * 1e-3)
        return w

    def fused(x, w, norm, silu_mul, residual):
        return linear(x, w, norm=norm, silu_mul=silu_mul, residual=residual)

    def fused32(x, w, norm, silu_mul, residual):
        w32 = w if isinstance(w, Fp8Weight) else w.float()
        return linear(x.float(), w32, norm=norm, silu_mul=silu_mul,
                      residual=residual.float() if residual is not None else None)
    out = []
    for model, name, N, K, fuse in DECODE_GEMMS:
        for kind in ("w8a8", "w8a16", "bf16"):
            if name == "lm_head" and kind != "bf16":
                continue                                 # the checkpoints keep lm_head in bf16
            w = fp8_weight(N, K, kind == "w8a8") if kind != "bf16" else \
                (torch.empty(N, K, dtype=bf, device=dev) if EMPTY_WEIGHTS else rnd(N, K, scale=K ** -0.5))
            wbytes = N * K * (1 if kind != "bf16" else 2)
            for M in DECODE_ROWS:
                x = rnd(M, K)
                norm = InputNorm(1.0 + rnd(K, dtype=torch.float32, scale=0.1), 1e-6) if "norm" in fuse else None
                n_out = N // 2 if "silu" in fuse else N
                residual = rnd(M, n_out) if "residual" in fuse else None
                out.append(Case(f"decode {kind} {model} {name}", f"{M}x{K} @ {N}x{K} {fuse}",
                                lambda a=(x, w, norm, "silu" in fuse, residual): a, fused,
                                wbytes + (M * K + M * n_out * (2 if residual is not None else 1)) * 2, fused32))
    def tma_or_reference(x, w, tiles):
        return prefill.fp8_linear(x, w, tiles) if use_triton(x) else fp8_linear(x, w)
    sm = {"hopper": 90, "blackwell": 120}
    for family in prefill.PREFILL_TILES if dev.type == "cpu" else ():   # on a GPU fp8_linear picks it (above)
        for M in PREFILL_GEMM_ROWS:
            for K, N in GEMMS:
                w, x = fp8_weight(N, K, True), rnd(M, K)
                out.append(Case(f"fp8 prefill tma {family}", f"{M}x{K} @ {N}x{K}",
                                lambda a=(x, w, prefill.PREFILL_TILES[family]): a, tma_or_reference,
                                N * K + (M * K + M * N) * 2, lambda x, w, t: fp8_linear(x.float(), w),
                                targets=(sm[family],)))
    return out


# 4-bit weights (kernels/w4_triton.py): (label, W4Weight options) of the decode cases; the first is also the MoE's
# (the last two only at the 27B's gate_up and down); one of each of w4_triton.dequant_mode's ways with bf16 x:
# SCALE_AFTER (GPTQ / AWQ g128), F32 (NVFP4; fp16 scales at group 32), X16 (compressed-tensors' bf16 scales)
W4_KINDS = (("int4 g128", dict(kind="int4", group=128, scale_dtype="float16")),
            ("fp4 g16", dict(kind="fp4", group=16, global_scale=0.5, scale_dtype="float32")),
            ("int4 g32 asym act-order bf16-scales", dict(kind="int4", group=32, asymmetric=True, act_order=True,
                                                         scale_dtype="bfloat16")),
            ("int4 g32 fp16-scales", dict(kind="int4", group=32, scale_dtype="float16")))
W4_PREFILL_ROWS = (64, 128, 256, 512, 2048)   # rows of the prefill cases: the in-tile kernel against scratch + cuBLAS
W4_BANDWIDTH_TARGET = 0.85                     # the decode GEMM's GB/s as a fraction of the copy's


def w4_weight(dev, g, N: int, K: int, experts: int | None = None, **options):
    """A W4Weight of random codes, scales ~K^-0.5 / 4 (products of the size of a bf16 projection's) and zeros; its
    perm a random permutation (under --compile an identity: the scratch path gathers by it on the CPU)."""
    import torch
    from tinyserve.kernels.w4_weight import W4Weight
    options = dict(options, scale_dtype=getattr(torch, options["scale_dtype"]))
    if K % options["group"]:                        # --dry-run's tiny shapes: a group that divides them
        options["group"] = 16
    w = W4Weight(N, K, device=dev, experts=experts, **options)
    if w.perm is not None:
        lead = w.perm.shape[:-1]
        w.perm.copy_(torch.arange(K, device=dev).expand(*lead, K) if EMPTY_WEIGHTS else
                     torch.stack([torch.randperm(K, device=dev) for _ in range(lead.numel())]).view(*lead, K))
    if EMPTY_WEIGHTS:
        return w
    w.codes.copy_(torch.randint(0, 256, w.codes.shape, generator=g, device=dev, dtype=torch.int32).to(torch.uint8))
    w.scales.copy_((torch.rand(w.scales.shape, generator=g, device=dev) + 0.5) * K ** -0.5 / 4)
    if w.zeros is not None:
        w.zeros.copy_(torch.randint(4, 12, w.zeros.shape, generator=g, device=dev, dtype=torch.int32).to(torch.uint8))
    return w


def w4_cases(dev, g, rnd) -> list[Case]:
    """4-bit weights: the decode GEMM at each 27B projection (and the 35B-A3B's) with what kernels.linear fuses
    there, its GB/s against a copy's (the summary after the table); the prefill at W4_PREFILL_ROWS, the in-tile
    kernel and scratch + cuBLAS side by side (the summary gives the crossover); the fused MoE with 4-bit experts."""
    import torch
    from tinyserve.kernels import use_triton, w4_triton
    from tinyserve.kernels.linear import InputNorm, linear
    from tinyserve.kernels.moe import fused_experts, route
    from tinyserve.kernels.w4 import w4_linear_reference
    bf = ACT or torch.bfloat16
    out = []
    if dev.type == "cuda":            # the roof the decode rows are read against: a copy far past L2
        src = torch.empty(1 << 27, dtype=torch.float32, device=dev).fill_(1.0)
        out.append(Case("copy (bandwidth roof)", "512 MiB", lambda a=(src, torch.empty_like(src)): a,
                        lambda s, d: d.copy_(s), 2 * src.numel() * 4, lambda s, d: s))

    def fused(x, w, norm, silu_mul, residual):
        return linear(x, w, norm=norm, silu_mul=silu_mul, residual=residual)

    def fused32(x, w, norm, silu_mul, residual):
        return linear(x.float(), w, norm=norm, silu_mul=silu_mul,
                      residual=residual.float() if residual is not None else None)
    for model, name, N, K, fuse in DECODE_GEMMS:
        if name == "lm_head":
            continue                                 # kept bf16 by every 4-bit checkpoint
        for label, options in W4_KINDS if model != "35B-A3B" else W4_KINDS[:1]:
            if label.startswith("int4 g32") and name not in ("gate_up", "down"):
                continue
            w = w4_weight(dev, g, N, K, **options)
            for M in DECODE_ROWS:
                x = rnd(M, K)
                norm = InputNorm(1.0 + rnd(K, dtype=torch.float32, scale=0.1), 1e-6) if "norm" in fuse else None
                n_out = N // 2 if "silu" in fuse else N
                residual = rnd(M, n_out) if "residual" in fuse else None
                out.append(Case(f"w4 decode {label} {model} {name}", f"{M}x{K} @ {N}x{K} {fuse}",
                                lambda a=(x, w, norm, "silu" in fuse, residual): a, fused,
                                w.nbytes() + (M * K + M * n_out * (2 if residual is not None else 1)) * 2, fused32))

    def in_tile(x, w):
        return w4_triton.prefill_linear(x, w) if use_triton(x) else w4_linear_reference(x, w)

    def scratch(x, w):
        return w4_triton.scratch_linear(x, w) if use_triton(x) else w4_linear_reference(x, w)
    for model, name, N, K, _ in DECODE_GEMMS[:2]:            # the 27B's gate_up and down
        w = w4_weight(dev, g, N, K, **W4_KINDS[0][1])
        for M in W4_PREFILL_ROWS:
            x = rnd(M, K)
            for path, fn in (("in-tile", in_tile), ("scratch", scratch)):
                out.append(Case(f"w4 prefill {path} {model} {name}", f"{M}x{K} @ {N}x{K}", lambda a=(x, w): a, fn,
                                w.nbytes() + (M * K + M * N) * 2, lambda x, w: w4_linear_reference(x.float(), w)))
    if dev.type == "cpu":       # --compile: Hopper's four-stage prefill tile, which a CPU run would not pick
        w = w4_weight(dev, g, DECODE_GEMMS[0][2], DECODE_GEMMS[0][3], **W4_KINDS[0][1])
        x = rnd(W4_PREFILL_ROWS[-1], DECODE_GEMMS[0][3])
        out.append(Case("w4 prefill tile hopper", f"{x.shape[0]} rows", lambda a=(x, w, (128, 64, 8, 4)): a,
                        lambda x, w, t: w4_triton.prefill_linear(x, w, t) if use_triton(x) else
                        w4_linear_reference(x, w), 0, lambda x, w, t: w4_linear_reference(x.float(), w),
                        targets=(90,)))

    # the fused MoE with 4-bit experts: Qwen3.5-35B-A3B's (hidden 2048, expert width 512, 256 experts, top 8) as a
    # GPTQ int4 g128 checkpoint holds them; 8 experts on the CPU (their count sets no constexpr)
    moe_h, moe_i, top_k = (2048, 512, 8) if ACT is None else (HIDDEN, MLP, 2)
    moe_e = 256 if dev.type == "cuda" else 8
    stacks = (w4_weight(dev, g, 2 * moe_i, moe_h, experts=moe_e, **W4_KINDS[0][1]),
              w4_weight(dev, g, moe_h, moe_i, experts=moe_e, **W4_KINDS[0][1]))
    for T in GEMM_ROWS + ((4096,) if dev.type == "cuda" else ()):
        x = rnd(T, moe_h)
        topk_weights, topk_ids = route(rnd(T, moe_e, dtype=torch.float32), top_k, True)
        hit = topk_ids.unique().numel()
        out.append(Case(f"moe w4 {W4_KINDS[0][0]}", f"T={T} E={moe_e} top{top_k}",
                        lambda a=(x, *stacks, topk_weights, topk_ids): a, fused_experts,
                        hit * sum(w.nbytes() // moe_e for w in stacks) + T * moe_h * 2 * 2,
                        lambda x, wgu, wd, tw, ti: fused_experts(x.float(), wgu, wd, tw, ti)))
    return out


def w4_summary(results: dict[tuple[str, str], tuple[float, float]]) -> None:
    """After the table: each 4-bit decode row's GB/s as a fraction of the copy's (target W4_BANDWIDTH_TARGET), and
    per prefill shape the rows from which scratch + cuBLAS beats the in-tile kernel (w4_triton.SCRATCH_ROWS)."""
    copy = next((gbs for (op, _), (_, gbs) in results.items() if op.startswith("copy")), None)
    decode = {k: v for k, v in results.items() if k[0].startswith("w4 decode")}
    if copy and decode:
        say(f"== 4-bit decode GEMM against the copy bandwidth ({copy:.0f} GB/s), target "
            f"{W4_BANDWIDTH_TARGET:.0%}")
        for (op, shape), (_, gbs) in decode.items():
            short = " (below target)" if gbs < W4_BANDWIDTH_TARGET * copy else ""
            say(f"   {op[len('w4 decode '):]:<44} {shape:<36} {gbs:>6.0f} GB/s {gbs / copy:>5.0%}{short}")
    prefill = {}
    for (op, shape), (ms, _) in results.items():
        if op.startswith("w4 prefill ") and op.split()[2] in ("in-tile", "scratch"):
            key = (" ".join(op.split()[3:]), shape.split(" @ ")[1])
            prefill.setdefault(key, {}).setdefault(int(shape.split("x")[0]), {})[op.split()[2]] = ms
    if prefill:
        from tinyserve.kernels.w4_triton import SCRATCH_ROWS
        say(f"== 4-bit prefill: in-tile kernel against scratch + cuBLAS (w4_triton.SCRATCH_ROWS = {SCRATCH_ROWS})")
        for (name, shape), by_rows in prefill.items():
            times = "  ".join(f"{m}: {t.get('in-tile', float('nan')):.3f} / {t.get('scratch', float('nan')):.3f} ms"
                              for m, t in sorted(by_rows.items()))
            wins = [m for m, t in sorted(by_rows.items()) if t.get("scratch", 1e9) < t.get("in-tile", 0)]
            say(f"   {name} {shape}: {times}; scratch faster from {wins[0] if wins else 'none of these'} rows")


W4_SWEEP = dict(BN=(32, 64, 128), split=(1, 2, 4, 8), num_stages=(4, 6))    # --w4-sweep's tiles
W4_SWEEP_SHAPES = ("gate_up", "down", "gdn out")


def w4_sweep(dev) -> None:
    """--w4-sweep: the 4-bit decode GEMM (int4 g128) at one row on three of the 27B's projections, with their fused
    parts, under every tile of W4_SWEEP against w4_decode_tiles's choice: the knob if the decode rows fall short of
    the copy bandwidth (STEP_BYTES, MIN_BN and the stage count in kernels/w4_triton.py). ~2 minutes, compiles
    mostly."""
    import itertools
    import torch
    from tinyserve.kernels import w4_triton
    from tinyserve.kernels.linear import InputNorm
    from tinyserve.kernels.linear_triton import DecodeTiles, num_sms
    bf = ACT or torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(2)
    say("== 4-bit decode tiles (--w4-sweep): GB/s of the default tile and of the best, one row")
    for model, name, N, K, fuse in DECODE_GEMMS:
        if model != "27B" or name not in W4_SWEEP_SHAPES:
            continue
        for label, options in W4_KINDS[:1]:
            w = w4_weight(dev, g, N, K, **options)
            x = torch.randn(1, K, generator=g, device=dev).to(bf)
            n_out = N // 2 if "silu" in fuse else N
            kw = dict(norm=InputNorm(torch.ones(K, device=dev), 1e-6) if "norm" in fuse else None,
                      silu_mul="silu" in fuse,
                      residual=torch.randn(1, n_out, generator=g, device=dev).to(bf) if "residual" in fuse else None)
            default = w4_triton.w4_decode_tiles(n_out, K, "silu" in fuse, num_sms(dev))
            timed = {}
            for BN, split, stages in itertools.product(*W4_SWEEP.values()):
                t = DecodeTiles(BN=BN, split=split, num_warps=4, num_stages=stages)
                try:
                    timed[t] = time_ms(lambda x_, t_=t: w4_triton.decode_linear(x_, w, tiles=t_, **kw), (x,))
                except Exception as e:                  # a tile past the card's shared memory
                    say(f"   {t}: {type(e).__name__}")
            if default not in timed:
                timed[default] = time_ms(lambda x_: w4_triton.decode_linear(x_, w, tiles=default, **kw), (x,))
            best = min(timed, key=timed.get)
            gbs = {t: w.nbytes() / (ms * 1e-3) / 1e9 for t, ms in timed.items()}
            say(f"   {label} {name} {N}x{K}: default {tuple(default)} {gbs[default]:.0f} GB/s, "
                f"best {tuple(best)} {gbs[best]:.0f} GB/s")


def time_ms(fn, args) -> float:
    if args[0].device.type != "cuda":                     # --dry-run: one call, wall clock
        t = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench
    return do_bench(lambda: fn(*args), warmup=10, rep=50)


# ---------------------------------------------------------------------------------------------------------------
# --compile: no GPU needed. Every kernel variant the wrappers launch for the bench cases, compiled to a cubin for
# each target with the ptxas that ships in the triton wheel; shared memory and registers/spills per variant.
# ---------------------------------------------------------------------------------------------------------------
TARGETS = {90: ("H100/H200", 232448), 89: ("RTX 4090", 101376), 120: ("RTX 5090", 101376), 80: ("A100", 166912)}
TL_TYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
            "torch.float8_e4m3fn": "fp8e4nv",
            "torch.int32": "i32", "torch.int64": "i64", "torch.bool": "i1", "torch.uint8": "u8"}


RECORDING_FOR: list = [None]              # the architectures of the case being recorded (None: every one)


def record_launches(run_cases) -> list[tuple]:
    """The (kernel, args, kwargs, architectures) of every launch run_cases() makes, recorded instead of launched."""
    from triton.runtime.jit import JITFunction
    seen, calls = set(), []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        key = (self.fn.__name__, tuple(_sig(a) for a in args), tuple(sorted(kwargs.items())), RECORDING_FOR[0])
        if key not in seen:
            seen.add(key)
            calls.append((self, args, kwargs, RECORDING_FOR[0]))
    JITFunction.run = record
    try:
        run_cases()
    finally:
        JITFunction.run = original
    return calls


def _sig(a) -> str:
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor
    if isinstance(a, TensorDescriptor):
        return f"desc<{TL_TYPES[str(a.base.dtype)]}{list(a.block_shape)}>"
    if isinstance(a, torch.Tensor):
        return "*" + TL_TYPES[str(a.dtype)]
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        return "i32" if -2 ** 31 <= a < 2 ** 31 else "i64"
    return "fp32"


def specialize(fn, args) -> tuple[dict[str, str], dict]:
    """The signature and attributes the runtime would compile these arguments with: triton's own specialization
    (an int equal to 1 becomes a constexpr; 16-aligned pointers and ints divisible by 16 get tt.divisibility,
    without which loads do not vectorize or pipeline and register counts look far worse than they are)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl
    sig, attrs = {}, {}
    for i, (param, a) in enumerate(zip(fn.params, args)):
        ty, key = native_specialize_impl(CUDABackend, a, False, not param.do_not_specialize,
                                         not param.do_not_specialize_on_alignment)
        sig[param.name] = ty
        if key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def widest_load(ptx: str) -> str:
    """How the kernel reads global memory at its widest: "tma" (cp.async.bulk.tensor), else the most bytes one
    thread's load or asynchronous copy moves ("16B": vectorised; "2B" on a weight stream would be a problem)."""
    import re
    if "cp.async.bulk.tensor" in ptx:
        return "tma"
    widths = [int(n, 0) for n in re.findall(r"cp\.async\.c[ag]\.shared\.global[^,]*,[^,]*,\s*(\w+)", ptx)]
    for vec, bits in re.findall(r"ld\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfsu](\d+)\s", ptx):
        widths.append(int(vec or 1) * int(bits) // 8)
    return f"{max(widths)}B" if widths else "-"


def compile_all(targets: list[int], only: list[str]) -> bool:
    import tempfile
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    dev = torch.device("cpu")

    def run_cases():
        for case in cases(dev):
            if only and not any(o in case.op for o in only):
                continue
            args = case.make()
            RECORDING_FOR[0] = case.targets
            with backend("triton"):
                try:
                    case.fn(*case.args(args))
                except Exception:          # outputs are never launched: whatever follows the launch may fail
                    pass
    for name in ("norm", "activation", "rotary", "gdn", "conv", "attention", "fp8", "moe", "linear",
                 "fp8_prefill", "w4"):                                                                  # compiled first
        importlib.import_module(f"tinyserve.kernels.{name}_triton")
    os.environ["TRITON_INTERPRET"] = "1"          # lets the forced backend take CPU tensors; nothing is launched
    try:
        calls = record_launches(run_cases)
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
    say(f"== compile: {len(calls)} kernel variants x targets {targets} (ptxas from the triton wheel, no GPU)")
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    ok = True
    say(f"{'kernel':<26} {'dtypes constexprs':<90} {'sm':>4} {'warps':>5} {'smem B':>8} {'regs':>5} {'spill':>6} "
        f"{'loads':>7} {'s':>5}")
    for fn, args, kwargs, only in calls:
        names = fn.arg_names
        constexprs = {k: v for k, v in kwargs.items() if k in names}
        opts = {k: v for k, v in kwargs.items() if k not in names}
        sig, attrs = specialize(fn, args)
        constexprs.update({n: a for n, a in zip(names, args) if sig[n] == "constexpr"})
        sig.update({k: "constexpr" for k in constexprs})
        ptrs = sorted({t[1:] for t in sig.values() if t.startswith("*") and not t.startswith("*i")})
        short = "/".join(ptrs) + " " + ",".join(k if v is True else f"{k}={v}" for k, v in constexprs.items()
                                                if v is not False)         # flags by name when set
        for sm in [t for t in targets if only is None or t in only]:
            t = time.time()
            try:
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                                   target=GPUTarget("cuda", sm, 32), options=opts)
                regs = spill = "?"
                if cuobjdump.exists():
                    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                        f.write(k.asm["cubin"])
                        f.flush()
                        res = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True)
                    for tok in res.stdout.replace(",", " ").split():
                        if tok.startswith("REG:"):
                            regs = tok[4:]
                        if tok.startswith("STACK:"):
                            spill = tok[6:]
                limit = TARGETS[sm][1]
                flag = "" if k.metadata.shared <= limit else f"  > {limit}: TOO MUCH SHARED MEMORY"
                ok &= not flag
                flag += "  SPILLS" if spill not in ("0", "?") else ""           # reported, not a failure
                say(f"{fn.fn.__name__:<26} {short[:90]:<90} {sm:>4} {opts.get('num_warps', 4):>5} "
                    f"{k.metadata.shared:>8} {regs:>5} {spill:>6} {widest_load(k.asm['ptx']):>7} "
                    f"{time.time() - t:>5.1f}{flag}")
            except Exception as e:
                ok = False
                say(f"{fn.fn.__name__:<26} {short[:90]:<90} {sm:>4} FAILED: {type(e).__name__}: {str(e)[:300]}")
    return ok


# ---------------------------------------------------------------------------------------------------------------
# 2. a CUDA graph
# ---------------------------------------------------------------------------------------------------------------
def graph_check(dev) -> bool:
    import torch
    from tinyserve.kernels.attention import paged_attention_decode
    from tinyserve.kernels.conv import causal_conv1d_decode
    from tinyserve.kernels.gdn import recurrent_gated_delta_rule_decode
    from tinyserve.kernels.pointwise import gated_rms_norm, l2_norm, rms_norm
    say("== 2. one decode layer's kernels in a CUDA graph")
    g = torch.Generator(device=dev).manual_seed(1)
    N = 8
    x = torch.randn(N, CONV, generator=g, device=dev).bfloat16()
    cw = torch.randn(CONV, KW, generator=g, device=dev).bfloat16()
    slots = torch.arange(N, device=dev)
    conv0 = torch.randn(N, CONV, KW - 1, generator=g, device=dev).bfloat16()
    ssm0 = torch.randn(N, NV, DK, DV, generator=g, device=dev) * 0.1
    gate = -torch.rand(N, NV, generator=g, device=dev)
    beta = torch.rand(N, NV, generator=g, device=dev)
    z = torch.randn(N, NV, DV, generator=g, device=dev).bfloat16()
    nw = torch.randn(DV, generator=g, device=dev)
    q_att = torch.randn(N, NH, HD, generator=g, device=dev).bfloat16()
    cache = torch.randn(N * 64 + 1, 2, 16, NKV, HD, generator=g, device=dev).bfloat16()
    table = torch.arange(N * 64, device=dev, dtype=torch.int32).view(N, 64)
    lens = torch.full((N,), 1000, dtype=torch.int32, device=dev)

    def step(conv, ssm):
        u = causal_conv1d_decode(x, cw, conv, slots)
        q, k, v = u.split([NK * DK, NK * DK, NV * DV], dim=-1)
        q = l2_norm(q.reshape(N, NK, DK), DK ** -0.5)
        k = l2_norm(k.reshape(N, NK, DK))
        o = recurrent_gated_delta_rule_decode(q, k, v.reshape(N, NV, DV), gate, beta, ssm, slots)
        y = gated_rms_norm(o, z, nw, 1e-6)
        a = paged_attention_decode(rms_norm(q_att, nw.repeat(2), 1e-6), cache, table, lens, 1000, HD ** -0.5)
        return y, a

    with backend("triton"):
        conv_e, ssm_e = conv0.clone(), ssm0.clone()
        y_e, a_e = step(conv_e, ssm_e)
        conv_g, ssm_g = conv0.clone(), ssm0.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):                  # warm up (compiles) outside the capture
            step(conv0.clone(), ssm0.clone())
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_g, a_g = step(conv_g, ssm_g)
        conv_g.copy_(conv0)
        ssm_g.copy_(ssm0)
        graph.replay()
        torch.cuda.synchronize()
    ok = all(torch.equal(p, q) for p, q in [(y_e, y_g), (a_e, a_g), (conv_e, conv_g), (ssm_e, ssm_g)])
    say(f"   captured and replayed; replay == eager: {ok}")
    return ok


# ---------------------------------------------------------------------------------------------------------------
# 3. timings
# ---------------------------------------------------------------------------------------------------------------
def bench(dev, only: list[str] = ()) -> None:
    import torch
    say("== 3. Triton vs the torch reference, Qwen3.5-27B shapes (bf16 activations, fp32 GDN state)")
    results = {}
    head = f"{'op':<24} {'shape':<22} {'torch ms':>9} {'triton ms':>10} {'speedup':>8} {'triton GB/s':>12} " \
           f"{'max err':>9} {'ref scale':>9}"
    say(head)
    say("-" * len(head))
    for case in cases(dev):
        if only and not any(o in case.op for o in only):
            continue
        try:
            args = case.make()
            with backend("triton"):
                tri = case.fn(*case.args(args))
                t_tri = time_ms(case.fn, case.args(args))
            with backend("torch"):
                ref32 = case.ref32(*case.args(args))
                t_ref = time_ms(case.fn, case.args(args))
            err = (tri.float() - ref32.float()).abs().max().item()
            scale = ref32.float().abs().max().item()
            gbs = case.nbytes / (t_tri * 1e-3) / 1e9
            results[(case.op, case.shape)] = (t_tri, gbs)
            say(f"{case.op:<24} {case.shape:<22} {t_ref:>9.4f} {t_tri:>10.4f} {t_ref / t_tri:>7.2f}x {gbs:>12.0f} "
                f"{err:>9.2e} {scale:>9.2e}")
        except Exception as e:                        # one failing row must not hide the others
            say(f"{case.op:<24} {case.shape:<22} FAILED: {type(e).__name__}: {str(e)[:200]}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    w4_summary(results)


# The released Qwen3.5 / 3.6 27B-class vision_config, as its config.json gives it; tiny under --dry-run.
VISION_27B = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=5120, num_position_embeddings=2304)
VISION_TINY = dict(VISION_27B, depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                   num_position_embeddings=16)


def vision_check(dev, dry_run: bool) -> None:
    """The vision tower (models/qwen_vision.py, torch only) on one 1024x1024 image in bf16, random weights: time
    and peak memory (issue: image input; the CPU cannot run the full tower in reasonable time)."""
    import torch
    from tinyserve.models.qwen_vision import VisionConfig, VisionTower
    cfg = VisionConfig.from_dict(VISION_TINY if dry_run else VISION_27B)
    dtype = torch.float32 if dry_run else torch.bfloat16
    say(f"== 4. vision tower, one 1024x1024 image ({cfg.depth} blocks, hidden {cfg.hidden_size}, {dtype})")
    tower = VisionTower(cfg, dtype, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in tower.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p.dtype))
    grid = (1, 64, 64)                                         # 1024 / 16 patches a side
    pixels = torch.randn(64 * 64, cfg.patch_dim, generator=g).to(dev, dtype)
    with torch.inference_mode():
        tower(pixels, [grid])                                  # warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(1 if dry_run else 5):
            t0 = time.perf_counter()
            out = tower(pixels, [grid])
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else float("nan")
    say(f"   features {list(out.shape)}, best {min(times) * 1e3:.1f} ms, peak memory {peak:.0f} MiB "
        f"(weights {tower.param_bytes() / 2**20:.0f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pytest", action="store_true", help="(internal) run the test file in this process")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: run sections 3 on tiny shapes on the CPU under Triton's interpreter")
    parser.add_argument("--compile", action="store_true",
                        help="no GPU: compile every kernel variant of the bench cases for sm_90/89/120/80 (ptxas)")
    parser.add_argument("--sm", type=int, nargs="*", default=[90, 89, 120])
    parser.add_argument("--w4-sweep", action="store_true", help="after section 3: the 4-bit decode GEMM under "
                        "every tile of W4_SWEEP against the default (a few minutes: each tile compiles)")
    parser.add_argument("--only", nargs="*", default=[], help="only the cases whose op names contain one "
                        "of these (e.g. decode 'fp8 prefill')")
    args = parser.parse_args()
    if args.pytest:
        sys.exit(pytest_main())
    if args.compile:
        os.environ.pop("TRITON_INTERPRET", None)
        import_kernels_from_the_tree()
        shrink_for_compile()
        sys.exit(0 if compile_all(args.sm, args.only) else 1)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        sys.path.insert(0, str(ROOT / "tests"))
        import triton_setup  # noqa: F401 - the tests' interpreter fixes (its fp32 -> fp8 rounding is wrong)
        shrink_for_dry_run()
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA device (or --dry-run)")
    import_kernels_from_the_tree()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    name = "CPU (interpreter, dry run)" if args.dry_run else torch.cuda.get_device_name()
    say(f"device {name}, torch {torch.__version__}, triton {triton.__version__}")
    t0 = time.time()
    rc = 0 if args.skip_tests or args.dry_run else run_tests()
    graph_ok = True
    if not args.dry_run:
        try:
            graph_ok = graph_check(dev)
        except Exception as e:
            graph_ok = False
            say(f"   FAILED: {type(e).__name__}: {str(e)[:300]}")
    bench(dev, args.only)
    if args.w4_sweep:
        with backend("triton"):
            w4_sweep(dev)
    try:
        if not args.only:                               # --only: the cases named, nothing else
            vision_check(dev, args.dry_run)
    except Exception as e:
        say(f"   FAILED: {type(e).__name__}: {str(e)[:300]}")
    say(f"tests exit {rc}, graph {'ok' if graph_ok else 'FAILED'}, total {time.time() - t0:.0f} s")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.txt").write_text("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
