"""The CPU's compiled static steps with NEXTN (compiled.CompiledSteps): the verify step and the head's passes
compiled give the greedy tokens of plain eager decoding, and the eager head's drafts, both while they compile on
their own thread after start (the steps eager until each is ready) and after. One draft and at most
2 running requests (T = 1 and 2 tokens per sequence, a lone sequence and a batch: 8 graphs, ~1 minute of CPU), so
the module is `slow` (left out of the quick tier); the plain decode graphs and their saved files:
tests/test_compiled.py.
"""
from __future__ import annotations

import threading

import pytest
import torch

from checkpoints import make_qwen3_5_text
from conftest import TEST_DEVICE, assert_no_leaks, drive, nextn, static_steps, tokens
from test_compiled import NEEDS_CXX, TWO_LAYERS, fresh_dynamo, make_engine
from tinyserve.loader import load_model

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the compiled steps are the CPU's")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    yield from fresh_dynamo(tmp_path / "inductor", monkeypatch)


@pytest.mark.slow
@NEEDS_CXX
@pytest.mark.timeout(1800)        # eight graphs to compile: minutes on a busy 2-core machine
def test_compiled_nextn_gives_the_unspeculated_tokens(tmp_path, cache_dir):
    """NEXTN through the compiled verify step and head passes (one draft: T = 1 and 2, at most 2 sequences):
    the greedy tokens are those of plain eager decoding, and the drafts (hence the acceptance counts) are the
    eager head's."""
    from checkpoints import make_agreeing_head
    from conftest import PinnedCost
    folder, _ = make_qwen3_5_text(tmp_path / "mtp", with_mtp=True, **TWO_LAYERS)
    make_agreeing_head(folder, mix=0.3, head_noise=0.05, head_layer=0.5)
    model = load_model(folder, torch.float32, TEST_DEVICE)
    schedule = [(0, tokens(20, 5), 30), (0, tokens(5, 6), 24), (10, tokens(40, 7), 16)]
    small = {"engine": {"max_running_requests": 2}}
    want = drive(make_engine(model, cache={"enabled": False}, **small), schedule)
    spec = {"speculative": {"num_steps": 1}}
    eager = make_engine(model, **spec, **small)
    nextn(eager).step_cost = PinnedCost()
    assert drive(eager, schedule) == want
    eng = make_engine(model, **spec, **small)
    nextn(eng).step_cost = PinnedCost()
    static = static_steps(eng, build=True, for_graphs=False, in_background=True)     # as a server starts
    assert static is not None and static.compiled is not None and static.max_tokens == 2
    compiled = static.compiled
    assert set(compiled.graphs) == {("step", 1, True), ("step", 1, False)}, "the plain decode's alone at start"
    every = {(kind, T, lone) for kind in ("step", "draft", "head_kv") for T in (1, 2) for lone in (True, False)}
    assert {key for key, _ in compiled.pending} == every - set(compiled.graphs)
    ready = []
    compiled.compile_pending(on_ready=lambda: ready.append(threading.current_thread().name))
    # while the graphs compile on their thread (and are swapped in as each is ready) the tokens stay the same:
    # driven until some are swapped in mid-run, then the rest compile without a driver taking half the CPU
    runs, at_start = 0, len(compiled.graphs)
    while compiled.pending and (runs < 2 or len(compiled.graphs) == at_start) or not runs:
        assert drive(eng, schedule) == want
        runs += 1
    assert compiled.wait(timeout=600) and ready == ["tinyserve-compile"]
    totals = nextn(eng).totals
    before = (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens)
    eager_before = compiled.eager_steps
    assert drive(eng, schedule) == want
    totals, want_totals = nextn(eng).totals, nextn(eager).totals
    assert (totals.num_drafts - before[0], totals.num_draft_tokens - before[1],
            totals.num_accepted_tokens - before[2]) == \
        (want_totals.num_drafts, want_totals.num_draft_tokens, want_totals.num_accepted_tokens)
    assert want_totals.num_accepted_tokens > 0
    assert compiled.eager_steps == eager_before, "every verify and head pass ran through the compiled graphs"
    assert set(compiled.graphs) == every and not compiled.pending
    assert_no_leaks(eng)
