"""Claude Code through the gateway: the newest release the tier runs (TINYSERVE_AGENTS_LATEST=1: its @latest), set
up with docs/clients.md's lines with the address moved to SMG, started by the shipped systemd/smg.sh in front of
the tier's server (`tinyserve config.example.toml`). Two runs and a continued session, as test_agent_clis.py runs
it directly: each exits 0 and shows the model's text, the server refuses nothing, the second run and the continued
turn read at least 90% of their main prompt from the prefix cache (SMG passes Claude Code's bodies on as it sends
them, so the prompt the cache holds is the same), and SMG routed on Claude Code's session header
(X-Claude-Code-Session-Id, the routing key systemd/smg.sh names).

Run by `bash tests/agents/run.sh` with the rest of the tier (-k gateway: this one alone).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from test_agent_clis import AGENTS, COMMANDS, PROMPTS, ROOT, Release, Server, prepare_home, releases, run_agent

SMG = shutil.which("smg") or str(Path(sys.executable).parent / "smg")
DIRECT = "http://127.0.0.1:8000"                 # the address docs/clients.md's lines point at


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def newest_claude() -> Release:
    """@latest when the tier runs it (TINYSERVE_AGENTS_LATEST=1), else the newest release releases.txt lists."""
    claude = [r for r in releases() if r.agent == "claude"]
    latest = [r for r in claude if r.latest]
    return latest[0] if latest else claude[0]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gateway")
    server = Server(folder, free_port())
    smg_log = folder / "smg.log"
    port, metrics = free_port(), free_port()
    env = {**os.environ, "WORKERS": server.url, "SMG": SMG, "SMG_HOST": "127.0.0.1", "SMG_PORT": str(port),
           "SMG_PROMETHEUS_PORT": str(metrics)}
    smg = None
    try:
        server.wait_ready()
        smg = subprocess.Popen(["bash", str(ROOT / "systemd" / "smg.sh")], env=env, stdout=open(smg_log, "wb"),
                               stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert smg.poll() is None, smg_log.read_text(errors="replace")[-3000:]
            try:
                with urllib.request.urlopen(url + "/workers", timeout=2) as r:
                    if any(w["is_healthy"] for w in json.load(r)["workers"]):
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "SMG did not register the server:\n" + smg_log.read_text()[-3000:]
            time.sleep(0.5)
        server.gateway_url, server.metrics_url, server.smg_log = url, f"http://127.0.0.1:{metrics}/metrics", smg_log
        yield server
    finally:
        if smg is not None:
            smg.terminate()
            try:
                smg.wait(10)
            except subprocess.TimeoutExpired:
                smg.kill()
        code = server.stop()
    assert code == 0, server.text()[-3000:]


def routed_on_the_session_header(metrics_url: str) -> float:
    """SMG's count of requests it routed by a routing key read from a header (its Prometheus metrics)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("smg_routing_key_source") and 'source="header"' in line)


def test_claude_code_through_smg_runs_twice_and_continues_from_the_cache(gateway, tmp_path):
    release = newest_claude()
    assert (release.bin / "claude").exists(), f"run tests/agents/install.sh ({AGENTS})"
    home, work = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    work.mkdir()
    (work / "README.md").write_text("# demo\n\nA small project the agent is started in.\n")
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    env_lines = prepare_home("claude", home)
    assert DIRECT in env_lines
    env_lines = env_lines.replace(DIRECT, gateway.gateway_url)        # the agents point at the gateway instead
    first, again = COMMANDS["claude"]
    runs = [run_agent(gateway, release, home, work, env_lines, first, PROMPTS[0], "first"),
            run_agent(gateway, release, home, work, env_lines, first, PROMPTS[1], "second"),
            run_agent(gateway, release, home, work, env_lines, again, PROMPTS[2], "continued")]
    for run in runs[1:]:
        main = run.main
        assert main.cached >= 0.9 * main.prompt, (f"{release.name} {run.name} through SMG: {main.cached} of the "
                                                  f"main prompt's {main.prompt} tokens came from the prefix cache")
    assert runs[2].main.prompt > runs[0].main.prompt, f"{release.name}: the continued turn did not carry the session"
    sent = sum(len(run.requests) for run in runs)
    assert routed_on_the_session_header(gateway.metrics_url) >= sent, gateway.smg_log.read_text()[-3000:]
