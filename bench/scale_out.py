"""Scale-out: N agent-like sessions against one tinyserve worker, and against two behind SMG, with session
affinity (systemd/smg.sh as shipped) and with random routing.

    python bench/scale_out.py                          # demo model on CPU: the figures of docs/benchmarks.md
    python bench/scale_out.py --model /srv/models/Qwen3.5-27B-FP8 --device cuda --kv-tokens 0 --state-slots 0 \\
        --context 262144 --sessions 16 --first-words 6000 --turn-words 400    # a CUDA machine with 2 cards

Sessions look like agents': one system prompt every session shares, a first user message of the session's own
(the files it read), then turns that each add a user message to the whole conversation so far (the answer stays in
the history). All sessions run at once, each sending its next turn as soon as its answer is in; a worker runs
`--concurrency` requests and queues the rest, so the turns go round the sessions and a session's prefix must survive
every other session's turn in between: what several agents on one box do, and the hardest case for a cache.

Scenarios (each on fresh workers and a fresh shared folder):
  1 worker,  N/2 sessions      what one worker's cache does when it holds every session (the reference)
  1 worker,  N sessions        more sessions than its cache holds (--kv-tokens is sized for about N/2)
  2 workers, N sessions, SMG affinity    systemd/smg.sh: each session's key (X-Claude-Code-Session-Id) pinned
  2 workers, N sessions, SMG random      `smg launch --policy random`: any worker, any turn
Reported per scenario: throughput (generated tokens/s, requests/s, over the wall time of all turns), TTFT p50 / p90
(streamed, from the request to the first token), and the share of prompt tokens served per tier (device, host, file;
turns 2 and later: a first turn has only the shared system prompt to find). The workers share one cache folder as
docs/scale-out.md sets them up; with --no-folder they do not (the device tier alone).

Each worker runs with OMP_NUM_THREADS=--threads (1: two workers on two cores stand for two boxes of one core each);
with --device cuda, worker i sees card i only (CUDA_VISIBLE_DEVICES). Needs smg (pip install -e ".[test]").
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from common import ServerProcess, fmt_table, free_port  # noqa: E402

SMG = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
TIERS = ("device", "host", "file")
WORDS = ("read", "edit", "test", "file", "module", "function", "class", "error", "patch", "diff", "line", "value")


# ---------------------------------------------------------------------------------------------------------------
# The sessions

def text(n_words: int, seed: int) -> str:
    """About n_words words of filler, different for each seed (~5 tokens a word on the demo tokenizer)."""
    return " ".join(f"{WORDS[(seed * 7 + i * 13) % len(WORDS)]}{(seed * 31 + i) % 997}" for i in range(n_words))


@dataclass
class Turn:
    session: int
    number: int
    prompt: int = 0
    cached: dict[str, int] = field(default_factory=dict)
    generated: int = 0
    ttft: float = 0.0


@dataclass
class Session:
    index: int
    messages: list[dict]


def sessions(n: int, args: argparse.Namespace, nonce: str) -> list[Session]:
    system = {"role": "system", "content": f"{nonce} You are a coding agent. " + text(args.system_words, 0)}
    return [Session(i, [system, {"role": "user", "content": f"Session {i}: " + text(args.first_words, 1000 + i)}])
            for i in range(n)]


async def one_turn(http: aiohttp.ClientSession, url: str, s: Session, number: int, args: argparse.Namespace) -> Turn:
    body = {"model": "tinyserve", "messages": s.messages, "max_tokens": args.answer_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0, first, answer, usage = time.perf_counter(), None, "", None
    async with http.post(url + "/v1/chat/completions", json=body,
                         headers={"X-Claude-Code-Session-Id": f"bench-session-{s.index}"}) as r:
        if r.status != 200:
            raise RuntimeError(f"session {s.index} turn {number}: HTTP {r.status}: {(await r.text())[:300]}")
        while raw := await r.content.readline(max_line_length=64 << 20):
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            for c in event.get("choices") or []:
                delta = c.get("delta", {})
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if piece and first is None:
                    first = time.perf_counter()
                answer += piece
            usage = event.get("usage") or usage
    details = usage["prompt_tokens_details"]
    s.messages = s.messages + [{"role": "assistant", "content": answer or "."},
                               {"role": "user", "content": f"Turn {number + 1}: " + text(args.turn_words,
                                                                                         s.index * 100 + number)}]
    return Turn(s.index, number, usage["prompt_tokens"], dict(details["cached_tokens_by_tier"]),
                usage["completion_tokens"], (first or time.perf_counter()) - t0)


async def drive(url: str, group: list[Session], args: argparse.Namespace) -> tuple[float, list[Turn]]:
    """Every session at once, each its turns one after the other (an agent waits for its answer, then sends the
    next turn at once). A worker runs `--concurrency` of them and queues the rest, so the sessions' turns take
    their place in line in rounds. Returns (wall seconds, turns)."""
    done: list[Turn] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        async def run(s: Session) -> None:
            for number in range(1, args.turns + 1):
                done.append(await one_turn(http, url, s, number, args))
        t0 = time.perf_counter()
        await asyncio.gather(*(run(s) for s in group))
        return time.perf_counter() - t0, done


# ---------------------------------------------------------------------------------------------------------------
# Workers and gateways

def worker_config(port: int, args: argparse.Namespace, folder: Path | None) -> str:
    lines = [f'[model]\npath = "{args.model}"\ndevice = "{args.device}"\ncontext_length = {args.context}',
             f'[server]\nhost = "127.0.0.1"\nport = {port}',
             f"[engine]\nmax_running_requests = {args.concurrency}\nkv_cache_tokens = {args.kv_tokens}\n"
             f"page_size = 16\ncompile_steps = false",
             f"[cache]\nenabled = true\nstate_slots = {args.state_slots}",
             f"[cache.host]\nsize_gb = {args.host_gb}",
             '[log]\nlevel = "warning"']
    if folder is not None:
        lines.append(f'[cache.file]\ndir = "{folder}"\nsize_gb = 20')
    return "\n".join(lines) + "\n"


class Fleet:
    """n workers on one shared folder (fresh), and optionally a gateway in front of them."""

    def __init__(self, n: int, args: argparse.Namespace, work: Path, gateway: str | None) -> None:
        self.work = Path(tempfile.mkdtemp(dir=work))
        folder = None if args.no_folder else self.work / "kv"
        self.workers = []
        for i in range(n):
            port = free_port()
            cfg = self.work / f"worker{i}.toml"
            cfg.write_text(worker_config(port, args, folder))
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            if args.device == "cuda":                  # a card per worker, as a box per worker would have
                env["CUDA_VISIBLE_DEVICES"] = str(i)
            self.workers.append(ServerProcess(f"worker{i}", [sys.executable, "-m", "tinyserve.cli", str(cfg)],
                                              f"http://127.0.0.1:{port}", self.work / f"worker{i}.log", env=env))
        for w in self.workers:
            w.wait_ready()
        self.gateway = None
        self.url = self.workers[0].url
        if gateway is not None:
            port, urls = free_port(), [w.url for w in self.workers]
            genv = {**os.environ, "WORKERS": " ".join(urls), "SMG": SMG, "SMG_HOST": "127.0.0.1",
                    "SMG_PORT": str(port), "SMG_PROMETHEUS_PORT": str(free_port())}
            if gateway == "affinity":          # the shipped set-up
                argv = ["bash", str(ROOT / "systemd" / "smg.sh")]
            else:                              # any worker for any request
                argv = [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                        "--policy", "random", "--prometheus-port", genv["SMG_PROMETHEUS_PORT"]]
            self.gateway = ServerProcess(f"smg-{gateway}", argv, f"http://127.0.0.1:{port}",
                                         self.work / "smg.log", env=genv)
            self.url = self.gateway.url
            self._wait_gateway(n)

    def _wait_gateway(self, n: int) -> None:
        import urllib.request
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/workers", timeout=2) as r:
                    listed = json.load(r)["workers"]
                if len(listed) == n and all(w["is_healthy"] for w in listed):
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"SMG did not register {n} workers; its log: {self.work / 'smg.log'}")

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop(10)
        for w in self.workers:
            w.stop()
        shutil.rmtree(self.work, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Report

def summarize(name: str, wall: float, turns: list[Turn]) -> dict:
    later = [t for t in turns if t.number >= 2]
    prompt = sum(t.prompt for t in later) or 1
    share = {tier: sum(t.cached.get(tier, 0) for t in later) / prompt for tier in TIERS}
    ttfts = sorted(t.ttft for t in turns)
    warm = sorted(t.ttft for t in later)
    return {"scenario": name, "requests": len(turns), "wall_s": wall,
            "tokens_per_s": sum(t.generated for t in turns) / wall, "requests_per_s": len(turns) / wall,
            "ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
            "ttft_later_p50": statistics.median(warm) if warm else 0.0,
            "prompt_later": prompt / max(1, len(later)),
            "hit": sum(share.values()), **{f"hit_{tier}": v for tier, v in share.items()}}


def table(rows: list[dict]) -> str:
    header = ("scenario", "requests", "prompt (turn 2+)", "wall s", "gen tok/s", "req/s", "TTFT p50", "TTFT p90",
              "TTFT p50 turn 2+", "hit (turn 2+)", "device", "host", "file")
    return fmt_table([(r["scenario"], str(r["requests"]), f"{r['prompt_later']:.0f}", f"{r['wall_s']:.1f}",
                       f"{r['tokens_per_s']:.1f}",
                       f"{r['requests_per_s']:.2f}", f"{r['ttft_p50']:.2f} s", f"{r['ttft_p90']:.2f} s",
                       f"{r['ttft_later_p50']:.2f} s", f"{100 * r['hit']:.1f}%",
                       *(f"{100 * r['hit_' + t]:.1f}%" for t in TIERS)) for r in rows], header)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="demo", help="model.path of the workers (default: the demo model)")
    ap.add_argument("--device", default="cpu", help="model.device of the workers (cpu, cuda)")
    ap.add_argument("--context", type=int, default=32768, help="model.context_length")
    ap.add_argument("--sessions", type=int, default=8, help="N: sessions of the 2-worker and the full 1-worker runs")
    ap.add_argument("--turns", type=int, default=4, help="turns per session")
    ap.add_argument("--concurrency", type=int, default=2, help="engine.max_running_requests of each worker (the "
                    "other sessions' turns wait in its queue)")
    ap.add_argument("--system-words", type=int, default=200, help="the shared system prompt (~5 tokens a word "
                    "on the demo tokenizer)")
    ap.add_argument("--first-words", type=int, default=300, help="each session's first user message")
    ap.add_argument("--turn-words", type=int, default=40, help="what each later turn adds")
    ap.add_argument("--answer-tokens", type=int, default=24, help="tokens generated per turn")
    ap.add_argument("--kv-tokens", type=int, default=24576, help="engine.kv_cache_tokens per worker: sized so one "
                    "worker's device tier holds about N/2 sessions (0: from the device's memory)")
    ap.add_argument("--state-slots", type=int, default=16, help="cache.state_slots per worker: the device tier's "
                    "state snapshots, which a hybrid model needs to resume a session (a few a session; 0: derived)")
    ap.add_argument("--host-gb", type=float, default=0, help="cache.host.size_gb per worker")
    ap.add_argument("--no-folder", action="store_true", help="no shared cache folder (device tier only)")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per worker (CPU)")
    ap.add_argument("--only", default="", help="comma-separated scenario numbers to run (1-4)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if not os.access(SMG, os.X_OK):
        ap.error("smg is not installed (pip install -e '.[test]', or pip install smg==1.13.0)")
    n = args.sessions
    scenarios = [(f"1 worker, {n // 2} sessions", 1, n // 2, None), (f"1 worker, {n} sessions", 1, n, None),
                 (f"2 workers, {n} sessions, SMG affinity", 2, n, "affinity"),
                 (f"2 workers, {n} sessions, SMG random", 2, n, "random")]
    only = {int(x) for x in args.only.split(",") if x}
    work = Path(tempfile.mkdtemp(prefix="scale-out-"))
    rows = []
    try:
        for k, (name, workers, count, gateway) in enumerate(scenarios, 1):
            if only and k not in only:
                continue
            fleet = Fleet(workers, args, work, gateway)
            try:
                wall, turns = asyncio.run(drive(fleet.url, sessions(count, args, os.urandom(4).hex()), args))
            finally:
                fleet.stop()
            rows.append(summarize(name, wall, turns))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
