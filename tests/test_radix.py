"""The radix prefix cache never changes output: every hit gives exactly the greedy tokens of a cold run
(cache.enabled = false), on page sizes 1, 16, 64 and two track intervals, for hybrid and pure-attention models;
and it never leaks: after flush every page and snapshot slot is free again."""
from __future__ import annotations

import ast
import asyncio
import inspect
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints import make_qwen3_5_text
from conftest import assert_no_leaks, engine_for, tokens
from tinyserve import file_index, file_tier, host_tier, tiers
from tinyserve.cache import Cache, PrefixCache
from tinyserve.loader import load_model
from tinyserve.radix import Node, RadixCache
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
COLD = {"enabled": False}


@pytest.fixture(scope="module")
def attention_model(tmp_path_factory):
    folder, _ = make_qwen3_5_text(tmp_path_factory.mktemp("attn"), max_position_embeddings=2048,
                                  layer_types=["full_attention"] * 2, num_hidden_layers=2)
    return load_model(folder, torch.float32)


def run_both(model, prompts, page_size, interval):
    """Each prompt in turn through a warm engine and a cold one; outputs must agree. Returns warm requests."""
    pool = {"page_size": page_size, "kv_cache_tokens": 4096}
    warm = engine_for(model, engine=pool, cache={"state_track_interval": interval})
    cold = engine_for(model, engine=pool, cache=COLD)
    done = []
    for p in prompts:
        prompt = p(done) if callable(p) else p
        (w,) = warm.run_requests([prompt], GREEDY)
        assert w.output_ids == cold.generate([prompt], GREEDY)[0]
        done.append(w)
    return warm, done


@pytest.mark.slow
@pytest.mark.parametrize("interval_pages", [4, 8])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_cache_hits_equal_cold_runs(hybrid_model, page_size, interval_pages):
    interval = max(64, page_size * interval_pages) // page_size * page_size
    shared = tokens(300, 1)
    prompts = [
        shared,                                                         # 0 cold
        shared,                                                         # 1 repeat
        lambda d: d[1].prompt_ids + d[1].output_ids + tokens(20, 2),    # 2 multi-turn: prompt + answer + message
        shared[:200] + tokens(40, 3),                                   # 3 shares 200 then diverges
        shared[:200] + tokens(40, 4),                                   # 4 a third one sharing the same 200
        tokens(page_size // 2 + 1, 5),                                  # 5 shorter than one page
        shared[:150],                                                   # 6 a prefix of a cached prompt
    ]
    warm, reqs = run_both(hybrid_model, prompts, page_size, interval)
    ps = page_size
    assert reqs[0].cached_tokens == 0
    assert reqs[1].cached_tokens == (300 - 1) // ps * ps                # all but the last page
    turn1 = reqs[1].prompt_ids + reqs[1].output_ids
    assert reqs[2].cached_tokens == (len(turn1) - 1) // ps * ps         # the whole previous turn
    assert reqs[4].cached_tokens >= 200 // ps * ps                      # branch point snapshot from request 3
    assert reqs[5].cached_tokens == 0
    if interval <= 149:                                                 # a snapshot lies inside its 149 tokens
        assert reqs[6].cached_tokens > 0
    assert_no_leaks(warm)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_pure_attention_models_reuse_everything_but_the_last_page(attention_model, page_size):
    shared = tokens(200, 7)
    warm, reqs = run_both(attention_model, [shared, shared, shared[:100] + tokens(30, 8)], page_size, 512)
    assert reqs[1].cached_tokens == (200 - 1) // page_size * page_size
    assert reqs[2].cached_tokens == 100 // page_size * page_size
    assert_no_leaks(warm)


def test_disabled_cache_reuses_nothing(hybrid_model):
    eng = engine_for(hybrid_model, engine={"page_size": 16, "kv_cache_tokens": 2048}, cache=COLD)
    a, b = eng.run_requests([tokens(100, 9)] * 1, GREEDY) + eng.run_requests([tokens(100, 9)], GREEDY)
    assert a.cached_tokens == b.cached_tokens == 0 and type(eng.cache) is Cache


def test_without_tiers_no_tier_code_runs(hybrid_model):
    """No host or file tier: the cache is the radix tree alone (radix.RadixCache, not tiers.TieredRadixCache), and
    requests that miss, hit, branch and evict pages and snapshots run no line of the tiers' policy or the tiers."""
    eng = engine_for(hybrid_model, engine={"page_size": 16, "kv_cache_tokens": 320},
                     cache={"state_track_interval": 32, "state_slots": 3})
    tree = eng.cache.tree
    assert type(tree) is RadixCache
    tier_files = {Path(m.__file__).resolve() for m in (tiers, host_tier, file_tier, file_index)}
    called: set[tuple[Path, str]] = set()

    def note(frame, event, arg):
        if event == "call":
            called.add((Path(frame.f_code.co_filename).resolve(), frame.f_code.co_name))
    shared = tokens(200, 30)
    sys.setprofile(note)
    try:
        for prompt in [shared, shared + tokens(40, 31), shared[:100] + tokens(60, 32), tokens(150, 33)]:
            eng.run_requests([prompt], GREEDY)
    finally:
        sys.setprofile(None)
    ran = {name for path, name in called if path.name == "radix.py"}
    assert {"match", "insert", "_evict_device", "_take_snapshot_slot"} <= ran       # hits, evictions happened
    assert not {path.name for path, _ in called if path in tier_files}
    assert all(type(n) is Node for n in tree.nodes())
    assert_no_leaks(eng)


SCHEDULER_CALLS = {"on_arrival", "admissible", "admit", "plan_prefill", "make_room", "advance", "finish", "drop"}


def test_the_scheduler_sees_eight_cache_calls():
    """The cache as the scheduler sees it (read from scheduler.py): eight calls, each answered by the null cache
    (Cache) and by PrefixCache with the same parameters."""
    tree = ast.parse((Path(__file__).resolve().parent.parent / "tinyserve" / "scheduler.py").read_text())
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "cache"}
    assert used == SCHEDULER_CALLS
    for name in SCHEDULER_CALLS:
        want = list(inspect.signature(getattr(Cache, name)).parameters)
        assert list(inspect.signature(getattr(PrefixCache, name)).parameters) == want, name
        assert getattr(PrefixCache, name) is not getattr(Cache, name), name


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), page_size=st.sampled_from([1, 16]))
def test_random_request_streams_match_uncached(hybrid_model, data, page_size):
    """Shared prefixes, a tiny page pool (evictions, preemptions) and a tiny snapshot pool: same outputs as an
    uncached engine, no crash, no leak."""
    bases = [tokens(120, 100 + i) for i in range(3)]
    n = data.draw(st.integers(2, 6))
    prompts = []
    for _ in range(n):
        base = data.draw(st.sampled_from(bases))
        cut = data.draw(st.integers(1, 120))
        extra = data.draw(st.lists(st.integers(3, 255), max_size=30))
        prompts.append(base[:cut] + extra)
    batch_size = data.draw(st.integers(1, 3))
    kw = dict(page_size=page_size, max_running_requests=2, chunked_prefill_size=48)
    warm = engine_for(hybrid_model, engine=dict(kw, kv_cache_tokens=320),
                      cache={"state_track_interval": 32, "state_slots": 3})
    cold = engine_for(hybrid_model, engine=dict(kw, kv_cache_tokens=4096), cache=COLD)
    for i in range(0, n, batch_size):
        group = prompts[i:i + batch_size]
        assert warm.generate(group, GREEDY) == cold.generate(group, GREEDY)
    assert_no_leaks(warm)


def test_concurrent_hits_and_cancelling_a_request_that_holds_a_locked_node(hybrid_model):
    shared = tokens(200, 11)
    pool = {"page_size": 16, "kv_cache_tokens": 4096}
    eng = engine_for(hybrid_model, engine=pool, cache={"state_track_interval": 64})
    cold = engine_for(hybrid_model, engine=pool, cache=COLD)
    eng.generate([shared], GREEDY)                                     # warm the cache
    prompts = [shared + tokens(10, 20 + i) for i in range(4)]
    expected = cold.generate(prompts, GREEDY)
    long_params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def scenario():
        await eng.start()
        try:
            streams = [eng.submit(p, GREEDY) for p in prompts]
            victim = eng.submit(shared + tokens(5, 99), long_params)    # starts from a locked cached node
            async def collect(s):
                return [e.token_id async for events in s for e in events]
            outs = await asyncio.gather(*(collect(s) for s in streams))
            async for _ in victim:                                      # cancel after its first token
                victim.cancel()
            await asyncio.sleep(0.2)
            return outs, streams, victim
        finally:
            await eng.stop()

    outs, results, victim = asyncio.run(scenario())
    assert outs == expected
    assert all(r.cached_tokens >= 192 for r in results)
    assert victim.finish_reason == "abort"
    assert_no_leaks(eng)
