"""Anthropic Messages as Claude Code sends it today (its request shapes read in the package itself; the agent itself
runs in tests/agents/): system messages inside `messages`, tool additions and removals in them, thinking whose
display is omitted, its anthropic-beta values, context_management edits, and the errors it branches on. A real
`tinyserve` process (demo model, qwen3 + qwen3_coder parsers) and the real `anthropic` client; unit checks where the
random model would have to write something on purpose (a tool call).
"""
from __future__ import annotations

import json
from typing import Any

import pytest

from server_util import ServerProcess, free_port, http, lazy_import, server_config
anthropic = lazy_import("anthropic")

PARSERS = {"parsers": {"reasoning": "qwen3", "tool_call": "qwen3_coder"}}
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"name": "get_time", "description": "The time in a city",
         "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# What Claude Code 2.1.x sends to a gateway, on every request
CLAUDE_CODE_BETAS = ("claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
                     "mid-conversation-tool-changes-2026-07-01,thinking-token-count-2026-05-13,"
                     "advanced-tool-use-2025-11-20,effort-2025-11-24")
ENVIRONMENT = {"role": "system", "content": [{"type": "text", "text": "# Environment\nPrimary working directory: /w",
                                              "cache_control": {"type": "ephemeral"}}]}


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("claude-code")
    proc = ServerProcess(folder, server_config(free_port(), {**PARSERS, "model": {"context_length": 2048}}),
                         env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120,
                               default_headers={"anthropic-beta": CLAUDE_CODE_BETAS})


def post(client: anthropic.Anthropic, **body: Any) -> dict[str, Any]:
    body.setdefault("max_tokens", 4)
    return client.post("/v1/messages", body={"model": "tinyserve", **body}, cast_to=object)


def count(client: anthropic.Anthropic, **body: Any) -> int:
    return client.post("/v1/messages/count_tokens", body={"model": "tinyserve", **body}, cast_to=object)[
        "input_tokens"]


def prompt_of(body: dict[str, Any]) -> str:
    """The prompt text a Messages body renders to (the demo checkpoint's template), in-process."""
    from tinyserve.anthropic import parse_messages_request, prompt_ids
    from tinyserve.chat import ChatFormat
    from tinyserve.demo import ensure_demo_checkpoint
    from tinyserve.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_folder(ensure_demo_checkpoint())
    req = parse_messages_request({"max_tokens": 4, **body})
    return tokenizer.decode(prompt_ids(ChatFormat("qwen3", "qwen3_coder"), req, tokenizer), skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------------------------
# System messages inside messages (mid-conversation-system)

def test_a_system_message_after_the_first_turn_is_a_user_turn_in_place(client):
    """Claude Code's first request: the user's turn, then its environment as a system message. Qwen's templates take
    a system message only first; it becomes a user turn where it was sent, so the next turn's prompt extends it."""
    first = [{"role": "user", "content": "Say hello"}, ENVIRONMENT]
    r = post(client, system="You are Claude Code.", messages=first, temperature=0)
    assert r["usage"]["output_tokens"] >= 1
    text = prompt_of({"system": "You are Claude Code.", "messages": first})
    assert text.startswith("<|im_start|>system\nYou are Claude Code.<|im_end|>\n<|im_start|>user\nSay hello<|im_end|>")
    assert ("<|im_start|>user\n<system-reminder>\n# Environment\nPrimary working directory: /w\n</system-reminder>"
            "<|im_end|>\n<|im_start|>assistant\n") in text
    reply = [{"type": "text", "text": "Hello"}]
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again"}]
    again = prompt_of({"system": "You are Claude Code.", "messages": second})
    assert again.startswith(text)                     # each turn's prompt extends the last one
    r2 = post(client, system="You are Claude Code.", messages=second, temperature=0)
    assert r2["usage"]["cache_read_input_tokens"] > 0


def test_tool_changes_in_a_system_message_are_offered_where_they_happen():
    """mid-conversation-tool-changes: a tool_addition renders in place (the first tools stay where the template put
    them, so the prompt's start never changes) and the parser takes calls of it; a tool_removal ends them."""
    from tinyserve.anthropic import message_body, parse_messages_request
    from tinyserve.chat import ChatFormat
    from tinyserve.generation import Choice, Meta, Usage
    added = {"role": "system", "content": [{"type": "tool_addition", "tool": {"type": "tool_definition",
                                                                              "definition": CLOCK}}]}
    messages = [{"role": "user", "content": "Weather and time in Paris?"}, added]
    req = parse_messages_request({"max_tokens": 64, "tools": [WEATHER], "messages": messages})
    assert [t["function"]["name"] for t in req.chat.tools] == ["get_weather"]          # what the template shows
    assert [t["function"]["name"] for t in req.chat.call_tools] == ["get_weather", "get_time"]
    assert "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_time\"" in req.chat.messages[-1]["content"]
    req.chat.starts_in_reasoning = False
    call = "<tool_call>\n<function=get_time>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    body = message_body(ChatFormat("qwen3", "qwen3_coder"), req, Meta("msg_1", 0, "tinyserve", [[1]], str, lambda t: str(t).encode()),
                        Choice(0, text=call), Usage(1, 9))
    assert body["content"][-1]["type"] == "tool_use" and body["content"][-1]["input"] == {"city": "Paris"}
    removed = {"role": "system", "content": [{"type": "tool_removal", "tool": {"type": "tool_reference",
                                                                               "name": "get_time"}}]}
    req = parse_messages_request({"max_tokens": 64, "tools": [WEATHER], "messages": messages + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}, removed]})
    assert [t["function"]["name"] for t in req.chat.call_tools] == ["get_weather"]
    assert "The function get_time can no longer be called." in req.chat.messages[-1]["content"]


def test_bad_system_blocks_are_refused_by_name(client):
    bad = {"role": "system", "content": [{"type": "tool_addition", "tool": {"type": "tool_reference"}}]}
    with pytest.raises(anthropic.BadRequestError) as info:
        post(client, messages=[{"role": "user", "content": "hi"}, bad])
    assert "messages[1].content[0].tool" in info.value.body["error"]["message"]
    image = {"role": "system", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                         "data": "AAAA"}}]}
    with pytest.raises(anthropic.BadRequestError) as info:
        post(client, messages=[{"role": "user", "content": "hi"}, image])
    assert "messages[1].content[0].type" in info.value.body["error"]["message"]


# ---------------------------------------------------------------------------------------------------------------
# Thinking: adaptive, and display "omitted" (Claude Code's headless sessions)

def test_omitted_thinking_comes_back_through_its_signature(client):
    """display "omitted": thinking blocks carry no text, their signature carries it, and a client sending the block
    back gives the model its reasoning again: the same prompt as the thinking sent in full."""
    from tinyserve.anthropic import omitted_thinking_signature, thinking_from_signature
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nLet me"}]
    thinking = {"type": "adaptive", "display": "omitted"}
    r = post(client, messages=prefill, thinking=thinking, max_tokens=8, temperature=0)
    block = r["content"][0]
    assert block["type"] == "thinking" and block["thinking"] == ""
    shown = post(client, messages=prefill, thinking={"type": "adaptive"}, max_tokens=8, temperature=0)["content"][0]
    assert thinking_from_signature(block["signature"]) == shown["thinking"] and shown["signature"] == ""
    with client.messages.stream(model="tinyserve", messages=prefill, max_tokens=8, thinking=thinking,
                                extra_body={"temperature": 0}) as s:
        deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "thinking_delta" not in deltas and final.content[0].signature == block["signature"]
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "", "signature": omitted_thinking_signature("I should greet back.")},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    full = [history[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should greet back.", "signature": ""}, history[1]["content"][1]]},
        history[2]]
    assert count(client, messages=history, tools=[WEATHER]) == count(client, messages=full, tools=[WEATHER])
    assert "I should greet back." in prompt_of({"messages": history, "tools": [WEATHER]})
    with pytest.raises(anthropic.BadRequestError) as info:
        post(client, messages=prefill, thinking={"type": "adaptive", "display": "hidden"})
    assert "thinking.display" in info.value.body["error"]["message"]


def test_thinking_token_count(client):
    """thinking-token-count: usage.output_tokens_details.thinking_tokens, the generated tokens up to the one that
    closes the think block; without the beta the usage has no such field."""
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nLet me"}]
    r = post(client, messages=prefill, max_tokens=8, temperature=0)
    details = r["usage"]["output_tokens_details"]
    assert 1 <= details["thinking_tokens"] <= r["usage"]["output_tokens"]
    plain = anthropic.Anthropic(base_url=client.base_url, api_key="unused", max_retries=0)
    assert "output_tokens_details" not in post(plain, messages=prefill, max_tokens=2)["usage"]


# ---------------------------------------------------------------------------------------------------------------
# anthropic-beta, and the errors Claude Code reads

def test_every_beta_flag_is_accepted_and_an_unknown_one_is_logged_once(server):
    """A flag says which fields a client may send; it asks for nothing. Claude Code 2.1.197 sends
    prompt-caching-scope-2026-01-05 on every request: a server refusing flags it does not know refused them all."""
    body = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for flags in (CLAUDE_CODE_BETAS + ",mid-conversation-system-2026-04-07", "claude-code-20250219, afk-mode-2026-01-31",
                  "a-flag-of-2027-01-01", "a-flag-of-2027-01-01,another-2027-02-02"):
        status, _, raw = http("POST", server.base_url + "/v1/messages", body,
                              headers={"anthropic-beta": flags, "anthropic-version": "2099-01-01"})
        assert status == 200, raw
    log = server.log()
    assert log.count("anthropic-beta: 'a-flag-of-2027-01-01' is not one this server knows") == 1
    assert log.count("anthropic-beta: 'another-2027-02-02' is not one this server knows") == 1
    assert log.count("anthropic-version: '2099-01-01' is not one this server knows") == 1
    assert "afk-mode-2026-01-31' is not one" not in log               # known: in anthropic.BETAS


def test_the_sdks_beta_calls_succeed_with_any_flag(client):
    """The Anthropic SDK's beta namespace, as a client on a newer SDK calls it, with a flag no server knows yet."""
    betas = ["token-counting-2024-11-01", "a-flag-of-2027-03-03"]
    plain = anthropic.Anthropic(base_url=client.base_url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Hello"}]
    made = plain.beta.messages.create(model="tinyserve", max_tokens=4, messages=messages, betas=betas)
    assert made.usage.output_tokens >= 1
    with plain.beta.messages.stream(model="tinyserve", max_tokens=4, messages=messages, betas=betas) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens >= 1
    counted = plain.beta.messages.count_tokens(model="tinyserve", messages=messages, betas=betas)
    assert counted.input_tokens == made.usage.input_tokens


def test_safeguards_are_accepted_and_not_run(server):
    """Claude Code 2.1.286's auto mode sends safeguards [{"type": "dangerous_tool_use", "classifier_context": ...}]:
    a check Anthropic runs on its side. None runs here; each type is logged once; a malformed one is a 400."""
    body = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "safeguards": [{"type": "dangerous_tool_use", "classifier_context": {"permission_mode": "auto"}}]}
    for _ in range(2):
        status, _, raw = http("POST", server.base_url + "/v1/messages", body)
        assert status == 200, raw
    assert server.log().count("safeguards of type 'dangerous_tool_use'") == 1
    status, _, raw = http("POST", server.base_url + "/v1/messages", {**body, "safeguards": "on"})
    assert status == 400 and json.loads(raw)["error"]["message"].startswith("safeguards must be")


def test_claude_codes_reachability_probe_is_answered(server):
    """Claude Code 2.1.286 sends HEAD /api/hello to ANTHROPIC_BASE_URL as it starts (a connection opened early)."""
    for method in ("HEAD", "GET"):
        status, _, _ = http(method, server.base_url + "/api/hello")
        assert status == 200
    assert "/api/hello: 404" not in server.log()


def test_a_prompt_past_the_context_is_worded_as_anthropic_words_it(client):
    """Claude Code compacts on "prompt is too long: N tokens > M maximum" (its own pattern)."""
    import re
    long = [{"role": "user", "content": "Hello there! " * 800}]
    n = count(client, messages=long)
    with pytest.raises(anthropic.BadRequestError) as info:
        post(client, messages=long)
    message = info.value.body["error"]["message"]
    assert re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message), message
    assert message == f"prompt is too long: {n} tokens > 2047 maximum"


# ---------------------------------------------------------------------------------------------------------------
# context_management

def _tool_session(uses: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Check the weather in several cities."}]
    for k in range(uses):
        messages += [{"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"Next city {k}.", "signature": ""},
            {"type": "tool_use", "id": f"toolu_{k}", "name": "get_weather", "input": {"city": f"City{k}"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{k}",
                                          "content": f"Result {k}: " + "sunny and warm " * 20}]}]
    return messages


def test_clear_edits_unit():
    """apply_edits on chat messages: the oldest tool results but `keep` cleared once past the trigger, excluded tools
    and clear_at_least honoured, inputs cleared on request; thinking kept for the last N turns; the caller's
    messages untouched."""
    from tinyserve.anthropic import parse_messages_request
    from tinyserve.context_edits import CLEARED_RESULT, apply_edits, parse_edits
    messages = parse_messages_request({"max_tokens": 4, "tools": [WEATHER],
                                       "messages": _tool_session(5)}).chat.messages
    before = json.dumps(messages)
    words = lambda text: len(text.split())          # noqa: E731 - a token count for the unit check

    def run(edit: dict[str, Any], prompt_tokens: int = 10**6):
        return apply_edits(messages, parse_edits({"edits": [edit]}), prompt_tokens, words)

    edited, applied = run({"type": "clear_tool_uses_20250919"})
    results = [m["content"] for m in edited if m["role"] == "tool"]
    assert results[:2] == [CLEARED_RESULT] * 2 and all(r.startswith("Result") for r in results[2:])
    assert applied[0]["type"] == "clear_tool_uses_20250919" and applied[0]["cleared_tool_uses"] == 2
    assert applied[0]["cleared_input_tokens"] == 2 * (words(results[3]) - words(CLEARED_RESULT))
    assert run({"type": "clear_tool_uses_20250919"}, prompt_tokens=1000)[1] == []          # under the trigger
    assert run({"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 4},
                "keep": {"type": "tool_uses", "value": 1}})[1][0]["cleared_tool_uses"] == 4
    assert run({"type": "clear_tool_uses_20250919", "exclude_tools": ["get_weather"]})[1] == []
    assert run({"type": "clear_tool_uses_20250919", "clear_at_least": {"type": "input_tokens", "value": 10**5}})[1] \
        == []
    edited, _ = run({"type": "clear_tool_uses_20250919", "clear_tool_inputs": True})
    calls = [m["tool_calls"][0]["function"]["arguments"] for m in edited if m.get("tool_calls")]
    assert calls[:2] == [{}, {}] and calls[2] == {"city": "City2"}
    edited, applied = run({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}})
    assert [m.get("reasoning_content") for m in edited if m["role"] == "assistant"] == \
        [None, None, None, "Next city 3.", "Next city 4."]
    assert applied == [{"type": "clear_thinking_20251015", "cleared_thinking_turns": 3, "cleared_input_tokens": 9}]
    assert run({"type": "clear_thinking_20251015", "keep": "all"})[1] == []
    assert json.dumps(messages) == before


def test_context_management_on_the_wire(client):
    """Claude Code's edit (clear_thinking, keep all) changes nothing; a clear_tool_uses past its trigger clears and
    is reported; the stream's message_delta reports it too; bad edits are refused by name."""
    session = _tool_session(4)
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    r = post(client, messages=session, tools=[WEATHER], context_management=keep_all)
    assert r["context_management"] == {"applied_edits": []}
    assert count(client, messages=session, tools=[WEATHER], context_management=keep_all) == \
        count(client, messages=session, tools=[WEATHER])
    clear = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100},
                        "keep": {"type": "tool_uses", "value": 1}}]}
    r = post(client, messages=session, tools=[WEATHER], context_management=clear)
    (edit,) = r["context_management"]["applied_edits"]
    assert edit["cleared_tool_uses"] == 3 and edit["cleared_input_tokens"] > 100
    full = count(client, messages=session, tools=[WEATHER])
    assert r["usage"]["input_tokens"] + r["usage"]["cache_read_input_tokens"] == full - edit["cleared_input_tokens"]
    with client.messages.stream(model="tinyserve", messages=session, tools=[WEATHER], max_tokens=2,
                                extra_body={"context_management": clear}) as s:
        deltas = [e for e in s if e.type == "message_delta"]
    assert deltas[0].model_extra["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 3
    for edits, where in [([{"type": "compact_20260101"}], "context_management.edits[0].type"),
                         ([{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}],
                          "context_management.edits[1]"),
                         ([{"type": "clear_tool_uses_20250919", "keep": {"type": "tokens", "value": 3}}],
                          "context_management.edits[0].keep")]:
        with pytest.raises(anthropic.BadRequestError) as info:
            post(client, messages=session, tools=[WEATHER], context_management={"edits": edits})
        assert where in info.value.body["error"]["message"]
