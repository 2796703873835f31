"""The coding agents themselves, unmodified, against `tinyserve config.example.toml` as shipped: Claude Code, Codex,
Qwen Code and opencode, at every release tests/agents/releases.txt lists (six months of each), set up with the lines
docs/clients.md gives (read from the page and run as they are written). Each release answers twice and once more
in its continued session:

  - it exits 0 and shows the model's text (nothing only where the model's last answer had no visible text: the
    random demo model's can be only reasoning; the proxy keeps each answer);
  - the server refuses nothing (no 4xx or 5xx line in its log);
  - the second run and the continued turn each read at least 90% of their main prompt (the largest prompt the run
    sends) from the prefix cache; for the continued turn, of the part before where its prompt leaves the cached path
    inside the answer it continues (the agent's text copy of the random model's stray bytes re-encodes otherwise);
  - what it sent has no route, header, flag or field path that its kept shape (tests/agents/shapes/, recorder.py)
    lacks: a release that sends something new fails here with the new paths listed, before a user meets it.

The agents reach 127.0.0.1:8000 (config.example.toml's address, as the set-up lines say); there the recording proxy
(recorder.py) passes each request to the server, which runs config.example.toml with only its port moved.

Run by `bash tests/agents/run.sh` (after the README's test command in CI), which installs the releases and, where
`unshare --net` is allowed, runs this in a network namespace where only loopback is reachable. The agents' vendor
traffic is off by their own settings (the set-up lines), and their output is capped by their own settings where they
have one (never by changing what they send). TINYSERVE_AGENTS_REPORT names a file for a table of every request
the agents made: prompt sizes, cache hits, time to the answer. TINYSERVE_AGENTS_RECORD=1 writes each release's
shape anew; TINYSERVE_AGENTS_LATEST=1 (with install.sh's) adds each agent's @latest, checked against the newest kept
shape of that agent.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomli_w

from recorder import Recorder, answer_text, compare, kinds, release_shape

try:
    import tomllib
except ModuleNotFoundError:                       # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DOCS = ROOT / "docs" / "clients.md"
SHAPES = HERE / "shapes"
AGENTS = Path(os.environ.get("TINYSERVE_AGENTS_DIR", "~/.cache/tinyserve/agents")).expanduser()
PORT = 8000                                      # config.example.toml's server.port, where the set-up lines point
URL = f"http://127.0.0.1:{PORT}"
RECORD = os.environ.get("TINYSERVE_AGENTS_RECORD") == "1"


@dataclass(frozen=True)
class Release:
    agent: str
    version: str
    latest: bool = False                          # TINYSERVE_AGENTS_LATEST's @latest, not in releases.txt

    @property
    def name(self) -> str:
        return f"{self.agent}-{self.version}"

    @property
    def bin(self) -> Path:
        return AGENTS / self.name / "node_modules" / ".bin"


def releases() -> list[Release]:
    """releases.txt's matrix, and with TINYSERVE_AGENTS_LATEST=1 each agent's @latest that is not in it."""
    listed = []
    for line in (HERE / "releases.txt").read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            agent, _package, *versions = line.split()
            listed += [Release(agent, v) for v in versions]
    latest = AGENTS / "latest.txt"
    if os.environ.get("TINYSERVE_AGENTS_LATEST") == "1" and latest.exists():
        for line in latest.read_text(encoding="utf-8").splitlines():
            agent, version = line.split()
            if Release(agent, version) not in listed:
                listed.append(Release(agent, version, latest=True))
    return listed
PROMPTS = ("Say hello", "Say hello", "And once more, in other words")
RUN_TIMEOUT_S = 300
# The agents' own output caps: the random demo model ends its answer at a random end-of-turn token, a few hundred
# tokens in; a cap bounds the rare long tail (a cap it meets makes Claude Code ask again and, met again, fail, so it
# is far above what the model writes). Codex has no such setting: its answers end when the model ends them.
CAPS = {"CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096", "QWEN_CODE_MAX_OUTPUT_TOKENS": "4096",
        "OPENCODE_EXPERIMENTAL_OUTPUT_TOKEN_MAX": "4096"}
# One request in the server's log: "<id>: <finish>, prompt N tokens, M from the prefix cache (...), G generated"
REQUEST_LINE = re.compile(r"^(\S+ \S+) INFO tinyserve\.generation: (\S+): (\w+), prompt (\d+) tokens, (\d+) from the prefix "
                          r"cache .*?, (\d+) generated")
# Where a prompt left a cached path: "<id> leaves a cached path at token N of ... | the prompt goes on '<text>'... |
# the cache went on '<text>'..." (the tokens either side as quoted text, tinyserve/divergences.py)
LEFT_LINE = re.compile(r"INFO tinyserve\.cache: prefix cache: (\S+) leaves a cached path at token (\d+) of .*"
                       r"\| the prompt goes on (.+?)\.\.\. \| the cache went on (.+?)\.\.\.$")
GENERATION_PATHS = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions")   # answers with text
REFUSAL_LINE = re.compile(r"WARNING tinyserve\.api: (GET|POST|PUT|DELETE|HEAD|OPTIONS) (\S+): ([45]\d\d) (.*)")


# ---------------------------------------------------------------------------------------------------------------
# The set-up lines, as docs/clients.md gives them

def setup_blocks(agent: str) -> list[tuple[str, str, str]]:
    """(kind, target, text) of each block docs/clients.md marks for `agent`: `<!-- tested: AGENT env -->` before a
    bash block of exports, `<!-- tested: AGENT file PATH -->` before a file's whole text."""
    text = DOCS.read_text(encoding="utf-8")
    marked = re.finditer(r"<!-- tested: (\S+) (env|file)(?: (\S+))? -->\n```\w*\n(.*?)```", text, re.S)
    return [(m.group(2), m.group(3) or "", m.group(4)) for m in marked if m.group(1) == agent]


def prepare_home(agent: str, home: Path) -> str:
    """Writes the agent's files from the page into `home`; returns its env lines."""
    env_lines = []
    for kind, target, body in setup_blocks(agent):
        if kind == "file":
            path = home / target.removeprefix("~/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body, encoding="utf-8")
        else:
            env_lines.append(body)
    assert env_lines or agent == "codex", f"docs/clients.md gives no env lines for {agent}"
    return "\n".join(env_lines)


# ---------------------------------------------------------------------------------------------------------------
# The server, as a user runs it

@dataclass
class Request:
    request_id: str
    finish: str
    prompt: int
    cached: int
    generated: int


@dataclass
class Run:
    agent: str
    name: str
    seconds: float
    requests: list[Request] = field(default_factory=list)
    # request id -> the token where it left a cached path whose text goes on as the prompt's does (other tokens for
    # the same text: see the test)
    left_same_text: dict[str, int] = field(default_factory=dict)

    @property
    def main(self) -> Request:
        return max(self.requests, key=lambda r: r.prompt)


class Server:
    """`tinyserve config.example.toml` with its port moved to `port` (the proxy has 8000); nothing else changed."""

    def __init__(self, folder: Path, port: int) -> None:
        self.log_path = folder / "server.log"
        self.url = f"http://127.0.0.1:{port}"
        config = tomllib.loads((ROOT / "config.example.toml").read_text(encoding="utf-8"))
        config["server"]["port"] = port
        config_path = folder / "config.toml"
        config_path.write_text(tomli_w.dumps(config), encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}   # the threads a user's server gets
        exe = shutil.which("tinyserve")
        command = [exe] if exe else [sys.executable, "-m", "tinyserve.cli"]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command + [str(config_path)], cwd=ROOT, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 900) -> None:
        """Healthy (the first start compiles the CPU decode step: a minute or two)."""
        import urllib.request
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "the server exited:\n" + self.text()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the server was not healthy within %d s:\n%s" % (timeout, self.text()[-3000:]))

    def text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(60)
        finally:
            self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if os.environ.get("TINYSERVE_AGENTS_NETNS"):
        with pytest.raises(OSError):                  # the namespace run.sh made: loopback only
            socket.create_connection(("1.1.1.1", 443), timeout=3).close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    srv = Server(tmp_path_factory.mktemp("server"), port)
    try:
        srv.wait_ready()
        srv.recorder = Recorder(PORT, srv.url).start()
        yield srv
        srv.recorder.stop()
    finally:
        code = srv.stop()
    assert code == 0, srv.text()[-3000:]


REPORT: list[Run] = []


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    path = os.environ.get("TINYSERVE_AGENTS_REPORT")
    if path:
        rows = ["| release | run | s | requests: prompt tokens / from the cache / generated |", "|---|---|---|---|"]
        for run in REPORT:
            shown = "; ".join(f"{r.prompt} / {r.cached} / {r.generated}" for r in run.requests)
            rows.append(f"| {run.agent} | {run.name} | {run.seconds:.1f} | {shown} |")
        Path(path).write_text("\n".join(rows) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------
# The agents

COMMANDS = {   # (first and second run, continued turn): each agent's own non-interactive form
    "claude": (["claude", "-p"], ["claude", "--continue", "-p"]),
    "codex": (["codex", "exec"], ["codex", "exec", "resume", "--last"]),
    "qwen": (["qwen", "-p"], ["qwen", "--continue", "-p"]),
    "opencode": (["opencode", "run"], ["opencode", "run", "--continue"]),
}
ERRORS = re.compile(r"API Error|\b[45]\d\d\b.*(error|Error)|ECONNREFUSED|context_length_exceeded")


def same_text(left: re.Match) -> bool:
    """Whether the prompt and the cached path it left go on with the same text (one starts with the other)."""
    try:
        prompt, cached = ast.literal_eval(left.group(3)), ast.literal_eval(left.group(4))
    except (ValueError, SyntaxError):
        return False
    return isinstance(prompt, str) and isinstance(cached, str) and (prompt.startswith(cached) or
                                                                    cached.startswith(prompt))


def run_agent(server: Server, release: Release, home: Path, work: Path, env_lines: str, command: list[str],
              prompt: str, name: str) -> Run:
    agent = release.agent
    recorder = getattr(server, "recorder", None)       # the gateway's tier has no recording proxy
    start, first_request = len(server.text()), len(recorder.requests) if recorder else 0
    env = {"PATH": f"{release.bin}:{os.environ['PATH']}", "HOME": str(home),
           "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1", **CAPS}
    script = f"set -e\n{env_lines}\nexec \"$@\""
    t0 = time.monotonic()
    out = subprocess.run(["bash", "-c", script, agent, *command, prompt], cwd=work, env=env, capture_output=True,
                         text=True, timeout=RUN_TIMEOUT_S)
    seconds = time.monotonic() - t0
    time.sleep(0.5)                                   # the last request's log line
    log = server.text()[start:]
    shown = (f"{release.name} {name}: exit {out.returncode}\nstdout:\n{out.stdout[-3000:]}\n"
             f"stderr:\n{out.stderr[-3000:]}")
    assert out.returncode == 0, shown
    refused = [m.group(0) for m in REFUSAL_LINE.finditer(log)]
    assert not refused, f"{release.name} {name}: the server refused requests:\n" + "\n".join(refused)
    run = Run(release.name, name, seconds, [Request(m.group(2), m.group(3), int(m.group(4)), int(m.group(5)),
                                             int(m.group(6)))
                                     for m in map(REQUEST_LINE.match, log.splitlines()) if m],
              {m.group(1): int(m.group(2)) for m in map(LEFT_LINE.search, log.splitlines()) if m and same_text(m)})
    assert run.requests, f"{release.name} {name}: no request reached the server\n{shown}"
    assert run.main.generated >= 1
    # the random demo model samples an answer of any length, a few characters now and then ("; for" and a lone
    # byte shown as U+FFFD were seen): what is checked is that the agent shows text and it is no error. An answer
    # with no visible text at all (its end-of-turn token at once, or only whitespace or reasoning before it) is
    # shown as nothing: then the agent must have been given nothing to show
    text = out.stdout.strip()
    assert not ERRORS.search(text), f"{release.name} {name}: an error shown\n{shown}"
    if not text:
        answers = [r for r in recorder.requests[first_request:] if r.path in GENERATION_PATHS] if recorder else []
        given = answer_text(answers[-1]) if answers else ""
        assert answers and not given.strip(), f"{release.name} {name}: no answer shown, of {given[:300]!r}\n{shown}"
    REPORT.append(run)
    return run


def newest_kept_shape(release: Release) -> Path | None:
    """The shape kept for this release, or for @latest the newest kept one of its agent."""
    own = SHAPES / f"{release.name}.json"
    if own.exists() or not release.latest:
        return own if own.exists() else None
    kept = sorted(SHAPES.glob(f"{release.agent}-*.json"),
                  key=lambda p: [int(x) for x in re.findall(r"\d+", p.stem.removeprefix(release.agent))])
    return kept[-1] if kept else None


# What an agent sends back only when the demo model's sampled answer happened to start a think block: the server's
# own thinking block, echoed in the history (Claude Code). Whether it appears depends on the random answer, not on
# the release, so it is part of every kept shape; that the server serves it is tests/test_anthropic.py's matter.
ECHOED = {"claude": [f"POST /v1/messages messages[].content[type=thinking].{key}"
                     for key in ("type", "thinking", "signature")]}


def check_shape(release: Release, recorded: list) -> None:
    """What the release sent against its kept shape; TINYSERVE_AGENTS_RECORD=1 keeps what it sent instead."""
    now = release_shape(recorded)
    if RECORD:
        SHAPES.mkdir(exist_ok=True)
        text = json.dumps({"release": release.name, "shape": now, "requests": kinds(recorded)}, indent=1,
                          ensure_ascii=False)
        (SHAPES / f"{release.name}.json").write_text(text + "\n", encoding="utf-8")
        return
    path = newest_kept_shape(release)
    assert path is not None, f"{release.name}: no shape kept in {SHAPES}; run with TINYSERVE_AGENTS_RECORD=1"
    kept = json.loads(path.read_text(encoding="utf-8"))["shape"]
    kept["paths"] = kept["paths"] + ECHOED.get(release.agent, [])
    diff = compare(kept, now)
    assert not diff, (f"{release.name} sent what {path.name} does not have; check that the server serves it "
                      f"(tests/test_agent_shapes.py), then keep the new shape (TINYSERVE_AGENTS_RECORD=1):\n{diff}")


@pytest.mark.parametrize("release", releases(), ids=lambda r: r.name)
def test_release_runs_twice_and_continues_from_the_cache(server, release, tmp_path):
    agent = release.agent
    assert (release.bin / agent).exists(), f"run tests/agents/install.sh ({AGENTS})"
    home, work = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    work.mkdir()
    (work / "README.md").write_text("# demo\n\nA small project the agent is started in.\n")
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    env_lines = prepare_home(agent, home)
    first, again = COMMANDS[agent]
    server.recorder.take()
    try:
        runs = [run_agent(server, release, home, work, env_lines, first, PROMPTS[0], "first"),
                run_agent(server, release, home, work, env_lines, first, PROMPTS[1], "second"),
                run_agent(server, release, home, work, env_lines, again, PROMPTS[2], "continued")]
    finally:
        recorded = server.recorder.take()
        if os.environ.get("TINYSERVE_AGENTS_DUMP"):                 # every request whole, to read by hand
            dump = Path(os.environ["TINYSERVE_AGENTS_DUMP"]) / f"{release.name}.json"
            dump.parent.mkdir(parents=True, exist_ok=True)
            dump.write_text(json.dumps([r.__dict__ for r in recorded], indent=1, ensure_ascii=False))
    for run, before in zip(runs[1:], runs):
        main, reusable = run.main, run.main.prompt
        left = run.left_same_text.get(main.request_id)
        if run.name == "continued" and left is not None and left > before.main.prompt:
            # the agent keeps the random model's answer as text: bytes that are no UTF-8 character come back as
            # U+FFFD, other tokens than the model made for the same text, and the prompt leaves the cached path
            # there (past the prompt the answer continues); what lies before that point must still be reused
            reusable = left
        assert main.cached >= 0.9 * reusable, (f"{release.name} {run.name}: {main.cached} of the main prompt's "
                                               f"{main.prompt} tokens came from the prefix cache (reusable: "
                                               f"{reusable})")
    assert runs[2].main.prompt > runs[0].main.prompt, f"{release.name}: the continued turn did not carry the session"
    check_shape(release, recorded)
