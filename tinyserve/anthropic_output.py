"""What POST /v1/messages answers: the message body, its usage and the stream's events (anthropic.py parses the
request).

Mapping (response): content blocks thinking, text and tool_use ("toolu_..." ids) in the order the model wrote them;
stop_reason end_turn | max_tokens | stop_sequence | tool_use. Usage follows Anthropic's split: input_tokens is the
uncached part of the prompt, cache_read_input_tokens the prompt tokens served from the prefix cache,
cache_creation_input_tokens 0 (writing the cache costs nothing extra here), so their sum is the prompt length; with
the thinking-token-count beta, output_tokens_details.thinking_tokens counts the generated tokens of the think block.
A request's context_management edits are reported as Anthropic reports them (applied_edits), on the message and on
the stream's message_delta.

Thinking blocks carry a signature: "" (nothing to sign) when their text is shown; with thinking.display "omitted" the
block's text is empty and the signature carries it (THINKING_SIGNATURE), so that a client sending the block back
gives the model its own reasoning again and the prompt stays the one the prefix cache holds.
"""
from __future__ import annotations

import base64
import binascii
import json
from typing import TYPE_CHECKING, Any, Callable

from .chat import ChatFormat, ChatStreamChoice, count_reasoning_tokens
from .protocol import APIError, ChoiceResult, Delta, Meta, NamedEventStream, Usage

if TYPE_CHECKING:
    from .anthropic import MessagesRequest

THINKING_SIGNATURE = "tinyserve-thinking:"     # + the omitted thinking text, base64 (UTF-8)

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors). Statuses are the server's own
# (a full queue is 503 + Retry-After, not Anthropic's 529); the type says what kind of failure it is.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(err: APIError) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}; the field in question, when known, leads the message."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def omitted_thinking_signature(text: str) -> str:
    return THINKING_SIGNATURE + base64.b64encode(text.encode()).decode()


def thinking_from_signature(signature: Any) -> str | None:
    """The thinking text a signature of ours carries; None for any other signature (Anthropic's own, "")."""
    if not isinstance(signature, str) or not signature.startswith(THINKING_SIGNATURE):
        return None
    try:
        return base64.b64decode(signature[len(THINKING_SIGNATURE):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def usage_body(req: MessagesRequest, usage: Usage, thinking_tokens: int) -> dict[str, Any]:
    cached = usage.cached_tokens or 0
    body: dict[str, Any] = {"input_tokens": usage.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": cached, "output_tokens": usage.completion_tokens}
    if req.count_thinking_tokens:
        body["output_tokens_details"] = {"thinking_tokens": thinking_tokens}
    return body


def tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or "").removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:                      # the parser writes JSON; never fail an answer over it
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str | None, stop_string: str | None, called_tools: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return ("tool_use" if called_tools else "end_turn"), None


def _thinking_block(req: MessagesRequest, text: str) -> dict[str, Any]:
    if req.omit_thinking:
        return {"type": "thinking", "thinking": "", "signature": omitted_thinking_signature(text)}
    return {"type": "thinking", "thinking": text, "signature": ""}


def _context_management(req: MessagesRequest) -> dict[str, Any]:
    return {"context_management": {"applied_edits": req.applied_edits}} if req.edits else {}


def message_body(format: ChatFormat, req: MessagesRequest, meta: Meta, r: ChoiceResult, usage: Usage
                 ) -> dict[str, Any]:
    answer = format.split(req.chat, r)
    content: list[dict[str, Any]] = []
    if answer.reasoning:
        content.append(_thinking_block(req, answer.reasoning))
    if answer.content:
        content.append({"type": "text", "text": answer.content})
    for call in answer.calls:
        content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                        "input": _input(call["function"]["arguments"])})
    reason, sequence = stop_reason(r.finish_reason, r.stop_string, bool(answer.calls))
    thinking = count_reasoning_tokens(r.token_ids, meta.token_text, answer.reasoning, answer.reasoning_end)
    return {"id": meta.request_id, "type": "message", "role": "assistant", "model": meta.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_body(req, usage, thinking), **_context_management(req)}


class MessagesStream(NamedEventStream):
    """message_start, ping, then content_block_start / _delta / _stop per block, message_delta, message_stop.

    message_start waits for the first delta: by then the prefill has run and the cached prompt tokens are known, so
    its usage is already the final split of the input (message_delta repeats it with output_tokens)."""

    def __init__(self, format: ChatFormat, req: MessagesRequest, meta: Meta) -> None:
        self.req, self.meta = req, meta
        self.choice = ChatStreamChoice(format, req.chat)
        self.started = False
        self.block: str | None = None                 # type of the open block
        self.index = -1                               # its index
        self.thinking = ""                            # the open thinking block's text (its signature when omitted)
        self.token_ids: list[int] = []
        self.reasoning = ""
        self.reason: tuple[str, str | None] = ("end_turn", None)

    def error(self, err: APIError) -> dict[str, Any]:
        return error_body(err)

    def _usage(self, usage: Usage | None = None, output_tokens: int | None = None) -> dict[str, Any]:
        if usage is None:
            usage = self.meta.usage() if self.meta.usage is not None else Usage(len(self.meta.prompt_ids), 0)
        parser = self.choice.reasoning
        thinking = count_reasoning_tokens(self.token_ids, self.meta.token_text, self.reasoning,
                                          parser.end_offset if parser is not None else None)
        body = usage_body(self.req, usage, thinking)
        if output_tokens is not None:
            body["output_tokens"] = output_tokens
        return body

    def _start(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        message = {"id": self.meta.request_id, "type": "message", "role": "assistant", "model": self.meta.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": self._usage(output_tokens=0)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        out = []
        if self.block == "thinking":                  # Anthropic's clients expect the block's signature before
            signature = omitted_thinking_signature(self.thinking) if self.req.omit_thinking else ""   # its stop
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "signature_delta", "signature": signature}})
        self.block = None
        return out + [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.index += 1
        self.block = block["type"]
        self.thinking = ""
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _piece(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if "reasoning_content" in piece:
            text = piece["reasoning_content"]
            self.reasoning += text
            if self.block != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += text
            if not self.req.omit_thinking:
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "thinking_delta", "thinking": text}})
        elif "content" in piece:
            if self.block != "text":
                out += self._open({"type": "text", "text": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": piece["content"]}})
        elif "tool_calls" in piece:
            call = piece["tool_calls"][0]
            if "id" in call:                          # a new call: its own block
                out += self._open({"type": "tool_use", "id": tool_use_id(call["id"]),
                                   "name": call["function"]["name"], "input": {}})
            fragment = call["function"].get("arguments") or ""
            if fragment:
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": fragment}})
        return out

    def delta(self, index: int, d: Delta) -> list[dict[str, Any]]:
        out = self._start()
        self.token_ids += d.token_ids
        final = d.finish_reason is not None
        for piece in self.choice.pieces(d.text, final, truncated=d.finish_reason == "length"):
            out += self._piece(piece)
        if final:
            self.reason = stop_reason(d.finish_reason, d.stop_string, self.choice.called_tools)
        return out

    def end(self, usage: Callable[[], Usage]) -> list[dict[str, Any]]:
        reason, sequence = self.reason
        return self._start() + self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": self._usage(usage()), **_context_management(self.req)},
            {"type": "message_stop"}]
