"""Host memory that yields (design invariant 8): the host tier takes memory in segments as it fills, up to its budget,
never grows past the floor (cache.host.min_free_gb), and gives memory back when the machine's available memory falls
below it: LRU host entries are evicted, the rest is compacted into the lowest segments and the emptied segments are
freed. Memory is driven by an injected probe; real engines on a tiny fp32 checkpoint; every answer is compared with
a cold run, and the radix tree's invariants and the page / slot accounting are checked after each scenario.
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading

import pytest
import torch

from conftest import assert_no_leaks, engine_for, tokens
from tinyserve import cli, engine as engine_mod, host_tier
from tinyserve.config import ConfigError, from_dict
from tinyserve.engine import Engine
from tinyserve.metrics import Metrics
from tinyserve.radix_check import check_tree
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
GIB = 1 << 30
SESSION = 250
SESSIONS = {name: tokens(SESSION, seed) for name, seed in (("A", 11), ("B", 12), ("C", 13))}
PAGES_PER_SEGMENT = 4


@pytest.fixture(scope="module")
def model(hybrid_model):
    return hybrid_model


@pytest.fixture(scope="module")
def cold(model):
    eng = engine_for(model, engine={"page_size": 16, "kv_cache_tokens": 4096}, cache={"enabled": False})
    return {name: eng.generate([p], GREEDY)[0] for name, p in SESSIONS.items()}


class FakeMemory:
    """The machine's available memory: `total` less what others use (`other`) less what the host tier holds."""

    def __init__(self, total: int) -> None:
        self.total, self.other, self.host = total, 0, None

    def __call__(self) -> int:
        return self.total - self.other - self.host.allocated_bytes


def engine_with_host(model, pages: int = 48, snapshots: int = 8, floor: int = 0, total: int = 1 << 40,
                     monkeypatch=None) -> tuple[Engine, FakeMemory]:
    """A device pool too small for two sessions, a host tier of exactly `pages` pages and `snapshots` snapshots in
    segments of PAGES_PER_SEGMENT pages (snapshots: 3 to a segment of twice that), a floor and a fake memory
    probe."""
    probe = engine_for(model, engine={"page_size": 16, "kv_cache_tokens": 400, "max_running_requests": 1})
    page, snap = probe.kv_pool.bytes_per_page, probe.state_pool.bytes_per_slot
    assert snap < PAGES_PER_SEGMENT * page < 2 * snap, "snapshots: 3 to a segment of twice the size"
    monkeypatch.setattr(host_tier, "SEGMENT_BYTES", PAGES_PER_SEGMENT * page)
    size = pages * page + snapshots * snap
    eng = engine_for(model, engine={"page_size": 16, "kv_cache_tokens": 400, "max_running_requests": 1},
                     cache={"host": {"size_gb": size / GIB, "min_free_gb": floor / GIB}},
                     host_state_share=(snapshots * snap + 0.5) / size)
    host = eng.cache.host
    assert (host.max_pages, host.max_snapshots) == (pages, snapshots)
    assert (host._pages.per_segment, host._snaps.per_segment) == (PAGES_PER_SEGMENT, 3)
    mem = FakeMemory(total)
    mem.host = host
    host.available_memory, host.min_free_bytes = mem, floor
    return eng, mem


def host_of(eng: Engine):
    return eng.cache.host


def run(eng: Engine, name: str):
    (req,) = eng.run_requests([SESSIONS[name]], GREEDY)
    return req


def check_host_rows(eng: Engine) -> None:
    """Every node with a device and a host copy holds the same KV in both (rows moved by compaction included)."""
    host, tree = host_of(eng), eng.cache.tree
    both = [n for n in tree.nodes() if n.pages is not None and n.host_pages is not None]
    for n in both:
        assert torch.equal(host.read_pages(n.host_pages), eng.kv_pool.buffer[n.pages])
    for n in tree.nodes():
        if n.snapshot is not None and n.host_snapshot is not None:
            conv, ssm = host.read_snapshot(n.host_snapshot)
            assert torch.equal(conv, eng.state_pool.conv[n.snapshot])
            assert torch.equal(ssm, eng.state_pool.ssm[n.snapshot])


def segments_needed(rows, used: int) -> int:
    return next(k for k in range(rows.max_segments + 1) if rows.rows_in(k) >= used)


# ---------------------------------------------------------------------------------------------------------------
# Segments

def test_rows_survive_random_alloc_free_and_shrink():
    """The segment store alone: logical ids keep their contents through growth, frees and compaction."""
    rng = random.Random(0)
    rows = host_tier._Rows([((3,), torch.float32), ((2, 2), torch.float64)], total=37, per_segment=5, pin=False)
    content: dict[int, float] = {}
    counter = 0.0
    for step in range(400):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 6)
            ids = rows.alloc(n, lambda nbytes: True)
            if ids is None:
                assert n > rows.limit - rows.used
                continue
            vals = [counter + k for k in range(n)]
            counter += n
            src = [torch.tensor([[v] * 3 for v in vals]), torch.tensor([[[v] * 2] * 2 for v in vals],
                                                                       dtype=torch.float64)]
            rows.write(ids, src, list(range(n)))
            content.update(zip(ids, vals))
        elif op < 0.85 and content:
            ids = rng.sample(sorted(content), rng.randint(1, len(content)))
            rows.free(ids)
            for i in ids:
                del content[i]
        else:
            keep = segments_needed(rows, rows.used)
            rows.limit = rows.rows_in(keep)
            freed = rows.shrink_to(keep)
            assert freed % rows.row_bytes == 0 and len(rows.segments) == min(keep, len(rows.segments))
            rows.limit = rows.total
        assert rows.used == len(content)
        assert len(rows._free_rows) + rows.used == rows.rows_in(len(rows.segments))
        if content:
            ids = sorted(content)
            a, b = rows.gather(ids)
            assert a[:, 0].tolist() == [content[i] for i in ids]
            assert b[:, 1, 1].tolist() == [content[i] for i in ids]


def test_the_tier_allocates_in_segments_as_it_fills(model, cold, monkeypatch):
    eng, _ = engine_with_host(model, monkeypatch=monkeypatch)
    host = host_of(eng)
    assert host.allocated_bytes == 0 and host.num_segments == 0     # nothing taken at start
    assert host.num_pages == 48 and host.num_free_pages == 48       # ... but the whole budget is usable
    seen = [0]
    for name in "ABC":
        assert run(eng, name).output_ids == cold[name]
        pages, snaps = host._pages, host._snaps
        assert len(pages.segments) == segments_needed(pages, pages.used)    # lowest rows first: no spare segment
        assert len(snaps.segments) == segments_needed(snaps, snaps.used)
        assert host.allocated_bytes == pages.allocated_bytes + snaps.allocated_bytes <= host.budget_bytes
        assert host.allocated_bytes > seen[-1]
        seen.append(host.allocated_bytes)
    r = run(eng, "A")                                               # A was pushed off the device: a host hit
    assert r.output_ids == cold["A"] and r.report["cached_by_tier"]["host"] > 0
    check_host_rows(eng)
    st = eng.stats().cache.host
    assert st.allocated_bytes == host.allocated_bytes and st.budget_bytes == host.budget_bytes
    assert st.pressure_events == 0 and st.released_bytes == 0
    assert_no_leaks(eng)
    assert host.num_free_pages == host.num_pages == 48 and host.num_free_snapshots == host.num_snapshots == 8


def test_growth_stops_at_the_floor(model, cold, monkeypatch, caplog):
    """The machine has room for the floor plus three segments: the tier never takes a fourth, works within the
    three (LRU eviction), answers stay exact, and the episode is logged once."""
    floor = 1 << 30
    eng, mem = engine_with_host(model, floor=floor, monkeypatch=monkeypatch)
    host = host_of(eng)
    seg = host._pages.bytes_in(1)
    mem.total = floor + 3 * seg + seg // 2
    with caplog.at_level(logging.WARNING, logger="tinyserve.tiers"):
        for name in "ABCABC":
            assert run(eng, name).output_ids == cold[name]
            assert mem() >= floor and host.num_segments <= 3
            eng.cache.check()
    assert host.under_pressure and host.stats.pressure_events == 1
    assert len([r for r in caplog.records if "min_free_gb" in r.getMessage()]) == 1
    check_host_rows(eng)
    assert_no_leaks(eng)


# ---------------------------------------------------------------------------------------------------------------
# Giving memory back

def fill(eng: Engine, cold) -> None:
    for name in "ABC":
        assert run(eng, name).output_ids == cold[name]


def test_pressure_evicts_lru_frees_segments_and_answers_stay_exact(model, cold, monkeypatch, caplog):
    floor = 1 << 30
    eng, mem = engine_with_host(model, floor=floor, total=8 << 30, monkeypatch=monkeypatch)
    host, tree = host_of(eng), eng.cache.tree
    fill(eng, cold)
    before, used_before = host.allocated_bytes, host._pages.used
    where_before = list(host._pages._where)
    assert not host.relief_due() and host.relieve(tree) == 0                  # plenty of memory: nothing to do
    # another program takes memory: the floor is short by about 20 pages' worth
    deficit = 20 * host.page_bytes
    mem.other = mem() - floor + deficit
    assert host.relief_due()
    with caplog.at_level(logging.WARNING, logger="tinyserve.tiers"):
        released = host.relieve(tree)
        assert host.relieve(tree) == 0 and host.relief_due() is False          # restored: the episode goes on
    assert released >= deficit and mem() >= floor
    assert host.allocated_bytes == before - released
    assert host.stats.released_bytes == released and host.stats.pressure_events == 1
    assert len([r for r in caplog.records if "min_free_gb" in r.getMessage()]) == 1
    assert host.under_pressure and host.num_pages < 48
    assert host._pages.used < used_before                                      # LRU entries went
    assert host._pages.used <= host.num_pages and host.num_segments < 48 // 4 + 3
    check_tree(tree)
    moved = [i for i, w in enumerate(host._pages._where) if w >= 0 and where_before[i] != w]
    assert moved, "compaction moved rows from the freed segments"
    check_host_rows(eng)
    # the most recent session (C) kept its host copy; take it off the device and hit it from the host
    eng.cache.make_room(eng.allocator.num_pages)
    r = run(eng, "C")
    assert r.output_ids == cold["C"] and r.report["cached_by_tier"]["host"] > 0, r.report["cached_by_tier"]
    for name in "AB":                                                          # evicted: recomputed, exact
        assert run(eng, name).output_ids == cold[name]
        assert mem() >= floor
        check_tree(tree)
    # memory comes back: the episode ends, the tier may grow to its budget again
    mem.other = 0
    assert host.relief_due()
    host.relieve(tree)
    assert not host.under_pressure and host.num_pages == 48 and host.num_snapshots == 8
    fill(eng, cold)
    assert host.allocated_bytes > before - released
    # a second episode is logged (and counted) again
    mem.other = mem() - floor + deficit
    with caplog.at_level(logging.WARNING, logger="tinyserve.tiers"):
        host.relieve(tree)
    assert host.stats.pressure_events == 2
    assert len([r for r in caplog.records if "min_free_gb" in r.getMessage()]) == 2
    check_host_rows(eng)
    assert_no_leaks(eng)
    assert host.num_free_pages == host.num_pages and host.num_free_snapshots == host.num_snapshots


def test_pressure_beyond_everything_empties_the_tier(model, cold, monkeypatch):
    floor = 1 << 30
    eng, mem = engine_with_host(model, floor=floor, total=8 << 30, monkeypatch=monkeypatch)
    host, tree = host_of(eng), eng.cache.tree
    fill(eng, cold)
    mem.other = mem.total                        # nothing the tier gives back restores the floor
    host.relieve(tree)
    assert host.allocated_bytes == 0 and host.num_segments == 0
    assert host.num_pages == 0 and host.num_snapshots == 0
    check_tree(tree)
    for name in "CAB":                           # no host tier to speak of: answers still exact
        assert run(eng, name).output_ids == cold[name]
        assert host.allocated_bytes == 0
    assert_no_leaks(eng)


def test_pressure_while_a_request_runs(model, cold, monkeypatch):
    """Memory runs out between two steps of a request that resumed from a host hit (its path locked, on the
    device now): the host tier gives back what the tree lets it evict, the request's answer is exact, and nothing
    leaks."""
    from tinyserve.request import Status
    floor = 1 << 30
    eng, mem = engine_with_host(model, floor=floor, total=8 << 30, monkeypatch=monkeypatch)
    host, tree = host_of(eng), eng.cache.tree
    fill(eng, cold)
    eng.cache.make_room(eng.allocator.num_pages)             # everything host-only: A resumes from the host
    req = eng.intake.make_request(SESSIONS["A"], GREEDY)
    eng.scheduler.add(req)
    eng._step()                                               # admitted (its path locked), prefilling
    assert req.status == Status.RUNNING and req.report["cached_by_tier"]["host"] > 0
    mem.other = mem.total                                     # all of it, at once
    host.relieve(tree)
    check_tree(tree)
    assert host.allocated_bytes < host.budget_bytes
    while req.status != Status.FINISHED:
        eng._step()
    assert req.output_ids == cold["A"]
    check_tree(tree)
    host.relieve(tree)                                        # the request is gone: the rest can go now
    assert host.allocated_bytes == 0
    mem.other = 0
    host.relieve(tree)
    assert not host.under_pressure
    fill(eng, cold)
    assert_no_leaks(eng)


def test_no_floor_never_probes(model, cold, monkeypatch):
    eng, _ = engine_with_host(model, floor=0, monkeypatch=monkeypatch)
    host = host_of(eng)

    def boom() -> int:
        raise AssertionError("probed without a floor")
    host.available_memory = boom
    fill(eng, cold)
    assert not host.relief_due() and host.relieve(eng.cache.tree) == 0
    assert_no_leaks(eng)


# ---------------------------------------------------------------------------------------------------------------
# Serving: the watcher gives memory back on the engine thread; config, plan and metrics

def test_the_serving_watcher_relieves_on_the_engine_thread(model, cold, monkeypatch):
    """A serving engine watches the host's memory itself (the cache's upkeep, started by Engine.start, stopped by
    Engine.stop)."""
    monkeypatch.setattr(engine_mod, "UPKEEP_S", 0.01)
    floor = 1 << 30
    eng, mem = engine_with_host(model, floor=floor, total=8 << 30, monkeypatch=monkeypatch)
    host = host_of(eng)
    assert host.min_free_bytes == floor                  # the engine gives the host tier cache.host.min_free_gb
    threads = []
    relieve = host.relieve

    def spy(tree):
        threads.append(threading.current_thread().name)
        return relieve(tree)
    host.relieve = spy

    async def scenario():
        await eng.start()
        try:
            for name in "ABC":
                s = eng.submit(SESSIONS[name], GREEDY)
                assert [e.token_id async for events in s for e in events] == cold[name]
            full = host.allocated_bytes
            mem.other = mem() - floor + 20 * host.page_bytes
            for _ in range(1000):
                if host.allocated_bytes < full and mem() >= floor:
                    break
                await asyncio.sleep(0.01)
            assert host.allocated_bytes < full and mem() >= floor
            s = eng.submit(SESSIONS["A"], GREEDY)
            assert [e.token_id async for events in s for e in events] == cold["A"]
            return await eng.call(eng.stats)
        finally:
            await eng.stop()

    stats = asyncio.run(scenario())
    assert threads and set(threads) == {"tinyserve-engine"}
    assert stats.cache.host.pressure_events == 1 and stats.cache.host.released_bytes > 0
    body = Metrics().render(stats).decode()
    assert "tinyserve:host_memory_pressure_events_total 1.0" in body
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in body.splitlines() if line[0] != "#"}
    assert values["tinyserve:host_memory_min_free_bytes"] == floor
    assert values["tinyserve:host_memory_budget_bytes"] == host.budget_bytes
    assert "tinyserve:host_memory_released_bytes_total" in body and "tinyserve:host_memory_allocated_bytes" in body
    assert_no_leaks(eng)


def test_min_free_gb_key():
    assert from_dict({}).cache.host.min_free_gb == 4.0
    assert from_dict({"cache": {"host": {"min_free_gb": 0}}}).cache.host.min_free_gb == 0.0
    with pytest.raises(ConfigError, match="cache.host.min_free_gb"):
        from_dict({"cache": {"host": {"min_free_gb": -1}}})
    with pytest.raises(ConfigError, match="cache.host.min_free_gb"):
        from_dict({"cache": {"host": {"min_free_gb": "4"}}})


def test_the_plan_shows_the_budget_and_the_floor(xdg, capsys):
    cfg = from_dict({"model": {"device": "cpu"}, "cache": {"host": {"size_gb": 0.25, "min_free_gb": 2.5}}})
    assert cli.check(cfg) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("host tier:"))
    assert "up to 0.25 GiB" in line and "2.5 GB" in line and "cache.host.min_free_gb" in line
    off = from_dict({"model": {"device": "cpu"}})
    assert cli.check(off) == 0
    assert "host tier:" not in capsys.readouterr().out
