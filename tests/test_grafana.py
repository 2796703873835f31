"""docs/grafana-tinyserve.json, the Grafana dashboard over /metrics: an importable dashboard (a Prometheus data source
asked for at import, every panel with queries), and every series its queries name is one the server exports: from
the metrics of an engine with every optional part on (NEXTN, host and file tiers, images), and, for the parts the demo
model has, from a real server's /metrics."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import ServerProcess, free_port, http, server_config
from tinyserve.cache import CacheStats
from tinyserve.engine import EngineInfo, EngineStats
from tinyserve.file_tier import FileStats
from tinyserve.host_tier import HostStats
from tinyserve.idle import IdleStats
from tinyserve.metrics import Metrics
from tinyserve.multimodal import ImageStats
from tinyserve.spec import NextNStats

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-tinyserve.json"
SERIES = re.compile(r"\b((?:tinyserve:|process_)[a-z_:]+)")


def queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"]]
    return exprs


def names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)} | \
        {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def everything_on() -> EngineStats:
    info = EngineInfo("/models/Qwen3.5-27B", "qwen", "cuda", "bfloat16", "bfloat16", 131072, 200000, "nextn", 600.0,
                      {"weights": 1, "kv_pool": 2, "state_slots": 3, "snapshot_slots": 4, "host_tier": 5,
                       "file_tier": 6})
    nextn = NextNStats()
    nextn.observe(3, 2)
    return EngineStats(1, 2, 3, 10, 1, 4, 0, CacheStats(host=HostStats(), file=FileStats()),
                       nextn=nextn, images=ImageStats(budget_bytes=1 << 30), idle=IdleStats(),
                       info=info)


def test_the_dashboard_imports_into_grafana():
    dash = json.loads(DASHBOARD.read_text())
    assert [i["pluginId"] for i in dash["__inputs"]] == ["prometheus"]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len(panels) >= 15 and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for p in panels:
        assert p["targets"] and p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
        for t in p["targets"]:
            e = t["expr"]
            assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
            assert 'instance=~"$instance"' in e, (p["title"], e)      # every query follows the server picker


def test_every_series_the_dashboard_queries_is_exported():
    metrics = Metrics()
    metrics.on_tokens(1, 0.5, first=True, warm=True)
    metrics.on_tokens(1, 2.5, first=True, warm=False)
    metrics.on_tokens(3, 0.03)
    metrics.on_response(200)
    metrics.on_finished("stop", 100, {"device": 50, "host": 0, "file": 10}, 3.0)
    exported = names(metrics.render(everything_on()).decode())
    wanted = {m for e in queries() for m in SERIES.findall(e)}
    assert wanted and wanted <= exported, sorted(wanted - exported)


@pytest.mark.slow
def test_a_real_server_exports_what_the_dashboard_needs_of_it(xdg, tmp_path):
    cfg = server_config(free_port(), {"cache": {"host": {"size_gb": 0.01, "min_free_gb": 0},
                                                "file": {"dir": str(tmp_path / "kv"), "size_gb": 1}}})
    with ServerProcess(tmp_path, cfg) as server:
        for _ in range(2):                          # the second hits the prefix cache
            status, _, _ = http("POST", server.base_url + "/v1/completions", {"prompt": "hello " * 40,
                                                                               "max_tokens": 4})
            assert status == 200
        exported = names(http("GET", server.base_url + "/metrics")[2].decode())
    wanted = {m for e in queries() for m in SERIES.findall(e)}
    optional = {m for m in wanted if re.match(r"tinyserve:(spec_decode|image_)", m)}   # NEXTN, images: not the demo
    assert wanted - optional <= exported, sorted(wanted - optional - exported)
