"""The cache simulator (bench/simulate.py) against the real engine.

The same traces, shrunk to a tiny checkpoint's context, go through a real Engine on the CPU (the real runner, real
forwards) and through sim_engine (the stand-in runner, pools of the same plan's counts with tiny tensors), both driven
by simulate.replay on the same virtual clock. The stand-in only replaces compute, so every request's cached tokens
and their device / host / file split, the tree's counters and the file tier's size accounting must be equal. Then
the 27B-shaped simulation itself: the plan's counts with pools of a few MB, bytes reported at real scale.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from conftest import engine_for, merge

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import simulate  # noqa: E402

SCALE_SEED = 1 / 160           # the seed trace's 170K prefix -> 1062 tokens (the tiny model has 2048 positions)
SCALE_CODING = 1 / 80          # the coding trace's 20K prefix -> 250 tokens


# Per trace: a device pool that holds one session but not all of them, few device snapshot slots, a host tier too
# small for the working set (so it evicts, and the file tier serves some of what it dropped), a small file tier (so
# it evicts too). 16-token pages, so a few hundred tokens make many pages and snapshots.
TABLES = {
    "seed": dict(engine={"kv_cache_tokens": 1504, "max_running_requests": 1},
                 cache={"state_track_interval": 32, "state_slots": 6, "host": {"size_gb": 0.001},
                        "file": {"size_gb": 0.001}}),
    "coding": dict(engine={"kv_cache_tokens": 1504, "max_running_requests": 2},
                   cache={"state_track_interval": 64, "state_slots": 8,
                          "host": {"size_gb": 0.001}, "file": {"size_gb": 0.002}}),
}


def tables(name: str, file_dir: Path) -> dict:
    return merge(dict(engine={"page_size": 16, "chunked_prefill_size": 256},
                      cache={"host": {"min_free_gb": 0},          # as the simulator: no memory pressure
                             "file": {"dir": str(file_dir), "prefetch_policy": "wait_complete"}}), TABLES[name])


def replay_both(model, tmp_path: Path, trace: simulate.Trace):
    real = engine_for(model, **tables(trace.name, tmp_path / "real"))
    mc = model.cfg
    values = sum(p.numel() for p in model.parameters())
    cost = simulate.CostModel.for_model(mc, values, real.plan).instant_transfers()
    r_real = simulate.replay(real, trace, cost, simulate.Clock())
    plan = dataclasses.replace(real.plan, file_dir=str(tmp_path / "sim"))
    clock = simulate.Clock()
    sim = simulate.sim_engine(real.cfg, plan, mc, cost, clock)
    r_sim = simulate.replay(sim, trace, cost, clock)
    sim.cache.check()
    real.cache.check()
    try:
        return real, sim, r_real, r_sim
    finally:
        real.close()
        sim.close()


def per_request(r: simulate.Result) -> list[tuple]:
    return [(x.request_id, x.prompt_tokens, x.cached, x.by_tier, x.output_tokens, x.computed, round(x.ttft, 9))
            for x in r.records]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["seed", "coding"])
def test_simulator_reproduces_the_engine(hybrid_model, tmp_path, name):
    if name == "seed":
        trace = simulate.seed_trace(scale=SCALE_SEED, vocab=256, turns=32)
    else:
        trace = simulate.coding_trace(scale=SCALE_CODING, vocab=256, sessions=4, gap_s=20.0)
    real, sim, r_real, r_sim = replay_both(hybrid_model, tmp_path, trace)
    assert per_request(r_sim) == per_request(r_real)
    assert r_sim.tree == r_real.tree
    f_real, f_sim = real.cache.file, sim.cache.file
    assert (f_sim.num_blobs, f_sim.used_bytes) == (f_real.num_blobs, f_real.used_bytes), \
        "the simulated file tier sizes blobs as the real one writes them"
    for k, v in r_real.end.items():                             # pages, snapshots, blobs held by each tier
        assert r_sim.end[k] == v, k
    # the trace exercised every tier: each served pages or states, the host and the file tier evicted (sizes chosen
    # for the snapshot policy of the day: retune TABLES if a policy change leaves a tier idle)
    c = r_sim.counters
    assert sum(x.by_tier["device"] for x in r_real.records) > 0
    assert c.host_pages_loaded + c.host_snapshots_loaded > 0, c
    assert c.file_to_device_bytes > 0, c
    assert c.host_pages_saved > r_sim.end["host_pages"], "the host tier evicted"
    assert c.file_blobs_written > r_sim.end["file_blobs"], "the file tier evicted"


@pytest.mark.slow
def test_27b_plan_with_tiny_pools(tmp_path):
    """production.toml's plan counts for Qwen3.5-27B (4,224 pages of 64, 4 device snapshots, 41 host ones) in pools
    of a few MB, bytes reported at real scale; the shared 170K prefix is hit by every session after the first."""
    cfg, mc, values, plan = simulate.plan_27b(simulate.ROOT / "systemd" / "production.toml", tmp_path)
    assert (plan.page_size, plan.kv_pages, plan.snapshot_slots, plan.host_snapshots) == (64, 4224, 4, 41)
    assert plan.state_bytes_per_slot == 153944064                  # 48 x (48 x 128 x 128 x 4 + conv state)
    cost, clock = simulate.CostModel.for_model(mc, values, plan), simulate.Clock()
    assert abs(cost.prefill_seconds(0, 50_000) - 7.73) < 0.01      # the calibration anchor
    engine = simulate.sim_engine(cfg, plan, mc, cost, clock)
    try:
        pools = engine.kv_pool.buffer.nbytes + engine.state_pool.conv.nbytes + engine.state_pool.ssm.nbytes
        assert engine.allocator.num_pages == 4224 and pools < 8 << 20
        r = simulate.replay(engine, simulate.seed_trace(turns=5), cost, clock)
        engine.cache.check()
        assert engine.cache.host._pages.allocated_bytes < 8 << 20
    finally:
        engine.close()
    sizes = simulate.Sizes.of(plan)
    assert r.end["device_bytes"] == r.end["device_pages"] * sizes.page_bytes + \
        r.end["device_snapshots"] * sizes.snap_bytes
    assert r.end["file_bytes"] > 10 * simulate.GB                   # real-scale accounting of tiny blobs
    first = {x.session: x for x in r.records if x.turn == 0}
    assert first["s0"].cached == 0
    assert all(x.cached >= 169_000 for s, x in first.items() if s != "s0"), \
        [(x.request_id, x.cached) for x in r.records]
