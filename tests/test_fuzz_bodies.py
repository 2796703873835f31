"""No request body, however malformed, gets a 5xx: hypothesis writes bodies for every generation route (and
count_tokens) and a real `tinyserve` process (demo model, both parsers, a short context) answers each one.

The bodies start from a valid request of the route and then get fields added, replaced or removed: the route's own
fields and other protocols' with values of any JSON type (huge integers, NaN and infinities, lone surrogates,
deep nesting, empty and odd strings), plus raw bodies that are no JSON object at all. Whatever the server says,
it must say it with a status below 500, in the route's error shape, and keep serving.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_util import ServerProcess, free_port, http, server_config

ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
}
FIELDS = sorted({
    # OpenAI chat / completions
    "messages", "model", "prompt", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "stop",
    "temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "top_logprobs", "logit_bias", "echo", "suffix",
    "best_of", "tools", "tool_choice", "parallel_tool_calls", "response_format", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "user", "metadata",
    "reasoning_effort", "chat_template_kwargs", "return_token_ids", "continue_final_message",
    "add_generation_prompt", "store", "modalities", "prediction", "service_tier", "functions", "verbosity",
    # Anthropic
    "system", "stop_sequences", "thinking", "output_config", "output_format", "cache_control", "container",
    # Responses
    "input", "instructions", "max_output_tokens", "text", "reasoning", "include", "previous_response_id",
    "truncation", "background", "prompt_cache_key", "max_tool_calls",
    "no_such_field"})

MAX_INT = 2 ** 70
EXAMPLES = int(os.environ.get("TINYSERVE_FUZZ_EXAMPLES", "60"))   # per route; more (and a random seed) when set


def json_values(max_leaves: int = 12) -> st.SearchStrategy[Any]:
    """Any JSON value Python's json writes: huge and negative integers, NaN / infinities (json writes them as
    NaN / Infinity, which the server's parser takes), text with lone surrogates and control characters."""
    scalars = (st.none() | st.booleans() | st.integers(-MAX_INT, MAX_INT)
               | st.floats(allow_nan=True, allow_infinity=True)
               | st.text(max_size=12) | st.sampled_from(["", "auto", "none", "required", "text", "json_schema",
                                                          "user", "assistant", "function", "\ud800", "-1", "0"]))
    return st.recursive(scalars, lambda children: st.lists(children, max_size=3)
                        | st.dictionaries(st.sampled_from(["type", "role", "content", "name", "schema", "text",
                                                           "function", "include_usage", "x"]) | st.text(max_size=4),
                                          children, max_size=3), max_leaves=max_leaves)


def nested(depth: int) -> bytes:
    """A JSON value nested `depth` levels deep, objects and lists in turn (written directly: json.dumps would
    recurse as deep)."""
    opens = "".join('{"a": ' if k % 2 else "[" for k in range(depth))
    closes = "".join("}" if k % 2 else "]" for k in reversed(range(depth)))
    return (opens + "1" + closes).encode()


@st.composite
def bodies(draw: st.DrawFn, route: str) -> bytes:
    kind = draw(st.sampled_from(["mutated"] * 8 + ["deep", "raw"]))
    if kind == "raw":
        return draw(st.sampled_from([b"", b"null", b"[]", b"42", b'"x"', b"{", b"{}", b"\xff\xfe", b"[" * 5000,
                                     b'{"a": ' + b"9" * 5000 + b"}", b'{"max_tokens": 1e999}',
                                     b'{"prompt": "\\ud800", "max_tokens": 1}']))
    body = dict(ROUTES[route])
    if kind == "deep":
        body[draw(st.sampled_from(FIELDS))] = "DEEP"
        return json.dumps(body).encode().replace(b'"DEEP"', nested(draw(st.sampled_from([40, 70, 500, 3000]))))
    for _ in range(draw(st.integers(1, 4))):
        name = draw(st.sampled_from(FIELDS + list(body)))
        if draw(st.booleans()) and name in body:
            del body[name]
        else:
            body[name] = draw(json_values())
    return json.dumps(body).encode()      # NaN, Infinity and lone surrogates as Python's json writes them


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    cfg = server_config(free_port(), {"parsers": {"reasoning": "qwen3", "tool_call": "qwen3_coder"},
                                      "model": {"context_length": 96}, "server": {"max_request_body_mb": 1.0}})
    proc = ServerProcess(folder, cfg, env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def check_answer(route: str, status: int, raw: bytes) -> None:
    assert status < 500, raw[:600]
    if status >= 400:
        error = json.loads(raw)
        if route.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["message"]
        else:
            assert error["error"]["message"] and "Traceback" not in error["error"]["message"]


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_no_body_gets_a_5xx(server, route):
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=EXAMPLES == 60,
              suppress_health_check=list(HealthCheck))
    @given(bodies(route))
    def one(raw: bytes) -> None:
        status, _, answer = http("POST", server.base_url + route, raw, timeout=120)
        seen[status] = seen.get(status, 0) + 1
        check_answer(route, status, answer)

    one()
    assert any(400 <= s < 500 for s in seen), seen               # the fuzzing reached the checks
    status, _, raw = http("POST", server.base_url + route, json.dumps(ROUTES[route]).encode())
    assert status == 200, raw                                     # and the server still serves


def test_deep_nesting_is_named_on_every_route(server):
    """A body nested 5,000 levels deep (which Python's parser cannot read) is a 400 that says why, on every route."""
    for route in ROUTES:
        body = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        status, _, raw = http("POST", server.base_url + route, body)
        assert status == 400, raw
        assert "nested" in raw.decode()


def test_numbers_python_takes_but_json_has_not(server):
    """NaN, Infinity and integers longer than Python converts: each a 400 naming the problem."""
    for body, needle in [(b'{"prompt": "x", "temperature": NaN}', "temperature"),
                         (b'{"prompt": "x", "max_tokens": Infinity}', "max_tokens"),
                         (b'{"prompt": "x", "max_tokens": ' + b"1" * 5000 + b"}", "digits"),
                         (b'{"prompt": "\\udc80"}', "Unicode")]:
        status, _, raw = http("POST", server.base_url + "/v1/completions", body)
        assert status == 400 and needle in raw.decode(), raw
    assert math.isnan(json.loads("NaN"))                          # what the server's parser takes
