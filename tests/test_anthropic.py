"""Anthropic's Messages API end to end: a real `tinyserve` process (demo model, qwen3 + qwen3_coder parsers) and the
real `anthropic` client.

The demo model's text is gibberish: these tests check shapes and plumbing (blocks, stop reasons, usage, streaming
events, errors, auth), with temperature 0 where outputs are compared.
"""
from __future__ import annotations

import json
from typing import Any

import pytest

from server_util import ServerProcess, free_port, http, lazy_import, server_config
anthropic = lazy_import("anthropic")

PARSERS = {"parsers": {"reasoning": "qwen3", "tool_call": "qwen3_coder"}}
API_KEY = "anthropic-test-key"
WEATHER_TOOL = {"name": "get_weather", "description": "Current weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"},
                                                                  "days": {"type": "integer"}},
                                 "required": ["city"]}}
USER = [{"role": "user", "content": "Hello! How are you?"}]
LONG_SYSTEM = "You are a careful assistant. " * 40          # long enough for the prefix cache to keep snapshots


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("anthropic")
    proc = ServerProcess(folder, server_config(free_port(), {**PARSERS, "model": {"context_length": 2048}}),
                         env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _sampling(kw: dict[str, Any]) -> dict[str, Any]:
    """This client version has no temperature / top_p / top_k arguments: they go in the body as extra fields."""
    extra = {k: kw.pop(k) for k in ("temperature", "top_p", "top_k") if k in kw}
    if extra:
        kw["extra_body"] = {**kw.get("extra_body", {}), **extra}
    return kw


def create(client: anthropic.Anthropic, messages: list[dict] = USER, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 8)
    return client.messages.create(model="tinyserve", messages=messages, **_sampling(kw))


def stream(client: anthropic.Anthropic, messages: list[dict] = USER, **kw: Any) -> Any:
    return client.messages.stream(model="tinyserve", messages=messages, **_sampling(kw))


def count(client: anthropic.Anthropic, messages: list[dict] = USER, **kw: Any) -> int:
    return client.messages.count_tokens(model="tinyserve", messages=messages, **kw).input_tokens


def assert_healthy(server: ServerProcess) -> None:
    assert http("GET", server.base_url + "/health")[0] == 200


# ---------------------------------------------------------------------------------------------------------------

def test_create_shape_and_usage(client):
    r = create(client, temperature=0)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_") and r.model == "tinyserve"
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert all(b.type in ("thinking", "text") for b in r.content)
    for b in r.content:
        if b.type == "thinking":
            assert b.signature == ""
    u = r.usage
    assert 1 <= u.output_tokens <= 8 and u.cache_creation_input_tokens == 0
    assert u.input_tokens + u.cache_read_input_tokens == count(client)


def test_stream_assembles_the_non_streamed_message(client):
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        kw: dict[str, Any] = dict(max_tokens=24, temperature=0, thinking=thinking, system="Be brief.")
        whole = create(client, **kw)
        with stream(client, **kw) as s:
            events = [e.type for e in s]
            final = s.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
        assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
        assert final.usage.output_tokens == whole.usage.output_tokens
        assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
                == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_raw_event_sequence(server):
    """The wire format: `event:` lines, message_start then ping, balanced block start/stop, message_delta, stop."""
    status, headers, body = http("POST", server.base_url + "/v1/messages", {
        "model": "tinyserve", "messages": USER, "max_tokens": 6, "stream": True, "temperature": 0})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    frames = [f for f in body.decode().split("\n\n") if f.strip()]
    names = []
    for f in frames:
        event_line, data_line = f.split("\n")
        name = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == name
        names.append(name)
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop")
    delta = json.loads(frames[-2].split("\n")[1].removeprefix("data: "))
    assert delta["delta"]["stop_reason"] == "max_tokens" or delta["delta"]["stop_reason"] == "end_turn"
    assert 1 <= delta["usage"]["output_tokens"] <= 6


def test_system_string_and_blocks(client):
    as_string = count(client, system="Be brief.\nAnswer in English.")
    blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in English."}]
    assert count(client, system=blocks) == as_string           # blocks are joined like the chat route joins parts
    assert count(client) < as_string
    assert create(client, system=blocks, max_tokens=2).usage.output_tokens >= 1


def test_billing_header_is_dropped(client):
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=abc123;"},
              {"type": "text", "text": "Be brief."}]
    assert count(client, system=system) == count(client, system="Be brief.")


def test_thinking_switch_changes_the_prompt(client):
    on = count(client, thinking={"type": "enabled", "budget_tokens": 2048})
    off = count(client, thinking={"type": "disabled"})
    assert on != off
    assert count(client) == on                                 # absent: the template's default (thinking)


def test_tools_and_a_tool_round_trip(client):
    plain = count(client)
    with_tools = count(client, tools=[WEATHER_TOOL])
    assert with_tools > plain
    assert count(client, tools=[WEATHER_TOOL], tool_choice={"type": "none"}) == plain   # none: nothing offered
    r = create(client, tools=[WEATHER_TOOL], tool_choice={"type": "auto"})
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "sig"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": '{"temperature": 20}'},
            {"type": "tool_result", "tool_use_id": "toolu_02", "content": [{"type": "text", "text": "x"}],
             "is_error": True},
            {"type": "text", "text": "Thanks"}]}]
    base = count(client, history[:1], tools=[WEATHER_TOOL])
    full = count(client, history, tools=[WEATHER_TOOL])
    assert full > base
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        r = create(client, history, tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=4)
        assert r.type == "message" and r.usage.output_tokens >= 1


def test_tool_use_response_blocks():
    """A parsed call becomes a typed tool_use block (the random model will not write one: unit-level check)."""
    from tinyserve.anthropic import MessagesStream, message_body, parse_messages_request
    from tinyserve.chat import ChatFormat
    from tinyserve.generation import Choice, Meta, Piece, Usage
    chat = ChatFormat("qwen3", "qwen3_coder")
    req = parse_messages_request({"messages": USER, "max_tokens": 64, "tools": [WEATHER_TOOL]})
    req.chat.starts_in_reasoning = False
    text = ("<think>\nhmm\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    meta = Meta("msg_1", 0, "tinyserve", [[1, 2, 3]], str, lambda t: str(t).encode())
    body = message_body(chat, req, meta, Choice(0, text=text), Usage(3, 20, cached_tokens=1))
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    call = body["content"][2]
    assert call["id"].startswith("toolu_") and call["input"] == {"city": "Paris", "days": 3}
    assert body["stop_reason"] == "tool_use"
    assert body["usage"] == {"input_tokens": 2, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1,
                             "output_tokens": 20}
    # The stream gives the same blocks: feed the text in small pieces and assemble the events.
    out = MessagesStream(chat, req, meta)
    events = []
    for k in range(0, len(text), 7):
        events += out.piece(Piece(0, text[k:k + 7], [], []))
    events += out.piece(Piece(0, "", [], [], "stop")) + out.end(Usage(3, 20, cached_tokens=1))
    blocks: list[dict] = []
    for e in events:
        if e["type"] == "content_block_start":
            blocks.append(dict(e["content_block"], _json=""))
        elif e["type"] == "content_block_delta":
            d, b = e["delta"], blocks[e["index"]]
            if d["type"] == "input_json_delta":
                b["_json"] += d["partial_json"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}[d["type"]]
                b[key] += d[key]
                b["signed"] = d["type"] == "signature_delta"   # the last delta of a thinking block signs it
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["signed"] and "signed" not in blocks[2]
    assert blocks[0]["thinking"] == "hmm" and blocks[1]["text"] == "Checking."
    assert json.loads(blocks[2]["_json"]) == {"city": "Paris", "days": 3}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_replayed_thinking_is_accepted(client):
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "The user greets me.", "signature": "abc"},
                   {"type": "redacted_thinking", "data": "opaque"},
                   {"type": "text", "text": "Hello!"}]},
               {"role": "user", "content": "How are you?"}]
    r = create(client, history, max_tokens=2)
    assert r.usage.output_tokens >= 1
    # Thinking of turns before the last user query is dropped by the template (as Qwen3's does).
    plain = [history[0], {"role": "assistant", "content": "Hello!"}, history[2]]
    assert count(client, history) == count(client, plain)


def test_stop_sequence(client):
    kw = dict(max_tokens=20, temperature=0, thinking={"type": "disabled"})
    full = "".join(b.text for b in create(client, **kw).content if b.type == "text")
    assert len(full) >= 4, full
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = create(client, stop_sequences=[stop], **kw)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert "".join(b.text for b in r.content if b.type == "text") == full[:full.index(stop)]
    with stream(client, stop_sequences=[stop], **kw) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_max_tokens(client):
    r = create(client, max_tokens=3, temperature=0, thinking={"type": "disabled"})
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_second_turn_reads_the_prefix_cache(client):
    def system(h: str) -> list[dict]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.0; cch={h};"},
                {"type": "text", "text": LONG_SYSTEM}]

    turn1 = [{"role": "user", "content": "Tell me a story about a fox."}]
    r1 = create(client, turn1, system=system("aaaa"), max_tokens=4, temperature=0)
    reply = [{"type": b.type, "text": b.text} for b in r1.content if b.type == "text"] or "ok"
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
    r2 = create(client, turn2, system=system("bbbb"), max_tokens=4, temperature=0)
    assert r2.usage.cache_read_input_tokens > 0
    assert r2.usage.input_tokens + r2.usage.cache_read_input_tokens == count(client, turn2, system=system("cccc"))


BAD = [
    ("missing-max-tokens", {"messages": USER}, "max_tokens"),
    ("wrong-block-type", {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}],
                          "max_tokens": 4}, "messages[0].content[0].type"),
    ("bad-role", {"messages": [{"role": "tool", "content": "hi"}], "max_tokens": 4}, "messages[0].role"),
    ("image", {"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}], "max_tokens": 4},
     "messages[0].content[0]: this model takes no image input"),        # the demo model has no vision tower
    ("image-in-system", {"system": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                "data": "AAAA"}}],
                         "messages": USER, "max_tokens": 4}, "system[0]: System message cannot contain images."),
    ("tool-use-in-user-turn", {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], "max_tokens": 4}, "messages[0]"),
    ("bad-temperature", {"messages": USER, "max_tokens": 4, "temperature": "hot"}, "temperature"),
]


@pytest.mark.parametrize("body,words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests(server, client, body, words):
    with pytest.raises(anthropic.BadRequestError) as info:   # the raw post: the client checks required args
        client.post("/v1/messages", body={"model": "tinyserve", **body}, cast_to=object)
    err = info.value
    assert err.status_code == 400
    assert err.body["type"] == "error" and err.body["error"]["type"] == "invalid_request_error"
    assert words in err.body["error"]["message"]
    status, _, raw = http("POST", server.base_url + "/v1/messages", b"{not json")
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, _, raw = http("POST", server.base_url + "/v1/messages/nope", {})
    assert status == 404 and json.loads(raw) == {"type": "error", "error": {
        "type": "not_found_error", "message": "no route POST /v1/messages/nope"}}
    status, _, raw = http("POST", server.base_url + "/v1/chat/completions", {"messages": "x"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "messages"      # OpenAI's shape stays there
    assert_healthy(server)
    assert create(client, max_tokens=1).usage.output_tokens == 1


@pytest.mark.slow
def test_x_api_key(xdg, tmp_path):
    cfg = server_config(free_port(), {"server": {"api_key": API_KEY}})
    with ServerProcess(tmp_path, cfg, env={"XDG_CACHE_HOME": str(xdg)}) as srv:
        ok = anthropic.Anthropic(base_url=srv.base_url, api_key=API_KEY, max_retries=0)
        assert create(ok, max_tokens=1).usage.output_tokens == 1
        with pytest.raises(anthropic.AuthenticationError) as info:
            create(anthropic.Anthropic(base_url=srv.base_url, api_key="wrong", max_retries=0), max_tokens=1)
        assert info.value.body["error"]["type"] == "authentication_error"
        status, _, raw = http("POST", srv.base_url + "/v1/messages", {"messages": USER, "max_tokens": 1})
        assert status == 401 and json.loads(raw)["type"] == "error"
        # x-api-key works on the OpenAI routes too, Bearer on the Anthropic ones
        assert http("GET", srv.base_url + "/v1/models", headers={"x-api-key": API_KEY})[0] == 200
        status, _, raw = http("GET", srv.base_url + "/v1/models")
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
        assert http("POST", srv.base_url + "/v1/messages/count_tokens", {"messages": USER},
                    headers={"Authorization": f"Bearer {API_KEY}"})[0] == 200


@pytest.mark.slow
def test_max_tokens_past_the_context_is_cut_to_what_fits(client):
    """Claude Code sends max_tokens 32000 whatever the server: it stops at the end of the context (2048 here)."""
    long = [{"role": "user", "content": "Hello there! " * 300}]   # most of the context: a short generation
    count = client.messages.count_tokens(model="tinyserve", messages=long).input_tokens
    assert 1000 < count < 2000
    msg = client.messages.create(model="tinyserve", messages=long, max_tokens=100000,
                                 extra_body={"temperature": 0, "top_k": 1})
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert count + msg.usage.output_tokens <= 2048


# ---------------------------------------------------------------------------------------------------------------
# The request fields walked (llama.cpp tools/server/tests/unit/test_compat_anthropic.py checks signature_delta and
# the parameters; the anthropic SDK's messages.parse reads output_config.format)

def test_prefill_is_continued(server, client, xdg):
    """A last assistant message is a prefill: the prompt ends with its text (no end of turn, no new assistant turn)
    and the answer holds only what follows it, as on Anthropic's API."""
    from tinyserve.demo import ensure_demo_checkpoint
    from tinyserve.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_folder(ensure_demo_checkpoint())
    prefill = USER + [{"role": "assistant", "content": "The answer is"}]
    status, _, raw = http("POST", server.base_url + "/v1/chat/completions", {   # the same turn closed (OpenAI's)
        "messages": prefill, "max_tokens": 1, "return_token_ids": True})
    closed = json.loads(raw)["prompt_token_ids"]
    turn_end = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
    assert closed[-len(turn_end):] == turn_end
    assert count(client, prefill) == len(closed) - len(turn_end)
    r = create(client, prefill, max_tokens=6, temperature=0)
    text = "".join(b.text for b in r.content if b.type == "text")
    assert not text.startswith("The answer is")
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(closed) - len(turn_end)


def test_streamed_thinking_is_signed(client):
    """Each streamed thinking block ends with a signature_delta before its content_block_stop (the SDK's stream
    accumulates it); the prefill opens the think block, so the answer starts in it."""
    prefill = USER + [{"role": "assistant", "content": "<think>\nLet me"}]
    with stream(client, prefill, max_tokens=12, temperature=0) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].signature == ""
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events   # the wire's events
             if e.type in ("content_block_start", "content_block_delta", "content_block_stop")]
    signed = kinds.index(("content_block_delta", "signature_delta"))
    assert kinds[signed + 1][0] == "content_block_stop" and kinds[signed - 1] == ("content_block_delta",
                                                                                  "thinking_delta")


def test_output_config_format_constrains_the_text(client):
    """Structured outputs: output_config.format's schema constrains the text, so the SDK's messages.parse gets a
    valid object even from the random demo model. Greedy (the SDK's parse takes no temperature): sampled at
    Anthropic's default temperature 1, the random model's integer can run on past max_tokens."""
    from pydantic import BaseModel

    class Answer(BaseModel):
        ok: bool
        level: int

    r = client.messages.parse(model="tinyserve", max_tokens=48, messages=USER, output_format=Answer,
                              thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert isinstance(r.parsed_output, Answer)
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    r = create(client, max_tokens=32, temperature=0, thinking={"type": "disabled"},
               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(r.content[-1].text)["city"] in ("Paris", "Rome")


FIELDS = [
    ("container", {"container": "c"}, "container"),
    ("mcp-servers", {"mcp_servers": [{"type": "url", "url": "http://x"}]}, "mcp_servers"),
    ("output-format-type", {"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
    ("effort", {"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ("metadata-type", {"metadata": "x"}, "metadata"),
    ("any-without-tools", {"tool_choice": {"type": "any"}}, "tool_choice"),
    ("prefill-empty", {"messages": USER + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "x", "signature": ""}]}]}, "cannot be continued"),
]


@pytest.mark.parametrize("body,words", [f[1:] for f in FIELDS], ids=[f[0] for f in FIELDS])
def test_fields_refused_by_name(client, body, words):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body={"model": "tinyserve", "messages": USER, "max_tokens": 2, **body},
                    cast_to=object)
    assert words in info.value.body["error"]["message"]


def test_fields_clients_may_send(client):
    """metadata, service_tier, cache_control, output_config.effort and disable_parallel_tool_use are accepted
    (docs/api.md says what each does here)."""
    r = create(client, max_tokens=2, metadata={"user_id": "u"}, service_tier="auto",
               extra_body={"cache_control": {"type": "ephemeral"}, "output_config": {"effort": "low"}},
               tools=[WEATHER_TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert r.usage.output_tokens >= 1
