"""What does HTTP cost? The same streaming load through the OpenAI API and straight through engine.submit.

    python bench/serve.py                         # the demo model on this machine's default device
    python bench/serve.py --config my.toml --concurrency 1 8 32 --requests 64 --prompt-len 512 --max-tokens 128

1. A real server process (`python -m tinyserve.cli CONFIG`, port from the config or a free one) gets N concurrent
   streaming /v1/completions clients (aiohttp) per concurrency level; then it is stopped.
2. The same requests (same token-id prompts, ignore_eos, fixed lengths) go to an engine loaded in this process.
Per mode and level: requests/s, output tokens/s, TTFT and inter-token latency p50/p99. Last line: HTTP/in-process
throughput at 8 concurrent streams (target: HTTP costs at most 10%, i.e. a ratio >= 0.90).
Prompts are random token ids, distinct per request, so the prefix cache does not help one mode more than the other.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import tomli_w

from tinyserve import config as config_mod
from tinyserve.sampling import SamplingParams


@dataclass
class RequestTiming:
    start: float
    first: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)   # per-token gaps after the first token
    end: float = 0.0

    def on_tokens(self, n: int, now: float, last: float | None) -> float:
        if self.first is None:
            self.first = now
        elif last is not None and n:
            self.gaps += [(now - last) / n] * n
        self.tokens += n
        return now


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    timings: list[RequestTiming]
    wall: float

    @property
    def rps(self) -> float:
        return len(self.timings) / self.wall

    @property
    def tok_s(self) -> float:
        return sum(t.tokens for t in self.timings) / self.wall

    def ttft(self, q: float) -> float:
        return _pct([t.first - t.start for t in self.timings if t.first is not None], q)

    def itl(self, q: float) -> float:
        return _pct([g for t in self.timings for g in t.gaps], q)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, vocab) for _ in range(length)] for _ in range(n)]


async def _run_level(concurrency: int, prompts: list[list[int]], one) -> tuple[list[RequestTiming], float]:
    """Run every prompt with at most `concurrency` in flight; `one(prompt) -> RequestTiming`."""
    queue = list(prompts)
    timings: list[RequestTiming] = []

    async def worker() -> None:
        while queue:
            timings.append(await one(queue.pop()))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings, time.perf_counter() - t0


# ---- HTTP ----

async def http_one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "return_token_ids": True}
    t = RequestTiming(time.perf_counter())
    last = None
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
            if n:
                last = t.on_tokens(n, time.perf_counter(), last)
    t.end = time.perf_counter()
    return t


async def bench_http(url: str, levels: list[int], prompts: list[list[int]], max_tokens: int) -> list[LevelResult]:
    results = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await http_one(session, url, prompts[0], 4)                   # warm-up
        for c in levels:
            timings, wall = await _run_level(c, prompts, lambda p: http_one(session, url, p, max_tokens))
            results.append(LevelResult("http", c, timings, wall))
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cfg_data: dict, folder: Path) -> tuple[subprocess.Popen, str]:
    path = folder / "bench.toml"
    path.write_text(tomli_w.dumps(cfg_data))
    port = cfg_data["server"]["port"]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "tinyserve.cli", str(path)], stderr=open(folder / "server.log", "wb"))
    deadline = time.monotonic() + 600
    import urllib.request
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {(folder / 'server.log').read_text()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    raise SystemExit("server did not become healthy")


# ---- in-process ----

async def engine_one(engine, prompt: list[int], max_tokens: int) -> RequestTiming:
    t = RequestTiming(time.perf_counter())
    last = None
    stream = engine.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
    async for events in stream:
        last = t.on_tokens(len(events), time.perf_counter(), last)
    t.end = time.perf_counter()
    return t


async def bench_engine(cfg, levels: list[int], prompts: list[list[int]], max_tokens: int) -> list[LevelResult]:
    from tinyserve.engine import Engine

    engine = Engine.from_config(cfg)
    await engine.start()
    try:
        await engine_one(engine, prompts[0], 4)                       # warm-up
        results = []
        for c in levels:
            timings, wall = await _run_level(c, prompts, lambda p: engine_one(engine, p, max_tokens))
            results.append(LevelResult("in-process", c, timings, wall))
        return results
    finally:
        await engine.stop()


# ---- report ----

def print_table(results: list[LevelResult]) -> None:
    head = f"{'mode':<11} {'conc':>4} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} " \
           f"{'ITL p50':>8} {'ITL p99':>8}"
    print(head)
    print("-" * len(head))
    for r in sorted(results, key=lambda r: (r.concurrency, r.mode)):
        print(f"{r.mode:<11} {r.concurrency:>4} {r.rps:>8.2f} {r.tok_s:>9.1f} {r.ttft(50) * 1e3:>7.1f}ms "
              f"{r.ttft(99) * 1e3:>7.1f}ms {r.itl(50) * 1e3:>6.1f}ms {r.itl(99) * 1e3:>6.1f}ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML config (default: the demo model, CPU-sized pools)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    if args.config:
        cfg = config_mod.load(args.config)
        data = config_mod.to_dict(cfg)
    else:
        data = {"model": {"path": "demo"}, "engine": {"kv_cache_tokens": 65536}, "cache": {"state_track_interval": 64}}
        cfg = config_mod.from_dict(data)
        data = config_mod.to_dict(cfg)
    data["server"]["host"] = "127.0.0.1"
    data["server"]["port"] = _free_port()
    data["server"]["api_key"] = ""
    data["log"]["level"] = "warning"
    levels = sorted(set(args.concurrency) | {8})

    from tinyserve.loader import read_model_config
    from tinyserve.demo import ensure_demo_checkpoint
    folder = ensure_demo_checkpoint() if cfg.model.path == "demo" else cfg.model.path
    vocab = read_model_config(folder).vocab_size
    prompts = make_prompts(args.requests, args.prompt_len, vocab)

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(data, Path(tmp))
        try:
            http_results = asyncio.run(bench_http(url, levels, prompts, args.max_tokens))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    engine_results = asyncio.run(bench_engine(cfg, levels, prompts, args.max_tokens))

    print(f"\n{args.requests} requests per level, prompt {args.prompt_len} tokens, {args.max_tokens} output tokens, "
          f"model {cfg.model.path}\n")
    print_table(http_results + engine_results)
    h8 = next(r for r in http_results if r.concurrency == 8)
    e8 = next(r for r in engine_results if r.concurrency == 8)
    ratio = h8.tok_s / e8.tok_s
    verdict = "ok" if ratio >= 0.90 else "HTTP costs more than 10%"
    print(f"\nHTTP / in-process throughput at 8 streams: {ratio:.3f} ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
