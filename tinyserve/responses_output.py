"""What POST /v1/responses answers: the output items, the response object and the stream's events (responses.py
parses the request).

Mapping (response): output items reasoning ("rs_...", summary [], content [reasoning_text]), message ("msg_...",
one output_text part), function_call ("fc_...", call_id "call_...", arguments a JSON string) and custom_tool_call
("ctc_...", input a string); status "incomplete" with incomplete_details.reason "max_output_tokens" when the
generation was cut by the token limit (its last item is "incomplete" too, unless it is a call: a call the limit cut
is dropped, so one that is there is whole). usage.output_tokens_details.reasoning_tokens counts the generated tokens
up to the one that closes the think block. A stream ends with response.completed whatever the status (the openai
client's get_final_response() needs it), carrying the same response the blocking call returns; every event carries
the item as it was at that event.
"""
from __future__ import annotations

import copy
import uuid
from typing import TYPE_CHECKING, Any, Callable

from .chat import ChatFormat, ChatStreamChoice, count_reasoning_tokens, freeform_input
from .parsers import THINK_END
from .protocol import APIError, Delta, Meta, NamedEventStream, Usage, logprob_content

if TYPE_CHECKING:
    from .responses import ResponsesRequest


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def usage_body(usage: Usage, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
                       ) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def custom_tool_call_item(item_id: str, call_id: str, name: str, input: str, status: str = "completed"
                          ) -> dict[str, Any]:
    return {"id": item_id, "type": "custom_tool_call", "call_id": call_id, "name": name, "input": input,
            "status": status}


def call_item(req: ResponsesRequest, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A parsed call as its output item: a custom_tool_call for a freeform tool, else a function_call; a tool of a
    namespace group under its own name, with the namespace beside it."""
    if name in req.chat.custom_tools:
        item = custom_tool_call_item(new_id("ctc_"), call_id, name, freeform_input(arguments))
    else:
        item = function_call_item(new_id("fc_"), call_id, name, arguments)
    if name in req.namespaced:
        item["namespace"], item["name"] = req.namespaced[name]
    return item


def response_body(req: ResponsesRequest, meta: Meta, output: list[dict[str, Any]], status: str,
                  usage: dict[str, Any] | None) -> dict[str, Any]:
    """The response object; status in_progress (stream start), completed or incomplete."""
    return {"id": meta.request_id, "object": "response", "created_at": meta.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": meta.model, "output": output, **req.echo, "usage": usage}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesStream(NamedEventStream):
    """response.created, response.in_progress; per output item output_item.added, (content_part.added, text deltas,
    text done, content_part.done | argument deltas, arguments done | custom tool input delta, input done),
    output_item.done; response.completed with the whole response. Every event carries a sequence_number, and a
    copy of the item as it is at that event (the item itself grows after it)."""

    def __init__(self, chat: ChatFormat, req: ResponsesRequest, meta: Meta) -> None:
        self.req, self.meta = req, meta
        self.choice = ChatStreamChoice(chat, req.chat)
        self.seq = 0
        self.output: list[dict[str, Any]] = []        # items so far; the last one is open while `open`
        self.open = False
        self.token_ids: list[int] = []
        self.reasoning = ""
        self.arguments = ""                           # the open custom tool call's arguments (JSON) so far
        self.finish_reason: str | None = None
        self.pending: list[Any] = []                  # token events not yet given to a text delta (logprobs)
        self.answering = False                        # a text delta went out: the think block is behind
        # a call goes out once it is whole (a call max_output_tokens cuts off is no call to run): (its parser index,
        # its item, its arguments so far)
        self.held: tuple[int, dict[str, Any], str] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def error(self, err: APIError) -> dict[str, Any]:
        return self._event("error", code=err.code or err.type, message=err.message, param=err.param)

    def start(self) -> list[dict[str, Any]]:
        snapshot = response_body(self.req, self.meta, [], "in_progress", None)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    # ---- items ----
    def _where(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.output.append(item)
        self.open = True
        out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                               item={**copy.deepcopy(item), "status": "in_progress"}))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        elif item["type"] == "reasoning":
            out.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                   part={"type": "reasoning_text", "text": ""}))
        return out

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        if not self.open:
            return []
        self.open = False
        item = self.output[-1]
        item["status"] = status
        where, out = self._where(), []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                                   logprobs=part["logprobs"]))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=dict(part)))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=dict(part)))
        elif item["type"] == "custom_tool_call":       # its input is whole once its arguments are
            item["input"] = freeform_input(self.arguments)
            if item["input"]:
                out.append(self._event("response.custom_tool_call_input.delta", **where, delta=item["input"]))
            out.append(self._event("response.custom_tool_call_input.done", **where, input=item["input"]))
        else:
            out.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                   arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=where["output_index"],
                               item=copy.deepcopy(item)))
        return out

    def _piece(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if "tool_calls" not in piece or "id" in piece["tool_calls"][0]:
            out += self._release(whole=True)          # what follows a call means that call is whole
        last = self.output[-1] if self.open else None
        if "reasoning_content" in piece:
            text = piece["reasoning_content"]
            self.reasoning += text
            if last is None or last["type"] != "reasoning":
                out += self._open(reasoning_item(new_id("rs_"), ""))
            self.output[-1]["content"][0]["text"] += text
            out.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        elif "content" in piece:
            text = piece["content"]
            if last is None or last["type"] != "message":
                out += self._open(message_item(new_id("msg_"), ""))
            logprobs = self._answer_logprobs() if self.req.logprobs else []
            self.output[-1]["content"][0]["text"] += text
            self.output[-1]["content"][0]["logprobs"] += logprobs
            out.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                   logprobs=logprobs))
        elif "tool_calls" in piece:
            call = piece["tool_calls"][0]
            if "id" in call:                          # a new call: its own item, once it is whole
                out += self._close()
                self.held = (call["index"], call_item(self.req, call["id"], call["function"]["name"], ""), "")
            elif self.held is not None:
                index, item, arguments = self.held
                self.held = (index, item, arguments + (call["function"].get("arguments") or ""))
        return out

    def _release(self, whole: bool) -> list[dict[str, Any]]:
        """The held call's events, when it is whole (else it is dropped: the end of output cut it off)."""
        if self.held is None:
            return []
        (_, item, arguments), self.held = self.held, None
        if not whole:
            return []
        out = self._open(item)
        if item["type"] == "custom_tool_call":
            self.arguments = arguments
        elif arguments:
            item["arguments"] = arguments
            out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return out + self._close()

    def _answer_logprobs(self) -> list[dict[str, Any]]:
        """Logprobs of the tokens since the last text delta, the think block's (through the token that closes it)
        left out."""
        events, self.pending = self.pending, []
        if not self.answering:
            self.answering, text = True, ""
            for k, e in enumerate(events):
                text += self.meta.token_text(e.token_id)
                if THINK_END in text:
                    events = events[k + 1:]
                    break
        return logprob_content(self.meta, events)

    def delta(self, index: int, d: Delta) -> list[dict[str, Any]]:
        self.token_ids += d.token_ids
        self.pending += d.events
        final = d.finish_reason is not None
        out: list[dict[str, Any]] = []
        for piece in self.choice.pieces(d.text, final, truncated=d.finish_reason == "length"):
            out += self._piece(piece)
        tools = self.choice.tools
        if self.held is not None and (final or tools is None or tools.open_call != self.held[0]):
            out += self._release(whole=tools is None or self.held[0] not in tools.cut_calls)
        if final:
            self.finish_reason = d.finish_reason
        return out

    def end(self, usage: Callable[[], Usage]) -> list[dict[str, Any]]:
        status = status_of(self.finish_reason)
        out = self._close(status)
        if status == "incomplete" and not self.output:
            out += self._open(message_item(new_id("msg_"), "")) + self._close(status)
        parser = self.choice.reasoning
        tokens = count_reasoning_tokens(self.token_ids, self.meta.token_text, self.reasoning,
                                        parser.end_offset if parser is not None else None)
        body = response_body(self.req, self.meta, [dict(item) for item in self.output], status,
                             usage_body(usage(), tokens))
        return out + [self._event("response.completed", response=body)]
