"""Prefix-cache benchmark on the ~30M-parameter hybrid checkpoint (CPU, fp32), cold and warm side by side.

1. One 3000-token prompt, 8 new tokens: cold (cache off) vs warm (the same prompt again), wall time and ratio.
2. Three requests share 2000 tokens, then diverge: tokens reused by the second and the third.
3. An agent trace of 10 turns whose context grows (previous prompt + answer + a new message): prefill tokens
   computed with the cache vs without, and the hit rate.
Outputs are compared with the cold run every time (a cache must never change tokens).

    python bench/prefix.py [--dir CACHE_DIR] [--page-size 16]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bench_checkpoint, fmt_table, make_prompts, engine_for    # noqa: E402

from tinyserve.engine import Engine  # noqa: E402
from tinyserve.loader import load_model    # noqa: E402
from tinyserve.sampling import SamplingParams    # noqa: E402

NEW8 = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def timed(engine: Engine, prompt: list[int], params: SamplingParams = NEW8):
    t0 = time.perf_counter()
    (req,) = engine.run_requests([prompt], params)
    return time.perf_counter() - t0, req


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    model = load_model(bench_checkpoint(args.dir), torch.float32)
    ps = args.page_size
    pool = dict(page_size=ps, kv_cache_tokens=65536, max_running_requests=4, chunked_prefill_size=2048)
    warm = engine_for(model, engine=pool, cache={"state_track_interval": 512})
    cold = engine_for(model, engine=pool, cache={"enabled": False})
    (long_prompt,) = make_prompts(1, 3000, 3000, seed=1)
    timed(cold, long_prompt[:64])                                   # warm up both paths
    rows = []

    # 1. cold vs warm
    t_cold, c = timed(cold, long_prompt)
    timed(warm, long_prompt)                                        # fills the cache
    t_warm, w = timed(warm, long_prompt)
    assert w.output_ids == c.output_ids, "cache hit changed the output"
    rows.append(("3000-token prompt, 8 new tokens", f"cold {t_cold:.3f} s", f"warm {t_warm:.3f} s",
                 f"warm/cold {t_warm / t_cold:.3f} (target <= 0.04)", f"reused {w.cached_tokens}"))

    # 2. three requests sharing 2000 tokens
    (shared,) = make_prompts(1, 2000, 2000, seed=2)
    tails = make_prompts(3, 40, 40, seed=3)
    reused = []
    for tail in tails:
        _, r = timed(warm, shared + tail)
        _, rc = timed(cold, shared + tail)
        assert r.output_ids == rc.output_ids
        reused.append(r.cached_tokens)
    rows.append(("3 requests sharing 2000 tokens", f"reused {reused[0]}, {reused[1]}, {reused[2]}",
                 f"third >= {2000 - ps}: {reused[2] >= 2000 - ps}", "", ""))

    # 3. agent trace: 10 turns, context grows by the answer and a new message each turn
    (system,) = make_prompts(1, 1500, 1500, seed=4)
    messages = make_prompts(10, 60, 200, seed=5)
    answer_params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    context: list[int] = list(system)
    computed_warm = computed_cold = prompt_total = 0
    t_w = t_c = 0.0
    for msg in messages:
        context = context + msg
        dw, r = timed(warm, context, answer_params)
        dc, rc = timed(cold, context, answer_params)
        assert r.output_ids == rc.output_ids
        prompt_total += len(context)
        computed_warm += len(context) - r.cached_tokens
        computed_cold += len(context)
        t_w, t_c = t_w + dw, t_c + dc
        context = context + r.output_ids
    rows.append(("agent trace, 10 turns", f"prefill computed {computed_warm} vs {computed_cold} tokens",
                 f"hit rate {1 - computed_warm / prompt_total:.3f}", f"time {t_w:.2f} s vs {t_c:.2f} s",
                 f"speed-up {t_c / t_w:.1f}x"))
    print(f"tinyserve prefix cache, page size {ps}, ~30M hybrid checkpoint, CPU fp32, "
          f"{torch.get_num_threads()} threads")
    print(fmt_table(rows, ("case", "a", "b", "c", "d")))


if __name__ == "__main__":
    main()
