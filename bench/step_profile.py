"""Where a served step's time goes: `tinyserve CONFIG` as a user runs it, with timers around the parts of a step.

    python bench/step_profile.py CONFIG [--out FILE]        # then send it traffic; Ctrl-C (or SIGUSR1) writes

The server runs in this process exactly as the console script runs it; the timers wrap, without changing them, the
engine's step (`Engine.run_step`), the runner's step, its static forward, each compiled graph (by kind and tokens
per sequence), the CPU attention's C kernel where its op runs in Python (each layer's call, from inside the graphs
too; its usual C++ op calls the kernel out of Python's sight, so there its time stays in the graphs'), the sampling,
the NEXTN drafting and the head's passes. On SIGUSR1 (and when the server stops) the
median and mean of each, grouped by the step's shape (sequences, and the drafts a lone decode verified; "x" for a
step with a prefill), go to --out (default: stderr), and the counts start again. Steps seen fewer than 5 times are
left out. Compare two servers by running both under it, side by side, with the same traffic (bench/spec.py's
checkpoints and configs, say).
"""
from __future__ import annotations

import argparse
import collections
import functools
import signal
import sys
import time
from pathlib import Path

from tinyserve import compiled, engine, runner, spec, static
from tinyserve.kernels import attention_cpu

_times: dict[tuple, list[float]] = collections.defaultdict(list)
_shape: list = [None]                         # the step in flight: (sequences, drafts verified | "x")


def _timed(owner, name: str, label) -> None:
    """Wrap owner.name so each call's wall time is kept under (the step's shape, label(args))."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _times[(_shape[0], label(*args) if callable(label) else label)].append(time.perf_counter() - start)
    setattr(owner, name, wrapper)


def _install() -> None:
    inner_step = runner.ModelRunner.step

    @functools.wraps(inner_step)
    def step(self, seqs, *args, **kwargs):
        lone_decode = len(seqs) == 1 and seqs[0].is_decode
        _shape[0] = (len(seqs), len(seqs[0].drafts) if lone_decode else "x") if seqs else None
        return inner_step(self, seqs, *args, **kwargs)
    runner.ModelRunner.step = step
    _timed(runner.ModelRunner, "step", "runner step")
    _timed(engine.Engine, "run_step", "engine step")
    _timed(static.StaticStep, "run", lambda self, packed, kind="step", *a: f"static {kind}")
    _timed(compiled.CompiledSteps, "_run", lambda self, kind, T, *a: f"graph {kind} x{T}")
    _timed(runner.ModelRunner, "_sample", "sampling")
    _timed(spec.NextN, "verify", "verify")
    _timed(spec.NextN, "_draft", "drafting")
    _timed(spec.NextN, "_head", lambda self, *a, kv_only=False: "head KV" if kv_only else "head pass")
    lib = attention_cpu.library()             # the CPU decode attention's C kernel, called inside the graphs too
    if lib is not None and not attention_cpu.op_in_cpp():
        _timed(lib, "paged_decode", "attention C kernel")


def _write(out: Path | None) -> None:
    lines = [f"{'step (sequences, drafts verified)':36s} {'part':24s} {'calls':>6s} {'median ms':>10s} {'mean ms':>8s}"]
    snapshot = list(_times.items())           # the engine's thread keeps adding
    _times.clear()
    for (shape, part), times in sorted(snapshot, key=lambda kv: (str(kv[0][0]), kv[0][1])):
        if len(times) >= 5 and shape is not None:
            lines.append(f"{shape!s:36s} {part:24s} {len(times):6d} {1000 * sorted(times)[len(times) // 2]:10.2f} "
                         f"{1000 * sum(times) / len(times):8.2f}")
    text = "\n".join(lines) + "\n"
    if out is None:
        sys.stderr.write(text)
    else:
        out.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="the server's TOML file")
    ap.add_argument("--out", type=Path, default=None, help="write the table here (default: stderr)")
    args = ap.parse_args(argv)
    _install()
    signal.signal(signal.SIGUSR1, lambda *_: _write(args.out))
    from tinyserve.cli import main as serve
    try:
        return serve([args.config])
    finally:
        _write(args.out)


if __name__ == "__main__":
    sys.exit(main())
