"""Agent sessions end to end, with the request bodies in the shapes Codex and Claude Code build (their sources: openai/
codex codex-rs ResponsesApiRequest and tool specs; Anthropic's Messages API with server tools and tool search), on
real servers (demo model, qwen3 + qwen3_coder parsers) and the real clients:
  - a five-turn Codex session (instructions, function tools, the freeform apply_patch tool with its Lark grammar,
    the hosted web_search tool, reasoning / function_call / custom_tool_call items replayed) answers every turn and
    reads the prefix cache from turn 2 on;
  - a forced freeform call follows its grammar (Lark or regex), checked against an independent oracle (the same
    language as a Python regular expression);
  - stream events carry the item as it was at that event;
  - Claude Code's server tools are left out of the prompt and counted, its tool_reference blocks are read;
  - a forced call cut by max_tokens leaves no markup in the answer;
  - on a checkpoint whose tokenizer flags the think / tool-call tags special, forced calls still come back as calls;
  - a <think> inside the conversation does not put the answer in reasoning: only the generation prompt does.

The demo model is random: its free text is noise, so the tests check shapes, plumbing, the prefix cache and the
constrained outputs, never what the model "means".
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from server_util import ServerProcess, free_port, http, lazy_import, server_config
anthropic = lazy_import("anthropic")
openai = lazy_import("openai")

PARSERS = {"parsers": {"reasoning": "qwen3", "tool_call": "qwen3_coder"}}
BIG = {"model": {"context_length": 4096}, "engine": {"kv_cache_tokens": 16384}}

# Codex's apply_patch grammar (openai/codex, codex-rs/core, tool_apply_patch.lark), sent as the custom tool's format.
APPLY_PATCH_LARK = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''
# The oracle: the same language, written independently as a Python regular expression.
APPLY_PATCH_RE = re.compile(
    r"\*\*\* Begin Patch\n"
    r"(?:\*\*\* Add File: .+\n(?:\+.*\n)+"
    r"|\*\*\* Delete File: .+\n"
    r"|\*\*\* Update File: .+\n(?:\*\*\* Move to: .+\n)?(?:(?:@@(?: .+)?\n|[-+ ].*\n)+(?:\*\*\* End of File\n)?)?"
    r")+\*\*\* End Patch\n?")
VERSION_REGEX = r"v[0-9]{1,2}\.[0-9]{1,2}( beta)?"
# A short patch language in the same Lark (sub-grammars, an imported terminal, an alias), so that the random demo
# model, forced into it, finishes within a few dozen tokens; and its oracle.
SHORT_PATCH_LARK = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk | delete_hunk
add_hunk: "*** Add File: " filename LF add_line
delete_hunk: "*** Delete File: " filename LF
filename: /[a-z]{1,6}\.py/
add_line: "+" /[a-z ]{0,6}/ LF -> line
%import common.LF
'''
SHORT_PATCH_RE = re.compile(r"\*\*\* Begin Patch\n(?:\*\*\* Add File: [a-z]{1,6}\.py\n\+[a-z ]{0,6}\n"
                            r"|\*\*\* Delete File: [a-z]{1,6}\.py\n)+\*\*\* End Patch\n?")

# The tools Codex sends (codex-rs tool specs): function tools, apply_patch as a freeform tool, the hosted web search.
SHELL = {"type": "function", "name": "shell", "strict": False,
         "description": "Runs a shell command and returns its output.",
         "parameters": {"type": "object", "properties": {
             "command": {"type": "array", "items": {"type": "string"}, "description": "The command to execute"},
             "workdir": {"type": "string", "description": "The working directory to execute the command in"},
             "timeout_ms": {"type": "number", "description": "The timeout for the command in milliseconds"}},
             "required": ["command"], "additionalProperties": False}}
UPDATE_PLAN = {"type": "function", "name": "update_plan", "strict": False, "description": "Updates the task plan.",
               "parameters": {"type": "object", "properties": {
                   "explanation": {"type": "string"},
                   "plan": {"type": "array", "items": {"type": "object", "properties": {
                       "step": {"type": "string"}, "status": {"type": "string"}},
                       "required": ["step", "status"], "additionalProperties": False}}},
                   "required": ["plan"], "additionalProperties": False}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch",
               "description": "Use the `apply_patch` tool to edit files. This is a FREEFORM tool, so do not wrap the "
                              "patch in JSON.",
               "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK}}
VERSION_TOOL = {"type": "custom", "name": "set_version", "description": "Sets the release version.",
                "format": {"type": "grammar", "syntax": "regex", "definition": VERSION_REGEX}}
SHORT_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edits files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": SHORT_PATCH_LARK}}
WEB_SEARCH = {"type": "web_search"}
CODEX_TOOLS = [SHELL, UPDATE_PLAN, APPLY_PATCH, WEB_SEARCH]
CODEX_INSTRUCTIONS = ("You are Codex, a coding agent running in a terminal. Work in the user's repository: read "
                      "files with the shell tool, edit them with apply_patch, keep the plan up to date. " * 4)
ENVIRONMENT = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": (
    "<environment_context>\n  <cwd>/home/user/project</cwd>\n  <approval_policy>on-request</approval_policy>\n"
    "  <sandbox_mode>workspace-write</sandbox_mode>\n  <shell>bash</shell>\n</environment_context>")}]}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def codex_body(input_items: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    """A request as Codex builds it (ResponsesApiRequest), but for max_output_tokens: Codex sends none (the server
    then writes to the end of the context); the random model is kept short here."""
    return {"model": "gpt-5-codex", "instructions": CODEX_INSTRUCTIONS, "input": input_items, "tools": CODEX_TOOLS,
            "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0198c0f4-thread", "text": {"verbosity": "medium"}, "max_output_tokens": 8, **kw}


def events_of(body: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in (f for f in body.decode().split("\n\n") if f.strip()):
        event_line, data_line = frame.split("\n", 1)
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == event_line.removeprefix("event: ")
        out.append(data)
    return out


def responses(server: ServerProcess, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the final response, the events: [] when not streamed)."""
    status, _, raw = http("POST", server.base_url + "/v1/responses", body, timeout=300)
    assert status == 200, raw
    if not body.get("stream"):
        return json.loads(raw), []
    events = events_of(raw)
    assert events[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events[-1]["response"], events


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("agents")
    proc = ServerProcess(folder, server_config(free_port(), {**PARSERS, **BIG}),
                         env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


# ---------------------------------------------------------------------------------------------------------------
# Codex

def test_codex_session_five_turns_reads_the_prefix_cache(server):
    """Each turn resends the whole history: the server's own output items, then what the agent did with them
    (a shell call, an apply_patch call, a plan update with the model's reasoning), then a new user message."""
    history = [ENVIRONMENT, user("Add a test for the parser and make it pass.")]
    agent_steps = [
        [{"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
          "arguments": json.dumps({"command": ["ls", "tests"], "workdir": "/home/user/project"})},
         {"type": "function_call_output", "call_id": "call_1", "output": "test_parser.py\n"}],
        [{"type": "custom_tool_call", "id": "ctc_2", "status": "completed", "call_id": "call_2",
          "name": "apply_patch", "input": "*** Begin Patch\n*** Add File: tests/test_new.py\n+def test_x():\n"
                                          "+    assert True\n*** End Patch\n"},
         {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Success. Updated the following files:\n"
                                                                            "A tests/test_new.py\n"}],
        [{"type": "reasoning", "id": "rs_3", "summary": [{"type": "summary_text", "text": "Run the tests."}],
          "content": [{"type": "reasoning_text", "text": "The file exists now; run pytest on it."}],
          "encrypted_content": None},
         {"type": "function_call", "id": "fc_3", "call_id": "call_3", "name": "update_plan",
          "arguments": json.dumps({"plan": [{"step": "add the test", "status": "completed"},
                                            {"step": "run it", "status": "in_progress"}]})},
         {"type": "function_call_output", "call_id": "call_3", "output": "Plan updated"}],
        [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "The test passes."}]},
         user("Now also mention it in the README.")],
    ]
    previous_prompt = 0
    for turn in range(5):
        final, events = responses(server, codex_body(history))
        assert final["status"] in ("completed", "incomplete") and final["error"] is None
        assert final["tools"][2]["type"] == "custom" and final["tools"][3] == WEB_SEARCH
        usage = final["usage"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        if turn:
            assert cached > 0, (turn, usage)
        if 0 < turn < 4:                              # the tool loop only appends: the whole last prompt is a hit
            assert cached >= previous_prompt - 64, (turn, usage, previous_prompt)
        previous_prompt = usage["input_tokens"]
        for item in final["output"]:
            assert item["type"] in ("reasoning", "message", "function_call", "custom_tool_call"), item
        history += final["output"]                    # Codex replays the items as it received them
        if turn < 4:
            history += agent_steps[turn]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_freeform_calls_follow_their_grammar(server, stream):
    """tool_choice naming a custom tool: the call is a custom_tool_call whose input is in the format's language."""
    for tool_def, oracle, tokens, tries in ((VERSION_TOOL, re.compile(VERSION_REGEX), 40, 3),
                                           (SHORT_PATCH, SHORT_PATCH_RE, 200, 3)):
        whole = 0
        for _ in range(tries):
            final, events = responses(server, codex_body(
                [user("Release it.")], tools=[SHELL, tool_def, WEB_SEARCH], stream=stream, max_output_tokens=tokens,
                tool_choice={"type": "custom", "name": tool_def["name"]}, reasoning={"effort": "none"},
                temperature=1.0))
            calls = [item for item in final["output"] if item["type"] == "custom_tool_call"]
            if final["status"] == "incomplete" and not calls:   # cut inside the call: no half call (vLLM's peer case)
                assert [(i["type"], i["status"]) for i in final["output"]] == [("message", "incomplete")]
                assert not [e for e in events if e["type"].startswith("response.custom_tool_call")]
                continue
            # a call is whole, with or without the limit cutting what follows it (its end marker, the end of turn)
            assert [item["status"] for item in calls] == ["completed"], final["output"]
            assert len(calls) == 1 and calls[0]["name"] == tool_def["name"], final["output"]
            assert not [item for item in final["output"] if item["type"] in ("message", "function_call")]
            assert calls[0]["call_id"].startswith("call_") and calls[0]["id"].startswith("ctc_")
            whole += 1
            assert oracle.fullmatch(calls[0]["input"]), calls[0]["input"]
            if stream:
                done = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
                assert [e["input"] for e in done] == [calls[0]["input"]]
                delta = "".join(e["delta"] for e in events if e["type"] == "response.custom_tool_call_input.delta")
                assert delta == calls[0]["input"]
        assert whole, f"no forced {tool_def['name']} call finished within {tokens} tokens"


def test_the_apply_patch_grammar_is_enforced_on_a_forced_call(xdg):
    """Codex's own apply_patch grammar, in the forced call's grammar: it takes the patches its language holds (the
    oracle agrees), rejects the others, and the parser reads the input back as it was written."""
    from tinyserve.chat import forced_tool_call, freeform_tool
    from tinyserve.demo import ensure_demo_checkpoint
    from tinyserve.grammar import GrammarCompiler
    from tinyserve.tokenizer import Tokenizer
    from tinyserve.tool_calls import Qwen3CoderToolParser
    tok = Tokenizer.from_folder(ensure_demo_checkpoint(Path(xdg) / "tinyserve"))
    comp = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    fn, fmt = freeform_tool(APPLY_PATCH, "tools[0]")
    shell = {"type": "function", "function": {"name": "shell", "parameters": SHELL["parameters"]}}
    constraint = forced_tool_call([shell, fn], {"type": "function", "function": {"name": "apply_patch"}},
                                  {"apply_patch": fmt})

    def call(patch: str) -> str:
        return (f"<tool_call>\n<function=apply_patch>\n<parameter=input>\n{patch}\n</parameter>\n</function>\n"
                "</tool_call>")

    def accepts(text: str) -> bool:
        state = comp.state(constraint)
        return all(state.advance(t) for t in tok.encode(text)) and state.matcher.is_accepting()

    good = ["*** Begin Patch\n*** Update File: src/a.py\n@@ def f():\n-    return 1\n+    return 2\n*** End Patch",
            "*** Begin Patch\n*** Add File: notes.md\n+# Notes\n+\n*** Delete File: old.txt\n*** End Patch\n",
            "*** Begin Patch\n*** Update File: a.py\n*** Move to: b.py\n x = 1\n*** End of File\n*** End Patch"]
    bad = ["*** Begin Patch\n*** End Patch",                                  # no hunk
           "*** Begin Patch\n*** Add File: x.py\n*** End Patch",              # an added file without lines
           "*** Begin Patch\n*** Update File: a.py\nx = 1\n*** End Patch",   # a change line without its mark
           "Begin Patch\n*** Delete File: a.py\n*** End Patch"]
    for patch in good + bad:
        assert bool(APPLY_PATCH_RE.fullmatch(patch)) is (patch in good)       # the oracle's reading
        assert accepts(call(patch)) is (patch in good), patch
    for patch in good:
        _, calls = Qwen3CoderToolParser([shell, fn]).parse(call(patch))
        assert json.loads(calls[0]["function"]["arguments"]) == {"input": patch}


def test_stream_events_carry_the_item_as_it_was(server):
    """output_item.added shows the item as it opened (empty), not as it grew while the same delta was written."""
    final, events = responses(server, codex_body([user("Hi")], tools=[], reasoning={"effort": "none"},
                                                 max_output_tokens=6, temperature=0))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert added and all(e["item"]["status"] == "in_progress" for e in added)
    for e in added:
        if e["item"]["type"] == "message":
            assert e["item"]["content"][0]["text"] == ""
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [{k: v for k, v in item.items() if k != "status"} for item in done] == \
        [{k: v for k, v in item.items() if k != "status"} for item in final["output"]]
    final, events = responses(server, codex_body([user("Release it.")], tools=[VERSION_TOOL], max_output_tokens=40,
                                                 tool_choice={"type": "custom", "name": "set_version"},
                                                 reasoning={"effort": "none"}))
    (added,) = [e for e in events if e["type"] == "response.output_item.added"]
    assert added["item"]["type"] == "custom_tool_call" and added["item"]["input"] == ""


def test_custom_tool_history_renders_as_calls(server):
    """custom_tool_call / custom_tool_call_output items render like function calls and their outputs (the prompt
    grows by them), and a hosted tool changes nothing in the prompt."""
    base = [user("Fix the bug.")]
    call = {"type": "custom_tool_call", "call_id": "call_9", "name": "apply_patch",
            "input": "*** Begin Patch\n*** Delete File: old.py\n*** End Patch"}
    output = {"type": "custom_tool_call_output", "call_id": "call_9", "output": "Done"}

    def prompt(items: list[dict[str, Any]], tools: list[dict[str, Any]]) -> int:
        final, _ = responses(server, codex_body(items, tools=tools, stream=False, max_output_tokens=1))
        return final["usage"]["input_tokens"]

    assert prompt(base + [call, output], CODEX_TOOLS) > prompt(base, CODEX_TOOLS)
    assert prompt(base, [SHELL, UPDATE_PLAN, APPLY_PATCH]) == prompt(base, CODEX_TOOLS)      # web_search left out
    broken = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: ("}}
    status, _, raw = http("POST", server.base_url + "/v1/responses", codex_body(
        base, tools=[broken], stream=False, tool_choice={"type": "custom", "name": "apply_patch"}))
    assert status == 400 and json.loads(raw)["error"]["param"] == "tools", raw     # forced: the grammar compiles


# ---------------------------------------------------------------------------------------------------------------
# Claude Code

CLAUDE_TOOLS = [
    {"name": "Bash", "description": "Executes a bash command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
        "required": ["command"], "additionalProperties": False}},
    {"name": "ToolSearch", "description": "Finds deferred tools.", "input_schema": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
    {"name": "mcp__github__create_issue", "description": "Creates a GitHub issue.", "defer_loading": True,
     "input_schema": {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}},
]
WEB_SEARCH_SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 8}


def claude_messages(result_content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "File an issue about the flaky test."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "I need the GitHub tool.", "signature": "sig"},
                {"type": "tool_use", "id": "toolu_01", "name": "ToolSearch", "input": {"query": "github issue"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                          "content": result_content}]}]


def test_claude_code_server_tools_and_tool_references(server):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    reference = [{"type": "tool_reference", "tool_name": "mcp__github__create_issue"}]
    system = [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}]
    kw = dict(model="claude-sonnet-4-5", system=system, messages=claude_messages(reference))
    r = client.messages.create(max_tokens=8, tools=CLAUDE_TOOLS + [WEB_SEARCH_SERVER_TOOL], **kw)
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use") and r.usage.output_tokens >= 1
    with client.messages.stream(max_tokens=4, tools=CLAUDE_TOOLS + [WEB_SEARCH_SERVER_TOOL], **kw) as s:
        assert s.get_final_message().usage.output_tokens >= 1

    def count(tools: list[dict[str, Any]], content: list[dict[str, Any]]) -> int:
        return client.messages.count_tokens(model="claude-sonnet-4-5", system=system, tools=tools,
                                            messages=claude_messages(content)).input_tokens

    # the server tool is not in the prompt; the reference reads as the line it renders to
    assert count(CLAUDE_TOOLS + [WEB_SEARCH_SERVER_TOOL], reference) == count(CLAUDE_TOOLS, reference)
    assert count(CLAUDE_TOOLS, reference) == count(CLAUDE_TOOLS, [
        {"type": "text", "text": "Tool loaded: mcp__github__create_issue"}])
    with pytest.raises(anthropic.BadRequestError) as info:   # naming the server tool: it is not one we offer
        client.messages.create(max_tokens=4, tools=CLAUDE_TOOLS + [WEB_SEARCH_SERVER_TOOL],
                               tool_choice={"type": "tool", "name": "web_search"}, **kw)
    assert "tool_choice" in info.value.body["error"]["message"]
    _, _, metrics = http("GET", server.base_url + "/metrics")
    counts = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.decode().splitlines()
              if line.startswith("tinyserve:tools_left_out_total")}
    assert counts['tinyserve:tools_left_out_total{type="web_search_20250305"}'] >= 2
    assert counts.get('tinyserve:tools_left_out_total{type="web_search"}', 0) >= 1


# ---------------------------------------------------------------------------------------------------------------
# Forced calls

MARKUP = ("<tool_call>", "</tool_call>", "<function=", "<parameter=", "</parameter>", "</function>")
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"]}}}


def test_a_forced_call_cut_by_max_tokens_leaves_no_markup(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for max_tokens in (1, 2, 3, 5, 8, 13):
        for stream in (False, True):
            kw = dict(model="tinyserve", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL],
                      tool_choice="required", max_tokens=max_tokens, temperature=1.0, seed=max_tokens)
            if stream:
                content, finish = "", None
                for chunk in client.chat.completions.create(stream=True, **kw):
                    if chunk.choices:
                        content += chunk.choices[0].delta.content or ""
                        finish = chunk.choices[0].finish_reason or finish
            else:
                r = client.chat.completions.create(**kw)
                content, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
            assert finish in ("length", "tool_calls") and not any(m in content for m in MARKUP), (content, finish)


@pytest.fixture(scope="module")
def special_flag_server(xdg, tmp_path_factory):
    """The demo checkpoint with its tokenizer flagging <think>, </think>, <tool_call>, </tool_call> special (as some
    fine-tunes ship it): detokenizing with skip_special_tokens would drop them."""
    from tinyserve.demo import ensure_demo_checkpoint
    from tinyserve.tokenizer import PARSER_MARKERS
    folder = tmp_path_factory.mktemp("special-flags") / "checkpoint"
    shutil.copytree(ensure_demo_checkpoint(Path(xdg) / "tinyserve"), folder)
    tok = json.loads((folder / "tokenizer.json").read_text())
    for added in tok["added_tokens"]:
        if added["content"] in PARSER_MARKERS:
            added["special"] = True
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    cfg = server_config(free_port(), {**PARSERS, "model": {"path": str(folder)}})
    proc = ServerProcess(folder.parent, cfg, env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc, folder
    assert proc.stop() == 0, proc.log()


def test_forced_calls_on_a_tokenizer_that_flags_the_markers_special(special_flag_server):
    from tinyserve.tokenizer import Tokenizer
    proc, folder = special_flag_server
    tok = Tokenizer.from_folder(folder)
    call_id = tok.token_to_id("<tool_call>")
    assert tok.hf.decode([call_id], skip_special_tokens=True) == ""          # what the flags alone would do
    assert tok.decode([call_id]) == "<tool_call>" and tok.decode(tok.encode("<|im_end|>")) == ""
    client = openai.OpenAI(base_url=proc.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for seed in range(3):
        for stream in (False, True):
            kw = dict(model="tinyserve", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL],
                      tool_choice="required", max_tokens=80, temperature=1.0, seed=seed)
            if stream:
                calls, finish = {}, None
                for chunk in client.chat.completions.create(stream=True, **kw):
                    for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                        calls[tc.index] = calls.get(tc.index, "") + (tc.function.arguments or "")
                    finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
                arguments = list(calls.values())
            else:
                r = client.chat.completions.create(**kw)
                arguments = [c.function.arguments for c in r.choices[0].message.tool_calls or []]
                finish = r.choices[0].finish_reason
            assert finish == "tool_calls" and len(arguments) == 1, (arguments, finish)
            assert json.loads(arguments[0])["city"] in ("Paris", "Rome")
    messages = anthropic.Anthropic(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=120)
    weather = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    r = messages.messages.create(model="claude", max_tokens=80, messages=[{"role": "user", "content": "Weather?"}],
                                 tools=[weather], tool_choice={"type": "any"})
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    final, _ = responses(proc, {"model": "codex", "input": "Weather?", "max_output_tokens": 80, "store": False,
                                "tools": [{"type": "function", "name": "get_weather",
                                           "parameters": WEATHER_TOOL["function"]["parameters"]}],
                                "tool_choice": "required"})
    assert [item["type"] for item in final["output"]] == ["function_call"] and final["status"] == "completed"


# ---------------------------------------------------------------------------------------------------------------
# Where reasoning starts

def test_a_think_tag_in_the_conversation_does_not_start_reasoning(xdg):
    from tinyserve.chat import ChatFormat
    from tinyserve.demo import CHAT_TEMPLATE, ensure_demo_checkpoint
    from tinyserve.openai_api import parse_chat_request
    from tinyserve.tokenizer import Tokenizer
    demo = Tokenizer.from_folder(ensure_demo_checkpoint(Path(xdg) / "tinyserve"))
    # a Qwen3.5-style template: its generation prompt opens <think> unless thinking is off
    opening = CHAT_TEMPLATE.replace("{%- endif -%}\n{%- endif -%}\n", "{%- else -%}{{- '<think>\\n' -}}\n"
                                    "    {%- endif -%}\n{%- endif -%}\n")
    assert opening != CHAT_TEMPLATE
    thinking = Tokenizer(hf=demo.hf, chat_template=opening, eos_token_ids=demo.eos_token_ids)
    file_text = "The parser reads <think> and then waits for the closing tag."
    for tokenizer, kwargs, expected in ((demo, {}, False), (thinking, {}, True),
                                        (thinking, {"enable_thinking": False}, False)):
        for content in ("Hi", f"Here is parse.py:\n{file_text}", "<think>"):
            req = parse_chat_request({"messages": [{"role": "user", "content": content}],
                                      "chat_template_kwargs": kwargs}, "tinyserve")
            ChatFormat("qwen3", "qwen3_coder").prompt_ids(req, tokenizer)
            assert req.starts_in_reasoning is expected, (content, kwargs)


def test_parsed_freeform_call_and_reasoning_ended_by_a_call():
    """On the module (the random model writes no call when not forced): a call made from inside the think block
    ends the reasoning, a call of the freeform tool is a custom_tool_call item, and the stream gives the same items
    with the input in its own events; reasoning_tokens counts up to the call that ended the block."""
    from tinyserve.chat import ChatFormat
    from tinyserve.generation import Choice, Meta, Piece, Usage
    from tinyserve.responses import ResponsesStream, parse_responses_request, response_of
    chat = ChatFormat("qwen3", "qwen3_coder")
    req = parse_responses_request({"input": "Fix it", "tools": CODEX_TOOLS})
    req.chat.starts_in_reasoning = True
    patch = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = 1\n+x = 2\n*** End Patch"
    text = ("The constant is wrong.\n<tool_call>\n<function=apply_patch>\n<parameter=input>\n" + patch +
            "\n</parameter>\n</function>\n</tool_call>")
    chars = list(text)                                # one "token" per character: token_text is the identity
    meta = Meta("resp_1", 0, "tinyserve", [[1, 2, 3]], str, lambda t: str(t).encode())
    usage = Usage(3, len(chars))
    body = response_of(chat, req, meta, Choice(0, text=text, token_ids=chars), usage)
    assert [i["type"] for i in body["output"]] == ["reasoning", "custom_tool_call"]
    reasoning, call = body["output"]
    assert reasoning["content"][0]["text"] == "The constant is wrong."
    assert call["name"] == "apply_patch" and call["input"] == patch and call["id"].startswith("ctc_")
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == text.index("<tool_call>")
    out = ResponsesStream(chat, req, meta)
    events = out.start()
    for k in range(0, len(text), 5):
        events += out.piece(Piece(0, text[k:k + 5], chars[k:k + 5], []))
    events += out.piece(Piece(0, "", [], [], "stop")) + out.end(usage)
    final = events[-1]["response"]

    def strip(items: list[dict]) -> list[dict]:
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

    assert strip(final["output"]) == strip(body["output"]) and final["usage"] == body["usage"]
    assert [e["input"] for e in events if e["type"] == "response.custom_tool_call_input.done"] == [patch]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [a["type"] for a in added] == ["reasoning", "custom_tool_call"] and added[1]["input"] == ""
    assert added[0]["content"][0]["text"] == ""
