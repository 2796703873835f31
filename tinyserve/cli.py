"""Command line: `tinyserve CONFIG` serves; `tinyserve --check CONFIG` validates and prints the plan;
`tinyserve status [URL]` prints a running server's status page as a table (exit 1 when it does not answer).

Serving lifecycle (what systemd's Type=notify unit expects):
  listen at once (/health answers 503 "loading") -> load the model on the compute thread, which then runs every
  step (engine.py's thread map) -> READY=1, "ready on http://..."
  SIGTERM / SIGINT -> STOPPING=1, /health 503, new requests 503, running requests get server.drain_timeout_s
  to finish, the rest are cancelled -> exit 0.
Configuration and checkpoint errors exit 1 with one message on stderr, never a traceback: they are the user's to
fix, and a traceback buries the key that is wrong.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

from . import config as config_mod
from .config import ConfigError

log = logging.getLogger("tinyserve")


# ---------------------------------------------------------------------------------------------------------------
# systemd notification (sd_notify without libsystemd)

def sd_notify(message: str) -> bool:
    """Send `message` to $NOTIFY_SOCKET (a unix datagram socket; '@' = abstract namespace). False when unset."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError as e:
        log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), e)
        return False


# ---------------------------------------------------------------------------------------------------------------
# --check

def check(cfg: Any, gpu_memory_gb: float | None = None) -> int:
    """Print the effective config and the memory plan, from config.json and the safetensors headers alone; with
    gpu_memory_gb, the CUDA plan for a card of that size. A plan that does not fit raises ConfigError (exit 1,
    naming the key to change)."""
    from .plan import plan_for

    print(config_mod.dumps(cfg).rstrip())
    print()
    plan = plan_for(cfg, gpu_memory_gb)[2]
    print(plan)
    if host_tier_line(cfg, plan):
        print(host_tier_line(cfg, plan, this_machine=not gpu_memory_gb))
    if plan.device == "cuda":
        print(gpu_budget_line(cfg, plan, gpu_memory_gb))
    return 0


def gpu_budget_line(cfg: Any, plan: Any, gpu_memory_gb: float | None = None) -> str:
    """How a CUDA plan fills the card: the static share (weights, GDN state, KV pool) and the rest (activations)."""
    from .plan import GIB

    static = plan.static_bytes
    budget = plan.gpu_bytes * cfg.engine.mem_fraction_static
    card = f"a {gpu_memory_gb:g} GiB card" if gpu_memory_gb else "this GPU"
    return (f"fits {card} ({plan.gpu_bytes / GIB:.1f} GiB free): weights, GDN state and KV pool "
            f"{static / GIB:.1f} GiB of {budget / GIB:.1f} GiB (engine.mem_fraction_static = "
            f"{cfg.engine.mem_fraction_static}); one step's activations ~{plan.activation_bytes / GIB:.2f} GiB "
            + (f"and the CUDA graphs ~{plan.graph_bytes / GIB:.2f} GiB " if plan.graph_bytes else "") + "of "
            f"the {(plan.gpu_bytes - budget) / GIB:.1f} GiB left; a request of {plan.context_length} tokens fits "
            f"the KV pool of {plan.kv_tokens}")


def host_tier_line(cfg: Any, plan: Any, this_machine: bool = True) -> str:
    """The host tier's budget and floor, for the plan shown at start and by --check ("" when the tier is off);
    this_machine: the plan is for this machine (else its available memory is not shown: --gpu-memory-gb)."""
    from .plan import GIB, host_available_bytes

    budget = (plan.host_pages * plan.page_size * plan.kv_bytes_per_token
              + plan.host_snapshots * plan.state_bytes_per_slot)
    if not budget:
        return ""
    floor = cfg.cache.host.min_free_gb
    return (f"host tier: up to {budget / GIB:.2f} GiB, allocated in segments as it fills; "
            + (f"gives memory back while the machine has less than {floor:g} GB available (cache.host.min_free_gb)"
               if floor else "no floor (cache.host.min_free_gb = 0)")
            + (f"; {host_available_bytes() / GIB:.1f} GiB available now" if this_machine
               else " (not checked against this machine's memory)"))


# ---------------------------------------------------------------------------------------------------------------
# Serving

async def _drain(engine: Any, timeout_s: float) -> None:
    """Let running requests finish up to timeout_s, then cancel the rest and give handlers a moment to close."""
    deadline = time.monotonic() + timeout_s
    if engine.num_unfinished:
        log.info("draining %d request(s), up to %.0f s", engine.num_unfinished, timeout_s)
    while engine.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_unfinished:
        log.warning("drain timeout: cancelling %d request(s)", engine.num_unfinished)
        engine.cancel_all()
        grace = time.monotonic() + 5.0
        while engine.num_unfinished and time.monotonic() < grace:
            await asyncio.sleep(0.05)


async def serve(cfg: Any) -> int:
    from aiohttp import web                           # imported here: --check needs neither aiohttp nor torch

    from .api import create_app, get_state, listening_sockets, set_engine

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    app = create_app(None, cfg)
    state = get_state(app)
    # handler_cancellation: a client that goes away while queued cancels its handler, whose finally cancels the
    # engine request (aiohttp's default leaves the handler running).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=log.getChild("access"),
                           shutdown_timeout=5.0)
    await runner.setup()
    host, port = cfg.server.host, cfg.server.port
    try:                                              # our own sockets: keepalive set on them (api.TCP_KEEPALIVE)
        for sock in listening_sockets(host, port):
            await web.SockSite(runner, sock).start()
    except OSError as e:
        await runner.cleanup()
        raise ConfigError(f"cannot listen on {host}:{port} (server.host / server.port): {e.strerror or e}",
                          "server.port") from None
    log.info("listening on http://%s:%d, loading %s", host, port, cfg.model.path)

    # Load on the compute thread, which then runs every step: one OpenMP team for the whole life of the process.
    from .build import build_engine
    from .engine import compute_thread
    load = asyncio.wrap_future(compute_thread().submit(build_engine, cfg))
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait([load, stop_wait], return_when=asyncio.FIRST_COMPLETED)
    if not load.done():                               # stopped while loading (the daemon thread dies with us)
        log.info("stopped while loading")
        sd_notify("STOPPING=1")
        await runner.cleanup()
        return 0
    try:
        engine = load.result()
    except BaseException:
        await runner.cleanup()
        raise
    await engine.start()
    set_engine(app, engine)
    log.info("plan: %s", engine.plan)
    if host_tier_line(cfg, engine.plan):
        log.info("%s", host_tier_line(cfg, engine.plan))
    log.info("ready on http://%s:%d (model %s)", host, port, engine.served_name)
    sd_notify(f"READY=1\nSTATUS=serving {engine.served_name} on http://{host}:{port}")

    await stop_wait
    log.info("shutting down")
    state.draining = True                             # before STOPPING=1: whoever hears it sees /health 503
    sd_notify("STOPPING=1")
    await _drain(engine, cfg.server.drain_timeout_s)
    await runner.cleanup()
    await engine.stop()
    log.info("stopped")
    return 0


# ---------------------------------------------------------------------------------------------------------------
# status

DEFAULT_URL = "http://127.0.0.1:8000"


def status_main(argv: list[str]) -> int:
    """`tinyserve status [URL]`: GET URL/status.json and print it as the status page shows it."""
    import json
    import urllib.error
    import urllib.request

    from .status import terminal

    parser = argparse.ArgumentParser(prog="tinyserve status", description="Print a running server's status (what "
                                     "its page at GET / shows) as a table; exit 1 when it does not answer.")
    parser.add_argument("url", nargs="?", default=DEFAULT_URL, help=f"the server (default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=os.environ.get("TINYSERVE_API_KEY", ""),
                        help="the server's server.api_key (default: $TINYSERVE_API_KEY)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the answer (default 10)")
    args = parser.parse_args(argv)
    url = args.url if "://" in args.url else "http://" + args.url
    req = urllib.request.Request(url.rstrip("/") + "/status.json", headers={"Accept": "application/json"})
    if args.api_key:
        req.add_header("Authorization", f"Bearer {args.api_key}")
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            report = json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            why = e.reason
        print(f"tinyserve status: {url} answered {e.code}: {why}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:                # refused, unreachable, timed out, not JSON
        print(f"tinyserve status: {url} does not answer ({getattr(e, 'reason', e)})", file=sys.stderr)
        return 1
    sys.stdout.write(terminal(report))
    return 0


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "debug":                              # one line per HTTP request is debug material
        logging.getLogger("tinyserve.access").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["status"]:
        return status_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tinyserve", description="Serve a Qwen3.5 / Qwen3-Next model over the "
                                     "OpenAI API, configured by one TOML file.")
    parser.add_argument("config", help="the TOML config file (see config.example.toml); `tinyserve status [URL]` "
                                       "prints a running server's status instead")
    parser.add_argument("--check", action="store_true",
                        help="validate the config, print the effective config and the memory plan, and exit")
    parser.add_argument("--gpu-memory-gb", type=float, metavar="N",
                        help="with --check: plan for a CUDA card with N GiB of memory (not this machine's device); "
                             "exit 1, naming the key to change, when the model does not fit")
    args = parser.parse_args(argv)
    if args.gpu_memory_gb is not None and (not args.check or args.gpu_memory_gb <= 0):
        parser.error("--gpu-memory-gb N needs --check and N > 0")
    try:
        cfg = config_mod.load(args.config)
    except ConfigError as e:                          # before importing torch: a typo fails in a blink
        return _fail(e)
    _setup_logging(cfg.log.level)
    from .model_config import LoaderError

    try:
        if args.check:
            return check(cfg, args.gpu_memory_gb)
        code = asyncio.run(serve(cfg))
    except (ConfigError, LoaderError) as e:
        return _fail(e)
    except KeyboardInterrupt:                         # Ctrl-C before the signal handlers were installed
        return 0
    return _leave(code)


def _leave(code: int) -> int:
    """Exit now after a served run, when nothing of ours runs any more (engine.stop joined the engine's threads):
    the exit handlers run (logs flushed, torch's helpers stopped), the interpreter's teardown does not (~0.5 s of
    freeing torch's objects that a service manager or a restart would wait for). Otherwise return the code for
    the normal exit, which joins what still runs."""
    import atexit
    import threading
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        return code
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(error: Exception) -> int:
    print(f"tinyserve: error: {error}", file=sys.stderr)
    return 1

if __name__ == "__main__":
    sys.exit(main())
