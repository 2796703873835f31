"""End-to-end engine benchmark: tinyserve vs transformers on a ~30M-parameter Qwen3.5 hybrid checkpoint (CPU, fp32).

    .venv/bin/python bench/engine.py [--dir DIR] [--rounds N] [--threads N]

Everything is measured side by side in one run and printed as one table; nothing here asserts a timing.
- throughput: 8 concurrent greedy requests of 48 new tokens (ignore_eos, prompts of 32-64 tokens) through
  Engine.generate all at once, against transformers `model.generate` (its own cache) on the same requests one by
  one; and one request alone on both.
- prefill tokens/s of one 2000-token prompt, decode tokens/s at batch 1 and 8 (pure-decode steps only).
- per-step engine overhead: each engine step is split into scheduler, batch building, model forward, logits +
  sampling and the rest (engine bookkeeping), by wrapping those calls from here.
- peak RSS while loading the sharded checkpoint with tinyserve.loader.load_model, in a fresh subprocess, minus the
  RSS of that interpreter with torch and tinyserve imported, compared with the weights' size.

The machine is shared (other processes may be running): each figure is the best of --rounds runs, alternating
tinyserve and transformers, and the load average is printed with the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # `bench.common` when run as a script

import torch  # noqa: E402

from bench.common import (DEFAULT_DIR, bench_checkpoint, fmt_table, load_hf, make_prompts, max_rss_bytes,  # noqa: E402
                          weights_bytes)

NUM_REQUESTS = 8
NEW_TOKENS = 48
PREFILL_TOKENS = 2000


# ---------------------------------------------------------------------------------------------------------------
# Step instrumentation
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class StepRecord:
    total: float
    parts: dict[str, float]
    decode_tokens: int          # tokens of sequences that were decoding (one token each)
    prefill_tokens: int


@dataclass
class StepProbe:
    """Wraps an Engine's step and the calls inside it (instance attributes only; no tinyserve file is touched)."""

    engine: object
    records: list[StepRecord] = field(default_factory=list)
    _parts: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _tokens: tuple[int, int] = (0, 0)

    def install(self) -> "StepProbe":
        eng = self.engine
        self._wrap(eng.scheduler, "schedule", "schedule", after=self._count_tokens)
        self._wrap(eng.runner, "build_batch", "build_batch")
        self._wrap(eng.model, "forward", "forward")
        self._wrap(eng.model, "compute_logits", "logits")
        import tinyserve.runner as runner_mod
        if hasattr(runner_mod, "sample"):
            orig_sample = runner_mod.sample
            self._orig_sample = orig_sample

            def sample(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return orig_sample(*a, **kw)
                finally:
                    self._parts["sample"] += time.perf_counter() - t0
            runner_mod.sample = sample
        orig_step = eng._step

        def step():
            self._parts = defaultdict(float)
            self._tokens = (0, 0)
            t0 = time.perf_counter()
            out = orig_step()
            total = time.perf_counter() - t0
            self.records.append(StepRecord(total, dict(self._parts), *self._tokens))
            return out
        eng._step = step
        return self

    def uninstall(self) -> None:
        for obj in (self.engine, self.engine.scheduler, self.engine.runner, self.engine.model):
            for name in ("_step", "schedule", "build_batch", "forward", "compute_logits"):
                if name in vars(obj):
                    delattr(obj, name)
        if hasattr(self, "_orig_sample"):
            import tinyserve.runner as runner_mod
            runner_mod.sample = self._orig_sample

    def _wrap(self, obj, name: str, part: str, after=None) -> None:
        if not hasattr(obj, name):
            return
        orig = getattr(obj, name)

        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            out = orig(*a, **kw)
            self._parts[part] += time.perf_counter() - t0
            if after is not None:
                after(out)
            return out
        setattr(obj, name, wrapped)

    def _count_tokens(self, seqs) -> None:
        dec = sum(1 for s in seqs if s.num_tokens == 1 and s.start > 0 and s.req.output_ids)
        self._tokens = (dec, sum(s.num_tokens for s in seqs) - dec)

    def decode_steps(self, batch: int) -> list[StepRecord]:
        return [r for r in self.records if r.decode_tokens == batch and r.prefill_tokens == 0]


# ---------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------
def run_tinyserve(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], StepProbe]:
    from tinyserve.sampling import SamplingParams
    if hasattr(engine, "flush_cache"):
        engine.flush_cache()                    # measure computation, not prefix-cache hits of earlier runs
    probe = StepProbe(engine).install()
    try:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        dt = time.perf_counter() - t0
    finally:
        probe.uninstall()
    return dt, outs, probe


@torch.inference_mode()
def run_hf(hf, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """transformers generate, one request after the other (greedy, its DynamicCache, no eos stop)."""
    times, outs = [], []
    for p in prompts:
        ids = torch.tensor([p])
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        times.append(time.perf_counter() - t0)
        outs.append(out[0, len(p):].tolist())
    return times, outs


@torch.inference_mode()
def hf_prefill_seconds(hf, ids: list[int]) -> float:
    t0 = time.perf_counter()
    hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def load_memory_child(folder: str) -> None:
    """Subprocess body: baseline RSS with torch + tinyserve imported, then peak RSS across load_model."""
    import torch  # noqa: F401  (part of the baseline)

    import tinyserve.loader as loader
    import tinyserve.models.qwen3_next  # noqa: F401
    base = max_rss_bytes()
    t0 = time.perf_counter()
    model = loader.load_model(folder, torch.float32, "cpu")
    dt = time.perf_counter() - t0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"baseline": base, "peak": max_rss_bytes(), "seconds": dt, "param_bytes": params}))


def measure_load_memory(folder: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--load-memory-child", str(folder)], capture_output=True,
                         text=True, check=True, env={**os.environ, "TQDM_DISABLE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="cache folder of the benchmark checkpoint")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; each figure is the best round")
    ap.add_argument("--threads", type=int, default=0, help="torch threads for both (0: torch's default)")
    ap.add_argument("--load-memory-child", metavar="FOLDER", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_memory_child:
        load_memory_child(args.load_memory_child)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    from tinyserve.engine import Engine
    from tinyserve.loader import load_model
    transformers.logging.set_verbosity_error()

    folder = bench_checkpoint(args.dir)
    wbytes = weights_bytes(folder)
    mem = measure_load_memory(folder)

    model = load_model(folder, torch.float32, "cpu")
    hf = load_hf(folder)
    hf.generation_config.eos_token_id = None        # ignore_eos, as the tinyserve requests
    hf.generation_config.pad_token_id = 0
    engine = Engine(model, None, page_size=16, kv_tokens=16384, max_running_requests=NUM_REQUESTS,
                    chunked_prefill_size=2048)
    # fresh prompts for every run (warm-up and each round), so no run reuses another's prefix-cache entries
    prompts = make_prompts(NUM_REQUESTS, seed=100)
    long_prompt = make_prompts(1, PREFILL_TOKENS, PREFILL_TOKENS, seed=101)[0]

    # warm-up: both paths, prefill and decode, batch 1 and batch 8
    run_tinyserve(engine, prompts, 4)
    run_tinyserve(engine, prompts[:1], 4)
    run_tinyserve(engine, [long_prompt[:256]], 1)
    run_hf(hf, prompts[:1], 4)
    hf_prefill_seconds(hf, long_prompt[:256])

    best: dict[str, float] = {}
    def keep_min(key: str, value: float) -> None:
        best[key] = min(best.get(key, float("inf")), value)

    probes8: list[StepProbe] = []
    probes1: list[StepProbe] = []
    same, compared = 0, 0
    for rnd in range(max(1, args.rounds)):
        prompts = make_prompts(NUM_REQUESTS, seed=rnd)
        long_prompt = make_prompts(1, PREFILL_TOKENS, PREFILL_TOKENS, seed=1000 + rnd)[0]
        dt, ts_outs, probe = run_tinyserve(engine, prompts, NEW_TOKENS)
        keep_min("ts8", dt)
        probes8.append(probe)
        dt, _, probe = run_tinyserve(engine, prompts[:1], NEW_TOKENS)
        keep_min("ts1", dt)
        probes1.append(probe)
        dt, _, probe = run_tinyserve(engine, [long_prompt], 1)
        keep_min("ts_prefill", dt)
        times, hf_outs = run_hf(hf, prompts, NEW_TOKENS)
        same += sum(a == b for a, b in zip(ts_outs, hf_outs))
        compared += len(prompts)
        keep_min("hf8", sum(times))
        keep_min("hf1", times[0])
        keep_min("hf_prefill", hf_prefill_seconds(hf, long_prompt))

    def decode_rate(probes: list[StepProbe], batch: int) -> tuple[float, StepRecord | None]:
        """Best tokens/s over the rounds' pure-decode steps, and the mean step breakdown of that round."""
        rate, rec = 0.0, None
        for p in probes:
            steps = p.decode_steps(batch)
            if not steps:
                continue
            total = sum(s.total for s in steps)
            r = batch * len(steps) / total
            if r > rate:
                parts: dict[str, float] = defaultdict(float)
                for s in steps:
                    for k, v in s.parts.items():
                        parts[k] += v / len(steps)
                rate, rec = r, StepRecord(total / len(steps), dict(parts), batch, 0)
        return rate, rec

    n_tok = NUM_REQUESTS * NEW_TOKENS
    ts8, hf8 = n_tok / best["ts8"], n_tok / best["hf8"]
    ts1, hf1 = NEW_TOKENS / best["ts1"], NEW_TOKENS / best["hf1"]
    pf_ts, pf_hf = PREFILL_TOKENS / best["ts_prefill"], PREFILL_TOKENS / best["hf_prefill"]
    dec1, rec1 = decode_rate(probes1, 1)
    dec8, rec8 = decode_rate(probes8, NUM_REQUESTS)

    rows = [
        (f"throughput, {NUM_REQUESTS} requests x {NEW_TOKENS} tokens (tok/s)", f"{ts8:.1f}", f"{hf8:.1f}",
         f"{ts8 / hf8:.1f}x", ">= 8x"),
        (f"one request, {NEW_TOKENS} tokens (tok/s)", f"{ts1:.1f}", f"{hf1:.1f}", f"{ts1 / hf1:.1f}x", ">= 3x"),
        (f"prefill, one {PREFILL_TOKENS}-token prompt (tok/s)", f"{pf_ts:.0f}", f"{pf_hf:.0f}",
         f"{pf_ts / pf_hf:.1f}x", ""),
        ("decode, batch 1 (tok/s)", f"{dec1:.1f}", "", "", ""),
        (f"decode, batch {NUM_REQUESTS} (tok/s)", f"{dec8:.1f}", "", "", ""),
    ]
    for label, rec in (("batch 1", rec1), (f"batch {NUM_REQUESTS}", rec8)):
        if rec is None:
            continue
        fwd = rec.parts.get("forward", 0.0)
        overhead = rec.total - fwd
        detail = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in rec.parts.items() if k != "forward")
        rest = rec.total - sum(rec.parts.values())
        rows.append((f"decode step, {label}: total / forward / outside (ms)",
                     f"{rec.total * 1e3:.2f} / {fwd * 1e3:.2f} / {overhead * 1e3:.2f}", "",
                     f"{overhead / rec.total:.0%} outside", ""))
        rows.append((f"  outside the forward, {label} (ms)", f"{detail}, engine rest {rest * 1e3:.2f}", "", "",
                     ""))
    load_extra = mem["peak"] - mem["baseline"]
    rows.append(("peak RSS while loading / weights (MB)", f"{load_extra / 1e6:.0f} / {wbytes / 1e6:.0f}", "",
                 f"{load_extra / wbytes:.2f}x", "<= 1.3x"))
    rows.append(("load_model time (s)", f"{mem['seconds']:.2f}", "", "", ""))
    rows.append(("greedy outputs identical to transformers", f"{same}/{compared}", "", "", ""))

    n_params = sum(p.numel() for p in model.parameters())
    print(f"\ncheckpoint {folder} ({n_params / 1e6:.1f}M parameters, "
          f"{len(list(folder.glob('*.safetensors')))} shards); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; "
          f"best of {max(1, args.rounds)} rounds")
    print(fmt_table(rows, ("measure", "tinyserve", "transformers", "ratio", "target")))
    if os.getloadavg()[0] > (os.cpu_count() or 1) and not os.environ.get("OMP_WAIT_POLICY"):
        print("note: the machine is busier than its core count; OpenMP's spinning barriers then slow every "
              "multi-threaded op by up to 50x and the figures mean little. Rerun when idle, or with "
              "OMP_WAIT_POLICY=PASSIVE (or --threads 1) for steadier figures.")


if __name__ == "__main__":
    main()
