"""Output parsers: Qwen3 reasoning (`<think>...</think>`) and Qwen3-Coder XML tool calls.

What vLLM and SGLang call `--reasoning-parser qwen3` and `--tool-call-parser qwen3_coder`. Both are small state
machines fed with text deltas. They hold back only what could still turn into a tag, so a stream never shows half a
tag, and the non-streaming `parse` runs the very same machine over the whole text, so streaming and non-streaming
always agree. Bad model output never raises: what cannot be parsed comes back as plain content.
"""
from __future__ import annotations

import ast
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_END, PARAMETER_END = "</function>", "</parameter>"
_MAX_TAG_NAME = 256  # a `<function=...` or `<parameter=...` longer than this without `>` is not a tag


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# ---------------------------------------------------------------------------------------------------------------
# reasoning: <think> ... </think>
# ---------------------------------------------------------------------------------------------------------------

class Qwen3ReasoningParser:
    """Splits model output into reasoning_content and content.

    starts_in_reasoning: the prompt already opened `<think>` (Qwen3.5 / Qwen3-Thinking templates), so the output
        begins inside the think block and only contains `</think>`; use `prompt_opens_reasoning(prompt)`.
    enabled: False for `enable_thinking: false` requests: everything is content.
    Newlines that only frame the sections (after `<think>`, before `</think>`, after `</think>`) are dropped.
    A `<think>` is recognised only before any content: once the answer has started, tags are plain text.
    """

    def __init__(self, starts_in_reasoning: bool = False, enabled: bool = True):
        self.starts_in_reasoning = starts_in_reasoning
        self.enabled = enabled
        self._mode = "reasoning" if starts_in_reasoning else "before"   # before | reasoning | content
        self._section_start = True     # at the start of a section: strip framing newlines
        self._repeat_checked = False   # whether a repeated leading <think> was looked for
        self._buf = ""
        self.saw_reasoning = starts_in_reasoning and enabled

    def feed(self, delta: str) -> tuple[str, str]:
        """Next text delta -> (reasoning_delta, content_delta); either may be ''."""
        if not self.enabled:
            return "", delta
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        """End of output: release whatever is still held back."""
        if not self.enabled:
            return "", ""
        return self._run(final=True)

    def parse(self, text: str) -> tuple[str | None, str]:
        """Whole output -> (reasoning, or None when there was none, content)."""
        p = Qwen3ReasoningParser(self.starts_in_reasoning, self.enabled)
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        return (r1 + r2) or None, c1 + c2

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            buf = self._buf
            if self._mode == "before":
                i = buf.find(THINK_START)
                if i >= 0 and not buf[:i].strip():       # only whitespace before <think>: drop it
                    self._buf = buf[i + len(THINK_START):]
                    self._mode, self._section_start, self.saw_reasoning = "reasoning", True, True
                    continue
                hold = 0 if final else _partial_suffix(buf, THINK_START)
                if not buf[:len(buf) - hold].strip() and not final:
                    return "".join(reasoning), "".join(content)   # whitespace so far: a <think> may follow
                self._mode, self._section_start = "content", False   # the answer started without thinking
                continue
            if self._mode == "reasoning":
                if self._section_start:
                    buf = buf.lstrip("\n")
                    if not self._repeat_checked:               # the model may repeat the prompt's <think>
                        if buf.startswith(THINK_START):
                            buf = buf[len(THINK_START):].lstrip("\n")
                            self._repeat_checked = True
                        elif final or not THINK_START.startswith(buf):
                            self._repeat_checked = True
                    self._buf = buf
                    if not final and (not buf or not self._repeat_checked):
                        return "".join(reasoning), "".join(content)
                    self._section_start = False
                i = buf.find(THINK_END)
                if i >= 0:
                    reasoning.append(buf[:i].rstrip("\n"))
                    self._buf = buf[i + len(THINK_END):]
                    self._mode, self._section_start = "content", True
                    continue
                if final:
                    reasoning.append(buf)
                    self._buf = ""
                    return "".join(reasoning), "".join(content)
                hold = _partial_suffix(buf, THINK_END)
                keep = buf[:len(buf) - hold]
                hold += len(keep) - len(keep.rstrip("\n"))   # newlines right before a possible </think>
                reasoning.append(buf[:len(buf) - hold])
                self._buf = buf[len(buf) - hold:]
                return "".join(reasoning), "".join(content)
            # content
            if self._section_start:
                buf = buf.lstrip("\n")
                if not buf and not final:
                    self._buf = ""
                    return "".join(reasoning), "".join(content)
                self._section_start = False
            content.append(buf)
            self._buf = ""
            return "".join(reasoning), "".join(content)


def prompt_opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt ends inside an open think block (the template wrote `<think>` for the model)."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


# ---------------------------------------------------------------------------------------------------------------
# tool calls: Qwen3-Coder XML
# ---------------------------------------------------------------------------------------------------------------

def _schema_types(schema: Any) -> list[str]:
    """JSON-schema types a parameter allows ('type' as a string or list, or via anyOf / oneOf)."""
    if not isinstance(schema, dict):
        return []
    types: list[str] = []
    t = schema.get("type")
    for v in ([t] if isinstance(t, str) else t if isinstance(t, list) else []):
        if isinstance(v, str) and v not in types:
            types.append(v)
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            for v in _schema_types(sub):
                if v not in types:
                    types.append(v)
    return types


def _json_safe(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError, RecursionError):
        return False


def _parse_container(text: str, kind: type) -> Any:
    """JSON first, then a Python literal (models sometimes write {'a': 1}); None when it is neither."""
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except Exception:  # noqa: BLE001 - any failure means "not this format"; literal_eval raises many kinds
            continue
        if isinstance(value, kind) and _json_safe(value):
            return value
    return None


_NO_VALUE = object()


def _parse_number(s: str) -> int | float | object:
    """An int when the text is one, else a finite float, else _NO_VALUE."""
    try:
        return int(s)
    except ValueError:
        try:
            f = float(s)
        except ValueError:
            return _NO_VALUE
        return f if math.isfinite(f) else _NO_VALUE


def _convert_typed(text: str, kind: str) -> Any:
    s = text.strip()
    if kind in ("integer", "number"):
        value = _parse_number(s)
        if kind == "integer" and isinstance(value, float):
            return int(value) if value.is_integer() else _NO_VALUE
        return value
    if kind == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _NO_VALUE)
    if kind == "null":
        return None if s.lower() in ("null", "none") else _NO_VALUE
    if kind in ("object", "array"):
        value = _parse_container(s, dict if kind == "object" else list)
        return _NO_VALUE if value is None else value
    return _NO_VALUE


def convert_parameter(text: str, schema: dict | None) -> Any:
    """A parameter's text -> its JSON value, typed by the parameter's schema.

    Strings stay strings; integer/number/boolean/object/array/null are parsed; text that does not fit its declared
    type is kept as a string. Unknown parameters stay strings unless they parse as a JSON object or array.
    """
    types = _schema_types(schema)
    if not types:
        if text.strip()[:1] in ("{", "["):
            value = _parse_container(text.strip(), (dict, list))
            if value is not None:
                return value
        return text
    if "null" in types and text.strip().lower() in ("null", "none"):
        return None
    for kind in ("integer", "number", "boolean", "object", "array"):
        if kind in types:
            value = _convert_typed(text, kind)
            if value is not _NO_VALUE:
                return value
    return text


_FUNCTION_OPEN = re.compile(r"\s*<function=([^>\n]*)>")
_PARAMETER_OPEN = re.compile(r"\s*<parameter=([^>\n]*)>")
_FUNCTION_CLOSE = re.compile(r"\s*</function>")
_TOOL_CALL_CLOSE = re.compile(r"\s*</tool_call>")


def _could_become(buf: str, literals: tuple[str, ...], openers: tuple[str, ...]) -> bool:
    """Could more text turn `buf` (after leading whitespace) into one of the tags?

    literals: fixed tags (`</function>`); openers: tags with a name (`<parameter=` ... `>`).
    """
    s = buf.lstrip()
    if not s:
        return True
    for tag in literals + openers:
        if tag.startswith(s):
            return True
    for tag in openers:
        if s.startswith(tag):
            name = s[len(tag):]
            return ">" not in name and "\n" not in name and len(name) <= _MAX_TAG_NAME
    return False


@dataclass
class _Event:
    kind: str                 # "content" | "call" | "args"
    text: str = ""            # content text, or arguments fragment
    index: int = 0
    call_id: str = ""
    name: str = ""


@dataclass
class _OpenCall:
    index: int
    name: str
    event_start: int          # position in _events where this call's events begin (to undo it)
    raw: str                  # the text consumed since before `<tool_call>` (to give it back as content)
    n_params: int = 0
    param: str = ""           # parameter being read (in_param)


def _tool_function(tool: dict) -> dict:
    fn = tool.get("function") if isinstance(tool, dict) and isinstance(tool.get("function"), dict) else tool
    return fn if isinstance(fn, dict) else {}


class Qwen3CoderToolParser:
    """Parses `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>`.

    tools: the request's OpenAI tool definitions (names and parameter schemas).
    allowed_names: functions that may be called (default: every tool); calls of others stay plain content.
    Streaming (feed/finish) returns OpenAI delta dicts, the way vLLM streams: {"content": ...}; for each call one
    {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}, then argument fragments
    {"tool_calls": [{"index", "function": {"arguments": ...}}]} (one per complete parameter, then the closing
    brace) whose concatenation is the final JSON arguments string.
    Whitespace between content and a call, between calls and after the last call is dropped.
    """

    def __init__(self, tools: list[dict], allowed_names: set[str] | None = None):
        self.tools = tools
        self._schemas: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            fn = _tool_function(tool)
            name = fn.get("name")
            if isinstance(name, str):
                params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
                props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
                self._schemas[name] = props
        self.allowed_names = set(self._schemas) if allowed_names is None else set(allowed_names)
        self._reset(revert_on_error=False)

    def _reset(self, revert_on_error: bool) -> None:
        # revert_on_error (non-streaming): a call that turns out malformed is given back as content. A stream cannot
        # take back what it sent, so there the call is closed with what it had.
        self._revert = revert_on_error
        self._mode = "content"       # content | call_open | in_function | in_param | after_function
        self._buf = ""
        self._pending_ws = ""        # trailing whitespace of content: dropped if a call follows
        self._after_call = False     # drop whitespace right after a call
        self._call: _OpenCall | None = None
        self._scan = 0               # in_param: where to resume looking for the end tag
        self._events: list[_Event] = []
        self.num_calls = 0

    # ---- public API ----
    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        self._run(final=False)
        return self._take_deltas()

    def finish(self) -> list[dict]:
        self._run(final=True)
        return self._take_deltas()

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """Whole output -> (content, OpenAI tool_calls [{id, type, function: {name, arguments}}])."""
        p = Qwen3CoderToolParser(self.tools, self.allowed_names)
        p._reset(revert_on_error=True)
        p._buf = text
        p._run(final=True)
        content: list[str] = []
        calls: list[dict] = []
        for ev in p._events:
            if ev.kind == "content":
                content.append(ev.text)
            elif ev.kind == "call":
                calls.append({"id": ev.call_id, "type": "function", "function": {"name": ev.name, "arguments": ""}})
            else:
                calls[ev.index]["function"]["arguments"] += ev.text
        return "".join(content), calls

    # ---- output ----
    def _take_deltas(self) -> list[dict]:
        deltas: list[dict] = []
        for ev in self._events:
            last = deltas[-1] if deltas else None
            if ev.kind == "content":
                if not ev.text:
                    continue
                if last is not None and "content" in last:
                    last["content"] += ev.text
                else:
                    deltas.append({"content": ev.text})
            elif ev.kind == "call":
                deltas.append({"tool_calls": [{"index": ev.index, "id": ev.call_id, "type": "function",
                                               "function": {"name": ev.name, "arguments": ""}}]})
            else:
                prev = last["tool_calls"][0] if last is not None and "tool_calls" in last else None
                if prev is not None and prev["index"] == ev.index and "id" not in prev:
                    prev["function"]["arguments"] += ev.text
                else:
                    deltas.append({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]})
        self._events = []
        return deltas

    def _content(self, text: str) -> None:
        """Emit content, holding trailing whitespace (dropped if a tool call comes next)."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        stripped = text.rstrip()
        if not stripped:
            self._pending_ws += text
            return
        self._events.append(_Event("content", self._pending_ws + stripped))
        self._pending_ws = text[len(stripped):]

    def _give_back(self, raw: str) -> None:
        """Malformed call: its text becomes content verbatim."""
        self._events.append(_Event("content", raw))
        self._after_call = False
        self._mode = "content"

    def _args(self, fragment: str) -> None:
        assert self._call is not None
        self._events.append(_Event("args", fragment, index=self._call.index))

    def _end_call(self) -> None:
        self._call = None
        self._mode = "content"
        self._after_call = True

    def _abort_call(self, final: bool, in_param: bool = False) -> None:
        """The open call is malformed or unfinished: give it back (non-streaming) or close it (streaming).

        In a stream, text after the point of failure continues as content, except an unfinished last parameter.
        """
        call = self._call
        assert call is not None
        self._call = None
        if self._revert:
            del self._events[call.event_start:]
            self.num_calls -= 1
            self._give_back(call.raw)
            return
        self._events.append(_Event("args", "}" if call.n_params else "{}", index=call.index))
        self._mode = "content"
        self._after_call = False
        if final and in_param:
            self._buf = ""          # a parameter cut off by the end of output is dropped, not shown as content

    # ---- the state machine ----
    def _run(self, final: bool) -> None:
        while True:
            buf = self._buf
            mode = self._mode
            if mode == "content":
                i = buf.find(TOOL_CALL_START)
                if i >= 0:
                    self._content(buf[:i])
                    prefix, self._pending_ws = self._pending_ws, ""
                    self._call = _OpenCall(index=self.num_calls, name="", event_start=len(self._events),
                                           raw=prefix + TOOL_CALL_START)
                    self._buf = buf[i + len(TOOL_CALL_START):]
                    self._mode = "call_open"
                    continue
                hold = 0 if final else _partial_suffix(buf, TOOL_CALL_START)
                self._content(buf[:len(buf) - hold])
                self._buf = buf[len(buf) - hold:]
                if final:
                    if self.num_calls == 0:     # no call: trailing whitespace is part of the answer
                        self._events.append(_Event("content", self._pending_ws))
                    self._pending_ws = ""
                return
            call = self._call
            assert call is not None
            if mode == "call_open":
                m = _FUNCTION_OPEN.match(buf)
                if m:
                    name = m.group(1).strip()
                    call.raw += m.group(0)
                    self._buf = buf[m.end():]
                    if name in self.allowed_names:
                        call.name = name
                        self._events.append(_Event("call", index=call.index, name=name,
                                                   call_id=f"call_{uuid.uuid4().hex[:24]}"))
                        self.num_calls += 1
                        self._mode = "in_function"
                    else:                       # unknown (or not chosen) function: plain text
                        self._call = None
                        self._give_back(call.raw)
                    continue
                if not final and _could_become(buf, (), ("<function=",)):
                    return
                self._call = None
                self._give_back(call.raw)       # `<tool_call>` not followed by `<function=`: plain text
                continue
            if mode == "in_function":
                m = _PARAMETER_OPEN.match(buf)
                if m:
                    call.param = m.group(1).strip()
                    call.raw += m.group(0)
                    self._buf = buf[m.end():]
                    self._scan = 0
                    self._mode = "in_param"
                    continue
                m = _FUNCTION_CLOSE.match(buf)
                if m:
                    call.raw += m.group(0)
                    self._buf = buf[m.end():]
                    self._args("}" if call.n_params else "{}")
                    self._mode = "after_function"
                    continue
                if not final and _could_become(buf, (FUNCTION_END,), ("<parameter=",)):
                    return
                self._abort_call(final)
                continue
            if mode == "in_param":
                ends = [j for j in (buf.find(PARAMETER_END, self._scan), buf.find(FUNCTION_END, self._scan))
                        if j >= 0]
                if not ends:
                    if not final:
                        self._scan = max(0, len(buf) - len(PARAMETER_END) + 1)
                        return
                    self._abort_call(final, in_param=True)
                    continue
                j = min(ends)
                value = buf[:j]
                consumed = j + (len(PARAMETER_END) if buf.startswith(PARAMETER_END, j) else 0)
                call.raw += buf[:consumed]
                self._buf = buf[consumed:]
                self._add_parameter(call, value)
                self._mode = "in_function"
                continue
            if mode == "after_function":
                m = _TOOL_CALL_CLOSE.match(buf)
                if m:
                    self._buf = buf[m.end():]
                    self._end_call()
                    continue
                if not final and _could_become(buf, (TOOL_CALL_END,), ()):
                    return
                self._end_call()                # `</tool_call>` missing: the call is complete anyway
                continue
            raise AssertionError(f"unknown parser mode {mode}")

    def _add_parameter(self, call: _OpenCall, value: str) -> None:
        # The format puts the value on its own lines: strip exactly one framing newline on each side.
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        typed = convert_parameter(value, self._schemas.get(call.name, {}).get(call.param))
        lead = ", " if call.n_params else "{"
        self._args(f"{lead}{json.dumps(call.param, ensure_ascii=False)}: {json.dumps(typed, ensure_ascii=False)}")
        call.n_params += 1


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
        known = {_tool_function(t).get("name") for t in tools}
        if name not in known:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return Qwen3CoderToolParser(tools, allowed_names={name})
    raise ValueError(f'tool_choice must be "none", "auto", "required" or a named function, got {tool_choice!r}')
