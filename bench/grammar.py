"""Cost of grammar-constrained decoding (grammar.py): per-step decode time with JSON-schema masks at 1 and 8 running
requests, against unconstrained decoding of the same batch in the same run, in-process (build_engine on the
~31M-parameter bench checkpoint, CPU, fp32; its tokenizer has 4096 ids).

A step is timed only while every request of the batch decodes (no prefill in it, nobody finished), so both sides
time the same batch shape; the figure is the median step. The constrained requests follow a schema that keeps them
going (an array of 48 small integers, ~100 tokens), the free ones ignore EOS; both sample at temperature 1.
Target: constrained at most 10% slower.

    python bench/grammar.py [--dir CACHE_DIR] [--steps 60]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_checkpoint, fmt_table, make_prompts    # noqa: E402

from tinyserve.config import from_dict    # noqa: E402
from tinyserve.engine import Engine  # noqa: E402
from tinyserve.build import build_engine  # noqa: E402
from tinyserve.grammar import Constraint    # noqa: E402
from tinyserve.request import Status    # noqa: E402
from tinyserve.sampling import SamplingParams    # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 48,
          "maxItems": 48}


def decode_steps(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], steps: int) -> list[float]:
    """Seconds of each step in which all requests decoded; stops after `steps` of them."""
    reqs = [engine.intake.make_request(p, sp) for p, sp in zip(prompts, params)]
    for r in reqs:
        engine.scheduler.add(r)
    times: list[float] = []
    while any(r.status != Status.FINISHED for r in reqs) and len(times) < steps:
        full = (len(engine.scheduler.running) == len(reqs) and not engine.scheduler.waiting
                and all(r.num_computed >= len(r.prompt_ids) for r in reqs))
        t0 = time.perf_counter()
        engine._step()
        dt = time.perf_counter() - t0
        if full and all(r.status == Status.RUNNING for r in reqs):
            times.append(dt)
    for r in reqs:                                   # requests that did not finish: abort them
        if r.status != Status.FINISHED:
            engine._abort(r)
    while engine._has_work():
        engine._step()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    folder = bench_checkpoint(args.dir)
    engine = build_engine(from_dict({
        "model": {"path": str(folder), "device": "cpu", "context_length": 1024},
        "engine": {"max_running_requests": 8, "page_size": 16, "kv_cache_tokens": 16384},
        "cache": {"enabled": False}}))
    constraint = Constraint.json_schema(SCHEMA)
    rows = []
    for n in (1, 8):
        prompts = make_prompts(n, 32, 48, seed=n)
        free = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
        constrained = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, constraint=constraint)
                       for i in range(n)]
        decode_steps(engine, prompts, free, 5)        # warm-up (both paths)
        decode_steps(engine, prompts, constrained, 5)
        t_free: list[float] = []
        t_con: list[float] = []
        for _ in range(args.repeats):                 # interleaved, so drift hits both sides
            t_free += decode_steps(engine, prompts, free, args.steps)
            t_con += decode_steps(engine, prompts, constrained, args.steps)
        mf, mc = statistics.median(t_free), statistics.median(t_con)
        rows.append((str(n), f"{mf * 1e3:.2f}", f"{mc * 1e3:.2f}", f"{mc / mf:.3f}", f"{len(t_free)}/{len(t_con)}"))
    print(fmt_table(rows, ("running", "free ms/step", "json_schema ms/step", "ratio", "steps timed")))


if __name__ == "__main__":
    main()
