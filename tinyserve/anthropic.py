"""Anthropic's Messages API without HTTP: POST /v1/messages (and /v1/messages/count_tokens) as an Endpoint.

A Messages request is translated into the chat request the OpenAI route builds (chat.ChatRequest), so all protocols
render the same prompt through the same template and share the prefix cache; the answer is split by the same qwen3
reasoning and qwen3_coder tool parsers (chat.ChatFormat) and written as Anthropic content blocks.

Mapping (request):
  system (string or text blocks)   -> one system message first; a text block starting with
                                      "x-anthropic-billing-header:" (Claude Code's per-request hash) is dropped:
                                      it would change every prompt's prefix
  text blocks                      -> content (joined with "\\n", as the chat route joins text parts)
  image blocks (user, and inside   -> the image marker in place (tokenizer.ContentJoiner), the image in
  tool_result content)                request.images: source base64 (media_type png | jpeg | webp | gif) or url
                                      (data: URLs; http(s) only with server.fetch_image_urls); in system: 400
  tool_use (assistant)             -> tool_calls; tool_result (user) -> a "tool" message ("Error: " first when
                                      is_error); a tool_reference block in it (tool search) -> the line
                                      "Tool loaded: NAME" (every tool is in the prompt from the first turn, deferred
                                      or not, so the prompt's start never changes)
  thinking (assistant)             -> reasoning_content (the template shows it only for turns after the last user
                                      query, as Qwen3 does); redacted_thinking is opaque and dropped
  document blocks                  -> 400 (not supported)
  tools of type "custom" (or none) -> OpenAI function tools; server tools (web_search_20250305, code_execution,
                                      web_fetch, tool_search, bash / text_editor ...) are left out of the prompt,
                                      logged once per type, counted in tinyserve:tools_left_out
  tools[].input_schema             -> the function's parameters; tool_choice auto | any | tool | none -> "auto" |
                                      "required" | named | no tools in the prompt. any / tool force one tool_use
                                      (with the qwen3_coder parser on, decoding is constrained to one call whose
                                      input follows the tool's input_schema; grammar.py)
  thinking.type enabled|adaptive / disabled -> enable_thinking true / false; absent: the template's default (Qwen3.5
                                      thinks); budget_tokens is accepted and not enforced
  model                            -> any name is accepted (Claude Code sends its own); responses carry the served
                                      name
  a last assistant message         -> a prefill: the prompt is cut after its text and the answer continues it
  output_config.format             -> json_schema: the text after any thinking is constrained to the schema (as
  (and the older output_format)       response_format; the SDK's messages.parse); output_config.effort accepted
  tool_choice.disable_parallel_tool_use -> at most one tool_use block
  metadata, service_tier, cache_control, inference_geo, speed, context_management: type-checked, no effect
                                      (docs/api.md); container, mcp_servers: 400
Mapping (response): thinking blocks carry signature "" (there is nothing to sign; the key is there because clients
require it; a stream sends it as a signature_delta before the block stops); tool_use ids are "toolu_..."; stop_reason end_turn | max_tokens | stop_sequence | tool_use. Usage
follows Anthropic's split: input_tokens is the uncached part of the prompt, cache_read_input_tokens the prompt
tokens served from the prefix cache, cache_creation_input_tokens 0 (writing the cache costs nothing extra here), so
their sum is the prompt length.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .chat import (ChatFormat, ChatRequest, ChatStreamChoice, TranslatedRequest, chat_tools, function_tool,
                   function_tools, leave_out, named_tool)
from .protocol import (APIError, ChoiceResult, Delta, Endpoint, GenerationOptions, ImageInput, Meta, NamedEventStream,
                       Usage, bad_request, boolean_field, ignored_fields, image_bytes, image_from_url, integer_field,
                       number_field, parse_response_format, refused_fields, stop_strings)
from .sampling import SamplingParams
from .tokenizer import SYSTEM_IMAGE_ERROR, ContentJoiner, Tokenizer

if TYPE_CHECKING:
    from .grammar import Constraint

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors). Statuses are the server's own
# (a full queue is 503 + Retry-After, not Anthropic's 529); the type says what kind of failure it is.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(err: APIError) -> dict[str, Any]:
    """{"type": "error", "error": {"type", "message"}}; the field in question, when known, leads the message."""
    kind = ERROR_TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---------------------------------------------------------------------------------------------------------------
# Requests

@dataclass
class MessagesRequest(TranslatedRequest):
    """A Messages request, as the chat request it renders as."""


def _text_blocks(value: Any, param: str, allowed: tuple[str, ...] = ("text",)) -> list[dict[str, Any]]:
    """A string or a list of blocks -> the list of blocks (a string is one text block); types are checked."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a string or a list of content blocks", param)
    for j, block in enumerate(value):
        p = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "document":
            raise bad_request(f"{p}: document blocks are not supported by this server", f"{p}.type")
        if kind == "image" and param == "system":
            raise bad_request(f"{p}: {SYSTEM_IMAGE_ERROR}", p)
        if kind not in allowed:
            raise bad_request(f"{p}.type must be one of {', '.join(allowed)}; got {kind!r}", f"{p}.type")
        if kind == "text" and not isinstance(block.get("text"), str):
            raise bad_request(f"{p}.text must be a string", f"{p}.text")
    return value


def _join(blocks: list[dict[str, Any]]) -> str:
    return "\n".join(b["text"] for b in blocks)


def _system(value: Any) -> str | None:
    if value is None:
        return None
    blocks = _text_blocks(value, "system")
    if isinstance(value, list):
        blocks = [b for b in blocks if not b["text"].lstrip().startswith(BILLING_HEADER_PREFIX)]
    text = _join(blocks)
    return text if blocks else None


def _image(block: dict[str, Any], p: str, fetch: bool) -> ImageInput:
    """{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return image_bytes(source.get("media_type"), source.get("data"), p)
    if kind == "url":
        return image_from_url(source.get("url"), p, fetch)
    if kind == "file":
        raise bad_request(f"{p}: file sources (the Files API) are not supported; send the image as a base64 source",
                          p)
    raise bad_request(f'{p}.source must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", "url"}}',
                      p)


def _tool_result(block: dict[str, Any], p: str, images: list[ImageInput], fetch: bool) -> dict[str, Any]:
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str):
        raise bad_request(f"{p}.tool_use_id must be a string", f"{p}.tool_use_id")
    content = block.get("content")
    out = ContentJoiner()
    if content is not None:
        for k, b in enumerate(_text_blocks(content, f"{p}.content", ("text", "image", "tool_reference"))):
            if b["type"] == "image":
                images.append(_image(b, f"{p}.content[{k}]", fetch))
                out.image()
            elif b["type"] == "tool_reference":
                if not isinstance(b.get("tool_name"), str) or not b["tool_name"]:
                    raise bad_request(f"{p}.content[{k}].tool_name must be a non-empty string",
                                      f"{p}.content[{k}].tool_name")
                out.text(f"Tool loaded: {b['tool_name']}")
            else:
                out.text(b["text"])
    text = out.result()
    if block.get("is_error") is True:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def _tool_use(block: dict[str, Any], p: str) -> dict[str, Any]:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not name:
        raise bad_request(f"{p}.name must be a non-empty string", f"{p}.name")
    if call_id is not None and not isinstance(call_id, str):
        raise bad_request(f"{p}.id must be a string", f"{p}.id")
    if not isinstance(args, dict):
        raise bad_request(f"{p}.input must be an object", f"{p}.input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


USER_BLOCKS = ("text", "image", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


def _messages(value: Any, images: list[ImageInput], fetch: bool = False) -> list[dict[str, Any]]:
    """Anthropic turns -> chat messages (OpenAI shape, tool results as "tool" messages, in the client's order); the
    image blocks are appended to `images` in the same order."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{p} must be an object with role and content", p)
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{p}.role must be 'user', 'assistant' or 'system'; got {role!r}", f"{p}.role")
        if "content" not in m:
            raise bad_request(f"{p}.content is required", f"{p}.content")
        if role == "system":                          # mid-conversation system text (Claude Code's environment,
            blocks = _text_blocks(m["content"], f"{p}.content")   # reminders): a user turn in place (tokenizer)
            out.append({"role": "system", "content": _join(blocks)})
            continue
        allowed = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
        blocks = _text_blocks(m["content"], f"{p}.content", allowed)
        if role == "user":
            turn = ContentJoiner()
            for j, b in enumerate(blocks):
                if b["type"] == "text":
                    turn.text(b["text"])
                    continue
                if b["type"] == "image":
                    images.append(_image(b, f"{p}.content[{j}]", fetch))
                    turn.image()
                    continue
                if not turn.empty:                    # text or images before a result: their own turn, in order
                    out.append({"role": "user", "content": turn.result()})
                    turn = ContentJoiner()
                out.append(_tool_result(b, f"{p}.content[{j}]", images, fetch))
            if not turn.empty or not blocks:
                out.append({"role": "user", "content": turn.result()})
            continue
        msg: dict[str, Any] = {"role": "assistant"}
        texts, reasoning, calls = [], [], []
        for j, b in enumerate(blocks):
            q = f"{p}.content[{j}]"
            if b["type"] == "text":
                texts.append(b["text"])
            elif b["type"] == "thinking":
                if not isinstance(b.get("thinking"), str):
                    raise bad_request(f"{q}.thinking must be a string", f"{q}.thinking")
                reasoning.append(b["thinking"])
            elif b["type"] == "tool_use":
                calls.append(_tool_use(b, q))
            # redacted_thinking: opaque (encrypted by Anthropic), nothing to render
        msg["content"] = "\n".join(texts)
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tools(body: dict, left_out: list[str]) -> tuple[list[dict[str, Any]] | None, Any]:
    """Anthropic tools + tool_choice -> OpenAI function tools + tool_choice (what the template and parser take); the
    types of the server tools left out land in `left_out`."""
    def read(tool: dict[str, Any], p: str) -> dict[str, Any] | None:
        """{"name", "description", "input_schema"} (a custom tool) -> an OpenAI function tool; None: a server tool."""
        kind = tool.get("type", "custom")
        if kind in ("custom", None):
            return function_tool(tool, p, "input_schema", schema_required=True)
        if not isinstance(kind, str) or not kind:
            raise bad_request(f"{p}.type must be \"custom\" or a server tool's type; got {kind!r}", f"{p}.type")
        leave_out(left_out, kind, "/v1/messages")    # a server tool: nothing here can run it
        return None

    tools = function_tools(body.get("tools"), read)
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind is not None:
        boolean_field(choice, "disable_parallel_tool_use", False)
    if choice is None or kind == "auto":
        return chat_tools(tools, "auto")
    if kind == "none":
        return chat_tools([], "none")                 # no tools offered at all
    # any / tool: like OpenAI's "required" / a named function: decoding is constrained to one call (ChatFormat)
    if kind == "any":
        return chat_tools(tools, "required")
    if kind == "tool":
        return chat_tools(tools, named_tool(tools, choice.get("name"), "tool_choice.name", noun="tool"))
    raise bad_request('tool_choice.type must be "auto", "any", "tool" or "none"', "tool_choice.type")


def _thinking(body: dict) -> dict[str, Any]:
    thinking = body.get("thinking")
    if thinking is None:
        return {}                                     # the template's default
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise bad_request('thinking.type must be "enabled" or "disabled"', "thinking.type")
    integer_field(thinking, "budget_tokens", None)  # type-checked; not enforced
    return {"enable_thinking": kind != "disabled"}


# Fields of Anthropic's that change nothing here (docs/api.md says why), and those refused
IGNORED = {"metadata": dict, "service_tier": str, "cache_control": dict, "inference_geo": str, "speed": str,
           "user_profile_id": str, "workspace_id": str, "context_management": dict}
REFUSED = {"container": lambda v: "no code-execution containers here",
           "mcp_servers": lambda v: "this server connects to no MCP servers (give the tools in tools)"}
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def _output_config(body: dict) -> Constraint | None:
    """output_config.format {"type": "json_schema", "schema"}: the text after any thinking is JSON matching the
    schema (constrained decoding, as response_format on the OpenAI routes; messages.parse reads it). The older
    output_format field is taken the same way. output_config.effort is accepted: Qwen's templates take no effort."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise bad_request("output_config must be an object", "output_config")
    config = config or {}
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"output_config.effort must be one of {', '.join(EFFORTS)}; got {effort!r}",
                          "output_config.effort")
    fmt, where = config.get("format"), "output_config.format"
    if fmt is None and body.get("output_format") is not None:
        fmt, where = body["output_format"], "output_format"
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request(f'{where} must be {{"type": "json_schema", "schema": {{...}}}}', f"{where}.type")
    return parse_response_format(fmt, where, nested=False)


def parse_messages_request(body: dict, count_only: bool = False, fetch_image_urls: bool = False) -> MessagesRequest:
    """count_only (count_tokens): no max_tokens, no sampling fields. fetch_image_urls (server.fetch_image_urls):
    http(s) image sources become RemoteImages instead of a 400. A last message from the assistant is a prefill:
    the answer continues it (and holds only what follows it), as on Anthropic's API."""
    refused_fields(body, REFUSED)
    ignored_fields(body, IGNORED)
    images: list[ImageInput] = []
    messages = _messages(body.get("messages"), images, fetch_image_urls)
    system = _system(body.get("system"))
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    left_out: list[str] = []
    tools, tool_choice = _tools(body, left_out)
    max_tokens = integer_field(body, "max_tokens", None, lo=1)
    if max_tokens is None and not count_only:
        raise bad_request("max_tokens is required", "max_tokens")
    stream = boolean_field(body, "stream", False)
    params = SamplingParams(temperature=number_field(body, "temperature", 1.0),
                            top_p=number_field(body, "top_p", 1.0), top_k=integer_field(body, "top_k", 0),
                            speculative=boolean_field(body, "speculative", True), constraint=_output_config(body))
    options = GenerationOptions(params=params, max_tokens=max_tokens, max_tokens_field="max_tokens",
                                stop=stop_strings(body, "stop_sequences", one_string=False), n=1, stream=stream,
                                include_usage=True, return_token_ids=False)
    choice = body.get("tool_choice")
    prefill = messages[-1]["role"] == "assistant"
    chat = ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice, template_kwargs=_thinking(body),
                       logprobs=False, top_logprobs=0, options=options, images=images, left_out=left_out,
                       continue_final=prefill, add_generation_prompt=not prefill,
                       parallel_tool_calls=not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use")))
    return MessagesRequest(chat)


# ---------------------------------------------------------------------------------------------------------------
# Responses

def usage_body(usage: Usage) -> dict[str, Any]:
    cached = usage.cached_tokens or 0
    return {"input_tokens": usage.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": usage.completion_tokens}


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


class Messages(Endpoint[MessagesRequest]):
    """POST /v1/messages. The parsers come from the config's [parsers] table, as for /v1/chat/completions."""

    id_prefix = "msg_"
    prompt_field = "messages"
    # Claude Code sends one large max_tokens (e.g. 32000) whatever the model: generation stops at the end of the
    # context instead (stop_reason max_tokens), as on Anthropic's own API, rather than a 400 on a small context.
    clamp_max_tokens = True

    def __init__(self, reasoning_parser: str = "", tool_parser: str = "", fetch_image_urls: bool = False) -> None:
        self.format = ChatFormat(reasoning_parser, tool_parser)
        self.fetch_image_urls = fetch_image_urls

    def parse(self, body: dict, served_name: str) -> MessagesRequest:
        return parse_messages_request(body, fetch_image_urls=self.fetch_image_urls)

    def parse_count(self, body: dict) -> MessagesRequest:
        return parse_messages_request(body, count_only=True, fetch_image_urls=self.fetch_image_urls)

    def prompt_ids(self, req: MessagesRequest, tokenizer: Tokenizer) -> list[int]:
        return self.format.prompt_ids(req.chat, tokenizer)

    def response(self, req: MessagesRequest, meta: Meta, results: list[ChoiceResult], usage: Usage
                 ) -> dict[str, Any]:
        (r,) = results
        message, _ = self.format.message(req.chat, r)
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        calls = message.get("tool_calls") or []
        for call in calls:
            content.append({"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
                            "input": _input(call["function"]["arguments"])})
        reason, sequence = stop_reason(r.finish_reason, r.stop_string, bool(calls))
        return {"id": meta.request_id, "type": "message", "role": "assistant", "model": meta.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": usage_body(usage)}

    def stream(self, req: MessagesRequest, meta: Meta) -> "MessagesStream":
        return MessagesStream(self, req, meta)


class MessagesStream(NamedEventStream):
    """message_start, ping, then content_block_start / _delta / _stop per block, message_delta, message_stop.

    message_start waits for the first delta: by then the prefill has run and the cached prompt tokens are known, so
    its usage is already the final split of the input (message_delta repeats it with output_tokens)."""

    def __init__(self, endpoint: Messages, req: MessagesRequest, meta: Meta) -> None:
        self.meta = meta
        self.choice = ChatStreamChoice(endpoint.format, req.chat)
        self.started = False
        self.block: str | None = None                 # type of the open block
        self.index = -1                               # its index
        self.reason: tuple[str, str | None] = ("end_turn", None)

    def error(self, err: APIError) -> dict[str, Any]:
        return error_body(err)

    def _usage(self, output_tokens: int | None = None) -> dict[str, Any]:
        usage = self.meta.usage() if self.meta.usage is not None else Usage(len(self.meta.prompt_ids), 0)
        body = usage_body(usage)
        if output_tokens is not None:
            body["output_tokens"] = output_tokens
        return body

    def _start(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        message = {"id": self.meta.request_id, "type": "message", "role": "assistant", "model": self.meta.model,
                   "content": [], "stop_reason": None, "stop_sequence": None, "usage": self._usage(0)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _close(self) -> list[dict[str, Any]]:
        if self.block is None:
            return []
        out = []
        if self.block == "thinking":                  # Anthropic's clients expect the block's signature before
            out.append({"type": "content_block_delta", "index": self.index,   # its stop ("": nothing to sign)
                        "delta": {"type": "signature_delta", "signature": ""}})
        self.block = None
        return out + [{"type": "content_block_stop", "index": self.index}]

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self._close()
        self.index += 1
        self.block = block["type"]
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _piece(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if "reasoning_content" in piece:
            if self.block != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": piece["reasoning_content"]}})
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
        final = d.finish_reason is not None
        for piece in self.choice.pieces(d.text, final, truncated=d.finish_reason == "length"):
            out += self._piece(piece)
        if final:
            self.reason = stop_reason(d.finish_reason, d.stop_string, self.choice.called_tools)
        return out

    def end(self, usage: Usage) -> list[dict[str, Any]]:
        reason, sequence = self.reason
        return self._start() + self._close() + [
            {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
             "usage": usage_body(usage)},
            {"type": "message_stop"}]
