"""The operator's view: the status page at GET / (rendered by a real headless Chromium), its numbers against
/metrics at the same moment, `tinyserve status URL` (the same summary as a table; exit 1 when the server does not
answer), the page behind server.api_key (a browser is asked for the key as a password), and the formatting rules the
page (JavaScript) and the terminal (Python) share.

The browser is Debian's chromium (`.ci/run` installs it); without it the browser test is skipped, saying so.
"""
from __future__ import annotations

import base64
import json
import math
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import ServerProcess, free_port, http, server_config
from tinyserve.metrics import sample_key
from tinyserve.status import fmt

CHROMIUM = "/usr/bin/chromium"
KEY = "sekret"
BEARER = {"Authorization": f"Bearer {KEY}"}


def scrape(base_url: str) -> dict[str, float]:
    """/metrics, parsed by prometheus_client's own text parser, by sample key."""
    status, _, body = http("GET", base_url + "/metrics", headers=BEARER)
    assert status == 200, body
    return {sample_key(s.name, s.labels): s.value for family in text_string_to_metric_families(body.decode())
            for s in family.samples}


def expected(values: dict[str, float], num: list[str], den: list[str] | None) -> float | None:
    total = sum(values.get(k, 0.0) for k in num)
    if den is None:
        return total
    d = sum(values.get(k, 0.0) for k in den)
    return total / d if d else None


def traffic(base_url: str) -> None:
    """A cold prompt, the same prompt warm, another one, and a bad request (a 400)."""
    prompt = "the quick brown fox jumps over the lazy dog " * 12
    for text in (prompt, prompt, prompt + "and then some"):
        status, _, body = http("POST", base_url + "/v1/completions",
                               {"model": "tinyserve", "prompt": text, "max_tokens": 6, "temperature": 0},
                               headers=BEARER)
        assert status == 200, body
    status, _, _ = http("POST", base_url + "/v1/completions", {"model": "tinyserve", "prompt": "x", "top_p": 7},
                        headers=BEARER)
    assert status == 400


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    """The demo model with the host and file tiers, idle release armed, and an API key."""
    folder = tmp_path_factory.mktemp("status")
    cfg = server_config(free_port(), {
        "server": {"api_key": KEY},
        "engine": {"idle_release_s": 3600},
        "cache": {"host": {"size_gb": 0.01, "min_free_gb": 0}, "file": {"dir": str(folder / "kv"), "size_gb": 1}}})
    proc = ServerProcess(folder, cfg).start()
    traffic(proc.base_url)
    yield proc
    assert proc.stop() == 0, proc.log()


# ---------------------------------------------------------------------------------------------------------------
# The page's DOM as headless Chromium leaves it after its script ran

class Cells(HTMLParser):
    """Every value cell (td with data-label) with its data attributes and text; the plots; the error line."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[dict[str, Any]] = []
        self.plots: list[str] = []
        self.polylines = 0
        self.error = ""
        self.generated: float | None = None
        self._cell: dict[str, Any] | None = None
        self._in_error = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "td" and "data-label" in a:
            self._cell = {"attrs": a, "text": ""}
        elif tag == "section" and "data-plot" in a:
            self.plots.append(a["data-plot"])
        elif tag == "polyline":
            self.polylines += 1
        elif tag == "span" and a.get("id") == "error":
            self._in_error = True
        elif tag == "body" and a.get("data-generated"):
            self.generated = float(a["data-generated"])

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None:
            self.cells.append(self._cell)
            self._cell = None
        elif tag == "span":
            self._in_error = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell["text"] += data
        elif self._in_error:
            self.error += data


def render_in_chromium(url: str, profile: Path) -> Cells:
    """The DOM after the page's script fetched status.json and drew it (virtual time runs past its first refresh)."""
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--disable-component-update", "--disable-sync", "--no-first-run",
                          f"--user-data-dir={profile}", "--virtual-time-budget=3000", "--window-size=412,900",
                          "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    cells = Cells()
    cells.feed(out.stdout)
    return cells


@pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason="Debian's chromium is not installed here "
                    "(apt-get install chromium chromium-driver; .ci/run installs it)")
def test_the_page_in_a_browser_shows_what_metrics_says(server, tmp_path):
    url = server.base_url.replace("http://", f"http://operator:{KEY}@") + "/"
    page = render_in_chromium(url, tmp_path / "profile")
    metrics = scrape(server.base_url)          # the same moment: nothing ran since the traffic
    assert not page.error, page.error
    assert page.generated is not None
    by_label = {c["attrs"]["data-label"]: c for c in page.cells}
    # the production summary users post by hand: every part of it is there
    for label in ("model", "served name", "context", "KV pool tokens", "weights", "KV pool", "host tier",
                  "file tier", "running requests", "queued requests", "KV pool use (pages)", "host tier fill (pages)",
                  "file tier fill", "idle release", "hit rate since start", "  device hits", "  host hits",
                  "  file hits", "hit rate, last hour", "TTFT cold (mean)", "TTFT warm (mean)",
                  "decode speed per request", "HTTP 4xx answers", "HTTP 5xx answers", "uptime"):
        assert label in by_label, (label, sorted(by_label))
    checked = 0
    for cell in page.cells:
        a = cell["attrs"]
        if "data-num" not in a:
            continue
        num, den = json.loads(a["data-num"]), json.loads(a["data-den"]) if "data-den" in a else None
        # a key not exported yet is a labelled counter that has not counted (e.g. no request failed)
        assert all(k in metrics or "{" in k for k in num + (den or [])), a
        want = expected(metrics, num, den)
        shown = json.loads(a["data-value"])
        assert (shown is None and want is None) or math.isclose(shown, want, rel_tol=1e-12), (a, want)
        row = {"value": shown, "format": a["data-format"]}
        if "data-total" in a:
            row["total"] = expected(metrics, json.loads(a["data-total"]), None)
        assert cell["text"] == fmt(row, page.generated), (a, cell["text"])    # JavaScript's fmt = Python's
        checked += 1
    assert checked >= 25
    # the traffic shows: a cold and a warm request, one 400, some prefix-cache hits
    assert by_label["HTTP 4xx answers"]["text"] == "1"
    assert by_label["TTFT cold (mean)"]["text"] != "-" and by_label["TTFT warm (mean)"]["text"] != "-"
    assert json.loads(by_label["hit rate since start"]["attrs"]["data-value"]) > 0
    info = next(k for k in metrics if k.startswith("tinyserve:model_info{"))
    assert f'served_name="{by_label["served name"]["text"]}"' in info and 'model="demo"' in info
    assert by_label["idle release"]["text"] == "device pools held (after 3600 s idle)"
    assert sorted(page.plots) == ["hit_rate", "kv_use", "tokens_per_s", "ttft_s"] and page.polylines == 4


def test_status_json_needs_the_key_and_a_browser_is_asked_for_it(server):
    status, headers, _ = http("GET", server.base_url + "/")
    assert status == 401 and headers.get("WWW-Authenticate") == 'Basic realm="tinyserve"'
    status, headers, _ = http("GET", server.base_url + "/v1/models")
    assert status == 401 and "WWW-Authenticate" not in headers          # API clients get no password prompt
    basic = {"Authorization": "Basic " + base64.b64encode(f"anyone:{KEY}".encode()).decode()}
    status, headers, body = http("GET", server.base_url + "/", headers=basic)
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"status.json" in body
    assert not re.search(rb"""(src|href)\s*=|@import|url\(""", body)      # self-contained: nothing from elsewhere
    wrong = {"Authorization": "Basic " + base64.b64encode(b"anyone:wrong").decode()}
    assert http("GET", server.base_url + "/status.json", headers=wrong)[0] == 401
    status, _, body = http("GET", server.base_url + "/status.json", headers=BEARER)
    assert status == 200
    report = json.loads(body)
    history = report["history"]
    assert report["served_name"] == "tinyserve" and report["sections"]
    assert set(history) == {"t", "tokens_per_s", "hit_rate", "ttft_s", "kv_use"}
    assert len({len(points) for points in history.values()}) == 1      # one value of each plot per interval


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinyserve.cli", "status", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_tinyserve_status_prints_the_same_numbers(server):
    out = run_cli(server.base_url, env={"TINYSERVE_API_KEY": KEY})
    assert out.returncode == 0, out.stderr
    metrics = scrape(server.base_url)
    lines = {line.strip().rsplit("  ", 1)[0].strip(): line.strip().rsplit("  ", 1)[1].strip()
             for line in out.stdout.splitlines() if "  " in line.strip()}
    assert lines["HTTP 4xx answers"] == "1"
    pages = metrics["tinyserve:kv_pages_total"]
    used = metrics["tinyserve:kv_pages_used"]
    assert lines["KV pool use (pages)"] == fmt({"value": used, "format": "count", "total": pages}, 0)
    cached = sum(metrics.get(f'tinyserve:cached_prompt_tokens_total{{tier="{t}"}}', 0) for t in ("device", "host",
                                                                                             "file"))
    assert lines["hit rate since start"] == fmt({"value": cached / metrics["tinyserve:prompt_tokens_total"],
                                                  "format": "percent"}, 0)
    assert lines["context"] == "1,024" and lines["model"] == "demo"


def test_tinyserve_status_exits_1_when_the_server_does_not_answer(server):
    out = run_cli(f"127.0.0.1:{free_port()}")
    assert out.returncode == 1 and "does not answer" in out.stderr and not out.stdout
    out = run_cli(server.base_url)                                      # no key: the server answers 401
    assert out.returncode == 1 and "401" in out.stderr and "API key" in out.stderr


def test_tinyserve_status_imports_no_torch():
    """`tinyserve status` answers in a blink: what it imports (the CLI, the page's rendering) loads no torch."""
    code = "import sys, tinyserve.cli, tinyserve.status; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


@pytest.mark.parametrize("row, text", [
    ({"value": 0.5625, "format": "percent"}, "56.3%"),                   # a tie: halves round up, as toFixed does
    ({"value": 0.885, "format": "percent"}, "88.5%"),
    ({"value": 503430, "format": "count", "total": 504447}, "503,430 / 504,447 (99.8%)"),
    ({"value": 2.6, "format": "seconds"}, "2.60 s"),
    ({"value": 0.67, "format": "seconds"}, "670 ms"),
    ({"value": 63.25, "format": "rate"}, "63.3 tok/s"),
    ({"value": 3 * 2 ** 30 + 2 ** 29, "format": "bytes"}, "3.50 GiB"),
    ({"value": 1000, "format": "bytes"}, "1,000 B"),
    ({"value": 4.125, "format": "number"}, "4.13"),
    ({"value": None, "format": "rate"}, "-"),
    ({"value": 100.0, "format": "since"}, "1 d 01:00:00"),
])
def test_formatting_rules(row, text):
    assert fmt(row, now=100.0 + 90000) == text


def test_the_page_has_nothing_to_fetch_but_its_own_json():
    page = (Path(__file__).resolve().parent.parent / "tinyserve" / "status.html").read_text()
    assert "status.json" in page and "<script src" not in page and "<link" not in page
