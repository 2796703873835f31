"""Anthropic's context_management edits (the context-management-2025-06-27 beta), applied to a chat request's
messages before they are rendered, as Anthropic applies them before the prompt reaches the model: the client keeps
the whole history and sends it every turn; the server edits what the model sees.

  clear_thinking_20251015  keep "all" (nothing is cleared: Claude Code's choice, which keeps the prompt the prefix
                           cache holds) or {"type": "thinking_turns", "value": N}: the reasoning of every assistant
                           message but the last N that have some is dropped. Without this edit the chat template's
                           own rule applies (Qwen's: reasoning is shown only after the last user query).
  clear_tool_uses_20250919 once the prompt is longer than `trigger` ({"type": "input_tokens", "value": 100000} by
                           default, or {"type": "tool_uses", "value": N}), the results of every tool use but the last
                           `keep` ({"type": "tool_uses", "value": 3}) become CLEARED_RESULT, oldest first, skipping
                           the tools named in `exclude_tools`; `clear_tool_inputs` (true, or a list of tool names)
                           empties those calls' arguments too; with `clear_at_least` ({"type": "input_tokens",
                           "value": N}) nothing is cleared unless that many tokens would go.
Each edit that cleared something is reported in the response's context_management.applied_edits (cleared turns or
tool uses, and the tokens they held). Clearing changes the prompt at the first cleared message, so the prefix cache
is read up to there: as on Anthropic's API, clear_at_least makes each clearing worth that.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .protocol import bad_request

CLEAR_THINKING, CLEAR_TOOL_USES = "clear_thinking_20251015", "clear_tool_uses_20250919"
CLEARED_RESULT = "[This tool result was cleared to save context.]"


@dataclass(frozen=True)
class Edit:
    kind: str
    keep: int | None = None           # thinking turns or tool uses kept; None: keep all (clear_thinking "all")
    trigger: tuple[str, int] = ("input_tokens", 100000)
    clear_at_least: int = 0
    exclude_tools: frozenset[str] = frozenset()
    clear_inputs: bool | frozenset[str] = False


def _count(value: Any, p: str, types: tuple[str, ...]) -> tuple[str, int]:
    """{"type": one of types, "value": integer >= 0} -> (type, value)."""
    kind = value.get("type") if isinstance(value, dict) else None
    number = value.get("value") if isinstance(value, dict) else None
    if kind not in types or not isinstance(number, int) or isinstance(number, bool) or number < 0:
        shown = " | ".join(f'"{t}"' for t in types)
        raise bad_request(f'{p} must be {{"type": {shown}, "value": an integer >= 0}}', p)
    return kind, number


def _names(value: Any, p: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request(f"{p} must be a list of tool names", p)
    return frozenset(value)


def parse_edits(value: Any) -> list[Edit]:
    """context_management -> its edits, checked; a type this server does not apply is refused by name."""
    if value is None:
        return []
    edits = value.get("edits") if isinstance(value, dict) else None
    if not isinstance(edits, list):
        raise bad_request('context_management must be {"edits": [...]}', "context_management")
    out: list[Edit] = []
    for i, e in enumerate(edits):
        p = f"context_management.edits[{i}]"
        kind = e.get("type") if isinstance(e, dict) else None
        if kind == CLEAR_THINKING:
            if i != 0:
                raise bad_request(f"{p}: {CLEAR_THINKING} must be the first edit", f"{p}.type")
            keep = e.get("keep", {"type": "thinking_turns", "value": 1})
            out.append(Edit(kind, None if keep == "all" else _count(keep, f"{p}.keep", ("thinking_turns",))[1]))
        elif kind == CLEAR_TOOL_USES:
            inputs = e.get("clear_tool_inputs", False)
            out.append(Edit(
                kind, keep=_count(e.get("keep", {"type": "tool_uses", "value": 3}), f"{p}.keep", ("tool_uses",))[1],
                trigger=_count(e.get("trigger", {"type": "input_tokens", "value": 100000}), f"{p}.trigger",
                               ("input_tokens", "tool_uses")),
                clear_at_least=_count(e["clear_at_least"], f"{p}.clear_at_least", ("input_tokens",))[1]
                if e.get("clear_at_least") is not None else 0,
                exclude_tools=_names(e.get("exclude_tools", []), f"{p}.exclude_tools"),
                clear_inputs=inputs if isinstance(inputs, bool) else _names(inputs, f"{p}.clear_tool_inputs")))
        else:
            raise bad_request(f'{p}.type must be "{CLEAR_THINKING}" or "{CLEAR_TOOL_USES}"; got {kind!r}',
                              f"{p}.type")
    return out


def apply_edits(messages: list[dict[str, Any]], edits: list[Edit], prompt_tokens: int,
                count: Callable[[str], int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the edited messages, the applied_edits to report). `messages` are chat messages (OpenAI's shape: reasoning in
    reasoning_content, calls in tool_calls, results as "tool" messages); `prompt_tokens` is the unedited prompt's
    length; `count(text)` the tokens of a text. The caller's messages are not changed."""
    messages = [dict(m) for m in messages]
    applied: list[dict[str, Any]] = []
    for edit in edits:
        if edit.kind == CLEAR_THINKING:
            cleared, tokens = _clear_thinking(messages, edit.keep, count)
            if cleared:
                applied.append({"type": edit.kind, "cleared_thinking_turns": cleared, "cleared_input_tokens": tokens})
        else:
            cleared, tokens = _clear_tool_uses(messages, edit, prompt_tokens - sum(a["cleared_input_tokens"]
                                                                                   for a in applied), count)
            if cleared:
                applied.append({"type": edit.kind, "cleared_tool_uses": cleared, "cleared_input_tokens": tokens})
    return messages, applied


def _clear_thinking(messages: list[dict[str, Any]], keep: int | None, count: Callable[[str], int]
                    ) -> tuple[int, int]:
    if keep is None:
        return 0, 0
    thinking = [m for m in messages if m.get("role") == "assistant" and m.get("reasoning_content")]
    cleared = thinking[:max(0, len(thinking) - keep)]
    tokens = sum(count(m.pop("reasoning_content")) for m in cleared)
    return len(cleared), tokens


def _clear_tool_uses(messages: list[dict[str, Any]], edit: Edit, prompt_tokens: int, count: Callable[[str], int]
                     ) -> tuple[int, int]:
    # every call, oldest first: (its assistant message, its index in tool_calls, its name, its result message)
    results = {m.get("tool_call_id"): m for m in messages if m.get("role") == "tool"}
    uses = [(m, j, call["function"]["name"], results.get(call.get("id")))
            for m in messages if m.get("role") == "assistant" for j, call in enumerate(m.get("tool_calls") or [])]
    kind, limit = edit.trigger
    if (prompt_tokens if kind == "input_tokens" else len(uses)) <= limit:
        return 0, 0
    candidates = [u for u in uses[:max(0, len(uses) - edit.keep)] if u[2] not in edit.exclude_tools]
    cleared: list[tuple[dict[str, Any], int, str, dict[str, Any] | None]] = []
    tokens = 0
    for use in candidates:
        m, j, name, result = use
        clears_input = edit.clear_inputs is True or (isinstance(edit.clear_inputs, frozenset)
                                                    and name in edit.clear_inputs)
        gain = 0
        if result is not None and result.get("content") != CLEARED_RESULT:
            gain += max(0, count(str(result.get("content") or "")) - count(CLEARED_RESULT))
        if clears_input:
            gain += count(str(m["tool_calls"][j]["function"].get("arguments") or ""))
        if gain:
            cleared.append(use)
            tokens += gain
    if not cleared or tokens < edit.clear_at_least:
        return 0, 0
    for m, j, name, result in cleared:
        if result is not None:
            result["content"] = CLEARED_RESULT
        if edit.clear_inputs is True or (isinstance(edit.clear_inputs, frozenset) and name in edit.clear_inputs):
            calls = [dict(c) for c in m["tool_calls"]]
            calls[j] = {**calls[j], "function": {**calls[j]["function"], "arguments": {}}}
            m["tool_calls"] = calls
    return len(cleared), tokens
