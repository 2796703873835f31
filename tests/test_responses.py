"""OpenAI's Responses API end to end: a real `tinyserve` process (demo model, qwen3 + qwen3_coder parsers) and the
real `openai` client; the parsed-output paths the random model will not reach (reasoning and function_call items)
are checked on the module directly.

The demo model's text is gibberish: these tests check shapes and plumbing (items, status, usage, streaming events,
errors), with temperature 0 where outputs are compared.
"""
from __future__ import annotations

import json
from typing import Any

import pytest

from server_util import ServerProcess, free_port, http, lazy_import, server_config
openai = lazy_import("openai")

PARSERS = {"parsers": {"reasoning": "qwen3", "tool_call": "qwen3_coder"}}
SHELL_TOOL = {"type": "function", "name": "shell", "description": "Run a shell command",
              "parameters": {"type": "object", "properties": {"command": {"type": "array",
                                                                          "items": {"type": "string"}},
                                                              "timeout": {"type": "integer"}},
                             "required": ["command"]}}
LONG_INSTRUCTIONS = "You are a careful coding agent. " * 40       # long enough for the prefix cache to keep snapshots


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("responses")
    proc = ServerProcess(folder, server_config(free_port(), {**PARSERS, "model": {"context_length": 2048}}),
                         env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def create(client: openai.OpenAI, input: Any = "Hello! How are you?", **kw: Any) -> Any:
    kw.setdefault("max_output_tokens", 8)
    kw.setdefault("store", False)
    return client.responses.create(model="gpt-5-codex", input=input, **kw)


def assert_healthy(server: ServerProcess) -> None:
    assert http("GET", server.base_url + "/health")[0] == 200


def comparable(response: Any) -> dict[str, Any]:
    """The response without what differs between two calls: ids, the creation time and the cached part of the
    prompt (the second call reads what the first wrote); `parsed` is the stream helper's own (None here)."""
    body = response.model_dump()
    body.pop("id"), body.pop("created_at")
    body["usage"]["input_tokens_details"].pop("cached_tokens")
    for item in body["output"]:
        item.pop("id")
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return body


# ---------------------------------------------------------------------------------------------------------------

def test_create_with_a_string(client):
    r = create(client, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tinyserve"
    assert r.status in ("completed", "incomplete") and r.error is None
    assert all(item.type in ("reasoning", "message") for item in r.output)
    for item in r.output:
        if item.type == "reasoning":
            assert item.id.startswith("rs_") and item.summary == [] and item.content[0].type == "reasoning_text"
        else:
            assert item.id.startswith("msg_") and item.role == "assistant"
            assert [c.type for c in item.content] == ["output_text"] and item.content[0].annotations == []
    assert r.output_text == "".join(c.text for i in r.output if i.type == "message" for c in i.content)
    u = r.usage
    assert 1 <= u.output_tokens <= 8 and u.total_tokens == u.input_tokens + u.output_tokens
    assert 0 <= u.output_tokens_details.reasoning_tokens <= u.output_tokens
    assert 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    assert r.store is False and r.previous_response_id is None and r.tools == [] and r.tool_choice == "auto"


def test_message_items_and_instructions(client):
    plain = create(client, max_output_tokens=1).usage.input_tokens
    items = [{"role": "user", "content": "Hello! How are you?"}]
    assert create(client, items, max_output_tokens=1).usage.input_tokens == plain     # a string is one user message
    parts = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"},
                                                              {"type": "input_text", "text": "How are you?"}]}]
    r = create(client, parts, instructions="Be brief.", max_output_tokens=2)
    assert r.usage.input_tokens > plain and r.instructions == "Be brief."
    # instructions and leading developer messages make one system message
    dev = [{"role": "developer", "content": "Answer in English."}, *items]
    merged = create(client, dev, instructions="Be brief.", max_output_tokens=1).usage.input_tokens
    one = create(client, [{"role": "system", "content": "Be brief.\n\nAnswer in English."}, *items],
                 max_output_tokens=1).usage.input_tokens
    assert merged == one


def test_stream_equals_the_non_streamed_response(client):
    for effort in ("none", "medium"):
        kw: dict[str, Any] = dict(max_output_tokens=24, temperature=0, instructions="Be brief.",
                                  reasoning={"effort": effort}, metadata={"k": "v"})
        whole = create(client, **kw)
        with client.responses.stream(model="codex", input="Hello! How are you?", store=False, **kw) as s:
            events = [e for e in s]
            final = s.get_final_response()
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert types.count("response.output_item.added") == types.count("response.output_item.done") \
            == len(final.output)
        assert final.id == events[0].response.id
        assert comparable(final) == comparable(whole)
        assert final.output_text == whole.output_text
    with client.responses.create(model="codex", input="Hi", stream=True, max_output_tokens=4) as raw:
        assert [e.type for e in raw][-1] == "response.completed"


def test_raw_event_sequence(server):
    """The wire format: `event:` lines whose name is the data's type; text deltas add up to the done text."""
    status, headers, body = http("POST", server.base_url + "/v1/responses", {
        "model": "codex", "input": "Hi", "max_output_tokens": 6, "stream": True, "temperature": 0,
        "reasoning": {"effort": "none"}})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = []
    for frame in (f for f in body.decode().split("\n\n") if f.strip()):
        event_line, data_line = frame.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == event_line.removeprefix("event: ")
        events.append(data)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = [e for e in events if e["type"] == "response.output_text.done"]
    assert len(done) == 1 and done[0]["text"] == text and text
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["output"][-1]["content"][0]["text"] == text


def test_codex_style_history_with_tools(client):
    history = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Run ls."}],
         "encrypted_content": None},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
         "arguments": json.dumps({"command": ["ls"]})},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsetup.py"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two files."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. Now count them."}]},
    ]
    r = create(client, history, tools=[SHELL_TOOL], tool_choice="auto", parallel_tool_calls=False,
               instructions="You are Codex.", max_output_tokens=4)
    assert r.usage.output_tokens >= 1
    assert r.tools[0].name == "shell" and r.parallel_tool_calls is False
    without = create(client, history[:1], tools=[SHELL_TOOL], instructions="You are Codex.", max_output_tokens=1)
    assert r.usage.input_tokens > without.usage.input_tokens
    for choice in ("required", "none", {"type": "function", "name": "shell"}):
        assert create(client, history, tools=[SHELL_TOOL], tool_choice=choice, max_output_tokens=1).usage
    assert create(client, max_output_tokens=1, tools=[SHELL_TOOL]).usage.input_tokens \
        > create(client, max_output_tokens=1).usage.input_tokens


def test_reasoning_effort_none_changes_the_prompt(client):
    on = create(client, reasoning={"effort": "high"}, max_output_tokens=1).usage.input_tokens
    off = create(client, reasoning={"effort": "none"}, max_output_tokens=1).usage.input_tokens
    assert on != off
    assert create(client, max_output_tokens=1).usage.input_tokens == on     # absent: the template's default


def test_max_output_tokens_gives_incomplete(client):
    r = create(client, max_output_tokens=3, temperature=0, reasoning={"effort": "none"})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.max_output_tokens == 3
    assert r.output[-1].status == "incomplete"
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_second_turn_reads_the_prefix_cache(client):
    turn1 = [{"role": "user", "content": "Tell me a story about a fox."}]
    r1 = create(client, turn1, instructions=LONG_INSTRUCTIONS, max_output_tokens=4, temperature=0)
    turn2 = turn1 + [item.model_dump(exclude_none=True) for item in r1.output] + [
        {"role": "user", "content": "And then?"}]
    r2 = create(client, turn2, instructions=LONG_INSTRUCTIONS, max_output_tokens=4, temperature=0)
    assert r2.usage.input_tokens_details.cached_tokens > 0
    assert r2.usage.input_tokens > r1.usage.input_tokens


def test_text_formats_are_accepted(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    r = create(client, text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
               max_output_tokens=2)
    assert r.text.format.type == "json_schema" and r.usage.output_tokens >= 1   # accepted; not enforced yet
    assert create(client, text={"format": {"type": "json_object"}}, max_output_tokens=1).text.format.type \
        == "json_object"


@pytest.mark.parametrize("body,param", [({"previous_response_id": "resp_123"}, "previous_response_id"),
                                        ({"conversation": "conv_123"}, "conversation"),
                                        ({"store": "yes"}, "store")],
                         ids=["previous_response_id", "conversation", "store-not-a-boolean"])
def test_stateless(server, client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body={"model": "codex", "input": "Hi", **body}, cast_to=object)
    err = info.value.body
    assert err["param"] == param
    if param != "store":
        assert "stateless" in err["message"] and "whole conversation" in err["message"]
    assert_healthy(server)


@pytest.mark.parametrize("stream", [False, True])
def test_store_true_is_served_and_answered_with_store_false(client, stream):
    """OpenAI's default, which SMG writes into every Responses body it passes on: served, and the response says it
    was not kept (docs/api.md)."""
    if stream:
        with client.responses.stream(model="codex", input="Hi", store=True, max_output_tokens=2) as s:
            r = s.get_final_response()
    else:
        r = create(client, "Hi", store=True, max_output_tokens=2)
    assert r.store is False and r.usage.output_tokens >= 1


BAD = [
    ("missing-input", {}, "input"),
    ("bad-item-type", {"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
    ("bad-role", {"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ("bad-part", {"input": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
     "input[0].content[0].type"),
    ("image-not-a-data-url-of-an-image", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:,"}]}]}, "input[0].content[0]"),
    ("image-on-a-text-model", {"input": [{"role": "user", "content": [   # the demo model has no vision tower
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, "input[0].content[0]"),
    ("image-file-id", {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
     "input[0].content[0]"),
    ("tool-type-not-a-string", {"input": "Hi", "tools": [{"type": 5}]}, "tools[0].type"),
    ("bad-custom-format", {"input": "Hi", "tools": [{"type": "custom", "name": "apply_patch", "format": {
        "type": "grammar", "syntax": "ebnf", "definition": "start: x"}}]}, "tools[0].format"),
    ("custom-call-without-input", {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}]},
     "input[0].input"),
    ("hosted-tool-choice", {"input": "Hi", "tools": [{"type": "web_search"}], "tool_choice": {
        "type": "web_search"}}, "tool_choice"),
    ("bad-call-arguments", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     "input[0].arguments"),
    ("unknown-tool-choice", {"input": "Hi", "tools": [SHELL_TOOL], "tool_choice": {"type": "function",
                                                                                   "name": "nope"}}, "tool_choice"),
    ("bad-effort", {"input": "Hi", "reasoning": {"effort": "max"}}, "reasoning.effort"),
    ("bad-format", {"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ("bad-temperature", {"input": "Hi", "temperature": "hot"}, "temperature"),
    ("max-output-past-context", {"input": "Hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ("include-not-strings", {"input": "Hi", "include": [3]}, "include"),
    ("top-logprobs-21", {"input": "Hi", "top_logprobs": 21}, "top_logprobs"),
    ("background", {"input": "Hi", "background": True}, "background"),
    ("stored-prompt", {"input": "Hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ("stream-options-without-stream", {"input": "Hi", "stream_options": {"include_obfuscation": False}},
     "stream_options"),
    ("required-without-tools", {"input": "Hi", "tool_choice": "required"}, "tool_choice"),
]


@pytest.mark.parametrize("body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_requests(server, client, body, param):
    with pytest.raises(openai.BadRequestError) as info:      # the raw post: the client checks some arguments
        client.post("/responses", body={"model": "codex", **body}, cast_to=object)
    err = info.value
    assert err.status_code == 400 and err.body["type"] == "invalid_request_error"
    assert err.body["param"] == param, err.body
    assert_healthy(server)


def test_errors_keep_the_openai_shape(server, client):
    status, _, raw = http("POST", server.base_url + "/v1/responses", b"{not json")
    assert status == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    assert create(client, max_output_tokens=1).usage.output_tokens == 1


# ---------------------------------------------------------------------------------------------------------------
# The parsed paths, on the module (the random model writes neither a think block that closes nor a tool call)

def test_parsed_items_and_their_stream():
    from tinyserve.chat import ChatFormat
    from tinyserve.generation import Choice, Meta, Piece, Usage
    from tinyserve.responses import ResponsesStream, parse_responses_request, response_of
    chat = ChatFormat("qwen3", "qwen3_coder")
    req = parse_responses_request({"input": "List the files", "tools": [SHELL_TOOL]})
    req.chat.starts_in_reasoning = True
    text = ("I should run ls.\n</think>\n\nChecking.\n<tool_call>\n<function=shell>\n<parameter=command>\n[\"ls\"]\n"
            "</parameter>\n<parameter=timeout>\n5\n</parameter>\n</function>\n</tool_call>")
    chars = list(text)                                # one "token" per character: token_text is the identity
    meta = Meta("resp_1", 0, "tinyserve", [[1, 2, 3]], str, lambda t: str(t).encode())
    usage = Usage(3, len(chars), cached_tokens=1)
    body = response_of(chat, req, meta, Choice(0, text=text, token_ids=chars), usage)
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    reasoning, message, call = body["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "I should run ls."}]
    assert message["content"][0]["text"] == "Checking."
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_") and call["name"] == "shell"
    assert json.loads(call["arguments"]) == {"command": ["ls"], "timeout": 5}
    assert body["status"] == "completed" and body["incomplete_details"] is None
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 1},
                             "output_tokens": len(chars), "output_tokens_details": {
                                 "reasoning_tokens": text.index("</think>") + len("</think>")},
                             "total_tokens": 3 + len(chars)}
    # The stream gives the same items: feed the text in small pieces and assemble the events.
    out = ResponsesStream(chat, req, meta)
    events = out.start()
    for k in range(0, len(text), 7):
        events += out.piece(Piece(0, text[k:k + 7], chars[k:k + 7], []))
    events += out.piece(Piece(0, "", [], [], "stop")) + out.end(usage)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"

    def strip(items: list[dict]) -> list[dict]:
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

    assert strip(final["output"]) == strip(body["output"]) and final["usage"] == body["usage"]
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(args) == {"command": ["ls"], "timeout": 5}
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == "I should run ls."
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call"]


# Codex's namespace entry (codex 0.171): function tools the client runs, grouped under one name
AGENTS_NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent.", "strict": False,
     "parameters": {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]}},
    {"type": "function", "name": "wait_agent", "description": "Wait for one.", "strict": False,
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}]}


def test_namespace_tools_are_offered_and_called_under_their_names():
    """The functions of a namespace are in the prompt as NAMESPACE.NAME; a call comes back as a function_call item
    named as Codex declared it, with the namespace beside it, whole and streamed; a replayed call with a namespace
    renders as the model wrote it."""
    from tinyserve.chat import ChatFormat
    from tinyserve.generation import Choice, Meta, Piece, Usage
    from tinyserve.responses import ResponsesStream, parse_responses_request, response_of
    chat = ChatFormat("qwen3", "qwen3_coder")
    req = parse_responses_request({"input": "Delegate it", "tools": [SHELL_TOOL, AGENTS_NAMESPACE]})
    assert [t["function"]["name"] for t in req.chat.tools] == ["shell", "multi_agent_v1.spawn_agent",
                                                               "multi_agent_v1.wait_agent"]
    assert req.echo["tools"][1] == AGENTS_NAMESPACE
    req.chat.starts_in_reasoning = False
    text = ("<tool_call>\n<function=multi_agent_v1.spawn_agent>\n<parameter=message>\nFix the tests\n</parameter>\n"
            "</function>\n</tool_call>")
    meta = Meta("resp_1", 0, "tinyserve", [[1]], str, lambda t: str(t).encode())
    body = response_of(chat, req, meta, Choice(0, text=text), Usage(1, 9))
    (call,) = body["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "spawn_agent", "multi_agent_v1")
    assert json.loads(call["arguments"]) == {"message": "Fix the tests"}
    out = ResponsesStream(chat, req, meta)
    events = out.start()
    for k in range(0, len(text), 5):
        events += out.piece(Piece(0, text[k:k + 5], [], []))
    events += out.piece(Piece(0, "", [], [], "stop")) + out.end(Usage(1, 9))
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["name"], i["namespace"]) for i in added] == [("spawn_agent", "multi_agent_v1")]
    replay = parse_responses_request({"input": [
        {"role": "user", "content": "Delegate it"},
        {"type": "function_call", "call_id": "call_1", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": "{\"message\": \"Fix the tests\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "started"}],
        "tools": [AGENTS_NAMESPACE], "tool_choice": {"type": "function", "name": "wait_agent",
                                                     "namespace": "multi_agent_v1"}})
    assert replay.chat.messages[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1.spawn_agent"
    assert replay.chat.tool_choice == {"type": "function", "function": {"name": "multi_agent_v1.wait_agent"}}
    for bad, where in [({"type": "namespace", "name": "x", "tools": []}, "tools[0].tools"),
                       ({"type": "namespace", "name": "x", "tools": [{"type": "web_search"}]}, "tools[0].tools[0].type")]:
        with pytest.raises(Exception) as info:
            parse_responses_request({"input": "hi", "tools": [bad]})
        assert info.value.param == where


def test_a_forced_namespace_call_on_the_wire(client):
    """tool_choice naming a namespaced function forces its call (constrained decoding), which the openai client
    reads back as a function_call with its namespace."""
    short = {**AGENTS_NAMESPACE, "tools": [{**AGENTS_NAMESPACE["tools"][0], "parameters": {        # the random model
        "type": "object", "properties": {"message": {"enum": ["go", "stop"]}}, "required": ["message"]}}]}  # ends it
    r = create(client, "Delegate the fix", tools=[short], max_output_tokens=64, temperature=0,
               tool_choice={"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"},
               reasoning={"effort": "none"})
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "spawn_agent" and calls[0].model_dump()["namespace"] == "multi_agent_v1"
    assert set(json.loads(calls[0].arguments)) <= {"message"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_output_tokens_is_no_call(client, stream):
    """vLLM test_max_tokens_with_tool_choice_required: a forced call that max_output_tokens cuts is not returned
    (an agent would run it with half its arguments); the response is incomplete and still has an item."""
    kw = dict(tools=[SHELL_TOOL], tool_choice="required", max_output_tokens=10, temperature=0)
    if stream:
        with client.responses.stream(model="tinyserve", input="List the files", **kw) as s:
            events = list(s)
            r = s.get_final_response()
        added = [e.item.type for e in events if e.type == "response.output_item.added"]
        assert "function_call" not in added          # a call goes out once it is whole: this one never was
    else:
        r = create(client, "List the files", **kw)
    assert len(r.output) >= 1 and all(item.type != "function_call" for item in r.output)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    enum = {**SHELL_TOOL, "parameters": {"type": "object", "properties": {"command": {"enum": ["ls", "pwd"]}},
                                         "required": ["command"]}}       # a call the random model can finish
    whole = create(client, "List the files", tools=[enum], tool_choice="required", max_output_tokens=200,
                   temperature=0)
    assert [item.type for item in whole.output] == ["function_call"] and whole.status == "completed"
    # the limit one token short of the end of turn: the call closed within it, so it is whole and returned as it
    # is, completed, in a response that is incomplete (the stream and the whole body alike)
    kw = dict(tools=[enum], tool_choice="required", max_output_tokens=whole.usage.output_tokens - 1, temperature=0)
    if stream:
        with client.responses.stream(model="tinyserve", input="List the files", **kw) as s:
            list(s)
            short = s.get_final_response()
    else:
        short = create(client, "List the files", **kw)
    assert short.status == "incomplete" and [(item.type, item.status) for item in short.output] == \
        [("function_call", "completed")]
    assert short.output[0].arguments == whole.output[0].arguments


def test_history_becomes_chat_messages():
    from tinyserve.responses import parse_responses_request
    from tinyserve.tokenizer import normalise_messages
    req = parse_responses_request({"instructions": "Sys.", "input": [
        {"role": "developer", "content": "Dev."},
        {"role": "user", "content": "Q"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A"}]},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"command\": [\"ls\"]}"},
        {"type": "function_call", "call_id": "call_2", "name": "shell", "arguments": ""},
        {"type": "function_call_output", "call_id": "call_1", "output": "x"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "y"}]},
        {"role": "user", "content": "Q2"}], "tools": [SHELL_TOOL], "tool_choice": {"type": "function",
                                                                                   "name": "shell"}})
    assert req.chat.messages[:2] == [{"role": "system", "content": "Sys."}, {"role": "system", "content": "Dev."}]
    assert normalise_messages(req.chat.messages[:2]) == [{"role": "system", "content": "Sys.\n\nDev."}]
    assert req.chat.messages[1:] == [
        {"role": "system", "content": "Dev."},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A", "reasoning_content": "think", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shell", "arguments": {"command": ["ls"]}}},
            {"id": "call_2", "type": "function", "function": {"name": "shell", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "x"},
        {"role": "tool", "tool_call_id": "call_2", "content": "y"},
        {"role": "user", "content": "Q2"}]
    assert req.chat.tool_choice == {"type": "function", "function": {"name": "shell"}}
    assert req.chat.tools[0]["function"]["name"] == "shell"
    assert req.chat.template_kwargs == {}
    assert parse_responses_request({"input": "x", "reasoning": {"effort": "none"}}).chat.template_kwargs == {
        "enable_thinking": False}


# ---------------------------------------------------------------------------------------------------------------
# Logprobs and the rest of the request fields

def test_output_text_logprobs(client):
    """include message.output_text.logprobs with top_logprobs: the answer's tokens with their bytes (which rebuild
    the text) and alternatives, in the body and on each streamed text delta, as OpenAI's SDK types them."""
    kw = dict(max_output_tokens=12, temperature=0, top_logprobs=3, include=["message.output_text.logprobs"],
              reasoning={"effort": "none"})
    r = create(client, **kw)
    (part,) = [item for item in r.output if item.type == "message"][0].content
    assert part.logprobs and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in part.logprobs)
    joined = b"".join(bytes(t.bytes) for t in part.logprobs).decode(errors="replace")
    assert joined.startswith(part.text) and joined[len(part.text):] in ("", "<|im_end|>", "<|endoftext|>")
    streamed = []
    with client.responses.stream(model="codex", input="Hello! How are you?", store=False, **kw) as s:
        for event in s:
            if event.type == "response.output_text.delta":
                streamed += event.logprobs
            if event.type == "response.output_text.done":
                assert [t.token for t in event.logprobs] == [t.token for t in part.logprobs]
        final = s.get_final_response()
    assert [t.token for t in streamed] == [t.token for t in part.logprobs]
    # the same tokens and alternatives; the values to float precision (the second request reads its prompt from the
    # prefix cache: the same sums in another order)
    again = final.output[-1].content[0].logprobs
    assert [(t.token, [a.token for a in t.top_logprobs]) for t in again] == \
        [(t.token, [a.token for a in t.top_logprobs]) for t in part.logprobs]
    assert [t.logprob for t in again] == pytest.approx([t.logprob for t in part.logprobs], abs=1e-4)
    plain = create(client, max_output_tokens=4, top_logprobs=3)         # asked for, but not included: none
    assert all(not p.logprobs for item in plain.output if item.type == "message" for p in item.content)


def test_context_length_exceeded_code(client):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input="Hello there! " * 1500)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "input"


def test_fields_clients_may_send(client):
    """Codex's include of encrypted reasoning, a prompt cache key, a service tier, stream_options on a stream and
    parallel_tool_calls are accepted (docs/api.md says what each does here)."""
    r = create(client, include=["reasoning.encrypted_content"], prompt_cache_key="k", service_tier="auto",
               safety_identifier="u", parallel_tool_calls=False, tools=[SHELL_TOOL], max_tool_calls=3)
    assert r.parallel_tool_calls is False and r.status in ("completed", "incomplete")
    with client.responses.stream(model="codex", input="Hi", store=False, max_output_tokens=2,
                                 stream_options={"include_obfuscation": False}) as s:
        assert s.get_final_response().usage.output_tokens >= 1


def test_an_include_value_or_beta_header_this_server_does_not_know_is_logged_once(server, client):
    """include asks for outputs to be added; a value this server does not know names one it never makes. It is
    logged once, like an OpenAI-Beta value, and the request goes on (the next client release keeps working)."""
    for _ in range(2):
        r = client.post("/responses", body={"model": "codex", "input": "Hi", "max_output_tokens": 2,
                                            "include": ["message.output_text.everything"]}, cast_to=object,
                        options={"headers": {"OpenAI-Beta": "responses=v9"}})
        assert r["status"] in ("completed", "incomplete")
    log = server.log()
    assert log.count("Responses include: 'message.output_text.everything' is not one this server knows") == 1
    assert log.count("OpenAI-Beta: 'responses=v9' is not one this server knows") == 1
