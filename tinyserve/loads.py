"""GET /v1/loads (and GET /loads): the worker's load, in the shape the gateways in front of several tinyserve
processes read: SGLang's /v1/loads, which SMG (the Shepherd Model Gateway, SGLang's router's successor) polls from
every worker (`?include=core,disagg,queues,memory`, every --load-monitor-interval seconds) and parses as its
WorkerLoadResponse / SchedulerLoadSnapshot (crates/protocols/src/worker.rs: serde defaults, unknown fields ignored,
integers as i32). Without it SMG balances on its own in-flight counts only.

    {"timestamp", "version", "dp_rank_count": 1,
     "loads": [one SchedulerLoadSnapshot: this process is one scheduler],
     "aggregate": {total_running_reqs, total_waiting_reqs, total_reqs, avg_token_usage, avg_throughput,
                   avg_utilization},
     "tinyserve": {what SMG ignores and an operator reads: the prefix cache by tier}}

Where each number comes from (one EngineStats taken on the engine thread, the HTTP counters beside it):
  num_running_reqs, num_waiting_reqs     the scheduler's running batch and queue (engine.stats)
  num_used_tokens, token_usage           KV tokens in use that the prefix cache does not hold (what the running
                                         requests computed past their cached prefix), over the pool. Not every
                                         used page: the prefix cache keeps a warm worker's pool full of pages it
                                         evicts as requests need them, and SMG takes a worker out of routing at
                                         0.8 usage (--worker-overload-token-usage)
  max_total_num_tokens                   the KV pool in tokens
  cache_hit_rate                         prefix-cache hit tokens / looked-up tokens since start (every tier)
  gen_throughput                         generated tokens/s since the previous call (at least RATE_MIN_S before)
  utilization                            running requests / engine.max_running_requests
  num_waiting_uncached_tokens            0: not known before admission, where the prompt meets the cache
  memory                                 the memory plan: weights and KV pool (GiB), the pool in tokens
                                         (graph_gb 0: the plan's public part has no figure for the CUDA graphs)
  queues                                 waiting (the others SGLang reports have no counterpart here: 0)
"""
from __future__ import annotations

import datetime
import importlib.metadata
import time
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from .protocol import APIError, bad_request, dumps, serving

if TYPE_CHECKING:
    from .engine import EngineStats

SECTIONS = ("core", "memory", "queues", "disagg", "all")   # `include` values; disagg: nothing to report here
RATE_MIN_S = 1.0          # a call sooner than this after the one the rate is measured from keeps the last rate
GIB = 1 << 30


def _version() -> str:
    try:
        return importlib.metadata.version("tinyserve")
    except importlib.metadata.PackageNotFoundError:      # run from a source tree that is not installed
        return "unknown"


VERSION = _version()


class Throughput:
    """Generated tokens per second between two calls of /v1/loads: what the load monitor's own interval sees. A
    second poller calling in between shortens the interval, never below RATE_MIN_S."""

    def __init__(self) -> None:
        self.last: tuple[float, float] | None = None      # (monotonic time, generated tokens) the rate runs from
        self.rate = 0.0

    def update(self, generated: float, now: float) -> float:
        if self.last is None:
            self.last = (now, generated)
        elif now - self.last[0] >= RATE_MIN_S:
            self.rate = (generated - self.last[1]) / (now - self.last[0])
            self.last = (now, generated)
        return self.rate


def _include(value: str | None) -> set[str]:
    """?include=core,memory,...: the sections asked for (none: all of them), each checked."""
    asked = {v.strip() for v in (value or "all").split(",") if v.strip()}
    unknown = sorted(asked - set(SECTIONS))
    if unknown:
        raise bad_request(f"unknown section {unknown[0]!r} in ?include= ({', '.join(SECTIONS)})", "include")
    return set(SECTIONS) if "all" in asked else asked | {"core"}


def load_response(st: EngineStats, served_name: str, max_running: int, generated: float,
                  cached: dict[str, float], rate: float, include: set[str]) -> dict[str, Any]:
    """The /v1/loads body (module docstring) from the engine's stats and the HTTP counters."""
    info = st.info
    page = info.kv_tokens // st.kv_pages_total if st.kv_pages_total else 0     # tokens a KV page holds
    total_tokens = st.kv_pages_total * page
    used_tokens = max(0, st.kv_pages_used - st.cache.cached_pages) * page
    usage = used_tokens / total_tokens if total_tokens else 0.0
    utilization = st.num_running / max_running if max_running else 0.0
    rank: dict[str, Any] = {
        "dp_rank": 0, "num_running_reqs": st.num_running, "num_waiting_reqs": st.num_waiting,
        "num_waiting_uncached_tokens": 0, "num_total_reqs": st.num_running + st.num_waiting,
        "num_used_tokens": used_tokens, "max_total_num_tokens": total_tokens, "token_usage": usage,
        "gen_throughput": rate,
        "cache_hit_rate": st.cache.hit_tokens / st.cache.query_tokens if st.cache.query_tokens else 0.0,
        "utilization": utilization, "max_running_requests": max_running}
    if "memory" in include:
        plan = info.plan_bytes
        rank["memory"] = {"weight_gb": plan["weights"] / GIB, "kv_cache_gb": plan["kv_pool"] / GIB, "graph_gb": 0.0,
                          "token_capacity": info.kv_tokens}
    if "queues" in include:
        rank["queues"] = {"waiting": st.num_waiting, "grammar": 0, "paused": 0, "retracted": 0}
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
        "version": VERSION, "dp_rank_count": 1, "loads": [rank],
        "aggregate": {"total_running_reqs": st.num_running, "total_waiting_reqs": st.num_waiting,
                      "total_reqs": st.num_running + st.num_waiting, "avg_token_usage": usage,
                      "avg_throughput": rate, "avg_utilization": utilization},
        "tinyserve": {"model": served_name, "generated_tokens": int(generated),
                      "cache": _tiers(st, page, cached)}}


def _tiers(st: EngineStats, page: int, cached: dict[str, float]) -> dict[str, Any]:
    """The prefix cache by tier: what each holds and may hold, and the prompt tokens it served (the split of
    usage.cached_tokens, as /metrics' tinyserve:cached_prompt_tokens_total{tier}). A tier that is off is null."""
    c, hits = st.cache, {tier: int(cached.get(tier, 0)) for tier in ("device", "host", "file")}
    out: dict[str, Any] = {
        "query_tokens": c.query_tokens, "hit_tokens": c.hit_tokens,
        "device": {"held_tokens": c.cached_pages * page, "capacity_tokens": st.kv_pages_total * page,
                   "snapshots": c.snapshots_held, "hit_tokens": hits["device"]},
        "host": None, "file": None}
    if c.host is not None:
        out["host"] = {"held_tokens": c.host.used * page, "capacity_tokens": c.host.capacity * page,
                       "snapshots": c.host.used_snapshots, "snapshot_capacity": c.host.capacity_snapshots,
                       "held_bytes": c.host.allocated_bytes, "hit_tokens": hits["host"]}
    if c.file is not None:
        out["file"] = {"held_bytes": c.file.used, "capacity_bytes": c.file.capacity, "blobs": c.file.blobs,
                       "writable": c.file.writable, "hit_tokens": hits["file"]}
    return out


def add_routes(app: web.Application, state_of: Callable[[web.Application], Any]) -> None:
    """GET /v1/loads and GET /loads on `app`; state_of(app) is the API's ServerState. 503 while the model loads or
    the server drains (as /health: a gateway then has no load to read)."""
    rate = Throughput()

    async def loads(request: web.Request) -> web.Response:
        state, engine = serving(request)
        include = _include(request.query.get("include"))
        model = request.query.get("model")
        if model is not None and model != engine.served_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {engine.served_name!r}",
                           "model", code="model_not_found")
        stats = await engine.call(engine.stats)            # the engine's state is read on its thread only
        generated, cached = state.metrics.served()
        body = load_response(stats, engine.served_name, state.cfg.engine.max_running_requests, generated, cached,
                             rate.update(generated, time.monotonic()), include)
        return web.json_response(body, dumps=dumps)

    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/loads", loads)
