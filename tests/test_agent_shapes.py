"""What each agent release sends, without the agent: the request kinds the real-agents tier recorded for every
release it runs (tests/agents/shapes/, tests/agents/recorder.py), sent to a server on the shipped parsers. Every
one is served: a field, block, tool type or flag that a release sends and this server refused would fail here, in
the suite, not only in the tier. The bodies are skeletons (long strings cut short, all structure kept), and
max_tokens is cut to a few tokens: the shape is what is tested, not the answer.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from server_util import ServerProcess, free_port, http, server_config

AGENTS = Path(__file__).resolve().parent / "agents"
sys.path.insert(0, str(AGENTS))
from recorder import Recorded, answer_text, compare, release_shape  # noqa: E402

SHAPES = sorted((AGENTS / "shapes").glob("*.json"))
KINDS = [(path.stem, i, kind) for path in SHAPES
         for i, kind in enumerate(json.loads(path.read_text(encoding="utf-8"))["requests"])]
PARSERS = {"parsers": {"reasoning": "qwen3", "tool_call": "qwen3_coder"}}   # config.example.toml's


def test_every_release_of_the_tier_has_its_shape_kept():
    listed = [f"{agent}-{v}" for line in (AGENTS / "releases.txt").read_text(encoding="utf-8").splitlines()
              if line.strip() and not line.startswith("#") for agent, _, *versions in [line.split()]
              for v in versions]
    assert sorted(listed) == sorted(path.stem for path in SHAPES)


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("agent-shapes")
    proc = ServerProcess(folder, server_config(free_port(), {**PARSERS, "model": {"context_length": 65536},
                                                             "engine": {"kv_cache_tokens": 65536}}),
                         env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.mark.parametrize("release,index,kind", KINDS, ids=[f"{r}-{i}" for r, i, _ in KINDS])
def test_each_request_kind_a_release_sends_is_served(server, release, index, kind):
    body = kind["body"]
    if isinstance(body, dict):
        for cap in ("max_tokens", "max_output_tokens", "max_completion_tokens"):
            if isinstance(body.get(cap), int):
                body[cap] = min(body[cap], 4)
        if kind["path"] == "/v1/responses" and body.get("max_output_tokens") is None:
            body["max_output_tokens"] = 4
    status, _, raw = http(kind["method"], server.base_url + kind["path"], body, headers=kind["headers"],
                          timeout=300)
    assert status < 400, f"{release} {kind['method']} {kind['path']}: {status} {raw[:500]!r}"


def test_a_field_a_release_adds_shows_up_as_a_new_path():
    """The tier's check: what a release sends now, against what was kept for it."""
    (path, _, kind), *_ = [k for k in KINDS if k[2]["path"] == "/v1/messages"]
    recorded = Recorded(kind["method"], kind["path"], dict(kind["headers"]), json.loads(json.dumps(kind["body"])))
    kept = release_shape([recorded])
    recorded.body["messages"][0]["content"] = [{"type": "text", "text": "hi", "citations_mode": "strict"}]
    recorded.body["new_field"] = {"on": True}
    recorded.headers["anthropic-beta"] += ",next-flag-2027-01-01"
    diff = compare(kept, release_shape([recorded]))
    assert diff.new["markers"] == ["anthropic-beta: next-flag-2027-01-01"]
    assert "POST /v1/messages new_field.on" in diff.new["paths"]
    assert "POST /v1/messages messages[].content[type=text].citations_mode" in diff.new["paths"]
    assert not compare(kept, kept)


# The visible text of a whole (not streamed) answer, read by each protocol's documented fields: the oracle for the
# recorder's answer_text, which the tier uses when an agent shows nothing.
WHOLE_TEXT = {
    "/v1/chat/completions": lambda a: a["choices"][0]["message"]["content"] or "",
    "/v1/messages": lambda a: "".join(b["text"] for b in a["content"] if b["type"] == "text"),
    "/v1/responses": lambda a: "".join(p["text"] for item in a["output"] if item["type"] == "message"
                                       for p in item["content"] if p["type"] == "output_text"),
}
ASK = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24},
       "/v1/messages": {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 24},
       "/v1/responses": {"input": "Say hello.", "max_output_tokens": 24}}


def test_the_recorder_reads_the_answers_text(server):
    """recorder.answer_text on the server's own answers, whole and streamed (greedy: the same text), for the three
    protocols the agents speak; at least one of them has visible text, so the comparison is not of empty strings."""
    texts = []
    for path, ask in ASK.items():
        got = {}
        for stream in (False, True):
            body = {"model": "tinyserve", "temperature": 0, "stream": stream, **ask}
            status, _, raw = http("POST", server.base_url + path, body, timeout=300)
            assert status == 200, (path, raw[:300])
            got[stream] = answer_text(Recorded("POST", path, {}, body, bytearray(raw)))
            if not stream:
                assert got[stream] == WHOLE_TEXT[path](json.loads(raw)), path
        assert got[True] == got[False], (path, got)
        texts.append(got[False])
    assert any(t.strip() for t in texts), texts
