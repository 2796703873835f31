"""Qwen3-Coder XML tool calls, as models write them: `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n
</parameter>\\n...</function>\\n</tool_call>`.

What vLLM and SGLang call `--tool-call-parser qwen3_coder`, built for what models really emit over an agent's hours:
  - a call without the `<tool_call>` wrapper (`<function=NAME>` at the start of a line) is a call when NAME is one of
    the request's functions;
  - a missing `</parameter>`, `</function>` or `</tool_call>` is recovered;
  - a string value ends only at a closing tag that the rest of the call confirms: `</parameter>` followed by the
    opener of a parameter not given yet, or a `</function>` / `</tool_call>` after which comes the end of the output,
    the next call, or text that holds no closing tag. So a file an agent writes may hold `</parameter>`,
    `</function>`, `<tool_call>` or a whole call as literal text, and no key is ever given twice;
  - a value that swallowed the opener of a parameter of the tool that is never given (`\\n<parameter=B>\\n` on its
    own line) is split there: the model forgot `</parameter>`.
One machine serves both modes: `parse` feeds the whole text and finishes, a stream feeds deltas. It decides nothing
that more text could change, so a stream emits exactly what `parse` returns at every chunking: the call's header
(id and name) once its body starts, each argument once the rest of the call confirms it, and nothing of a call in
the content. Bad model output never raises.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tinyserve.tool_values import convert_parameter

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
PARAMETER_START, PARAMETER_END = "<parameter=", "</parameter>"
CLOSERS = (PARAMETER_END, FUNCTION_END, TOOL_CALL_END)
MAX_TAG_NAME = 256            # a `<function=...` or `<parameter=...` longer than this without `>` is not a tag

_CLOSER = re.compile("|".join(re.escape(t) for t in CLOSERS))
_PARAM_TAG = re.compile(r"<parameter=([^>\n]{0,%d})>" % MAX_TAG_NAME)
_NAME_END = re.compile(r"([^>\n]{0,%d})>" % MAX_TAG_NAME)
_LINE_PARAM = re.compile(r"(?:^|\n)[ \t]*<parameter=([^>\n]{1,%d})>" % MAX_TAG_NAME)
_MARKUP = re.compile(r"</?(?:tool_call>|function[=>]|parameter[=>])")

# call_start verdicts
YES, NO, WAIT, CUT = "yes", "no", "wait", "cut"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def at_line_start(text: str, i: int, flag: bool) -> bool:
    """Whether text[i] starts a line (spaces before it allowed); `flag` says it for the start of `text`."""
    while i > 0 and text[i - 1] in " \t":
        i -= 1
    return flag if i == 0 else text[i - 1] == "\n"


def _proper_prefix(rest: str, *tags: str) -> bool:
    return bool(rest) and any(len(rest) < len(t) and t.startswith(rest) for t in tags)


def call_start(text: str, i: int, names: set[str], line_start: bool, final: bool) -> tuple[str, int, str]:
    """Does a call of one of `names` start at text[i]? (verdict, end of its `<function=NAME>` tag, NAME).

    YES / NO; WAIT (not final): the text ends inside what may still become one; CUT (final only): the output ended
    inside the opener of a call (`<tool_call>` and then part of `<function=NAME`, or a bare `<function=` with part of
    a name). A bare `<function=` counts only at the start of a line (`line_start` for text[0])."""
    rest = text[i:i + len(TOOL_CALL_START)]
    undecided = (CUT if final else WAIT, 0, "")
    if text.startswith(TOOL_CALL_START, i):
        j = _skip_ws(text, i + len(TOOL_CALL_START))
        if j == len(text) or _proper_prefix(text[j:j + len(FUNCTION_START)], FUNCTION_START):
            return undecided
        if not text.startswith(FUNCTION_START, j):
            return NO, 0, ""
        wrapped = True
        j += len(FUNCTION_START)
    elif text.startswith(FUNCTION_START, i) and at_line_start(text, i, line_start):
        wrapped = False
        j = i + len(FUNCTION_START)
    elif not final and (_proper_prefix(rest, TOOL_CALL_START) and i + len(rest) == len(text)
                        or _proper_prefix(text[i:], FUNCTION_START) and at_line_start(text, i, line_start)):
        return WAIT, 0, ""
    else:
        return NO, 0, ""
    m = _NAME_END.match(text, j)
    if m is None:
        partial = text[j:]
        if len(partial) > MAX_TAG_NAME or "\n" in partial or ">" in partial:
            return NO, 0, ""
        if not final:
            return WAIT, 0, ""
        cut = wrapped or any(n.startswith(partial.strip()) for n in names)
        return (CUT, 0, "") if cut else (NO, 0, "")
    name = m.group(1).strip()
    return (YES, m.end(), name) if name in names else (NO, 0, "")


def _frame(raw: str) -> str:
    """The format puts a value on its own lines: exactly one framing newline on each side is markup."""
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


# ---------------------------------------------------------------------------------------------------------------
# the parser
# ---------------------------------------------------------------------------------------------------------------

FREEFORM_INPUT = "input"              # the one parameter of a freeform tool (Responses `custom`)
FORMAT_SYNTAXES = ("lark", "regex")   # the grammars a freeform tool's format may give its input in


def tool_function(tool: dict) -> dict:
    """The function of an OpenAI tool ({"type": "function", "function": {...}}) or the bare function object."""
    fn = tool.get("function") if isinstance(tool, dict) and isinstance(tool.get("function"), dict) else tool
    return fn if isinstance(fn, dict) else {}


@dataclass
class _Event:
    kind: str                 # "content" | "call" | "args"
    text: str = ""            # content text, or arguments fragment
    index: int = 0
    call_id: str = ""
    name: str = ""


@dataclass
class _Call:
    index: int
    name: str
    opener: str               # `<tool_call>\n<function=NAME>` as written: content again if no body follows
    ws_before: str            # whitespace between the content and the opener (dropped when it is a call)
    committed: bool = False   # its header (id, name) is out: it is a call whatever follows
    params: list[tuple[str, str]] = field(default_factory=list)   # decided (name, raw value)
    sent: int = 0             # params whose argument fragments are out
    held: bool = False        # a value may hide a missing </parameter>: the rest waits for the end of the call


class Qwen3CoderToolParser:
    """Splits model output into content and tool calls.

    tools: the request's OpenAI tool definitions (names and parameter schemas).
    allowed_names: functions that may be called (default: every tool); calls of others stay plain content.
    Streaming (feed / finish) returns OpenAI delta dicts, the way vLLM streams: {"content": ...}; for each call one
    {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}, then argument fragments
    {"tool_calls": [{"index", "function": {"arguments": ...}}]} (complete parameters, the closing brace with the
    last one) whose concatenation is the final JSON arguments string.
    finish(truncated=True): the output was cut by max_tokens, so a value the end of output left open is dropped
    (its call keeps the parameters before it) rather than read up to the first closing tag it holds.
    Whitespace between content and a call, between calls and after the last call is dropped; the opener of a call
    the end of output cut off is dropped too (markup, not an answer).
    """

    def __init__(self, tools: list[dict], allowed_names: set[str] | None = None):
        self.tools = tools
        self._schemas: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            fn = tool_function(tool)
            name = fn.get("name")
            if isinstance(name, str):
                params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
                props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
                self._schemas[name] = props
        self.allowed_names = set(self._schemas) if allowed_names is None else set(allowed_names)
        self._buf = ""
        self._call: _Call | None = None
        self._pos = 0                # in a call: where the next element of its body starts in _buf
        self._closers_from = 0       # in a value: closing tags before this index are known not to end it
        self._line_start = True      # whether _buf[0] starts a line (a bare `<function=` may start a call there)
        self._pending_ws = ""        # trailing whitespace of content: dropped if a call follows
        self._after_call = False     # drop whitespace right after a call
        self._events: list[_Event] = []
        self._truncated = False
        self.num_calls = 0
        self.cut_calls: set[int] = set()   # calls the end of output cut off (finish / parse with truncated)

    # ---- public API ----
    @property
    def open_call(self) -> int | None:
        """The index of the call whose end the text has not reached yet (its header went out), else None."""
        return self._call.index if self._call is not None and self._call.committed else None

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        # In a call, scanning again only when a tag can have closed (a '>') changes when a decision comes, not what
        # it is, and keeps a long value from being rescanned at every token.
        if self._call is None or ">" in delta:
            self._run(final=False)
        return self._take_deltas()

    def finish(self, truncated: bool = False) -> list[dict]:
        self._truncated = truncated
        self._run(final=True)
        return self._take_deltas()

    def parse(self, text: str, truncated: bool = False) -> tuple[str, list[dict]]:
        """Whole output -> (content, OpenAI tool_calls [{id, type, function: {name, arguments}}]); the calls the end
        of a truncated output cut off are in cut_calls."""
        p = Qwen3CoderToolParser(self.tools, self.allowed_names)
        p._buf, p._truncated = text, truncated
        p._run(final=True)
        self.cut_calls = p.cut_calls
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
        if text:
            kept = text.rstrip(" \t")
            self._line_start = kept.endswith("\n") if kept else self._line_start
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

    # ---- the machine ----
    def _run(self, final: bool) -> None:
        while self._scan_body(final) if self._call is not None else self._scan_content(final):
            pass

    def _scan_content(self, final: bool) -> bool:
        """Content up to the next call start. True when a call opened (go on in its body)."""
        buf, pos = self._buf, 0
        while (i := buf.find("<", pos)) >= 0:
            verdict, end, name = call_start(buf, i, self.allowed_names, self._line_start, final)
            if verdict == NO:
                pos = i + 1
                continue
            self._content(buf[:i])
            if verdict == WAIT:
                self._buf = buf[i:]
                return False
            if verdict == CUT:                       # a call the end of output cut off before its name was whole
                self._buf, self._pending_ws = "", ""
                return False
            self._call = _Call(self.num_calls, name, buf[i:end], self._pending_ws)
            self._pending_ws = ""
            self._buf, self._pos = buf[end:], 0
            return True
        self._content(buf)
        self._buf = ""
        if final:
            if self.num_calls == 0:                  # no call: trailing whitespace is part of the answer
                self._events.append(_Event("content", self._pending_ws))
            self._pending_ws = ""
        return False

    def _scan_body(self, final: bool) -> bool:
        """The open call's parameters, as far as the text decides them. True when the call ended (or turned out to
        be no call)."""
        call, buf = self._call, self._buf
        assert call is not None
        while True:
            pos = _skip_ws(buf, self._pos)
            if not call.committed:
                verdict = self._body_starts(buf, pos, final)
                if verdict is None:
                    return False
                if not verdict:                      # `<function=NAME>` followed by prose: plain text
                    self._call, self._pending_ws = None, call.ws_before
                    self._content(call.opener)
                    return True
                call.committed = True
                self.num_calls += 1
                self._events.append(_Event("call", index=call.index, name=call.name,
                                           call_id=f"call_{uuid.uuid4().hex[:24]}"))
            m = _PARAM_TAG.match(buf, pos)
            if m is None:
                end = self._call_end(buf, pos, final)
                if end is None:
                    return False
                self._end_call(end, cut=self._truncated and not buf.startswith((FUNCTION_END, TOOL_CALL_END), pos))
                return True
            name = m.group(1).strip()
            value_end = self._value_end(buf, m.end(), name, final)
            if value_end is None:
                return False
            if value_end is CUT_VALUE:               # the end of output left this value open: dropped
                self._end_call(len(buf), cut=self._truncated)
                return True
            close, after = value_end
            call.params.append((name, buf[m.end():close]))
            self._pos = after
            if not call.held:
                call.held = self._may_hide_a_parameter(call, name, buf[m.end():close])
            if not call.held:
                self._send(call, final=False)

    def _body_starts(self, buf: str, pos: int, final: bool) -> bool | None:
        """After `<function=NAME>`: a parameter, `</function>` or `</tool_call>` (or the end of output) make it a
        call; prose makes it plain text; None: too early to say."""
        rest = buf[pos:]
        if _PARAM_TAG.match(buf, pos) or rest.startswith((FUNCTION_END, TOOL_CALL_END)):
            return True
        if not rest or (rest.startswith(PARAMETER_START) and _name_may_follow(buf, pos + len(PARAMETER_START))) \
                or _proper_prefix(rest, PARAMETER_START, FUNCTION_END, TOOL_CALL_END):
            return True if final else None          # cut off right after the name: a call without arguments
        return False

    def _call_end(self, buf: str, pos: int, final: bool) -> int | None:
        """Where the call ends when no parameter comes next: after `</function>` (and `</tool_call>`)."""
        if buf.startswith(FUNCTION_END, pos):
            j = _skip_ws(buf, pos + len(FUNCTION_END))
            if buf.startswith(TOOL_CALL_END, j):
                return j + len(TOOL_CALL_END)
            if not final and (j == len(buf) or _proper_prefix(buf[j:], TOOL_CALL_END)):
                return None
            return pos + len(FUNCTION_END)
        if buf.startswith(TOOL_CALL_END, pos):
            return pos + len(TOOL_CALL_END)
        if pos == len(buf) or _proper_prefix(buf[pos:], PARAMETER_START, FUNCTION_END, TOOL_CALL_END) \
                or (buf.startswith(PARAMETER_START, pos) and _name_may_follow(buf, pos + len(PARAMETER_START))):
            return len(buf) if final else None       # cut off: what is left of the call is markup
        return pos                                   # text after a value: the call ended without its closers

    def _value_end(self, buf: str, start: int, name: str, final: bool) -> tuple[int, int] | object | None:
        """(end of the value, where the call goes on) for the value starting at `start`; CUT_VALUE when the end of
        output leaves it open; None: too early to say."""
        seen = {n for n, _ in self._call.params} | {name}
        for m in _CLOSER.finditer(buf, max(start, self._closers_from)):
            plain = _MARKUP.search(buf, start, m.start()) is None
            verdict = self._confirmed(buf, m.start(), m.group(), seen, final, plain)
            if verdict is None:
                self._closers_from = m.start()
                return None
            if verdict:
                self._closers_from = 0
                return m.start(), m.end() if m.group() == PARAMETER_END else m.start()
        if not final:                                # a "no" never turns "yes": look only at new text next time
            self._closers_from = max(start, self._closers_from, len(buf) - len(TOOL_CALL_END) + 1)
            return None
        if self._truncated:
            return CUT_VALUE
        # The output ended and no closing tag is confirmed by what follows it (text with closing tags after the
        # call): the first closing tag that reads as structure where it stands.
        for m in _CLOSER.finditer(buf, start):
            if m.group() != PARAMETER_END:
                return m.start(), m.start()
            a = _skip_ws(buf, m.end())
            if buf.startswith((FUNCTION_END, TOOL_CALL_END), a) or self._next_parameter(buf, a, seen, final):
                return m.start(), m.end()
        return CUT_VALUE

    def _confirmed(self, buf: str, k: int, tag: str, seen: set[str], final: bool, plain: bool = False
                   ) -> bool | None:
        """Does the rest of the call confirm that this closing tag ends the value? plain: the value holds no tool-call
        markup, so the call's closing tags end it even before the text after them is seen."""
        if tag != PARAMETER_END:                     # `</function>` / `</tool_call>` with `</parameter>` missing
            return self._call_ends_here(buf, k, final)
        a = _skip_ws(buf, k + len(tag))
        if buf.startswith(PARAMETER_START, a):
            return self._next_parameter(buf, a, seen, final)
        if not final and _proper_prefix(buf[a:], PARAMETER_START):
            return None
        return self._call_ends_here(buf, a, final, plain)

    def _next_parameter(self, buf: str, a: int, seen: set[str], final: bool) -> bool | None:
        """At `<parameter=`: the opener of a parameter not given yet? One the tool does not declare counts only when
        its own value ends at its first closing tag (a template line inside a file is no parameter)."""
        m = _PARAM_TAG.match(buf, a)
        if m is None:
            return None if not final and _name_may_follow(buf, a + len(PARAMETER_START)) else False
        name = m.group(1).strip()
        if name in seen:
            return False
        if self._known(name):
            return True
        first = _CLOSER.search(buf, m.end())
        if first is None:
            return True if final else None
        return self._confirmed(buf, first.start(), first.group(), seen | {name}, final)

    def _call_ends_here(self, buf: str, a: int, final: bool, plain: bool = False) -> bool | None:
        """At `a`: `</function>` and `</tool_call>` (each optional), then the end of output, the next call, or text
        without a closing tag up to either. A plain value (no markup in it) closed by `</parameter>` is ended by the
        `</function>` after it as soon as that comes: only a value that quotes markup (an example call, a parser's
        fixture) may go on after one, so only such a value waits for what follows (a stream sends the last argument
        with the delta that closes the call)."""
        a = _skip_ws(buf, a)
        closed = buf.startswith(FUNCTION_END, a)
        for tag in (FUNCTION_END, TOOL_CALL_END):
            if buf.startswith(tag, a):
                a = _skip_ws(buf, a + len(tag))
            elif not final and _proper_prefix(buf[a:], tag):
                return None
        if plain and closed and _CLOSER.search(buf, a) is None:
            return True
        pos = a
        while (i := buf.find("<", pos)) >= 0:
            rest = buf[i:i + len(TOOL_CALL_END)]
            if rest.startswith(CLOSERS):
                return False                         # a closing tag after the "end": it was inside the value
            if not final and _proper_prefix(buf[i:], *CLOSERS):
                return None
            verdict, _, _ = call_start(buf, i, self.allowed_names, False, final)
            if verdict in (YES, CUT):
                return True
            if verdict == WAIT:
                return None
            pos = i + 1
        return True if final else None

    def _known(self, name: str) -> bool:
        props = self._schemas.get(self._call.name) or {}
        return not props or name in props            # a tool without declared parameters takes any name

    def _may_hide_a_parameter(self, call: _Call, name: str, raw: str) -> bool:
        props = self._schemas.get(call.name) or {}
        given = {n for n, _ in call.params}
        return any(m.group(1).strip() in props and m.group(1).strip() not in given for m in _LINE_PARAM.finditer(raw))

    def _split(self, name: str, raw: str, keys: set[str]) -> list[tuple[str, str]]:
        """A value holding `\\n<parameter=B>\\n` of a parameter of the tool given nowhere else: `</parameter>` was
        missing; B's value follows."""
        props = self._schemas.get(self._call.name) or {}
        out = []
        while True:
            hit = next((m for m in _LINE_PARAM.finditer(raw)
                        if m.group(1).strip() in props and m.group(1).strip() not in keys), None)
            if hit is None:
                out.append((name, raw))
                return out
            out.append((name, raw[:hit.start() + (1 if raw[hit.start()] == "\n" else 0)]))
            name, raw = hit.group(1).strip(), raw[hit.end():]
            keys.add(name)

    def _send(self, call: _Call, final: bool) -> None:
        """Argument fragments of the decided parameters not sent yet (at the end of the call: split where a
        `</parameter>` was missing, and the closing brace)."""
        todo = call.params[call.sent:]
        if final and call.held:
            keys = {n for n, _ in call.params}
            todo = [piece for n, raw in todo for piece in self._split(n, raw, keys)]
        schema = self._schemas.get(call.name) or {}
        fragment = ""
        for i, (name, raw) in enumerate(todo):
            typed = convert_parameter(_frame(raw), schema.get(name))
            lead = ", " if call.sent + i else "{"
            fragment += f"{lead}{json.dumps(name, ensure_ascii=False)}: {json.dumps(typed, ensure_ascii=False)}"
        if final:
            fragment += "}" if call.sent + len(todo) else "{}"
        call.sent = len(call.params) if not final else call.sent + len(todo)
        if fragment:
            self._events.append(_Event("args", fragment, index=call.index))

    def _end_call(self, end: int, cut: bool = False) -> None:
        call = self._call
        assert call is not None and call.committed
        if cut:
            self.cut_calls.add(call.index)
        self._send(call, final=True)
        self._call = None
        self._buf, self._pos, self._closers_from = self._buf[end:], 0, 0
        self._after_call, self._line_start = True, True


CUT_VALUE = object()


def _name_may_follow(text: str, j: int) -> bool:
    """After `<parameter=`: the text ends in what may still become a name and its `>`."""
    partial = text[j:]
    return len(partial) <= MAX_TAG_NAME and "\n" not in partial and ">" not in partial
