"""Prometheus metrics for one server (one app), names prefixed `tinyserve:` like vLLM's `vllm:` and SGLang's `sglang:`.

Each Metrics owns its own CollectorRegistry, so several apps can live in one process (the tests start many).
Counters and histograms that the HTTP layer sees are updated by api.py as requests run; gauges and the engine's own
counters (prefix-cache queries/hits) come from the EngineStats taken on the engine thread for each scrape, so they are
never stale and the engine does not need to know about Prometheus.
"""
from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any, Iterable

from prometheus_client import (CollectorRegistry, Counter, Histogram, ProcessCollector, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tinyserve.engine import EngineInfo, EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The `*_created` timestamp series double the output for no use on a single server (vLLM turns them off too).
disable_created_metrics()

# Buckets in seconds. TTFT spans a cached 1-token prefill to a cold 100k-token prompt; ITL a few ms to a slow CPU.
# Share of a request's prompt served by the prefix cache: a client whose prompts drift (a per-request hash in the
# system prompt, a moved system message) shows every request in the lowest bucket.
_HIT_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Tokens a speculating request committed per verify round (1 = no draft accepted; at most 1 + speculative.num_steps):
# acceptance that collapses shows as requests piling up in the lowest buckets while /health stays green.
_ACCEPT_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


# A sample's key: its name and labels as /metrics writes them (labels sorted, values unescaped).
def sample_key(name: str, labels: dict[str, str] | None = None) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


G, C = GaugeMetricFamily, CounterMetricFamily
# The engine's gauges and counters, from each scrape's EngineStats: (family, name, help, the EngineStats field).
ENGINE_SERIES = (
    (G, "num_requests_running", "Requests in the running batch.", "num_running"),
    (G, "num_requests_waiting", "Requests waiting for admission.", "num_waiting"),
    (G, "kv_pages_used", "Device KV pages in use.", "kv_pages_used"),
    (G, "kv_pages_total", "Device KV pages in the pool.", "kv_pages_total"),
    (C, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "cache.query_tokens"),
    (C, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "cache.hit_tokens"),
    (C, "prefix_cache_divergences", "Prompts that left a cached path that goes on with other tokens (the first at "
        "each point is logged with the tokens either side).", "cache.divergences"),
    (G, "prefix_cache_pages", "Device KV pages held by the prefix cache.", "cache.cached_pages"),
    (G, "prefix_cache_snapshots", "Recurrent-state snapshots held by the prefix cache.", "cache.snapshots_held"),
    (C, "prefix_cache_snapshots_evicted", "State snapshots evicted from the prefix cache.", "cache.snapshots_evicted"),
    (C, "num_preemptions", "Requests preempted (pages freed, recomputed later).", "num_preemptions"),
)
# Shares (0..1): (name, help, part, whole).
ENGINE_RATIOS = (
    ("kv_cache_usage_perc", "Share of device KV pages in use (0..1).", "kv_pages_used", "kv_pages_total"),
    ("state_pool_usage_perc", "Share of recurrent-state slots in use (0..1).", "state_slots_used", "state_slots_total"),
    ("cache_hit_rate", "Prefix-cache hit tokens / query tokens since start (0..1).", "cache.hit_tokens",
     "cache.query_tokens"),
)
# The optional parts' series, shown whether the part is on or not (0 when off): (part: its EngineStats field,
# family, name, help, the field of the part's stats).
FEATURE_SERIES = (
    ("idle", G, "device_pools_released", "1 while the device KV and state pools are freed after "
     "engine.idle_release_s without requests.", "pools_freed"),
    ("idle", C, "idle_releases", "Times the device pools were freed after engine.idle_release_s idle.", "times"),
    ("images", C, "images", "Images in submitted requests (a request with n choices counts its images n times).",
     "received"),
    ("images", C, "images_encoded", "Images run through the vision tower (the others came from its feature cache).",
     "encoded"),
    ("images", C, "vision_encoder_seconds", "Time spent in the vision tower.", "encode_seconds"),
)
# Shown only while the part is on: the image budget, NEXTN (vLLM's counters and definitions), the tiers.
IMAGE_BUDGET_SERIES = (
    (G, "image_budget_bytes", "Most bytes of image pixels waiting for the vision tower (derived: docs/operators.md).",
     "budget_bytes"),
    (G, "image_bytes_held", "Bytes of image pixels held now (preprocessed, not encoded yet).", "bytes_held"),
    (G, "image_requests_waiting", "Requests waiting for room in the image budget.", "requests_waiting"),
)
NEXTN_SERIES = (
    (C, "spec_decode_num_drafts", "Verify rounds of speculating requests.", "num_drafts"),
    (C, "spec_decode_num_draft_tokens", "Draft tokens verified.", "num_draft_tokens"),
    (C, "spec_decode_num_accepted_tokens", "Draft tokens accepted.", "num_accepted_tokens"),
    (G, "spec_decode_mean_accept_length", "Tokens committed per verify round since start, the bonus token included "
     "(1 + accepted / drafts; 0 before the first round).", "mean_accept_length"),
)
TIER_SERIES = (       # one family each, a sample per tier (errors and failures: the file tier's only)
    (C, "tier_hit_tokens", "Prompt tokens loaded from the tier.", "hit_tokens"),
    (C, "tier_bytes_in", "Bytes written into the tier (backups).", "bytes_in"),
    (C, "tier_bytes_out", "Bytes read from the tier (loads).", "bytes_out"),
    (C, "tier_transfer_seconds", "Time spent copying / reading / writing.", "seconds"),
    (C, "tier_errors", "Corrupt, truncated or foreign blobs (each deleted).", "errors"),
    (C, "tier_read_failures", "Reads that failed with an I/O error (a miss; the blob left as it is).",
     "read_failures"),
    (C, "tier_write_failures", "Writes that failed (the blob skipped: a full disk, an I/O error, the folder gone; "
     "writes pause, then resume).", "write_failures"),
    (G, "tier_used", "Used capacity (pages for host, bytes for file).", "used"),
    (G, "tier_capacity", "Capacity (pages for host, bytes for file).", "capacity"),
)
HOST_MEMORY_SERIES = (
    (G, "host_memory_allocated_bytes", "Host-tier memory held now (whole segments, taken as it fills).",
     "allocated_bytes"),
    (G, "host_memory_budget_bytes", "Most host-tier memory (cache.host.size_gb as planned).", "budget_bytes"),
    (G, "host_memory_min_free_bytes", "Available host memory the tier leaves to the machine "
     "(cache.host.min_free_gb).", "min_free_bytes"),
    (C, "host_memory_pressure_events", "Episodes of the host's available memory below cache.host.min_free_gb (the "
     "tier gave memory back).", "pressure_events"),
    (C, "host_memory_released_bytes", "Host-tier memory given back under memory pressure.", "released_bytes"),
)


def _series(table, of) -> list[Metric]:
    """One family per row of a (family, name, help, field) table, its value the field of `of`."""
    return [family(f"tinyserve:{name}", doc, value=float(attrgetter(field)(of))) for family, name, doc, field in table]


def _setup(i: EngineInfo) -> list[Metric]:
    """The set-up, fixed at start."""
    info = G("tinyserve:model_info", "The server's set-up (value 1).",
             labels=["model", "served_name", "device", "dtype", "kv_cache_dtype", "speculative"])
    info.add_metric([i.model, i.served_name, i.device, i.dtype, i.kv_dtype, i.speculative], 1.0)
    plan = G("tinyserve:memory_plan_bytes", "The memory plan by part (weights, kv_pool, state_slots, snapshot_slots "
             "on the device; host_tier, file_tier).", labels=["part"])
    for part, n in i.plan_bytes.items():
        plan.add_metric([part], float(n))
    return [info, G("tinyserve:context_length_tokens", "Longest prompt + completion (model.context_length as "
                    "planned).", value=i.context_length),
            G("tinyserve:kv_pool_tokens", "Tokens the device KV pool holds.", value=i.kv_tokens),
            G("tinyserve:idle_release_seconds", "engine.idle_release_s (0: off).", value=i.idle_release_s), plan]


def _nextn(sp: Any) -> list[Metric]:
    per_pos = C("tinyserve:spec_decode_num_accepted_tokens_per_pos",
                "Rounds whose draft at this position (0 = first) was accepted.", labels=["position"])
    for i, n in enumerate(sp.accepted_per_pos):
        per_pos.add_metric([str(i)], float(n))
    return [*_series(NEXTN_SERIES, sp), per_pos]


def _tiers(st: EngineStats) -> list[Metric]:
    c = st.cache
    tiers = {name: t for name, t in (("host", c.host), ("file", c.file)) if t is not None}
    out = []
    for family, name, doc, field in TIER_SERIES:
        out.append(family(f"tinyserve:{name}", doc, labels=["tier"]))
        for tier, t in tiers.items():
            out[-1].add_metric([tier], float(getattr(t, field, 0)))
    return out + (_series(HOST_MEMORY_SERIES, c.host) if c.host is not None else [])


class _EngineCollector(Collector):
    """Turns the EngineStats of the current scrape into gauges and the engine's cumulative counters."""

    def __init__(self) -> None:
        self.stats: EngineStats | None = None     # set by Metrics.render for the scrape in progress
        self.setup: list[Metric] | None = None    # the set-up's families: it is fixed at start, so built once

    def collect(self) -> Iterable[Metric]:
        st = self.stats
        if st is None:                            # still loading: nothing to report yet
            return []
        if self.setup is None and st.info is not None:
            self.setup = _setup(st.info)
        out = (self.setup or []) + _series(ENGINE_SERIES, st)
        for name, doc, part, whole in ENGINE_RATIOS:
            total = attrgetter(whole)(st)
            out.append(G(f"tinyserve:{name}", doc, value=attrgetter(part)(st) / total if total else 0.0))
        for part, family, name, doc, field in FEATURE_SERIES:
            stats = getattr(st, part)
            out.append(family(f"tinyserve:{name}", doc, value=float(getattr(stats, field) if stats else 0)))
        if st.images is not None and st.images.budget_bytes:
            out += _series(IMAGE_BUDGET_SERIES, st.images)
        if st.nextn is not None:
            out += _nextn(st.nextn)
        if st.cache.host is not None or st.cache.file is not None:
            out += _tiers(st)
        return out


class Metrics:
    """The metrics of one app. api.py calls the on_* methods; render() is the /metrics body."""

    def __init__(self) -> None:
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
        self.ttft_by_cache = Histogram("tinyserve:time_to_first_token_by_cache_seconds",
                                       "TTFT of requests with most of the prompt from the prefix cache (warm: at "
                                       "least half) or not (cold).", ["cache"], buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("tinyserve:inter_token_latency_seconds",
                             "Time between consecutive generated tokens.", buckets=_ITL_BUCKETS, registry=r)
        self.prompt_hit_ratio = Histogram("tinyserve:request_prompt_cache_hit_ratio",
                                          "Per request: prompt tokens from the prefix cache / prompt tokens.",
                                          buckets=_HIT_RATIO_BUCKETS, registry=r)
        self.e2e = Histogram("tinyserve:e2e_request_latency_seconds",
                             "From the HTTP request to its last token.", buckets=_E2E_BUCKETS, registry=r)
        self.tools_left_out = Counter("tinyserve:tools_left_out", "Tools of types this server cannot run (hosted / "
                                      "server tools such as web search) left out of requests' prompts, by type.",
                                      ["type"], registry=r)
        self.accept_length = Histogram("tinyserve:spec_decode_request_accept_length",
                                       "Per finished request that verified NEXTN drafts: tokens committed per "
                                       "verify round (1 + accepted drafts / rounds).",
                                       buckets=_ACCEPT_LENGTH_BUCKETS, registry=r)
        self._engine = _EngineCollector()
        r.register(self._engine)
        ProcessCollector(registry=r)      # process_start_time_seconds (uptime), resident memory, CPU seconds

    # ---- events from api.py ----
    def on_response(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()

    def on_tools_left_out(self, types: list[str]) -> None:
        for kind in types:
            self.tools_left_out.labels(type=kind).inc()

    # `count` tokens arrived together, `seconds` after the request (the first ones: time to first token, warm when at
    # least half of the prompt came from the prefix cache) or after the previous ones (spread evenly over them).
    def on_tokens(self, count: int, seconds: float, first: bool = False, warm: bool = False) -> None:
        self.generation_tokens.inc(count)
        if first:
            self.ttft.observe(seconds)
            self.ttft_by_cache.labels(cache="warm" if warm else "cold").observe(seconds)
        for _ in range(0 if first else count):
            self.itl.observe(seconds / count)

    # cached_by_tier: every tier's count, 0 included (each tier's series is there from the first request on);
    # draft_rounds: the request's NEXTN verify rounds, accepted_drafts: the drafts they accepted. A prompt is never
    # empty (Intake refuses one).
    def on_finished(self, finish_reason: str, prompt_tokens: int, cached_by_tier: dict[str, int], seconds: float,
                    draft_rounds: int = 0, accepted_drafts: int = 0) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()
        if draft_rounds:
            self.accept_length.observe(1 + accepted_drafts / draft_rounds)
        self.prompt_tokens.inc(prompt_tokens)
        for tier, n in cached_by_tier.items():
            self.cached_tokens.labels(tier=tier).inc(n)
        self.prompt_hit_ratio.observe(sum(cached_by_tier.values()) / prompt_tokens)
        self.e2e.observe(seconds)

    def served(self) -> tuple[float, dict[str, float]]:
        """Generated tokens since start, and prompt tokens served from the prefix cache by tier: the counters
        /metrics shows as tinyserve:generation_tokens_total and tinyserve:cached_prompt_tokens_total{tier}
        (GET /v1/loads reports them without rendering the whole registry)."""
        generated = sum(s.value for m in self.generation_tokens.collect() for s in m.samples
                        if s.name.endswith("_total"))
        cached = {s.labels["tier"]: s.value for m in self.cached_tokens.collect() for s in m.samples
                  if s.name.endswith("_total")}
        return generated, cached

    # Every sample /metrics would show with these stats, by sample_key (the status page samples them).
    def values(self, stats: EngineStats | None) -> dict[str, float]:
        self._engine.stats = stats
        try:
            return {sample_key(s.name, s.labels): s.value for family in self.registry.collect() for s in family.samples}
        finally:
            self._engine.stats = None

    def render(self, stats: EngineStats | None) -> bytes:
        """The /metrics body; `stats` from the engine thread (`await engine.call(engine.stats)`), None while
        loading."""
        self._engine.stats = stats
        try:
            return generate_latest(self.registry)
        finally:
            self._engine.stats = None
