"""The operator's view: the production summary users post by hand (plan, cache fill, hit rates, TTFT cold vs warm,
decode speed, acceptance length, errors, uptime), live, with the last hour in a ring buffer.

Every number comes from the metrics registry at one moment (`Metrics.values`, the samples /metrics renders), so the
page (GET /, status.html), its JSON (GET /status.json) and `tinyserve status URL` show what /metrics says. A row
names where its value comes from: `num` (a sum of samples) over `den` (another sum) when it is a ratio, or `window`
when it is taken from the ring buffer over the last hour. The page and the terminal format values alike (`fmt`;
status.html's fmt is the same rules in JavaScript, and the browser test holds them equal).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import threading
import time
from collections import deque
from decimal import ROUND_HALF_UP, Decimal
from importlib import resources
from typing import Any, Awaitable, Callable

from aiohttp import web

from .metrics import sample_key as key

log = logging.getLogger("tinyserve.status")

SAMPLE_S = 5.0                       # ring-buffer sampling period
WINDOW_S = 3600.0                    # "last hour"
PAGE = resources.files("tinyserve").joinpath("status.html").read_bytes()

M = "tinyserve:"
TIERS = ("device", "host", "file")
PLAN_PARTS = (("weights", "weights"), ("kv_pool", "KV pool"), ("state_slots", "GDN state slots"),
              ("snapshot_slots", "state snapshot slots"), ("host_tier", "host tier"), ("file_tier", "file tier"))
# what the ring buffer keeps of each sample: the counters the windows and plots difference, and the gauges plotted
HISTORY_KEYS = (f"{M}generation_tokens_total", f"{M}prompt_tokens_total", f"{M}kv_cache_usage_perc",
                f"{M}time_to_first_token_seconds_sum", f"{M}time_to_first_token_seconds_count",
                f"{M}inter_token_latency_seconds_sum", f"{M}inter_token_latency_seconds_count",
                f"{M}spec_decode_num_drafts_total", f"{M}spec_decode_num_accepted_tokens_total",
                *(f'{M}cached_prompt_tokens_total{{tier="{t}"}}' for t in TIERS),
                *(f'{M}time_to_first_token_by_cache_seconds_{s}{{cache="{c}"}}' for c in ("cold", "warm")
                  for s in ("sum", "count")))


# ---------------------------------------------------------------------------------------------------------------
# Formatting (status.html's fmt follows the same rules)

def _fixed(v: float, digits: int) -> str:
    """v with `digits` decimals, halves rounded up on the exact binary value (JavaScript's toFixed)."""
    return str(Decimal(v).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def _count(v: float) -> str:
    return f"{int(Decimal(v).quantize(Decimal(1), rounding=ROUND_HALF_UP)):,}"


def _bytes(v: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= size:
            return f"{_fixed(v / size, 2)} {unit}"
    return f"{_count(v)} B"


def _duration(v: float) -> str:
    s = int(max(0.0, v))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d} d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def fmt(row: dict[str, Any], now: float) -> str:
    """A row's value as the page shows it."""
    if "text" in row:
        return row["text"]
    v, kind = row.get("value"), row["format"]
    if v is None:
        return "-"
    if kind == "percent":
        return f"{_fixed(v * 100, 1)}%"
    if kind == "bytes":
        out = _bytes(v)
    elif kind == "count":
        out = _count(v)
    elif kind == "seconds":
        out = f"{_fixed(v * 1000, 0)} ms" if v < 1 else f"{_fixed(v, 2)} s"
    elif kind == "rate":
        out = f"{_fixed(v, 1)} tok/s"
    elif kind == "number":
        out = _fixed(v, 2)
    elif kind == "since":                     # a start time, shown as the time since
        out = _duration(now - v)
    else:
        raise ValueError(f"unknown format {kind!r}")
    if row.get("total"):                      # a fill: "used / total (share)"
        total_text = _bytes(row["total"]) if kind == "bytes" else _count(row["total"])
        out += f" / {total_text} ({_fixed(v / row['total'] * 100, 1)}%)"
    return out


# ---------------------------------------------------------------------------------------------------------------
# The summary

def _sum(values: dict[str, float], keys: list[str]) -> float:
    return sum(values.get(k, 0.0) for k in keys)


def _matching(values: dict[str, float], pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return sorted(k for k in values if rx.fullmatch(k))


def _row(label: str, values: dict[str, float], num: list[str], den: list[str] | None = None, fmt_: str = "count",
         total: list[str] | None = None) -> dict[str, Any]:
    """A row read from the samples: sum(num), or sum(num) / sum(den) (None when that is 0); `total`: a fill's
    capacity."""
    value: float | None = _sum(values, num)
    if den is not None:
        d = _sum(values, den)
        value = value / d if d else None
    row: dict[str, Any] = {"label": label, "value": value, "format": fmt_, "num": num}
    if den is not None:
        row["den"] = den
    if total is not None:
        row["total"], row["total_keys"] = _sum(values, total), total
    return row


def _windowed(label: str, samples: list[tuple[float, dict[str, float]]], num: list[str], den: list[str],
              fmt_: str, scale: float = 1.0, plus: float = 0.0) -> dict[str, Any]:
    """A ratio of differences over the ring buffer's last hour: (d num / d den) * scale + plus."""
    value = None
    span = 0.0
    if len(samples) >= 2:
        (t0, first), (t1, last) = samples[0], samples[-1]
        d = _sum(last, den) - _sum(first, den)
        if d > 0:
            value = (_sum(last, num) - _sum(first, num)) / d * scale + plus
        span = t1 - t0
    return {"label": label, "value": value, "format": fmt_, "window": span}


def info_labels(values: dict[str, float]) -> dict[str, str]:
    """The labels of tinyserve:model_info (the server's set-up)."""
    for k in values:
        if k.startswith(f"{M}model_info{{"):
            return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', k[len(M) + 11:-1]))
    return {}


def summary(values: dict[str, float], history: list[tuple[float, dict[str, float]]], now: float) -> dict[str, Any]:
    """The production summary: sections of rows (label, value, format, where the value comes from) and the last
    hour's series for the plots. `values`: the samples at `now`; `history`: (time, samples) of the ring buffer."""
    info = info_labels(values)
    recent = [(t, s) for t, s in history if t >= now - WINDOW_S] + [(now, values)]
    prompt, cached = [f"{M}prompt_tokens_total"], [f'{M}cached_prompt_tokens_total{{tier="{t}"}}' for t in TIERS]
    ttft = {c: ([f'{M}time_to_first_token_by_cache_seconds_sum{{cache="{c}"}}'],
                [f'{M}time_to_first_token_by_cache_seconds_count{{cache="{c}"}}']) for c in ("cold", "warm")}
    itl = ([f"{M}inter_token_latency_seconds_count"], [f"{M}inter_token_latency_seconds_sum"])
    drafts, accepted = [f"{M}spec_decode_num_drafts_total"], [f"{M}spec_decode_num_accepted_tokens_total"]
    setup = [{"label": "model", "text": info.get("model", "-")},
             {"label": "served name", "text": info.get("served_name", "-")},
             {"label": "device, dtype / KV dtype", "text": f"{info.get('device', '-')}, {info.get('dtype', '-')} / "
                                                          f"{info.get('kv_cache_dtype', '-')}"},
             _row("context", values, [f"{M}context_length_tokens"]),
             _row("KV pool tokens", values, [f"{M}kv_pool_tokens"]),
             {"label": "speculative decoding", "text": info.get("speculative") or "off"}]
    plan = [_row(label, values, [key(f"{M}memory_plan_bytes", {"part": part})], fmt_="bytes")
            for part, label in PLAN_PARTS if values.get(key(f"{M}memory_plan_bytes", {"part": part}))]
    if values.get(f"{M}image_budget_bytes"):
        plan.append(_row("image pixels", values, [f"{M}image_bytes_held"], fmt_="bytes",
                         total=[f"{M}image_budget_bytes"]))
    load = [_row("running requests", values, [f"{M}num_requests_running"]),
            _row("queued requests", values, [f"{M}num_requests_waiting"]),
            _row("KV pool use (pages)", values, [f"{M}kv_pages_used"], fmt_="count", total=[f"{M}kv_pages_total"])]
    for tier, unit in (("host", "count"), ("file", "bytes")):
        used = key(f"{M}tier_used", {"tier": tier})
        if used in values:
            load.append(_row(f"{tier} tier fill" + (" (pages)" if tier == "host" else ""), values, [used], fmt_=unit,
                             total=[key(f"{M}tier_capacity", {"tier": tier})]))
    if values.get(f"{M}image_budget_bytes"):
        load.append(_row("waiting for image memory", values, [f"{M}image_requests_waiting"]))
    idle_s = values.get(f"{M}idle_release_seconds", 0.0)
    if idle_s:
        released = values.get(f"{M}device_pools_released", 0.0)
        load.append({"label": "idle release", "text": ("device pools released" if released else "device pools held")
                     + f" (after {idle_s:g} s idle)"})
        load.append(_row("idle releases", values, [f"{M}idle_releases_total"]))
    else:
        load.append({"label": "idle release", "text": "off"})
    cache = [_row("hit rate since start", values, cached, prompt, "percent"),
             _row("prompt tokens since start", values, prompt)]
    cache += [_row(f"  {tier} hits", values, [c], prompt, "percent") for tier, c in zip(TIERS, cached)]
    cache.append(_windowed("hit rate, last hour", recent, cached, prompt, "percent"))
    cache += [_windowed(f"  {tier} hits, last hour", recent, [c], prompt, "percent") for tier, c in zip(TIERS, cached)]
    speed = [_row("TTFT cold (mean)", values, *ttft["cold"], "seconds"),
             _row("TTFT warm (mean)", values, *ttft["warm"], "seconds"),
             _windowed("TTFT cold, last hour", recent, *ttft["cold"], "seconds"),
             _windowed("TTFT warm, last hour", recent, *ttft["warm"], "seconds"),
             _row("decode speed per request", values, *itl, "rate"),
             _windowed("decode speed, last hour", recent, *itl, "rate"),
             {"label": "generated tokens/s, last hour", "value": _throughput(recent), "format": "rate",
              "window": recent[-1][0] - recent[0][0]}]
    if f"{M}spec_decode_mean_accept_length" in values:
        speed.append(_row("NEXTN acceptance length", values, [f"{M}spec_decode_mean_accept_length"], fmt_="number"))
        speed.append(_windowed("acceptance length, last hour", recent, accepted, drafts, "number", plus=1.0))
    errors = [_row("HTTP 4xx answers", values, _matching(values, rf'{M}requests_total\{{status="4\d\d"\}}')),
              _row("HTTP 5xx answers", values, _matching(values, rf'{M}requests_total\{{status="5\d\d"\}}')),
              _row("requests failed in the engine", values,
                   [key(f"{M}request_finished_total", {"finish_reason": "error"})]),
              _row("preemptions", values, [f"{M}num_preemptions_total"])]
    if key(f"{M}tier_errors_total", {"tier": "file"}) in values:
        errors.append(_row("bad file-tier blobs", values, [key(f"{M}tier_errors_total", {"tier": "file"})]))
    errors.append(_row("uptime", values, ["process_start_time_seconds"], fmt_="since"))
    sections = [("Set-up", setup), ("Memory plan", plan), ("Now", load), ("Prefix cache", cache),
                ("Speed", speed), ("Errors and uptime", errors)]
    return {"served_name": info.get("served_name", ""), "generated": now,
            "sections": [{"name": n, "rows": rows} for n, rows in sections],
            "history": series(recent)}


def _throughput(samples: list[tuple[float, dict[str, float]]]) -> float | None:
    if len(samples) < 2 or samples[-1][0] <= samples[0][0]:
        return None
    g = f"{M}generation_tokens_total"
    return (samples[-1][1].get(g, 0.0) - samples[0][1].get(g, 0.0)) / (samples[-1][0] - samples[0][0])


def series(samples: list[tuple[float, dict[str, float]]]) -> dict[str, list[float | None]]:
    """The plots: per interval between samples, generated tokens/s, prefix-cache hit rate, mean TTFT; and KV pool
    use at each sample."""
    out: dict[str, list[float | None]] = {"t": [], "tokens_per_s": [], "hit_rate": [], "ttft_s": [], "kv_use": []}
    cached = [f'{M}cached_prompt_tokens_total{{tier="{t}"}}' for t in TIERS]
    for (t0, a), (t1, b) in zip(samples, samples[1:]):
        if t1 <= t0:
            continue

        def d(keys: list[str]) -> float:
            return _sum(b, keys) - _sum(a, keys)
        prompt = d([f"{M}prompt_tokens_total"])
        first = d([f"{M}time_to_first_token_seconds_count"])
        out["t"].append(t1)
        out["tokens_per_s"].append(d([f"{M}generation_tokens_total"]) / (t1 - t0))
        out["hit_rate"].append(d(cached) / prompt if prompt else None)
        out["ttft_s"].append(d([f"{M}time_to_first_token_seconds_sum"]) / first if first else None)
        out["kv_use"].append(b.get(f"{M}kv_cache_usage_perc"))
    return out


def terminal(report: dict[str, Any]) -> str:
    """The summary as a terminal table (`tinyserve status`)."""
    lines = [f"tinyserve status: {report.get('served_name', '')}"]
    width = max((len(r["label"]) for s in report["sections"] for r in s["rows"]), default=10)
    for section in report["sections"]:
        if not section["rows"]:
            continue
        lines += ["", section["name"]]
        lines += [f"  {r['label']:<{width}}  {fmt(r, report['generated'])}" for r in section["rows"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# The ring buffer

class History:
    """The last hour of samples (every SAMPLE_S), for the windows and plots."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, dict[str, float]]] = deque(maxlen=int(WINDOW_S / SAMPLE_S) + 1)

    def add(self, now: float, values: dict[str, float]) -> None:
        self.samples.append((now, {k: values[k] for k in HISTORY_KEYS if k in values}))

    def start(self, scrape: Callable[[], Awaitable[dict[str, float] | None]]) -> Callable[[], None]:
        """Sample every SAMPLE_S, from a thread of its own that hands each `scrape` to the running event loop (no
        timer of ours sits on the loop); `scrape` gives None while the model loads. Returns the function that
        stops it."""
        loop, stop = asyncio.get_running_loop(), threading.Event()

        def sample() -> None:
            while not stop.is_set():
                try:
                    values = asyncio.run_coroutine_threadsafe(scrape(), loop).result(SAMPLE_S * 4)
                    if values is not None:
                        self.add(time.time(), values)
                except concurrent.futures.TimeoutError:
                    pass                          # a long step held the engine thread: this sample is skipped
                except Exception:                 # noqa: BLE001 - the next sample retries; a closed loop ends it
                    if loop.is_closed():
                        return
                    log.warning("status: sampling the metrics failed", exc_info=True)
                stop.wait(SAMPLE_S)
        threading.Thread(target=sample, name="tinyserve-status", daemon=True).start()
        return stop.set


# ---------------------------------------------------------------------------------------------------------------
# The routes: GET / and GET /status.json, behind the API's middlewares (errors, server.api_key)

def add_routes(app: web.Application, state_of: Callable[[web.Application], Any]) -> None:
    """Serve the page and its numbers on `app`; state_of(app) is the API's ServerState (its metrics, and its engine:
    None while loading). The History this module samples into while the app runs is the app's own."""
    from .protocol import APIError, dumps    # the server's side only: `tinyserve status` imports no torch
    history = History()

    async def scrape(state: Any) -> dict[str, float] | None:
        """Every /metrics sample now (None while the model loads)."""
        engine = state.engine
        if engine is None:
            return None
        return state.metrics.values(await engine.call(engine.stats))

    async def page(request: web.Request) -> web.Response:
        return web.Response(body=PAGE, content_type="text/html", charset="utf-8", headers={"Cache-Control": "no-cache"})

    async def numbers(request: web.Request) -> web.Response:
        state = state_of(request.app)
        values = await scrape(state)
        if values is None:
            raise APIError(503, "the model is still loading", headers={"Retry-After": "1"})
        return web.json_response(summary(values, list(history.samples), time.time()), dumps=dumps)

    async def sampling(app: web.Application) -> Any:
        state = state_of(app)
        stop = history.start(lambda: scrape(state))
        yield
        stop()

    app.router.add_get("/", page)
    app.router.add_get("/status.json", numbers)
    app.cleanup_ctx.append(sampling)
