"""Snapshot placement that fits (the home-box issue, item 2): under state-snapshot pressure the cache keeps the
snapshots that resume requests (prompt ends, branch points, request ends: the deepest state on a path) before
interval snapshots, drops interior interval snapshots first, and demotes leaf snapshots to the host tier rather than
dropping them; it never holds more snapshot bytes than the plan says (radix_check.check_tree).

Every scenario runs the same requests through an engine without snapshot pressure and through one with a handful of
snapshot slots: a later request resumes from the same point in both (where the slots can hold it), every answer equals
a cold run's, and nothing leaks."""
from __future__ import annotations

import inspect

import pytest

from conftest import assert_no_leaks, engine_for, tokens
from tinyserve.cache import PrefixCache
from tinyserve.engine import Engine
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
GIB = 1 << 30
SESSION = 250
PS = 16
INTERVAL = 32                 # an interval snapshot every two pages: seven of them inside each session's prompt


@pytest.fixture(scope="module")
def model(hybrid_model):
    return hybrid_model


def engine(model, state_slots: int, host: tuple[dict, float] | None = None) -> Engine:
    """host: ([cache.host], the share of it for state snapshots), as host_tier gives them."""
    table, share = host or ({}, None)
    return engine_for(model, engine={"page_size": PS, "kv_cache_tokens": 4096, "max_running_requests": 1},
                      cache={"state_track_interval": INTERVAL, "state_slots": state_slots, "host": table},
                      host_state_share=share)


def host_tier(probe: Engine, snapshots: int, pages: int = 200, **keys) -> tuple[dict, float]:
    """[cache.host] (size_gb and `keys`) and the state share giving exactly `pages` host pages and `snapshots`
    host snapshots."""
    page, snap = probe.kv_pool.bytes_per_page, probe.state_pool.bytes_per_slot
    size = pages * page + snapshots * snap
    return {"size_gb": size / GIB, **keys}, (snapshots * snap + 0.5) / size


def play(eng: Engine, cold: Engine, script) -> list:
    """Run each prompt of the script in turn (a callable gets the requests so far); answers must equal cold ones."""
    done = []
    for step in script:
        prompt = step(done) if callable(step) else step
        (req,) = eng.run_requests([prompt], GREEDY)
        assert req.output_ids == cold.generate([prompt], GREEDY)[0]
        eng.cache.check()
        done.append(req)
    return done


def next_turn(i: int, seed: int):
    """The next turn of the conversation request i started: its prompt, its answer and a new message."""
    return lambda done: done[i].prompt_ids + done[i].output_ids + tokens(20, seed)


SESSIONS = [tokens(SESSION, 40 + i) for i in range(3)]
SCRIPT = [
    SESSIONS[0], SESSIONS[1], SESSIONS[2],     # three sessions, each leaving interval snapshots and a prompt end
    next_turn(0, 50),                          # A's next turn: resumes at A's prompt end (A's deepest state)
    SESSIONS[1],                               # B again (a regenerate): resumes at B's prompt end
    next_turn(2, 51),                          # C's next turn
    next_turn(3, 52),                          # A's third turn: resumes at A's second prompt end
]
LATER = range(3, len(SCRIPT))


@pytest.fixture(scope="module")
def cold(model):
    return engine_for(model, engine={"page_size": PS, "kv_cache_tokens": 4096}, cache={"enabled": False})


@pytest.fixture(scope="module")
def roomy(model, cold):
    """Cached tokens of each request with room for every snapshot."""
    eng = engine(model, state_slots=64)
    reqs = play(eng, cold, SCRIPT)
    assert eng.cache.stats().snapshots_evicted == 0
    assert_no_leaks(eng)
    return [r.cached_tokens for r in reqs]


# cache.py marks the snapshots that resume requests (insert(..., resume=True)) and asks for interval snapshots with
# alloc_snapshot(resume=False); without that, radix.py tells resume points by shape only (leaves, branch points), and
# the tightest settings below need one slot more.
MARKS = "resume" in inspect.signature(PrefixCache._snapshot).parameters
needs_marks = pytest.mark.skipif(not MARKS, reason="cache.py does not mark resume points yet")


@pytest.mark.slow
@pytest.mark.parametrize("slots", [5, pytest.param(4, marks=needs_marks)])
def test_resume_points_outlive_interval_snapshots_on_the_device(model, cold, roomy, slots):
    """A few device snapshot slots for three sessions of eight snapshots each: every later request still resumes
    from its deepest state (LRU over snapshots drops A's and B's for C's interval snapshots: all later requests
    would start cold)."""
    eng = engine(model, state_slots=slots)
    reqs = play(eng, cold, SCRIPT)
    assert eng.cache.stats().snapshots_evicted > 0
    assert [reqs[i].cached_tokens for i in LATER] == [roomy[i] for i in LATER]
    assert all(roomy[i] > 0 for i in LATER)
    assert_no_leaks(eng)


@pytest.mark.slow
@pytest.mark.parametrize("host_snapshots", [4, pytest.param(2, marks=needs_marks)])
def test_leaf_snapshots_are_demoted_to_the_host_not_dropped(model, cold, roomy, host_snapshots):
    """Two device snapshot slots and a small host tier (write_back): leaf snapshots are demoted to the host, not
    dropped, and later requests resume from them (KV on the device, the state loaded back from the host, counted
    as the host's hit)."""
    probe = engine(model, state_slots=2)
    eng = engine(model, state_slots=2, host=host_tier(probe, host_snapshots, write_policy="write_back"))
    reqs = play(eng, cold, SCRIPT)
    assert [reqs[i].cached_tokens for i in LATER] == [roomy[i] for i in LATER]
    # KV on the device, the state from the host: the host made those tokens usable, so they count as its hits
    assert reqs[4].report["cached_by_tier"] == {"device": 0, "host": reqs[4].cached_tokens, "file": 0}
    assert eng.cache.tree.host.stats.bytes_out > 0                     # states came back from the host
    assert eng.cache.tree.host.report().used_snapshots <= host_snapshots
    assert_no_leaks(eng)


def test_a_full_host_tier_keeps_leaves_over_interior_snapshots(model, cold, roomy):
    """write_through fills a host tier of three snapshot slots with copies of every snapshot; demoted leaves displace
    interior and duplicated copies there, never a leaf for an interior one."""
    probe = engine(model, state_slots=2)
    eng = engine(model, state_slots=2, host=host_tier(probe, 3, write_policy="write_through"))
    reqs = play(eng, cold, SCRIPT)
    assert [reqs[i].cached_tokens for i in LATER] == [roomy[i] for i in LATER]
    assert_no_leaks(eng)


def snapshot_ends(eng: Engine) -> dict[int, int]:
    """depth -> first token of every node holding a device snapshot."""
    return {n.depth: n.tokens[0] for n in eng.cache.tree.nodes() if n.snapshot is not None}


def test_interior_interval_snapshots_go_first_and_intervals_never_push_out_resume_points(model, cold):
    """The order on the tree itself: X leaves one snapshot (its prompt end, 32), Y three (32, 64 and its prompt end
    96) in three slots, so Y's interval snapshot at 32 went first; a new snapshot then takes Y's interior 64 (more
    recent than X's leaf); an interval snapshot (resume=False) takes no leaf's slot; a resume point takes the least
    recently used leaf's."""
    eng = engine(model, state_slots=3)
    x, y = tokens(40, 60), tokens(100, 61)
    play(eng, cold, [x, y])
    tree = eng.cache.tree
    assert sorted(snapshot_ends(eng).items()) == [(32, x[0]), (64, y[32]), (96, y[64])]
    slot = tree.alloc_snapshot()
    assert sorted(snapshot_ends(eng).items()) == [(32, x[0]), (96, y[64])]      # LRU would have taken X's
    assert tree.alloc_snapshot(resume=False) is None
    assert tree.alloc_snapshot(resume=False) is None and len(snapshot_ends(eng)) == 2
    other = tree.alloc_snapshot()
    assert other is not None and sorted(snapshot_ends(eng).items()) == [(96, y[64])]
    for s in (slot, other):
        eng.state_pool.free_snapshot(s)
    assert_no_leaks(eng)


def test_each_path_keeps_its_deepest_interval_snapshots(model, cold):
    """Y (200 tokens: intervals at 32..160, its prompt end at 192) is cached, then X's prompt takes slots: the
    interval snapshots that go are Y's shallow ones and X's own, never Y's KEPT_INTERVALS deepest (by LRU alone
    Y's older ones would all go before X's), so Y with its last stretch changed (at 150, before Y's deepest
    interval) resumes within one interval of the change."""
    eng = engine(model, state_slots=7)
    y, x = tokens(200, 65), tokens(140, 66)
    play(eng, cold, [y, x])
    kept = [n.depth for n in eng.cache.tree.nodes() if n.snapshot is not None and n.tokens[0] == y[n.depth - 32]]
    assert eng.cache.stats().snapshots_evicted > 0 and sorted(kept) == [128, 160, 192]
    (changed,) = play(eng, cold, [y[:150] + tokens(50, 67)])
    assert changed.cached_tokens == 128
    assert_no_leaks(eng)


def test_a_running_requests_lock_pins_its_pages_not_its_snapshots(model, cold):
    """Sessions running on one shared prefix lock its path; if a lock pinned the snapshots on it too, every slot
    would be held by running requests and nobody else could leave a state behind (the coding trace of
    bench/simulate.py lost a third of its hits that way). Here X's path holds both slots and is locked as a running
    request locks it: Y still caches its prompt end and resumes there next time, and X's pages stay."""
    eng = engine(model, state_slots=2)
    x, y = tokens(100, 62), tokens(100, 63)
    play(eng, cold, [x])
    tree = eng.cache.tree
    assert len(snapshot_ends(eng)) == 2
    m = tree.match(x + tokens(20, 64))                   # a request resuming from X's deepest state, still running
    tree.lock(m.node, +1)
    x_pages = [n.pages for n in tree.nodes() if n is not tree.root]
    first, again = play(eng, cold, [y, y])
    assert first.cached_tokens == 0 and again.cached_tokens == (len(y) - 1) // PS * PS
    assert all(n.pages is not None for n in tree.nodes() if n.lock)       # the locked path kept its KV
    assert x_pages[0] == tree.match(x).pages[:len(x_pages[0])]
    tree.lock(m.node, -1)
    assert_no_leaks(eng)



def record_prefills(eng: Engine) -> list[tuple[int, int, int]]:
    """(start, tokens, snapshots written in the forward) of every prefill chunk eng runs from now on."""
    seen, step = [], eng.runner.step

    def recording(seqs, *args):
        seen.extend((s.start, s.num_tokens, len(s.snapshots)) for s in seqs if not s.is_decode)
        return step(seqs, *args)
    eng.runner.step = recording
    return seen


def test_a_prompts_snapshots_are_written_inside_its_one_prefill_forward(model, cold):
    """A fresh prompt is prefilled in one forward: the interval snapshots and the page-aligned prompt end inside it
    are written by that forward (kernels.gdn's snapshots), not by ending the chunk at each. Each one resumes a later
    request exactly where a cold run would be. Where no snapshot slot is free, a chunk's first snapshot takes the
    slot of the cached one least worth keeping; a later one ends the chunk (advance weighs it against the cached
    ones, its own chunk's included, after the step)."""
    prompt = tokens(100, 60)                     # due: intervals at 32 and 64, the prompt end's page at 96
    for slots, chunks in ((64, [(0, 100, 3)]), (2, [(0, 96, 2), (96, 4, 0)]),
                          (1, [(0, 64, 1), (64, 36, 1)])):
        eng = engine(model, state_slots=slots)
        prefills = record_prefills(eng)
        (req,) = eng.run_requests([prompt], GREEDY)
        assert prefills == chunks, slots
        assert req.output_ids == cold.generate([prompt], GREEDY)[0]
        if slots == 64:
            for cut in (32, 64, 96):             # a branch after each snapshot resumes from it
                other = prompt[:cut] + tokens(20, cut)
                (r,) = eng.run_requests([other], GREEDY)
                assert r.cached_tokens == cut
                assert r.output_ids == cold.generate([other], GREEDY)[0]
        if slots == 1:                           # the prompt end's state, written over the evicted one, resumes
            other = prompt[:96] + tokens(20, 96)
            (r,) = eng.run_requests([other], GREEDY)
            assert r.cached_tokens == 96 and r.output_ids == cold.generate([other], GREEDY)[0]
        assert_no_leaks(eng)


def test_a_sessions_prompt_end_outlives_older_sessions_leaves(model, cold):
    """An agent's next turn renders the last answer back otherwise (a think block dropped), so it resumes at the last
    prompt's end, not at the request's end below it. With the slots full of older sessions' leaves, the newest
    request's prompt end stays (it counts as its request's, snapshot_worth), also when a second run found it cached
    (its claim) and its own end is still to come; the oldest session's states go. Ranked below every leaf, the
    prompt end went as soon as its own request's end took a slot."""
    eng = engine(model, state_slots=4)
    answer = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    sessions = [tokens(90, 70 + i) for i in range(5)]
    for prompt in sessions + [sessions[-1]]:             # the last one twice: the second resumes at its prompt end
        (req,) = eng.run_requests([prompt], answer)
        eng.cache.check()
    assert req.cached_tokens == 80                       # (90 - 1) // 16 * 16
    rendered_otherwise = sessions[-1] + tokens(30, 80) + tokens(10, 81)
    (turn,) = play(eng, cold, [rendered_otherwise])
    assert turn.cached_tokens == 80
    (first,) = play(eng, cold, [sessions[0] + tokens(10, 82)])
    assert first.cached_tokens == 0                      # the oldest session's states went first
    assert_no_leaks(eng)


def test_a_sessions_last_interval_snapshots_outlive_older_sessions_leaves(model, cold):
    """An agent's next turn drops a reminder from inside its last message: it resumes from an interval snapshot
    just before the change, one of the KEPT_INTERVALS last before the prompt's end, which the cache asks for as for
    a resume point; with the slots full of older sessions' states, the last session's stay (the two sessions before
    it keep theirs: INTERVAL_AGE). An interval snapshot that may never take a leaf's or a resume point's slot is
    never made once the slots are full."""
    eng = engine(model, state_slots=8)
    answer = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(5):                                   # older sessions, a prompt end and a request end each
        eng.run_requests([tokens(100, 90 + i)], answer)
    prompt = tokens(200, 95)                             # intervals at 32 .. 192; kept: 128 and 160
    for _ in range(2):                                   # run twice, the second from the cache
        (req,) = eng.run_requests([prompt], answer)
        eng.cache.check()
    assert req.cached_tokens == 192
    changed = prompt[:170] + tokens(40, 96)              # changed past the last kept interval snapshot
    (turn,) = play(eng, cold, [changed])
    assert turn.cached_tokens == 160
    assert_no_leaks(eng)
