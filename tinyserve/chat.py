"""The chat request that every chat protocol becomes, and the model's side of it: the prompt rendered through the
chat template, the answer split into reasoning, content and tool calls.

OpenAI chat completions (openai_api.py), Anthropic Messages (anthropic.py) and Responses (responses.py) each
translate their request into a ChatRequest: messages and function tools in OpenAI chat's shape, which is what the
chat template takes. So the three render the same prompt for the same conversation and share the prefix cache.
ChatFormat renders it (and sets the forced-tool-call constraint), then splits what the model wrote with the qwen3
reasoning and qwen3_coder tool-call parsers of the config's [parsers] table: a whole answer (`message`) or one
streamed choice at a time (ChatStreamChoice). Each protocol writes the pieces in its own shape.

Tools: each protocol writes a small reader for one tool object of its own shape; `function_tools` runs it over the
list and `function_tool` checks the name and the JSON schema the same way for all. Each maps its tool_choice onto
"auto" | "none" | "required" | a named function (`named_tool` checks the name), and `chat_tools` checks the pair as
the tool parser and the grammar take it. A tool of a type this server cannot run (a hosted / server tool: web
search, code execution, ...) is left out of the prompt rather than refused: `leave_out` logs it once per type and
the request counts it (tinyserve:tools_left_out in /metrics).
"""
from __future__ import annotations

import json
import logging
from contextlib import suppress
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable

from .config import Config
from .generation import Choice
from .parsers import Qwen3ReasoningParser, prompt_opens_reasoning
from .protocol import GenerationOptions, ImageInput, bad_request, constraint_after_reasoning
from .sampling import Constraint
from .tokenizer import Tokenizer
from .tool_calls import FORMAT_SYNTAXES, FREEFORM_INPUT, Qwen3CoderToolParser, tool_function

log = logging.getLogger("tinyserve.chat")


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any                  # "auto" | "none" | "required" | {"type": "function", "function": {"name"}}
    template_kwargs: dict[str, Any]
    logprobs: bool
    top_logprobs: int
    options: GenerationOptions
    starts_in_reasoning: bool = False  # set once the prompt is rendered: the template opened <think> itself
    images: list[ImageInput] = field(default_factory=list)   # the image parts, in prompt order
    # freeform tools (Responses `custom`), rendered as a function with one string parameter `input`: name -> the
    # format its input must follow ({"type": "text"} or {"type": "grammar", "syntax", "definition"})
    custom_tools: dict[str, dict[str, Any]] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)   # types of the tools left out of the prompt
    continue_final: bool = False       # the last (assistant) message is continued, not closed (a prefill)
    add_generation_prompt: bool = True
    parallel_tool_calls: bool = True   # False: at most one tool call per answer (the first)
    echo: str = ""                     # vLLM's echo of a continued message: its text goes before the answer
    # the tools the model may call, where they differ from those the template shows first (tools added or removed
    # mid-conversation: Anthropic's tool_addition / tool_removal); None: `tools`
    call_tools: list[dict[str, Any]] | None = None


# ---------------------------------------------------------------------------------------------------------------
# Tools: every protocol's tool list and tool_choice, as the template, the tool parser and the grammar take them

# (one tool, its param) -> its function tool, or several (a group of tools), or None (left out)
ToolReader = Callable[[dict[str, Any], str], "dict[str, Any] | list[dict[str, Any]] | None"]


def function_tools(value: Any, read: ToolReader, shape: str = "an object") -> list[dict[str, Any]]:
    """A protocol's `tools` -> OpenAI function tools. `read(tool, param)` checks one tool object of the protocol's
    shape and returns its function tool (through function_tool), a list of them (a group, such as a Responses
    namespace), or None for a tool left out of the prompt (leave_out); an entry that is no object must be
    `shape`."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, tool in enumerate(value):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{p} must be {shape}", p)
        fn = read(tool, p)
        if isinstance(fn, list):
            out.extend(fn)
        elif fn is not None:
            out.append(fn)
    return out


def function_tool(fields: dict[str, Any], where: str, schema_key: str = "parameters", schema_required: bool = False
                  ) -> dict[str, Any]:
    """{"type": "function", "function": {"name", "description", "parameters"}} from a tool's name, description and
    JSON schema (under `schema_key`; an absent optional one takes no arguments). Errors name `where`.name and
    `where`.`schema_key`."""
    name = fields.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be a non-empty string", f"{where}.name")
    schema = fields.get(schema_key)
    if schema is None and not schema_required:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.{schema_key} must be a JSON schema object", f"{where}.{schema_key}")
    fn: dict[str, Any] = {"name": name}
    if isinstance(fields.get("description"), str):
        fn["description"] = fields["description"]
    fn["parameters"] = schema
    return {"type": "function", "function": fn}


def named_tool(tools: list[dict[str, Any]], name: Any, param: str, noun: str = "function") -> dict[str, Any]:
    """A tool_choice naming one tool -> the chat tool_choice; the name must be one of the tools'."""
    if not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {noun} {name!r}, which is not in tools", param)
    return {"type": "function", "function": {"name": name}}


_LOGGED_LEFT_OUT: set[tuple[str, str]] = set()


def leave_out(left_out: list[str], kind: str, protocol: str) -> None:
    """A tool of a type this server cannot run: noted on the request (counted in /metrics) and logged once per
    protocol and type, so an agent that sends it on every turn does not fill the log."""
    left_out.append(kind)
    if (protocol, kind) not in _LOGGED_LEFT_OUT:
        _LOGGED_LEFT_OUT.add((protocol, kind))
        log.warning("%s: tools of type %r are left out of the prompt: this server cannot run them (logged once; "
                    "counted in tinyserve:tools_left_out)", protocol, kind)


def forced_tool_call(tools: list[dict[str, Any]] | None, tool_choice: Any,
                     formats: dict[str, dict[str, Any]] | None = None) -> Constraint | None:
    """tool_choice "required" (one call of any tool) or {"type": "function", "function": {"name"}} (a call of that
    one) -> the "tool_call" constraint (grammar.py); None when the choice forces nothing (auto, none, no tools).
    formats: the freeform tools' input formats (ChatRequest.custom_tools), enforced on their `input`."""
    if not tools:
        return None
    if tool_choice == "required":
        return Constraint.tool_call(tools, formats=formats)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        return Constraint.tool_call(tools, tool_choice["function"].get("name"), formats=formats)
    return None


# A freeform tool (Responses `custom`: Codex's apply_patch) has no JSON arguments: its input is free text. The template
# shows it as a function with one string parameter; the call's `input` is that parameter's text.
FREEFORM_SCHEMA = {"type": "object", "properties": {FREEFORM_INPUT: {
    "type": "string", "description": "The tool's input, as free text (not JSON)."}}, "required": [FREEFORM_INPUT]}


def freeform_tool(tool: dict[str, Any], p: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A freeform tool {"name", "description", "format"} -> (the function tool the template shows, the format of its
    input: {"type": "text"} or {"type": "grammar", "syntax": "lark" | "regex", "definition"})."""
    fmt = tool.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        fmt = {"type": "text"}
    elif kind == "grammar" and fmt.get("syntax") in FORMAT_SYNTAXES and isinstance(fmt.get("definition"), str):
        fmt = {"type": "grammar", "syntax": fmt["syntax"], "definition": fmt["definition"]}
    else:
        raise bad_request(f'{p}.format must be {{"type": "text"}} or {{"type": "grammar", "syntax": "lark" | '
                          f'"regex", "definition": ...}}', f"{p}.format")
    description = tool.get("description") if isinstance(tool.get("description"), str) else ""
    note = f"Call it with one parameter, `{FREEFORM_INPUT}`: free text, not JSON."
    if fmt["type"] == "grammar":
        note += f" The text must match this {fmt['syntax']} grammar:\n{fmt['definition']}"
    fields = {"name": tool.get("name"), "description": "\n\n".join(t for t in (description, note) if t),
              "parameters": FREEFORM_SCHEMA}
    return function_tool(fields, p), fmt


def freeform_input(arguments: str) -> str:
    """A freeform tool's input from the parsed call's JSON arguments: its `input`, else its one parameter's text
    (a model may name it otherwise), else the arguments as they are."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return arguments
    if not isinstance(args, dict):
        return arguments
    if isinstance(args.get(FREEFORM_INPUT), str):
        return args[FREEFORM_INPUT]
    if len(args) == 1:
        (value,) = args.values()
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return json.dumps(args, ensure_ascii=False) if args else ""


def chat_tools(tools: list[dict[str, Any]], choice: Any) -> tuple[list[dict[str, Any]] | None, Any]:
    """(tools, tool_choice) for the ChatRequest: None when no tool is offered; a choice the tool parser cannot take
    is a 400 naming tool_choice. "required" and a named function force one call when the tool-call parser is on
    (ChatFormat.prompt_ids sets the grammar constraint); a named function also limits what is parsed as a call."""
    offered = tools or None
    if offered is None and choice not in ("auto", "none"):
        raise bad_request("tool_choice forces a tool call, but no tools are given", "tool_choice")
    try:
        make_tool_parser(offered, choice)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from None
    return offered, choice


# ---------------------------------------------------------------------------------------------------------------
# The model's side: prompt in, answer split

@dataclass
class Answer:
    """A finished choice split by the parsers."""

    reasoning: str | None
    content: str
    calls: list[dict[str, Any]]       # OpenAI tool calls {id, type, function: {name, arguments}}
    finish_reason: str                # "tool_calls" for a stop with calls
    reasoning_end: int | None         # where in the output text the think block ended (None: never closed)
    last_call_cut: bool = False       # max_tokens cut the last call off before it closed


def make_tool_parser(tools: list[dict] | None, tool_choice: Any = "auto") -> Qwen3CoderToolParser | None:
    """The parser for a request's tools + tool_choice; None when no parsing is wanted.

    "none" (or no tools): None. "auto" / "required" / None: parse every tool. {"type": "function", "function":
    {"name": X}}: only X; calls of other functions stay content. Raises ValueError naming tool_choice when bad.
    """
    if not tools or tool_choice == "none":
        return None
    if tool_choice is None or tool_choice in ("auto", "required"):
        return Qwen3CoderToolParser(tools)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError('tool_choice must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}')
        known = {tool_function(t).get("name") for t in tools}
        if name not in known:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return Qwen3CoderToolParser(tools, allowed_names={name})
    raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}')


def count_reasoning_tokens(token_ids: list[int], token_text: Callable[[int], str], reasoning: str | None,
                           reasoning_end: int | None) -> int:
    """Generated tokens that belong to the think block: up to the one that reaches `reasoning_end`, the offset in
    the output text where the block ended (all of them when it never ended); 0 without reasoning."""
    if not reasoning:
        return 0
    if reasoning_end is None:
        return len(token_ids)
    length = 0
    for k, token_id in enumerate(token_ids):
        length += len(token_text(token_id))
        if length >= reasoning_end:
            return k + 1
    return len(token_ids)


@dataclass(frozen=True)
class ChatFormat:
    """The prompt through the chat template, the answer through the parsers. The parser names come from the
    config's [parsers] table ("" = off).

    prompt_ids renders the prompt (a worker thread: templates take time) and settles the request's constraint (a
    forced tool call, and where it starts). The answer starts inside a think block only when the generation prompt
    opened it; a <think> in the conversation (a file a tool read) does not count, so the prompt is rendered again
    without the generation prompt when a <think> is open at all (a prefill, or a template that insists on its
    generation prompt: the whole prompt is judged)."""

    reasoning_parser: str = ""
    tool_parser: str = ""

    @classmethod
    def of(cls, cfg: Config) -> ChatFormat:
        return cls(cfg.parsers.reasoning, cfg.parsers.tool_call)

    def prompt_ids(self, req: ChatRequest, tokenizer: Tokenizer) -> list[int]:
        render = partial(tokenizer.apply_chat_template, req.messages, tools=req.tools,
                         continue_final_message=req.continue_final, **req.template_kwargs)
        try:
            text = render(add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:                       # e.g. the template's raise_exception on a bad history
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        req.starts_in_reasoning = prompt_opens_reasoning(text)
        if req.starts_in_reasoning and req.add_generation_prompt:
            with suppress(ValueError):                # a template that insists on its generation prompt
                req.starts_in_reasoning = prompt_opens_reasoning(text, render(add_generation_prompt=False))
        if req.tools or req.options.params.constraint is not None:
            self._settle_constraint(req, tokenizer)
        return tokenizer.encode(text)

    def _settle_constraint(self, req: ChatRequest, tokenizer: Tokenizer) -> None:
        """A forced tool call is the request's constraint (it replaces any response_format), and a constraint starts
        after the reasoning when the answer starts inside a think block."""
        if self.tool_parser == "qwen3_coder" and req.tools:
            constraint = forced_tool_call(req.tools, req.tool_choice, req.custom_tools)
            if constraint is not None:
                req.options.params = replace(req.options.params, constraint=constraint)
        if req.options.params.constraint is not None:
            req.options.params = constraint_after_reasoning(req.options.params, req.starts_in_reasoning, tokenizer)

    # One choice's reasoning and tool-call parsers (None: off), fresh: they are stateful.
    def parsers(self, req: ChatRequest) -> tuple[Qwen3ReasoningParser | None, Qwen3CoderToolParser | None]:
        offered = req.tools if req.call_tools is None else req.call_tools
        tools = make_tool_parser(offered, req.tool_choice) if self.tool_parser == "qwen3_coder" and offered else None
        if self.reasoning_parser != "qwen3":
            return None, tools
        return Qwen3ReasoningParser(req.starts_in_reasoning, bool(req.template_kwargs.get("enable_thinking", True)),
                                    tools.allowed_names if tools is not None else None), tools

    def split(self, req: ChatRequest, r: Choice) -> Answer:
        """A finished choice's text -> reasoning, content and tool calls. A choice cut by max_tokens reads a value
        the end left open as cut (its call keeps the parameters before it)."""
        reasoning, content, reasoning_end = None, r.text, None
        parser, tools = self.parsers(req)
        if parser is not None:
            reasoning, content = parser.parse(r.text)
            reasoning_end = parser.end_offset
        calls: list[dict[str, Any]] = []
        cut = False
        if tools is not None and content:
            content, calls = tools.parse(content, truncated=r.finish_reason == "length")
            cut = len(calls) - 1 in tools.cut_calls
            if not req.parallel_tool_calls:
                calls, cut = calls[:1], cut and len(calls) == 1
        finish = "tool_calls" if calls and r.finish_reason == "stop" else r.finish_reason
        return Answer(reasoning, content, calls, finish, reasoning_end, cut)

    def message(self, req: ChatRequest, r: Choice) -> tuple[dict[str, Any], str]:
        """Split a finished choice's text into reasoning, content and tool calls (an OpenAI chat message); the
        finish reason to report."""
        answer = self.split(req, r)
        message: dict[str, Any] = {"role": "assistant"}
        if self.reasoning_parser == "qwen3":
            message["reasoning_content"] = answer.reasoning
        if answer.calls:
            message["tool_calls"] = answer.calls
        message["content"] = answer.content if answer.content or not answer.calls else None
        return message, answer.finish_reason


class ChatStreamChoice:
    """One choice's parsers while streaming: text deltas in, OpenAI chat delta dicts out. `pieces` gives the deltas
    for one text: reasoning_content, then content and tool_calls in the order they came; final: the choice's last
    text, truncated: max_tokens cut it."""

    def __init__(self, chat: ChatFormat, req: ChatRequest) -> None:
        self.reasoning, self.tools = chat.parsers(req)
        self.called_tools, self.parallel_tool_calls = False, req.parallel_tool_calls

    def pieces(self, text: str, final: bool, truncated: bool = False) -> list[dict[str, Any]]:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning is not None else ("", text)
        out = [{"reasoning_content": reasoning}] if reasoning else []
        if self.tools is not None:
            return out + self._tool_pieces(content, final, truncated)
        return out + [{"content": content}] if content else out

    def _tool_pieces(self, content: str, final: bool, truncated: bool) -> list[dict[str, Any]]:
        """Content and tool_calls deltas, in the order they came."""
        tool_deltas = self.tools.feed(content) if content else []
        if final:
            tool_deltas += self.tools.finish(truncated)
        if not self.parallel_tool_calls:              # only the first call goes out
            tool_deltas = [d for d in tool_deltas if "tool_calls" not in d or d["tool_calls"][0]["index"] == 0]
        for d in tool_deltas:
            self.called_tools = self.called_tools or "tool_calls" in d
        return tool_deltas
