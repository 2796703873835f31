"""The CPU's compiled static steps (compiled.CompiledSteps, engine.compile_steps): the decode step compiled by
torch.compile at start gives exactly the eager path's greedy tokens while the batch grows and shrinks and the
context crosses pages, with the prefix cache on; the graphs are saved in the folder it was given and a restart
loads them (a damaged file is compiled again); a CPU where compilation fails (here: no C++ compiler) runs every step
eagerly, after one warning.

The smallest shapes only (at most 3 running requests): each graph costs 5-15 s of CPU to compile, so the compiling
tests are `slow` (left out of the quick tier). The NEXTN graphs: tests/test_compiled_nextn.py (a module of its own, so
a second test worker compiles them meanwhile).
"""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from checkpoints import make_qwen3_5_text
from conftest import TEST_DEVICE, assert_no_leaks, drive, engine_for, merge, static_steps, tokens
from tinyserve.engine import Engine
from tinyserve.loader import load_model

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the compiled steps are the CPU's")

CTX = 256
MAX_RUNNING = 3
# one layer of each kind: the graphs hold every op of a deeper model, at half the compile time of the default four
TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
              "max_position_embeddings": CTX}

# torch.compile's CPU code is C++ built by the machine's compiler (.ci/run installs g++)
NEEDS_CXX = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="no C++ compiler here (apt-get install g++)")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder, _ = make_qwen3_5_text(tmp_path_factory.mktemp("q35"), **TWO_LAYERS)
    return load_model(folder, torch.float32, TEST_DEVICE)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One inductor cache for the module: the restart's graph that is compiled again reuses inductor's cached code."""
    return tmp_path_factory.mktemp("inductor")


def fresh_dynamo(folder, monkeypatch):
    import torch._dynamo
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    torch._dynamo.reset()
    yield folder
    torch._dynamo.reset()


@pytest.fixture
def cache_dir(shared_cache, monkeypatch):
    yield from fresh_dynamo(shared_cache, monkeypatch)


@pytest.fixture
def own_cache_dir(tmp_path, monkeypatch):
    """A cache of its own: nothing compiled before can be reused."""
    yield from fresh_dynamo(tmp_path / "inductor", monkeypatch)


def make_engine(model, **tables) -> Engine:
    defaults = {"engine": {"page_size": 16, "kv_cache_tokens": 2048, "max_running_requests": MAX_RUNNING,
                           "chunked_prefill_size": 64}, "cache": {"state_track_interval": 32}}
    return engine_for(model, **merge(defaults, tables))


def workload() -> list[tuple[int, list[int], int]]:
    """One request alone, then three at once (one sharing a prefix with the first: a prefix-cache hit), finishing
    at different steps; contexts from 3 to ~100 tokens: page tables 1 to 7 pages wide."""
    shared = tokens(40, 1)
    return [(0, shared, 12), (14, tokens(3, 2), 40), (15, shared + tokens(9, 3), 25), (16, tokens(30, 4), 60)]


def test_the_compile_cache_is_the_cache_folder_unless_the_user_chose_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    from tinyserve.compiled import use_cache_dir
    ours = tmp_path / "compiled"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())     # what importing torch._dynamo leaves
    assert use_cache_dir(ours) == ours and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ours)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_cache_dir(ours) == tmp_path / "mine"


@pytest.mark.slow
@NEEDS_CXX
def test_compiled_decode_gives_the_eager_tokens(dense, cache_dir, caplog):
    schedule = workload()
    want = drive(make_engine(dense), schedule)
    eng = make_engine(dense)
    steps = cache_dir / "tinyserve-steps"
    others = set(steps.glob("*.bin"))           # the NEXTN test's graphs, where it ran first in this process
    static = static_steps(eng, build=True, for_graphs=False)            # compiles, as engine start does
    assert static is not None and static.compiled is not None
    calls = []
    compiled_run = static.compiled._run
    static.compiled._run = lambda *a, **k: calls.append(a[3][10].shape) or compiled_run(*a, **k)   # its page table
    lm_head_rows = []
    compiled_logits = static.compiled.logits
    static.compiled.logits = lambda row: lm_head_rows.append(row.shape) or compiled_logits(row)
    assert drive(eng, schedule) == want
    assert lm_head_rows and set(lm_head_rows) == {(1, dense.cfg.hidden_size)}, "one sampled row: the LM head's graph"
    batch_sizes = {shape[0] for shape in calls}
    assert batch_sizes == {1, 2, 3}, batch_sizes
    assert len({shape[1] for shape in calls}) >= 4, "page tables of several widths"
    assert static.compiled.eager_steps == 0, "every step ran through the graphs compiled at start"
    assert eng.cache.stats().hit_tokens > 0
    assert static.compiled.compiled == 3 and static.compiled.loaded == 0, \
        "one graph for 1 sequence, one for 2-3, the LM head's for one row"
    assert_no_leaks(eng)

    # a restart: the graphs come back from their files (no tracing); one file damaged is compiled again
    saved = sorted(set(steps.glob("*.bin")) - others)
    assert len(saved) == 3, saved
    saved[0].write_bytes(saved[0].read_bytes()[:1000])
    again = make_engine(dense)
    with caplog.at_level(logging.WARNING, logger="tinyserve.compiled"):
        compiled = static_steps(again, build=True, for_graphs=False).compiled
    assert (compiled.compiled, compiled.loaded) == (1, 2)
    assert any("could not load the saved graph" in r.getMessage() for r in caplog.records)
    assert drive(again, schedule) == want
    assert_no_leaks(again)


def test_a_failed_compile_runs_eagerly_after_one_warning(dense, own_cache_dir, caplog):
    from torch._inductor import config as inductor_config
    schedule = workload()[:2]
    want = drive(make_engine(dense), schedule)
    eng = make_engine(dense)
    with caplog.at_level(logging.WARNING), inductor_config.patch({"cpp.cxx": ("no-such-c++-compiler",)}):
        assert static_steps(eng, build=True, for_graphs=False) is None
        assert drive(eng, schedule) == want
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "compiling the CPU steps failed" in warnings[0].getMessage(), warnings
    assert_no_leaks(eng)
