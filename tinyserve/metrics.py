"""Prometheus metrics for one server (one app), names prefixed `tinyserve:` like vLLM's `vllm:` and SGLang's `sglang:`.

Each Metrics owns its own CollectorRegistry, so several apps can live in one process (the tests start many).
Counters and histograms that the HTTP layer sees are updated by api.py as requests run; gauges and the engine's own
counters (prefix-cache queries/hits) are read from engine.stats() at scrape time by a custom collector, so they are
never stale and the engine does not need to know about Prometheus.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The `*_created` timestamp series double the output for no use on a single server (vLLM turns them off too).
disable_created_metrics()

# Buckets in seconds. TTFT spans a cached 1-token prefill to a cold 100k-token prompt; ITL a few ms to a slow CPU.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _stat(stats: Any, name: str) -> float | None:
    """One field of EngineStats, or None when this engine does not report it (e.g. no prefix cache)."""
    value = getattr(stats, name, None)
    if value is None and isinstance(stats, dict):
        value = stats.get(name)
    return None if value is None else float(value)


class _EngineCollector(Collector):
    """Reads engine.stats() when Prometheus scrapes; gauges plus the engine's cumulative counters."""

    def __init__(self, get_engine: Callable[[], Any]) -> None:
        self._get_engine = get_engine

    def collect(self) -> Iterable[Metric]:
        engine = self._get_engine()
        if engine is None:                        # still loading: nothing to report yet
            return []
        stats = engine.stats()
        out: list[Metric] = []

        def gauge(name: str, doc: str, value: float | None) -> None:
            if value is not None:
                out.append(GaugeMetricFamily(f"tinyserve:{name}", doc, value=value))

        def counter(name: str, doc: str, value: float | None) -> None:
            if value is not None:
                out.append(CounterMetricFamily(f"tinyserve:{name}", doc, value=value))

        def ratio(used: str, total: str) -> float | None:
            u, t = _stat(stats, used), _stat(stats, total)
            return None if u is None or not t else u / t

        gauge("num_requests_running", "Requests in the running batch.", _stat(stats, "num_running"))
        gauge("num_requests_waiting", "Requests waiting for admission.", _stat(stats, "num_waiting"))
        gauge("kv_cache_usage_perc", "Share of device KV pages in use (0..1).",
              ratio("kv_pages_used", "kv_pages_total"))
        gauge("state_pool_usage_perc", "Share of recurrent-state slots in use (0..1).",
              ratio("state_slots_used", "state_slots_total"))
        gauge("kv_pages_used", "Device KV pages in use.", _stat(stats, "kv_pages_used"))
        gauge("kv_pages_total", "Device KV pages in the pool.", _stat(stats, "kv_pages_total"))
        counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                _stat(stats, "prefix_cache_query_tokens"))
        counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", _stat(stats, "prefix_cache_hit_tokens"))
        gauge("cache_hit_rate", "Prefix-cache hit tokens / query tokens since start (0..1).",
              ratio("prefix_cache_hit_tokens", "prefix_cache_query_tokens"))
        gauge("prefix_cache_pages", "Device KV pages held by the prefix cache.", _stat(stats, "cached_pages"))
        gauge("prefix_cache_snapshots", "Recurrent-state snapshots held by the prefix cache.",
              _stat(stats, "snapshots_held"))
        counter("prefix_cache_snapshots_evicted", "State snapshots evicted from the prefix cache.",
                _stat(stats, "snapshots_evicted"))
        counter("num_preemptions", "Requests preempted (pages freed, recomputed later).",
                _stat(stats, "num_preemptions"))
        tiers = getattr(stats, "tiers", None) or {}          # host and file tiers, one label value each
        for name, doc, key, family_type in [
                ("tier_hit_tokens", "Prompt tokens loaded from the tier.", "hit_tokens", CounterMetricFamily),
                ("tier_bytes_in", "Bytes written into the tier (backups).", "bytes_in", CounterMetricFamily),
                ("tier_bytes_out", "Bytes read from the tier (loads).", "bytes_out", CounterMetricFamily),
                ("tier_transfer_seconds", "Time spent copying / reading / writing.", "seconds", CounterMetricFamily),
                ("tier_errors", "Corrupt, truncated or foreign blobs (each deleted).", "errors", CounterMetricFamily),
                ("tier_used", "Used capacity (pages for host, bytes for file).", "used", GaugeMetricFamily),
                ("tier_capacity", "Capacity (pages for host, bytes for file).", "capacity", GaugeMetricFamily)]:
            if not tiers:
                break
            family = family_type(f"tinyserve:{name}", doc, labels=["tier"])
            for tier, t in tiers.items():
                value = t.get(key, t.get(key + ("_pages" if tier == "host" else "_bytes")))
                if value is not None:
                    family.add_metric([tier], float(value))
            out.append(family)
        return out


class Metrics:
    """The metrics of one app. api.py calls the on_* methods; render() is the /metrics body."""

    def __init__(self, get_engine: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Counter names drop the `_total` suffix: prometheus_client appends it.
        self.requests = Counter("tinyserve:requests", "HTTP generation requests by response status.",
                                ["status"], registry=r)
        self.finished = Counter("tinyserve:request_finished", "Finished choices by finish reason.",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("tinyserve:prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter("tinyserve:generation_tokens", "Generated tokens.", registry=r)
        self.cached_tokens = Counter("tinyserve:cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
                                     ["tier"], registry=r)
        self.ttft = Histogram("tinyserve:time_to_first_token_seconds",
                              "From the HTTP request to the first generated token.", buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tinyserve:inter_token_latency_seconds",
                             "Time between consecutive generated tokens.", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("tinyserve:e2e_request_latency_seconds",
                             "From the HTTP request to its last token.", buckets=_E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(get_engine))

    # ---- events from api.py ----
    def on_response(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_tokens(self, count: int, seconds_since_last: float | None) -> None:
        """`count` tokens arrived together; the gap since the previous arrival is spread evenly over them."""
        self.generation_tokens.inc(count)
        if seconds_since_last is not None and count > 0:
            per_token = seconds_since_last / count
            for _ in range(count):
                self.itl.observe(per_token)

    def on_finished(self, finish_reason: str, prompt_tokens: int, cached_by_tier: dict[str, int] | None,
                    seconds: float) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        for tier, n in (cached_by_tier or {}).items():
            if n:
                self.cached_tokens.labels(tier=tier).inc(n)
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
