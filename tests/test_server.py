"""End-to-end tests of the HTTP server: a real `tinyserve` process on 127.0.0.1 (or the app in-process), the demo
model, and the real `openai` client.

The demo model's text is gibberish, so these tests check the plumbing: shapes, counts, token ids, stop strings,
reproducibility, error handling, cancellation, shutdown. Parser formats are covered by the parsers' own tests;
here we check that the server wires them in.
"""
from __future__ import annotations

import http.client as httpclient
import json
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pytest

from checkpoints import make_qwen3_5_text
from server_util import (InProcessServer, ServerProcess, free_port, http, lazy_import, server_config, wait_healthy,
                         write_config)

from tinyserve import config as config_mod
openai = lazy_import("openai")

PARSERS = {"parsers": {"reasoning": "qwen3", "tool_call": "qwen3_coder"}}
BODY_LIMIT_MB = 0.05            # the shared server rejects bodies over 50 KB
CONTEXT = 1024
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}


# ---------------------------------------------------------------------------------------------------------------
# Fixtures

@pytest.fixture(scope="session")
def tokenizer(xdg):
    from tinyserve.demo import ensure_demo_checkpoint
    from tinyserve.tokenizer import Tokenizer
    return Tokenizer.from_folder(ensure_demo_checkpoint())


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    """The shared real server process, with both parsers on and a small body limit."""
    folder = tmp_path_factory.mktemp("server")
    cfg = server_config(free_port(), {**PARSERS, "server": {"max_request_body_mb": BODY_LIMIT_MB},
                                      "model": {"context_length": CONTEXT}})
    proc = ServerProcess(folder, cfg, env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    code = proc.stop()
    assert code == 0, proc.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


API_KEY = "test-key-123"
LONG_CONTEXT = 4096             # room for streams long enough to be cut off mid-way


@pytest.fixture(scope="module")
def inproc(xdg):
    """In-process server: no parsers, no prefix cache (pages return to zero), an API key, room for 1 request."""
    data = server_config(free_port(), {
        "server": {"api_key": API_KEY, "max_queued_requests": 0},
        "engine": {"max_running_requests": 1},
        "cache": {"enabled": False},
        "model": {"context_length": LONG_CONTEXT}})
    with InProcessServer(config_mod.from_dict(data)) as srv:
        yield srv


@pytest.fixture(scope="module")
def inproc_client(inproc) -> openai.OpenAI:
    return openai.OpenAI(base_url=inproc.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, content: str = "Hello! How are you?", **kw: Any) -> Any:
    kw.setdefault("max_tokens", 8)
    return client.chat.completions.create(model="tinyserve", messages=[{"role": "user", "content": content}], **kw)


def tiny_request_works(base_url: str, headers: dict[str, str] | None = None) -> None:
    status, _, body = http("POST", base_url + "/v1/completions",
                           {"prompt": [1, 2, 3], "max_tokens": 1}, headers)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 1


# ---------------------------------------------------------------------------------------------------------------
# The happy paths

def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tinyserve"]
    status, _, body = http("GET", server.base_url + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_chat(client):
    r = chat(client, max_tokens=6, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.object == "chat.completion" and r.model == "tinyserve" and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    details = r.usage.prompt_tokens_details
    assert details.cached_tokens is not None and 0 <= details.cached_tokens <= r.usage.prompt_tokens
    assert isinstance(details.model_extra["cached_tokens_by_tier"], dict)


def test_stream_matches_non_stream_and_reports_usage(client):
    kw = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    whole = chat(client, "Tell me about the fox.", **kw)
    chunks = list(chat(client, "Tell me about the fox.", stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert text == whole.choices[0].message.content


def test_completion_with_token_ids(client, tokenizer):
    prompt = tokenizer.encode("The quick brown fox")
    r = client.completions.create(model="tinyserve", prompt=prompt, max_tokens=7, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    (choice,) = r.choices
    extra = choice.model_extra
    assert r.model_extra["prompt_token_ids"] == prompt
    assert len(extra["token_ids"]) == r.usage.completion_tokens == 7
    assert choice.text == tokenizer.decode(extra["token_ids"])
    assert r.usage.prompt_tokens == len(prompt)
    # The same prompt as text gives the same tokens (greedy).
    again = client.completions.create(model="tinyserve", prompt="The quick brown fox", max_tokens=7, temperature=0,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert again.choices[0].model_extra["token_ids"] == extra["token_ids"]


def test_completion_stream(client):
    chunks = list(client.completions.create(model="tinyserve", prompt="Hello", max_tokens=5, stream=True,
                                            temperature=0, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    whole = client.completions.create(model="tinyserve", prompt="Hello", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5


def test_chat_logprobs(client):
    r = chat(client, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs), abs=1e-4)


def test_completion_logprobs(client):
    r = client.completions.create(model="tinyserve", prompt="Hello", max_tokens=4, logprobs=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0


def test_n2_and_seed_reproducibility(client):
    kw = dict(max_tokens=8, temperature=1.0, seed=1234, n=2, extra_body={"ignore_eos": True})
    a = chat(client, "Say something random.", **kw)
    b = chat(client, "Say something random.", **kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert a.usage.completion_tokens == 16
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    streamed = list(chat(client, "Say something random.", stream=True, **kw))
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in a.choices]


def test_stop_string_cuts_text(client):
    kw = dict(max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(model="tinyserve", prompt="Question: what is", **kw).choices[0].text
    cut_at = len(full) // 2
    stop = full[cut_at:cut_at + 2]
    assert stop
    expected = full[:full.index(stop)]
    r = client.completions.create(model="tinyserve", prompt="Question: what is", stop=[stop], **kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tinyserve", prompt="Question: what is", stop=stop, stream=True,
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_tools_reach_the_template(client, tokenizer):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model="tinyserve", messages=messages, tools=[WEATHER_TOOL], max_tokens=8,
                                       extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert "<tools>" in prompt and '"get_weather"' in prompt
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls
    # tool_choice "none": tools stay in the prompt (same prefix for the cache) but nothing is parsed.
    r2 = client.chat.completions.create(model="tinyserve", messages=messages, tools=[WEATHER_TOOL], max_tokens=4,
                                        tool_choice="none")
    assert r2.choices[0].message.tool_calls is None
    # A history with an earlier call: arguments given as a JSON string are rendered as parameters.
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 20}'}]
    r3 = client.chat.completions.create(model="tinyserve", messages=history, tools=[WEATHER_TOOL], max_tokens=4,
                                        extra_body={"return_token_ids": True})
    prompt3 = tokenizer.decode(r3.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert "<parameter=city>\nParis\n</parameter>" in prompt3 and "<parameter=days>\n2\n</parameter>" in prompt3
    assert "<tool_response>\n{\"temperature\": 20}\n</tool_response>" in prompt3


def test_text_parts_join_like_the_tokenizer(client, tokenizer):
    """Content as text parts: the server's prompt is the one apply_chat_template builds from the same parts, the
    parts joined with a newline (one normaliser, tinyserve.tokenizer.content_text, serves both)."""
    parts = [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "and Oslo?"}]
    r = client.chat.completions.create(model="tinyserve", messages=[{"role": "user", "content": parts}],
                                       max_tokens=1, extra_body={"return_token_ids": True})
    expected = tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    assert expected == tokenizer.apply_chat_template([{"role": "user", "content": "Weather in Paris\nand Oslo?"}])
    assert r.model_extra["prompt_token_ids"] == tokenizer.encode(expected)


def test_thinking_switch_reaches_the_template(client, tokenizer):
    def prompt_of(**template_kwargs: Any) -> str:
        r = chat(client, max_tokens=2, extra_body={"return_token_ids": True, "chat_template_kwargs": template_kwargs})
        return tokenizer.decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False)

    assert prompt_of(enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    assert not prompt_of(enable_thinking=True).endswith("</think>\n\n")


def test_reasoning_off_gives_plain_content(client, inproc_client):
    """Thinking off: the qwen3 parser (shared server) passes everything through as content, like no parser."""
    kw = dict(max_tokens=10, temperature=0, extra_body={"ignore_eos": True,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    parsed = chat(client, "Hi there", **kw).choices[0].message
    plain = chat(inproc_client, "Hi there", **kw).choices[0].message
    assert not parsed.model_extra.get("reasoning_content")
    assert "reasoning_content" not in plain.model_extra
    assert parsed.content == plain.content


def test_metrics_and_flush_cache(server, client):
    chat(client, max_tokens=2)
    status, headers, body = http("GET", server.base_url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = body.decode()
    for name in ("tinyserve:requests_total", "tinyserve:prompt_tokens_total", "tinyserve:generation_tokens_total",
                 "tinyserve:time_to_first_token_seconds_bucket", "tinyserve:inter_token_latency_seconds_bucket",
                 "tinyserve:num_requests_running", "tinyserve:num_requests_waiting", "tinyserve:kv_cache_usage_perc",
                 "tinyserve:request_prompt_cache_hit_ratio_bucket"):
        assert name in text, name
    assert 'tinyserve:requests_total{status="200"}' in text
    # per request, the log tells how much of the prompt the cache served (prompt drift shows as 0 every turn)
    assert re.search(r"prompt \d+ tokens, \d+ from the prefix cache \(device \d+, host \d+, file \d+\)", server.log())
    status, _, body = http("POST", server.base_url + "/flush_cache")
    assert status == 200, body


# ---------------------------------------------------------------------------------------------------------------
# Bad input: always a 4xx in the error shape, and the server keeps working

TOKENS_OVER_CONTEXT = [5] * (CONTEXT + 10)
PNG_1X1 = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJ"
           "RU5ErkJggg==")

BAD_INPUTS = [
    # id, method, path, body, status, param
    ("malformed-json", "POST", "/v1/chat/completions", b"{not json", 400, None),
    ("body-not-object", "POST", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("messages-not-list", "POST", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("messages-missing", "POST", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("empty-messages", "POST", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown-role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("content-number", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    # the demo model has no vision tower: an image is refused naming its part (test_image_api.py serves images)
    ("image-part", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": PNG_1X1}}]}]}, 400,
     "messages[0].content[1]"),
    ("image-url-not-fetched", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, 400, "messages[0].content[0]"),
    ("negative-max-tokens", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "max_tokens"),
    ("string-max-tokens", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ("huge-max-tokens", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 9}, 400, "max_tokens"),
    ("huge-max-completion-tokens", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10 ** 9}, 400,
     "max_completion_tokens"),
    ("prompt-plus-max-completion-tokens-over-context", "POST", "/v1/chat/completions",   # each alone would fit
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": CONTEXT - 2}, 400,
     "max_completion_tokens"),
    ("negative-temperature", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ("string-temperature", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ("zero-top-p", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ("n-zero", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ("n-nine", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 9}, 400, "n"),
    ("top-logprobs-21", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("top-logprobs-alone", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("stop-number", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop": 5}, 400, "stop"),
    ("stream-string", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream"),
    ("bad-tool", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("tool-choice-unknown-function", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER_TOOL],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("thinking-not-bool", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": "no"}}, 400,
     "chat_template_kwargs.enable_thinking"),
    ("stop-token-ids-strings", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ("unknown-model", "POST", "/v1/chat/completions",
     {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("prompt-object", "POST", "/v1/completions", {"prompt": {"text": "x"}}, 400, "prompt"),
    ("prompt-batch-past-capacity", "POST", "/v1/completions", {"prompt": ["a"] * 100}, 400, "prompt"),
    ("prompt-negative-id", "POST", "/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("prompt-id-past-vocab", "POST", "/v1/completions", {"prompt": [10 ** 7]}, 400, "prompt"),
    ("prompt-empty", "POST", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("completion-logprobs-6", "POST", "/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
    ("prompt-over-context", "POST", "/v1/completions", {"prompt": TOKENS_OVER_CONTEXT, "max_tokens": 1}, 400,
     "prompt"),
    ("body-over-limit", "POST", "/v1/completions", {"prompt": "x" * int(BODY_LIMIT_MB * 1024 * 1024 * 2)}, 413,
     None),
    ("unknown-route", "GET", "/v1/nothing", None, 404, None),
    ("wrong-method", "GET", "/v1/chat/completions", None, 405, None),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input(server, case):
    _, method, path, body, status, param = case
    got, _, raw = http(method, server.base_url + path, body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param
    if case[0] == "prompt-over-context":
        assert str(len(TOKENS_OVER_CONTEXT)) in error["message"] and str(CONTEXT) in error["message"]
    if case[0] == "image-part":
        assert "this model takes no image input" in error["message"]
    if case[0] == "image-url-not-fetched":
        assert "server.fetch_image_urls = false" in error["message"]
    assert http("GET", server.base_url + "/health")[0] == 200
    tiny_request_works(server.base_url)


# ---------------------------------------------------------------------------------------------------------------
# In-process server: auth, the bounded queue, cancellation on disconnect

def test_api_key(inproc):
    url = inproc.base_url
    assert http("GET", url + "/health")[0] == 200                      # public
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, _, body = http("GET", url + "/v1/models", headers=headers)
        assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    assert http("GET", url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})[0] == 200
    tiny_request_works(url, {"Authorization": f"Bearer {API_KEY}"})


def _open_stream(base_url: str, body: dict[str, Any]) -> tuple[httpclient.HTTPConnection, Any]:
    host, port = base_url.removeprefix("http://").split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _wait_for(predicate: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_queue_full_and_disconnect_frees_pages(inproc):
    """Room for one request (max_running 1, max_queued 0): a second gets 503 + Retry-After. Closing the first
    stream mid-way cancels it: the engine shows no request and no KV page in use."""
    idle = inproc.stats()
    conn, resp = _open_stream(inproc.base_url, {"prompt": "Hello there", "max_tokens": 4000, "ignore_eos": True})
    first = resp.readline()
    assert first.startswith(b"data: ")
    busy = inproc.stats()
    assert busy.num_running + busy.num_waiting == 1 and busy.kv_pages_used > idle.kv_pages_used

    status, headers, body = http("POST", inproc.base_url + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                                 {"Authorization": f"Bearer {API_KEY}"})
    assert status == 503 and headers.get("Retry-After") and json.loads(body)["error"]["message"]

    conn.close()                                                      # the client goes away mid-stream
    _wait_for(lambda: (lambda s: s.num_running == 0 and s.num_waiting == 0
                       and s.kv_pages_used == idle.kv_pages_used)(inproc.stats()), "the request to be freed")
    status, _, body = http("GET", inproc.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert "tinyserve:num_requests_running 0.0" in body.decode()
    assert 'tinyserve:request_finished_total{finish_reason="abort"} 1.0' in body.decode()   # cut off, not done
    tiny_request_works(inproc.base_url, {"Authorization": f"Bearer {API_KEY}"})


# ---------------------------------------------------------------------------------------------------------------
# Process lifecycle: systemd notification, SIGTERM drain, config errors, --check

@pytest.mark.slow
def test_sigterm_drains_and_notifies_systemd(xdg, tmp_path):
    name = f"tinyserve-test-{uuid.uuid4().hex}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind("\0" + name)                                           # abstract namespace: NOTIFY_SOCKET=@name
    notify.settimeout(180)
    drain_s = 1.0
    cfg = server_config(free_port(), {"server": {"drain_timeout_s": drain_s},
                                      "model": {"context_length": LONG_CONTEXT}})
    proc = ServerProcess(tmp_path, cfg, env={"XDG_CACHE_HOME": str(xdg), "NOTIFY_SOCKET": "@" + name})
    proc.start(wait=False)
    try:
        assert notify.recv(4096).decode().split("\n")[0] == "READY=1"
        wait_healthy(proc.base_url, proc=proc.proc)

        # A long request is running when SIGTERM comes: it gets drain_s, then it is cancelled.
        events: list[dict[str, Any]] = []

        def stream() -> None:
            try:
                conn, resp = _open_stream(proc.base_url, {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True})
                while line := resp.readline():
                    if line.startswith(b"data: {"):
                        events.append(json.loads(line[6:]))
            except OSError:
                pass

        t = threading.Thread(target=stream)
        t.start()
        _wait_for(lambda: events, "the stream to start")
        proc.proc.send_signal(15)
        assert notify.recv(4096).decode().split("\n")[0] == "STOPPING=1"
        if proc.proc.poll() is None:
            try:
                assert http("GET", proc.base_url + "/health", timeout=5)[0] == 503
            except OSError:
                pass                                                   # already closed: fine
        assert proc.proc.wait(timeout=drain_s + 60) == 0, proc.log()
        t.join(30)
        assert events[-1]["choices"][0]["finish_reason"] in ("abort", "length")
    finally:
        proc.stop()
        notify.close()


def _run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-m", "tinyserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


CONFIG_ERRORS = [
    ("page-size-zero", {"engine": {"page_size": 0}}, "engine.page_size"),
    ("port-string", {"server": {"port": "eighty"}}, "server.port"),
    ("unknown-key", {"model": {"paht": "demo"}}, "model.paht"),
    ("bad-choice", {"model": {"dtype": "float8"}}, "model.dtype"),
    ("cross-table", {"cache": {"state_track_interval": 24}}, "cache.state_track_interval"),
    ("drain-negative", {"server": {"drain_timeout_s": -1}}, "server.drain_timeout_s"),
]


@pytest.mark.parametrize("mode", ["--check", "serve"])
@pytest.mark.parametrize("case", CONFIG_ERRORS, ids=[c[0] for c in CONFIG_ERRORS])
def test_config_error_exits_1(tmp_path, case, mode):
    _, overrides, key = case
    path = write_config(tmp_path, server_config(free_port(), overrides))
    result = _run_cli(*(["--check"] if mode == "--check" else []), str(path))
    assert result.returncode == 1
    assert key in result.stderr and "Traceback" not in result.stderr


def test_bad_toml_and_missing_checkpoint_exit_1(tmp_path, xdg):
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\npath = 1\n")
    result = _run_cli("--check", str(bad))
    assert result.returncode == 1 and "TOML" in result.stderr and "Traceback" not in result.stderr
    missing = tmp_path / "no-such-checkpoint"
    path = write_config(tmp_path, server_config(free_port(), {"model": {"path": str(missing)}}))
    result = _run_cli("--check", str(path), env={"XDG_CACHE_HOME": str(xdg)})
    assert result.returncode == 1 and str(missing) in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_checkpoint_without_a_tokenizer_exits_1_naming_the_file(tmp_path, xdg):
    folder, _ = make_qwen3_5_text(tmp_path / "no-tokenizer")          # weights and config.json only
    path = write_config(tmp_path, server_config(free_port(), {"model": {"path": str(folder), "dtype": "float32"}}))
    result = _run_cli(str(path), env={"XDG_CACHE_HOME": str(xdg)})
    assert result.returncode == 1, result.stderr
    assert "tokenizer.json" in result.stderr and "Traceback" not in result.stderr


def test_check_prints_config_and_plan(tmp_path, xdg):
    path = write_config(tmp_path, server_config(free_port()))
    result = _run_cli("--check", str(path), env={"XDG_CACHE_HOME": str(xdg)})
    assert result.returncode == 0, result.stderr
    effective = config_mod.dumps(config_mod.load(path)).strip()
    assert result.stdout.startswith(effective)
    assert result.stdout[len(effective):].strip()                          # and the plan after it


# ---------------------------------------------------------------------------------------------------------------
# Parser plumbing without the model (its output never holds a tool call): the same functions the handlers use

def test_tool_call_and_reasoning_plumbing():
    from tinyserve.chat import ChatFormat, ChatStreamChoice
    from tinyserve.openai_api import parse_chat_request
    from tinyserve.generation import Choice

    parsers = config_mod.from_dict(PARSERS).parsers
    chat = ChatFormat(parsers.reasoning, parsers.tool_call)
    req = parse_chat_request({"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER_TOOL]},
                             "tinyserve")
    text = ("<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    message, finish = chat.message(req, Choice(0, text=text, finish_reason="stop"))
    assert finish == "tool_calls"
    assert message["reasoning_content"] == "The user wants the weather."
    assert message["content"] == "Let me check."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}   # typed by the schema

    # Streamed a few characters at a time, the deltas add up to the same message.
    stream = ChatStreamChoice(chat, req)
    pieces = []
    for i in range(0, len(text), 3):
        pieces += stream.pieces(text[i:i + 3], final=False)
    pieces += stream.pieces("", final=True)
    assert stream.called_tools
    reasoning = "".join(p.get("reasoning_content", "") for p in pieces)
    content = "".join(p.get("content", "") for p in pieces)
    calls: dict[int, dict[str, str]] = {}
    for p in pieces:
        for d in p.get("tool_calls", []):
            c = calls.setdefault(d["index"], {"name": "", "arguments": ""})
            c["name"] += d["function"].get("name", "")
            c["arguments"] += d["function"].get("arguments", "")
    assert reasoning == message["reasoning_content"] and content == message["content"]
    assert calls == {0: {"name": "get_weather", "arguments": call["function"]["arguments"]}}

    # tool_choice "none" and thinking off: everything is content.
    plain = parse_chat_request({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER_TOOL],
                                "tool_choice": "none", "chat_template_kwargs": {"enable_thinking": False}},
                               "tinyserve")
    message, finish = chat.message(plain, Choice(0, text=text, finish_reason="stop"))
    assert finish == "stop" and message["content"] == text and not message.get("reasoning_content")


def test_bad_parameters_with_n_leave_nothing_submitted(server):
    """n choices with an out-of-range parameter: the engine's validation fails the first submit, a 400 names the
    field, and no request is left behind in the engine."""
    status, _, body = http("POST", server.base_url + "/v1/completions",
                           {"prompt": "Hello", "max_tokens": 4, "n": 3, "temperature": -1.0})
    assert status == 400 and json.loads(body)["error"]["param"] == "temperature"
    status, _, body = http("GET", server.base_url + "/metrics")
    assert "tinyserve:num_requests_running 0.0" in body.decode()
    assert "tinyserve:num_requests_waiting 0.0" in body.decode()
    tiny_request_works(server.base_url)
