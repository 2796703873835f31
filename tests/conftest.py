"""Fixtures and helpers shared by the test modules: tiny checkpoints, engines built from TOML-named keys, prompts,
and the no-leak check that also asserts the prefix cache's invariants."""
from __future__ import annotations

import os
import sys

# Python's compiled bytecode kept where the environment turns it off (PYTHONDONTWRITEBYTECODE): each test worker and
# each of the suite's ~50 server processes would compile the tests and tinyserve from source again (~4 s a worker).
# Set here, before the workers and the servers start, so they inherit it.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# One OpenMP thread per torch-running thread in the test process: the tests run engines both offline (main thread)
# and served (the compute thread), and two multi-threaded OpenMP teams on a 2-core machine crawl. Tests are not
# timed; the benchmarks in bench/ run tinyserve as a user does. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Where the engine tests put the model: the CPU here and in CI; tests/gpu.sh runs the parity, engine, NEXTN and
# cache-path tests again with TINYSERVE_TEST_DEVICE=cuda on a machine with a GPU (same tests, same oracles).
TEST_DEVICE = os.environ.get("TINYSERVE_TEST_DEVICE", "cpu")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from checkpoints import make_qwen3_5_text  # noqa: E402
from tinyserve import plan  # noqa: E402
from tinyserve.build import built_static_step, engine_for_model  # noqa: E402
from tinyserve.config import from_dict  # noqa: E402
from tinyserve.engine import Engine  # noqa: E402
from tinyserve.loader import load_model  # noqa: E402
from tinyserve.request import Status  # noqa: E402
from tinyserve.sampling import SamplingParams  # noqa: E402
from tinyserve.static import static_step  # noqa: E402

if torch.cuda.is_available():
    # The engine tests' xdist workers share one GPU: each sizes its pools (engine.mem_fraction_static of what
    # torch.cuda.mem_get_info reports free) in an equal share of the card, or the first engine takes 90% of it and
    # every other worker runs out of memory.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if _workers > 1:
        _mem_get_info = torch.cuda.mem_get_info

        def _mem_get_info_of_this_worker(device=None):
            free, total = _mem_get_info(device)
            return max(0, min(free, total // _workers - torch.cuda.memory_reserved(device))), total

        torch.cuda.mem_get_info = _mem_get_info_of_this_worker

    @pytest.fixture(autouse=True)
    def _release_cached_gpu_memory():
        """The kernel test files run side by side on one GPU (tests/gpu.sh): a test's freed tensors go back to the
        device, not to this process's allocator cache, where the other files could not have them."""
        yield
        torch.cuda.empty_cache()


# The quick tier (`pytest -m "not slow"`, docs/testing.md) runs in-process only: besides the tests marked `slow` by
# hand, it leaves out every test that starts a server process (through one of these fixtures, or marked), and the
# modules that run Triton's interpreter, the C++ compiler or the NEXTN case matrix. server_util.ServerProcess
# refuses to start in the quick tier, so a test that needs a process and is not listed fails there.
SERVER_FIXTURES = {"server", "special_flag_server", "no_vision", "two_servers"}
SLOW_MODULES = {"test_compiled", "test_compiled_nextn", "test_spec_cases", "test_triton_fp8",
                "test_triton_gdn_prefill", "test_triton_kernels", "test_triton_moe", "test_triton_prefill"}


def pytest_configure(config: pytest.Config) -> None:
    if "not slow" in (config.option.markexpr or ""):
        os.environ["TINYSERVE_QUICK_TIER"] = "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--agents", action="store_true",
                     help="run tests/agents: the real coding-agent CLIs against the shipped config "
                          "(bash tests/agents/run.sh installs them and runs this)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/agents runs only when asked (--agents): it needs the agents installed from npm and ~5 minutes."""
    if collection_path == Path(__file__).parent / "agents" and not config.getoption("--agents"):
        return True
    return None


@pytest.hookimpl(tryfirst=True)         # before -m deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with a test marked `slow` by hand first (the order within each group kept): the workers take whole
    modules in collection order (pyproject's addopts), and a long module handed out last keeps one worker busy
    alone. Then the quick tier's rule above marks the rest of what it leaves out."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)
    for item in items:
        if item.path.stem in SLOW_MODULES or SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Deep merge of TOML tables (extra wins)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def engine_for(loaded_model, tokenizer=None, host_state_share: float | None = None,
               **tables: dict[str, Any]) -> Engine:
    """An engine around a loaded model, configured by TOML tables with the TOML's own key names:
    engine_for(model, engine={"page_size": 16}, cache={"enabled": False, "host": {"size_gb": 0.01}}).
    host_state_share: the share of cache.host.size_gb its plan gives state snapshots (plan.HOST_STATE_SHARE, a
    constant, not a key), for tests that need exact host page and snapshot counts.
    The static steps are off unless a test asks for them: capturing CUDA graphs (tests/gpu.sh) or compiling the
    CPU steps for every engine of the suite would take most of a GPU check's minutes, and minutes of CPU
    (tests/test_cuda_graphs.py and tests/test_compiled.py test them)."""
    tables = merge({"engine": {"compile_steps": False}}, tables)
    if host_state_share is None:
        return engine_for_model(from_dict(tables), loaded_model, tokenizer)
    default, plan.HOST_STATE_SHARE = plan.HOST_STATE_SHARE, host_state_share
    try:
        return engine_for_model(from_dict(tables), loaded_model, tokenizer)
    finally:
        plan.HOST_STATE_SHARE = default


def nextn(eng: Engine):
    """The engine's NEXTN feature (spec.NextN), or None when speculation is off."""
    return eng.nextn


def static_steps(eng: Engine, build: bool = False, for_graphs: bool = True, in_background: bool = False):
    """Switch an engine's static steps on for up to engine.max_running_requests sequences: built as engine start
    builds them (captured with for_graphs, else compiled, with in_background the NEXTN graphs left pending; None
    where that fails), or unbuilt (the CPU tests' switch: the static batches run eagerly through the static
    buffers, in the CUDA graphs' layout with for_graphs)."""
    max_batch = eng.cfg.engine.max_running_requests
    static = built_static_step(eng.runner, max_batch, for_graphs, in_background) if build else \
        static_step(eng.runner, max_batch, for_graphs)
    if static is not None:
        eng.runner.steps = static
        eng.runner.compiled = static.compiled      # built on the CPU: plain decodes through its graphs
    return static


def drive(eng: Engine, schedule: list[tuple[int, list[int], int]]) -> list[list[int]]:
    """Run requests offline step by step: (step it arrives at, prompt, max_tokens) each; the batch grows as they
    arrive and shrinks as they finish. Returns each request's greedy tokens."""
    reqs, step = [], 0
    pending = sorted(schedule, key=lambda a: a[0])
    while pending or any(r.status != Status.FINISHED for r in reqs):
        while pending and pending[0][0] <= step:
            _, prompt, n = pending.pop(0)
            req = eng.intake.make_request(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), None)
            eng.scheduler.add(req)
            reqs.append(req)
        eng._step()
        step += 1
    return [r.output_ids for r in reqs]


def prefill_logits(eng: Engine, req) -> torch.Tensor:
    """Logits of every prompt position of `req`, computed through the scheduler's chunked prefill and the runner."""
    eng.scheduler.add(req)
    hidden = []
    while req.num_computed < len(req.prompt_ids):
        seqs = eng.scheduler.schedule()
        hidden.append(eng.runner.forward(seqs)[1])
        req.num_computed += seqs[0].num_tokens
    return eng.model.compute_logits(torch.cat(hidden))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_no_leaks(engine: Engine) -> None:
    """The prefix cache keeps its invariants; once emptied, every page, state slot and snapshot slot is free, and
    the cache keeps no request's bookkeeping."""
    engine.cache.check()
    assert not getattr(engine.cache, "runs", {}), "bookkeeping of requests that are gone"
    assert engine.flush_cache()
    engine.cache.check()
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert engine.state_pool.num_free == engine.state_pool.num_slots
    assert engine.state_pool.num_free_snapshots == engine.state_pool.num_snapshot_slots
    stats = engine.cache.stats()
    assert stats.cached_pages == 0 and stats.snapshots_held == 0


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    """A Qwen3.5 text model (GDN + full attention), fp32, 2048 positions, on the test device."""
    folder, _ = make_qwen3_5_text(tmp_path_factory.mktemp("hybrid"), max_position_embeddings=2048)
    return load_model(folder, torch.float32, TEST_DEVICE)


@pytest.fixture(scope="session")
def xdg(tmp_path_factory: pytest.TempPathFactory):
    """One XDG_CACHE_HOME per session, set for this process and its children: the demo checkpoint is written once."""
    folder = tmp_path_factory.mktemp("xdg")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(folder))
        from tinyserve.demo import ensure_demo_checkpoint
        ensure_demo_checkpoint()
        yield folder


class PinnedCost:
    """The runner prices a draft by timing its steps (spec.StepCost); tests must not depend on timing, so the
    price is pinned here (a draft costs `per_draft` of a decode step): the depth then follows acceptance alone."""

    def __init__(self, per_draft: float = 0.1) -> None:
        self.per_draft = per_draft

    def relative(self, d: int) -> float:
        return 1.0 + self.per_draft * d

    def observe(self, drafts: int, seconds: float) -> None:
        pass
