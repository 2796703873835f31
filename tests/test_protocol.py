"""The OpenAI endpoints (tinyserve.openai_api) and the shared layer (tinyserve.protocol) without a server: request
parsing (each error names its field), the engine-error mapping, response bodies and stream chunks."""
from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest

from tinyserve.chat import ChatFormat
from tinyserve.config import Config
from tinyserve.generation import Choice, Meta, Piece, Usage
from tinyserve.openai_api import (chat_events, completion_body, completion_events, completion_prompts,
                                  parse_chat_request, parse_completion_request)
from tinyserve.protocol import SSE_DONE, APIError, Fields
from tinyserve.request import Intake, RequestError
from tinyserve.tokenizer import Tokenizer

USER = [{"role": "user", "content": "x"}]


def chat_error(body: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as e:
        parse_chat_request(body, "tinyserve")
    return e.value


CHAT_ERRORS = [
    # id, body, status, param
    ("messages-missing", {}, 400, "messages"),
    ("messages-empty", {"messages": []}, 400, "messages"),
    ("message-not-object", {"messages": ["hi"]}, 400, "messages[0]"),
    ("role-unknown", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content-missing", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("content-number", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("content-image-no-scheme", {"messages": USER + [{"role": "user", "content": [   # test_image_api.py has the rest
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[1].content[1]"),
    ("content-audio", {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, 400,
     "messages[0].content[0]"),
    ("tool-call-bad-json", {"messages": USER + [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{x"}}]}]}, 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("tool-call-no-name", {"messages": USER + [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, 400,
     "messages[1].tool_calls[0]"),
    ("name-number", {"messages": [{"role": "user", "content": "x", "name": 3}]}, 400, "messages[0].name"),
    ("string-temperature", {"messages": USER, "temperature": "hot"}, 400, "temperature"),
    ("nan-top-p", {"messages": USER, "top_p": float("nan")}, 400, "top_p"),
    ("bool-top-k", {"messages": USER, "top_k": True}, 400, "top_k"),
    ("string-max-tokens", {"messages": USER, "max_tokens": "ten"}, 400, "max_tokens"),
    ("float-max-completion-tokens", {"messages": USER, "max_completion_tokens": 1.5}, 400, "max_completion_tokens"),
    ("seed-past-64-bits", {"messages": USER, "seed": 2 ** 64}, 400, "seed"),
    ("n-nine", {"messages": USER, "n": 9}, 400, "n"),
    ("stop-number", {"messages": USER, "stop": 5}, 400, "stop"),
    ("stop-too-many", {"messages": USER, "stop": ["a"] * 17}, 400, "stop"),
    ("stop-token-string", {"messages": USER, "stop_token_ids": ["a"]}, 400, "stop_token_ids"),
    ("stream-string", {"messages": USER, "stream": "yes"}, 400, "stream"),
    ("stream-options-list", {"messages": USER, "stream_options": []}, 400, "stream_options"),
    ("include-usage-string", {"messages": USER, "stream": True, "stream_options": {"include_usage": 1}}, 400,
     "include_usage"),
    ("top-logprobs-alone", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top-logprobs-21", {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("tools-not-list", {"messages": USER, "tools": {}}, 400, "tools"),
    ("tool-no-name", {"messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]}, 400,
     "tools[0].function.name"),
    ("tool-choice-unknown", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
                             "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("template-kwargs-reserved", {"messages": USER, "chat_template_kwargs": {"tools": []}}, 400,
     "chat_template_kwargs"),
    ("response-format-type", {"messages": USER, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("response-format-no-schema", {"messages": USER, "response_format": {"type": "json_schema",
                                                                         "json_schema": {"name": "x"}}}, 400,
     "response_format.json_schema.schema"),
    ("response-format-strict", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}}, 400,
     "response_format.json_schema.strict"),
    ("model-unknown", {"messages": USER, "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("case", CHAT_ERRORS, ids=[c[0] for c in CHAT_ERRORS])
def test_chat_parse_errors_name_the_field(case):
    _, body, status, param = case
    err = chat_error(body)
    assert (err.status, err.param) == (status, param)
    assert err.message and err.type


COMPLETION_ERRORS = [
    ("logprobs-6", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("echo-string", {"prompt": "x", "echo": "yes"}, "echo"),
    ("best-of", {"prompt": "x", "best_of": 2}, "best_of"),
    ("suffix", {"prompt": "x", "suffix": "y"}, "suffix"),
]


@pytest.mark.parametrize("case", COMPLETION_ERRORS, ids=[c[0] for c in COMPLETION_ERRORS])
def test_completion_parse_errors_name_the_field(case):
    _, body, param = case
    with pytest.raises(APIError) as e:
        parse_completion_request(body, "tinyserve")
    assert (e.value.status, e.value.param) == (400, param)


# the prompt is read where it is encoded (completion_prompts, on a worker thread)
PROMPT_ERRORS = [
    ("prompt-missing", {}, "prompt"),
    ("prompt-empty-string", {"prompt": ""}, "prompt"),
    ("prompt-batch-empty-entry", {"prompt": ["a", ""]}, "prompt[1]"),
    ("prompt-batch-mixed-ids", {"prompt": [[1, 2], [3, "x"]]}, "prompt[1]"),
    ("prompt-empty-ids", {"prompt": []}, "prompt"),
    ("prompt-bool-id", {"prompt": [True]}, "prompt"),
    ("prompt-not-text-or-ids", {"prompt": {"text": "a"}}, "prompt"),
]


@pytest.fixture(scope="module")
def tokenizer():
    from tinyserve.demo import ensure_demo_checkpoint
    return Tokenizer.from_folder(ensure_demo_checkpoint())


@pytest.mark.parametrize("case", PROMPT_ERRORS, ids=[c[0] for c in PROMPT_ERRORS])
def test_completion_prompt_errors_name_the_prompt(case, tokenizer):
    _, body, param = case
    req = parse_completion_request(body, "tinyserve")
    with pytest.raises(APIError) as e:
        completion_prompts(req, tokenizer)
    assert (e.value.status, e.value.param) == (400, param)


def test_completion_prompts_are_each_prompts_ids(tokenizer):
    req = parse_completion_request({"prompt": ["ab", [5, 6]], "echo": True}, "tinyserve")
    assert completion_prompts(req, tokenizer) == [tokenizer.encode("ab"), [5, 6]]
    assert req.echo_texts == ["ab", tokenizer.decode([5, 6], skip_special_tokens=False)]
    assert completion_prompts(parse_completion_request({"prompt": [7, 8]}, "tinyserve"), tokenizer) == [[7, 8]]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOL = {"type": "function", "function": {"name": "weather", "description": "d", "parameters": SCHEMA}}
MESSAGES_TOOL = {"name": "weather", "description": "d", "input_schema": SCHEMA}
RESPONSES_TOOL = {"type": "function", "name": "weather", "description": "d", "parameters": SCHEMA}


def parse_tools(protocol: str, tools: Any, tool_choice: Any = None) -> Any:
    """The chat request each protocol's parser builds from these tools (and tool_choice)."""
    from tinyserve.anthropic import parse_messages_request
    from tinyserve.responses import parse_responses_request
    body = {"tools": tools, **({"tool_choice": tool_choice} if tool_choice is not None else {})}
    if protocol == "chat":
        return parse_chat_request({"messages": USER, **body}, "tinyserve")
    if protocol == "messages":
        return parse_messages_request({"messages": USER, "max_tokens": 4, **body}).chat
    return parse_responses_request({"input": "x", **body}).chat


def test_every_protocol_maps_its_tools_onto_one_function_tool():
    """The same tool and named tool_choice in each protocol's shape reach the template and the parsers as one OpenAI
    function tool (chat's as it was sent)."""
    chat = parse_tools("chat", [CHAT_TOOL], {"type": "function", "function": {"name": "weather"}})
    messages = parse_tools("messages", [MESSAGES_TOOL], {"type": "tool", "name": "weather"})
    responses = parse_tools("responses", [RESPONSES_TOOL], {"type": "function", "name": "weather"})
    assert chat.tools == messages.tools == responses.tools == [CHAT_TOOL]
    named = {"type": "function", "function": {"name": "weather"}}
    assert chat.tool_choice == messages.tool_choice == responses.tool_choice == named


TOOL_ERRORS = [
    # protocol, tools, tool_choice, the field the 400 names
    ("chat", "x", None, "tools"),
    ("chat", [3], None, "tools[0]"),
    ("chat", [{"type": "function", "function": {"parameters": SCHEMA}}], None, "tools[0].function.name"),
    ("chat", [{"type": "function", "function": {"name": "f", "parameters": 3}}], None, "tools[0].function.parameters"),
    ("chat", [CHAT_TOOL], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ("messages", "x", None, "tools"),
    ("messages", [3], None, "tools[0]"),
    ("messages", [{"input_schema": SCHEMA}], None, "tools[0].name"),
    ("messages", [{"name": "f"}], None, "tools[0].input_schema"),
    ("messages", [MESSAGES_TOOL], {"type": "tool", "name": "nope"}, "tool_choice.name"),
    ("responses", "x", None, "tools"),
    ("responses", [3], None, "tools[0]"),
    ("responses", [{"type": "function", "parameters": SCHEMA}], None, "tools[0].name"),
    ("responses", [{"type": "function", "name": "f", "parameters": 3}], None, "tools[0].parameters"),
    ("responses", [RESPONSES_TOOL], {"type": "function", "name": "nope"}, "tool_choice"),
]


@pytest.mark.parametrize("case", TOOL_ERRORS, ids=[f"{c[0]}-{c[3]}" for c in TOOL_ERRORS])
def test_tool_errors_name_each_protocols_field(case):
    protocol, tools, tool_choice, param = case
    with pytest.raises(APIError) as e:
        parse_tools(protocol, tools, tool_choice)
    assert e.value.status == 400 and e.value.param == param and param.split(".")[0] in e.value.message


def test_ranges_are_the_engines():
    """Types are checked while parsing; ranges (sampling parameters, ids in the vocabulary) reach the engine, whose
    RequestError names the field."""
    req = parse_chat_request({"messages": USER, "temperature": -1, "top_p": 0, "min_tokens": -3, "max_tokens": 0,
                              "stop_token_ids": [10 ** 9]}, "tinyserve")
    p = req.options.params
    assert (p.temperature, p.top_p, p.min_tokens, p.max_tokens) == (-1.0, 0.0, -3, 0)
    assert p.stop_token_ids == [10 ** 9]
    assert completion_prompts(parse_completion_request({"prompt": [-1, 10 ** 9]}, "tinyserve"), None) == [[-1, 10 ** 9]]


def test_engine_error_fields_map_to_what_the_client_sent():
    newer = parse_chat_request({"messages": USER, "max_completion_tokens": 5}, "tinyserve")
    older = parse_chat_request({"messages": USER, "max_tokens": 5}, "tinyserve")
    assert Fields("messages", newer.options.max_tokens_field).of("max_tokens") == "max_completion_tokens"
    chat = Fields("messages", older.options.max_tokens_field)
    assert chat.of("max_tokens") == "max_tokens" and chat.of("prompt") == "messages"
    assert chat.of("temperature") == "temperature"
    assert chat.of("messages[0].content[1]") == "messages[0].content[1]"                 # an image: its part
    assert Fields("prompt").of("prompt") == "prompt"
    assert Fields("input", renamed={"response_format": "text.format"}).of("response_format") == "text.format"


def test_min_tokens_after_fit():
    """min_tokens is cut to a max_tokens the engine chose, never to one the client chose (that is an error)."""
    intake = Intake(Config(), context_length=24, kv_tokens=64, vocab_size=100)
    free = parse_chat_request({"messages": USER, "min_tokens": 50}, "tinyserve").options
    req = intake.make_request([1, 2, 3, 4], free.params)
    assert (req.params.max_tokens, req.params.min_tokens) == (20, 20)
    fixed = parse_chat_request({"messages": USER, "min_tokens": 50, "max_tokens": 20}, "tinyserve").options
    with pytest.raises(RequestError, match="min_tokens"):
        intake.make_request([1, 2, 3, 4], fixed.params)


class _Event:
    def __init__(self, token_id: int, logprob: float = -0.5) -> None:
        self.token_id, self.logprob, self.top_logprobs = token_id, logprob, [(token_id, logprob)]


META = Meta("cmpl-1", 123, "tinyserve", [[1, 2, 3]], lambda t: f"<{t}>", lambda t: f"<{t}>".encode())


def frames(events) -> tuple[list[dict], bytes]:
    """A stream writer's SSE frames, run over its pieces: (the events as JSON, the last frame)."""
    async def run() -> list[bytes]:
        return [f async for f in events]
    raw = asyncio.run(run())
    return [json.loads(f[len(b"data: "):]) for f in raw if f != SSE_DONE], raw[-1]


async def pieces(*items: Piece):
    for item in items:
        yield item


def test_completion_body_and_stream():
    req = parse_completion_request({"prompt": [1, 2, 3], "logprobs": 1, "n": 2, "return_token_ids": True,
                                    "stream": True, "stream_options": {"include_usage": True}}, "tinyserve")
    usage = Usage(3, 2, cached_tokens=1, cached_tokens_by_tier={"device": 1})
    choices = [Choice(0, "ab", [7, 8], [_Event(7), _Event(8)], "length"), Choice(1, "", [], [], "stop")]
    body = completion_body(req, META, choices, usage)
    assert body["object"] == "text_completion" and body["prompt_token_ids"] == [1, 2, 3]
    assert body["choices"][0]["token_ids"] == [7, 8] and body["choices"][0]["logprobs"]["text_offset"] == [0, 3]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "prompt_tokens_details":
                             {"cached_tokens": 1, "cached_tokens_by_tier": {"device": 1}}}
    meta = replace(META, usage=lambda: Usage(3, 1))
    (a, b, last), end = frames(completion_events(req, meta, pieces(Piece(0, "<7>", [7], [_Event(7)]),
                                                                     Piece(0, "", [], [], "length"))))
    assert a["choices"][0]["logprobs"]["text_offset"] == [0] and b["choices"][0]["finish_reason"] == "length"
    assert last["choices"] == [] and "prompt_tokens_details" not in last["usage"]
    assert end == b"data: [DONE]\n\n"


def test_chat_stream_chunks():
    req = parse_chat_request({"messages": USER, "n": 2, "logprobs": True}, "tinyserve")
    meta = replace(META, usage=lambda: pytest.fail("usage made for a stream that does not send it"))        # no include_usage
    events, end = frames(chat_events(ChatFormat(), req, meta, pieces(Piece(1, "hi", [5], [_Event(5)]),
                                                                      Piece(1, "", [], [], "stop"))))
    *roles, piece, fin = events
    assert [c["choices"][0]["delta"] for c in roles] == [{"role": "assistant", "content": ""}] * 2
    assert piece["object"] == "chat.completion.chunk" and piece["choices"][0]["delta"] == {"content": "hi"}
    assert piece["choices"][0]["logprobs"]["content"][0]["token"] == "<5>"
    assert fin["choices"][0] == {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert end == SSE_DONE


# ---------------------------------------------------------------------------------------------------------------
# Request bodies (protocol.parse_body, json_body.py)

def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@pytest.mark.parametrize("chunk", [1 << 20, 7, 2, 1])
def test_json_depth_is_the_parsed_nesting(monkeypatch, chunk):
    """The byte scan's depth equals the nesting of what json parses, whatever the strings hold (brackets, quotes,
    runs of backslashes) and wherever a chunk boundary falls (the scan carries its state across them)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tinyserve import json_body
    monkeypatch.setattr(json_body, "_DEPTH_CHUNK", chunk)
    tricky = st.sampled_from(['a[{"', '\\\\', '\\\\\\"]', "}{[", "", "\\\\\\\\", '"'])
    values = st.recursive(st.none() | st.integers() | st.text(max_size=4) | tricky,
                          lambda kids: st.lists(kids, max_size=3) | st.dictionaries(tricky | st.text(max_size=3),
                                                                                    kids, max_size=3),
                          max_leaves=20)

    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(values)
    def check(value: Any) -> None:
        assert json_body.json_depth(json.dumps(value).encode()) == _depth(value)

    check()


def test_json_bodies_refused_with_a_reason():
    from tinyserve.json_body import MAX_JSON_DEPTH
    from tinyserve.protocol import APIError, parse_body
    deep = b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"
    for raw, words in [(deep, "nested 65 levels"), (b"[" * 5000 + b"]" * 5000, "nested 5000 levels"),
                       (b'{"a": "\\ud800"}', "Unicode"), (b'{"a": ' + b"7" * 5000 + b"}", "not valid JSON"),
                       (b"\xff{}", "not valid"), (b"[1]", "JSON object"), (b"", "not valid JSON")]:
        with pytest.raises(APIError) as e:
            parse_body(raw)
        assert e.value.status == 400 and words in str(e.value), (raw[:20], str(e.value))
    ok = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b', "b": "\\ud83d\\ude80 [[["}'
    assert parse_body(ok)["b"] == "\U0001F680 [[["


def test_completion_logprob_tokens_join_into_the_text():
    """A character split across tokens: the first adds "" and the one that completes it the character, so the
    tokens join into the text (vLLM's test_some_logprobs); each top-n key keeps the token's own spelling; a character
    left open at the end is U+FFFD, as in the text."""
    from tinyserve.openai_api import TextOffsets, completion_logprobs
    pieces = [b"ok ", "天".encode()[:1], "天".encode()[1:], b"!", "気".encode()[:2]]
    text = lambda i: pieces[i].decode("utf-8", "replace") if len(pieces[i]) != 1 or pieces[i] < b"\x80" \
        else "bytes:" + "".join(f"\\x{b:02x}" for b in pieces[i])                           # noqa: E731
    meta = Meta("cmpl-1", 0, "m", [[0]], text, lambda i: pieces[i])
    out = completion_logprobs(meta, [(i, -0.5, [(i, -0.5)]) for i in range(5)], TextOffsets())
    assert out["tokens"] == ["ok ", "", "天", "!", "\ufffd"]
    assert "".join(out["tokens"]) == b"".join(pieces).decode("utf-8", "replace")
    assert out["text_offset"] == [0, 3, 3, 4, 5]
    assert list(out["top_logprobs"][1]) == ["bytes:\\xe5"]
    streamed, offsets = [], TextOffsets()                  # chunk by chunk, the last one ends the choice
    for k in range(0, 5, 2):
        streamed += completion_logprobs(meta, [(i, -0.5, None) for i in range(k, min(k + 2, 5))], offsets,
                                        final=k + 2 >= 5)["tokens"]
    assert streamed == out["tokens"]
