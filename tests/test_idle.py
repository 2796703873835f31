"""Idle release (engine.idle_release_s): after that long without requests the device cache is demoted to the host
tier and the device pools are freed; the next request allocates them again and is served from the host tier with
the cold run's tokens; /health and /metrics do not wake it."""
from __future__ import annotations

import asyncio
import re
import time

import pytest

from conftest import assert_no_leaks, engine_for, tokens
from server_util import ServerProcess, free_port, http, server_config
from tinyserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


async def run(eng, prompt: list[int]):
    """One request through a started engine: its tokens and its result."""
    stream = eng.submit(prompt, GREEDY)
    out = [e.token_id async for events in stream for e in events]
    return out, stream


async def wait_for_release(eng) -> None:
    """A bounded wait for the engine thread's idle release."""
    for _ in range(400):
        if (await eng.call(eng.stats)).idle.pools_freed:
            return
        await asyncio.sleep(0.01)


def test_idle_release_then_a_host_hit(hybrid_model):
    session = tokens(200, 5)
    cold = engine_for(hybrid_model, cache={"enabled": False}).generate([session], GREEDY)[0]
    eng = engine_for(hybrid_model, engine={"page_size": 16, "idle_release_s": 0.2},
                     cache={"host": {"size_gb": 0.01, "min_free_gb": 0}})

    async def scenario():
        await eng.start()
        try:
            first, _ = await run(eng, session)
            await wait_for_release(eng)
            stats = await eng.call(eng.stats)
            assert stats.idle.pools_freed and stats.idle.times == 1
            assert eng.kv_pool.buffer.numel() == 0 and eng.state_pool.ssm.numel() == 0
            assert stats.kv_pages_used == 0 and stats.cache.cached_pages == 0 and stats.cache.snapshots_held == 0
            await asyncio.sleep(0.3)                   # stats calls (like /metrics) do not wake it
            assert (await eng.call(eng.stats)).idle.times == 1
            again, result = await run(eng, session)
            return first, again, result
        finally:
            await eng.stop()

    first, again, result = asyncio.run(scenario())
    assert first == cold and again == cold
    assert result.report["cached_by_tier"]["host"] > 0, result.report
    assert eng.kv_pool.allocated
    assert_no_leaks(eng)


def test_no_room_to_restore_fails_the_request_not_the_server(hybrid_model):
    """Another process took the device memory while the server idled: the pools cannot be allocated again. The
    request that woke it ends with finish_reason "error" (no hang, no retry loop), the pools stay released, whole,
    and the next request, with room again, is served with the cold run's tokens."""
    session = tokens(120, 6)
    cold = engine_for(hybrid_model, cache={"enabled": False}).generate([session], GREEDY)[0]
    eng = engine_for(hybrid_model, engine={"page_size": 16, "idle_release_s": 0.2})
    allocate = eng.state_pool.allocate

    def no_room():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(more detail)")

    async def scenario():
        await eng.start()
        try:
            await run(eng, session)
            await wait_for_release(eng)
            eng.state_pool.allocate = no_room            # the KV pool is allocated, then the state pool fails
            failed = await asyncio.wait_for(run(eng, session), 10)
            released = not eng.kv_pool.allocated and not eng.state_pool.allocated
            eng.state_pool.allocate = allocate
            again = await asyncio.wait_for(run(eng, session), 30)
            return failed, released, again
        finally:
            await eng.stop()

    (out, result), released, (again, _) = asyncio.run(scenario())
    assert out == [] and result.finish_reason == "error" and released
    assert again == cold and eng.kv_pool.allocated and eng.state_pool.allocated
    assert_no_leaks(eng)


def metric(base_url: str, name: str) -> float:
    _, _, body = http("GET", base_url + "/metrics")
    text = body.decode() if isinstance(body, bytes) else body
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


@pytest.mark.slow
def test_health_and_metrics_do_not_wake_a_released_server(xdg, tmp_path):
    cfg = server_config(free_port(), {"engine": {"idle_release_s": 0.5},
                                      "cache": {"host": {"size_gb": 0.05, "min_free_gb": 0}}})
    with ServerProcess(tmp_path, cfg) as srv:
        body = {"model": "tinyserve", "prompt": "hello there, a long enough prompt " * 8, "max_tokens": 4,
                "temperature": 0}
        status, _, first = http("POST", srv.base_url + "/v1/completions", body)
        assert status == 200
        deadline = time.monotonic() + 30
        while metric(srv.base_url, "tinyserve:device_pools_released") != 1.0:
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.1)
        for _ in range(5):
            assert http("GET", srv.base_url + "/health")[0] == 200
            assert metric(srv.base_url, "tinyserve:device_pools_released") == 1.0
        assert metric(srv.base_url, "tinyserve:idle_releases_total") == 1.0
        status, _, again = http("POST", srv.base_url + "/v1/completions", body)
        assert status == 200 and again is not None
        assert metric(srv.base_url, "tinyserve:device_pools_released") == 0.0
        import json
        a, b = json.loads(first), json.loads(again)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["host"] > 0, b["usage"]
