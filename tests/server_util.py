"""Start tinyserve for tests: a real server process, or the app in-process on a background thread.

Both serve on 127.0.0.1 on a free port from a TOML config written to a tmp folder. The demo model
(model.path = "demo") is written once per test session into the XDG_CACHE_HOME folder the caller passes.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import tomli_w


def lazy_import(name: str):
    """The module `name`, executed on its first attribute access: every test worker collects every test module, and
    the openai and anthropic clients take ~2.3 s of CPU to import, which only the workers that run their tests pay."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def server_config(port: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A small config for the demo model on CPU; `overrides` is merged in by table."""
    base = {
        "model": {"path": "demo", "device": "cpu", "context_length": 1024},
        "server": {"host": "127.0.0.1", "port": port, "drain_timeout_s": 5.0},
        "engine": {"max_running_requests": 4, "chunked_prefill_size": 256, "page_size": 16,
                   "kv_cache_tokens": 8192, "compile_steps": False},
        "cache": {"state_track_interval": 64},
        "log": {"level": "info"},
    }
    return _merge(base, overrides or {})


def write_config(folder: Path, data: dict[str, Any], name: str = "tinyserve.toml") -> Path:
    path = Path(folder) / name
    path.write_text(tomli_w.dumps(data))
    return path


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """One plain HTTP request (stdlib): (status, headers, body). `body` dict -> JSON, bytes -> raw."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_healthy(base_url: str, timeout: float = 120, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            status, _, _ = http("GET", base_url + "/health", timeout=2)
            if status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout} s")


class ServerProcess:
    """`python -m tinyserve.cli CONFIG` as a child process; stderr goes to a log file in the tmp folder."""

    def __init__(self, folder: Path, config: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.folder = Path(folder)
        self.port = config["server"]["port"]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.config_path = write_config(self.folder, config)
        self.log_path = self.folder / f"server-{self.port}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True, timeout: float = 180) -> "ServerProcess":
        if os.environ.get("TINYSERVE_QUICK_TIER"):
            raise RuntimeError("a server process in the quick tier: mark the test slow, or name its fixture in "
                               "conftest.SERVER_FIXTURES")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            try:
                wait_healthy(self.base_url, timeout, self.proc)
            except BaseException:
                self.stop()
                raise RuntimeError(f"server did not start:\n{self.log()}")
        return self

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tinyserve.cli", str(self.config_path)]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class InProcessServer:
    """The aiohttp app and the engine on an event loop in a background thread (fast tests, direct engine access).

    Build the Config in the test (config.from_dict(server_config(...))); the engine is loaded on the process's
    compute thread, as the CLI does.
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.base_url = f"http://127.0.0.1:{cfg.server.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="inprocess-server", daemon=True)
        self.engine: Any = None
        self.app: Any = None
        self._runner: Any = None

    def call(self, coro: Any, timeout: float = 120) -> Any:
        """Run a coroutine on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        from aiohttp import web

        from tinyserve.api import create_app
        from tinyserve.build import build_engine
        from tinyserve.engine import compute_thread

        self.engine = await asyncio.wrap_future(compute_thread().submit(build_engine, self.cfg))
        await self.engine.start()
        self.app = create_app(self.engine, self.cfg)
        self._runner = web.AppRunner(self.app, handler_cancellation=True, shutdown_timeout=2.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.cfg.server.host, self.cfg.server.port).start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.engine is not None:
            await self.engine.stop()

    def stats(self) -> Any:
        """engine.stats(), taken on the engine thread (the engine's state is touched there only)."""
        return self.call(self.engine.call(self.engine.stats))

    def start(self) -> "InProcessServer":
        self.thread.start()
        self.call(self._start(), timeout=300)
        return self

    def stop(self) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def __enter__(self) -> "InProcessServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# The real CLI with the draft priced as PinnedCost prices it offline: the depth follows acceptance alone, not the
# timed steps, which a loaded machine (another test worker, another process) makes too dear to draft.
PINNED_LAUNCHER = r"""
import sys
from tinyserve import cli, spec


class PinnedStepCost(spec.StepCost):
    def relative(self, d):
        return 1.0 + 0.1 * d


spec.StepCost = PinnedStepCost
sys.exit(cli.main(sys.argv[1:]))
"""


class PinnedCostServer(ServerProcess):
    def command(self) -> list[str]:
        return [sys.executable, "-c", PINNED_LAUNCHER, str(self.config_path)]
