"""OpenAI's chat completions and completions without HTTP: POST /v1/chat/completions and POST /v1/completions as
Endpoints (protocol.py), their request bodies -> typed requests, results -> response bodies and stream chunks.

A chat request becomes chat.py's ChatRequest, as the Anthropic and Responses requests do; the messages keep OpenAI's
shape (the one the chat template takes) and the function tools go to the template as sent. chat.ChatFormat renders
the prompt and splits the answer into reasoning_content, content and tool_calls with the configured parsers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from .chat import ChatFormat, ChatRequest, ChatStreamChoice, chat_tools, function_tool, function_tools
from .protocol import (APIError, ChoiceResult, Delta, Endpoint, EndpointStream, GenerationOptions, ImageInput, Meta,
                       Usage, bad_request, boolean_field, image_from_url, integer_field, parse_options,
                       parse_response_format, token_id_list)
from .sampling import MAX_LOGPROBS
from .tokenizer import SYSTEM_ROLES, MessageError, Tokenizer, content_text, tool_call_arguments

MAX_COMPLETION_LOGPROBS = 5
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
CHAT_TOOL = '{"type": "function", "function": {...}}'


# ---------------------------------------------------------------------------------------------------------------
# Request fields

def _check_model(body: dict, served_name: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {model!r}", "model")
    if model != served_name:
        raise APIError(404, f"model {model!r} is not served here; this server serves {served_name!r}",
                       "model", code="model_not_found")


def _reject_unsupported(body: dict, fields: dict[str, Callable[[Any], bool]]) -> None:
    """OpenAI fields we know but do not implement: a clear 400 beats silently different output."""
    for name, ok in fields.items():
        value = body.get(name)
        if value is not None and not ok(value):
            raise bad_request(f"{name}={value!r} is not supported by this server", name)


def _chat_image(part: dict, param: str, fetch: bool) -> ImageInput:
    """{"type": "image_url", "image_url": {"url", "detail"}} (or the URL as a bare string); detail means nothing to
    Qwen's processor and is ignored."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise bad_request(f"{param}.image_url must be {{\"url\": \"data:image/...;base64,...\"}} or the URL as a "
                          "string", param)
    return image_from_url(url, param, fetch)


# ---------------------------------------------------------------------------------------------------------------
# Chat requests

def _assistant_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """Earlier tool calls in the history, in the shape the templates take."""
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a list", param)
    calls = []
    for j, call in enumerate(value):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{p} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", p)
        args = tool_call_arguments(fn.get("arguments"), f"{p}.function.arguments")
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return calls


def _parse_messages(value: Any, images: list[ImageInput], fetch_image_urls: bool = False) -> list[dict[str, Any]]:
    """The messages as the template takes them; their image parts are appended to `images` in order."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{p} must be an object with role and content", p)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{p}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", f"{p}.role")
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}   # templates know "system"
        content = m.get("content")
        if content is None and role != "assistant":   # an assistant turn may be tool calls only
            raise bad_request(f"{p}.content is required", f"{p}.content")
        try:                                          # the tokenizer's normaliser: one rule for both paths
            msg["content"] = content_text(content, f"{p}.content", images=role not in SYSTEM_ROLES) or ""
            if role == "assistant" and m.get("tool_calls"):
                msg["tool_calls"] = _assistant_tool_calls(m["tool_calls"], f"{p}.tool_calls")
        except MessageError as e:
            raise bad_request(str(e), e.param) from None
        if isinstance(content, list):                 # content_text put a marker where each of these goes
            images += [_chat_image(part, f"{p}.content[{j}]", fetch_image_urls) for j, part in enumerate(content)
                       if isinstance(part, dict) and part.get("type") == "image_url"]
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_request(f"{p}.{key} must be a string", f"{p}.{key}")
                msg[key] = m[key]
        out.append(msg)
    return out


def _chat_tool(tool: dict[str, Any], p: str) -> dict[str, Any]:
    fn = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise bad_request(f"{p} must be {CHAT_TOOL}", p)
    function_tool(fn, f"{p}.function")                # the checks: the template takes the tool as it was sent
    return tool


def _parse_tools(body: dict) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = function_tools(body.get("tools"), _chat_tool, CHAT_TOOL)
    choice = body.get("tool_choice")
    return chat_tools(tools, "auto" if choice is None else choice)


def _parse_template_kwargs(body: dict) -> dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    for reserved in ("messages", "tools", "add_generation_prompt"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs must not set {reserved!r}", "chat_template_kwargs")
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be a boolean",
                          "chat_template_kwargs.enable_thinking")
    return dict(kwargs)


def parse_chat_request(body: dict, served_name: str, fetch_image_urls: bool = False) -> ChatRequest:
    """fetch_image_urls (server.fetch_image_urls): http(s) image URLs become RemoteImages instead of a 400."""
    _check_model(body, served_name)
    constraint = parse_response_format(body.get("response_format"))
    images: list[ImageInput] = []
    messages = _parse_messages(body.get("messages"), images, fetch_image_urls)
    tools, tool_choice = _parse_tools(body)
    logprobs = boolean_field(body, "logprobs", False)
    top_logprobs = integer_field(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    options = parse_options(body, top_logprobs if logprobs else None)
    options.params = replace(options.params, constraint=constraint)
    return ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice,
                       template_kwargs=_parse_template_kwargs(body), logprobs=logprobs,
                       top_logprobs=top_logprobs, options=options, images=images)


# ---------------------------------------------------------------------------------------------------------------
# Completion requests

@dataclass
class CompletionRequest:
    prompt: str | list[int]
    logprobs: int | None
    options: GenerationOptions

    @property
    def images(self) -> list[ImageInput]:
        return []                     # a completion prompt is text or token ids


def parse_completion_request(body: dict, served_name: str) -> CompletionRequest:
    _check_model(body, served_name)
    _reject_unsupported(body, {"echo": lambda v: v is False, "suffix": lambda v: v == "",
                               "best_of": lambda v: v == 1})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                            # the OpenAI client wraps single prompts sometimes
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
    elif isinstance(prompt, list):
        prompt = token_id_list(prompt, "prompt", allow_empty=False)
    else:
        raise bad_request("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    logprobs = integer_field(body, "logprobs", None, lo=0, hi=MAX_COMPLETION_LOGPROBS)
    return CompletionRequest(prompt=prompt, logprobs=logprobs, options=parse_options(body, logprobs))


# ---------------------------------------------------------------------------------------------------------------
# Responses and stream chunks

def usage_body(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
    if usage.cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens,
                                         "cached_tokens_by_tier": dict(usage.cached_tokens_by_tier)}
    if usage.accepted_prediction_tokens is not None:
        body["completion_tokens_details"] = {"accepted_prediction_tokens": usage.accepted_prediction_tokens,
                                             "rejected_prediction_tokens": usage.rejected_prediction_tokens}
    return body


def chat_logprobs(token_text: Callable[[int], str], events: list[Any]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        tok = token_text(token_id)
        return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}

    content = []
    for e in events:
        item = entry(e.token_id, e.logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in (e.top_logprobs or [])]
        content.append(item)
    return {"content": content}


def completion_logprobs(token_text: Callable[[int], str], events: list[Any], offset: int) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in events:
        tok = token_text(e.token_id)
        tokens.append(tok)
        token_logprobs.append(e.logprob)
        top.append({token_text(t): lp for t, lp in (e.top_logprobs or [(e.token_id, e.logprob)])})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _envelope(meta: Meta, obj: str) -> dict[str, Any]:
    return {"id": meta.request_id, "object": obj, "created": meta.created, "model": meta.model}


def _response_body(meta: Meta, obj: str, choices: list[dict[str, Any]], usage: Usage, options: GenerationOptions
                   ) -> dict[str, Any]:
    body = {**_envelope(meta, obj), "choices": choices, "usage": usage_body(usage)}
    if options.return_token_ids:
        body["prompt_token_ids"] = meta.prompt_ids
    return body


# ---------------------------------------------------------------------------------------------------------------
# Endpoints

class Chat(Endpoint[ChatRequest]):
    """POST /v1/chat/completions. The parser names come from the config's [parsers] table ("" = off);
    fetch_image_urls is server.fetch_image_urls."""

    id_prefix = "chatcmpl-"
    prompt_field = "messages"

    def __init__(self, reasoning_parser: str = "", tool_parser: str = "", fetch_image_urls: bool = False) -> None:
        self.format = ChatFormat(reasoning_parser, tool_parser)
        self.fetch_image_urls = fetch_image_urls

    def parse(self, body: dict, served_name: str) -> ChatRequest:
        return parse_chat_request(body, served_name, self.fetch_image_urls)

    def prompt_ids(self, req: ChatRequest, tokenizer: Tokenizer) -> list[int]:
        return self.format.prompt_ids(req, tokenizer)

    def response(self, req: ChatRequest, meta: Meta, results: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
        choices = []
        for r in results:
            message, finish = self.format.message(req, r)
            choice: dict[str, Any] = {"index": r.index, "message": message,
                                      "logprobs": chat_logprobs(meta.token_text, r.events) if req.logprobs else None,
                                      "finish_reason": finish}
            if req.options.return_token_ids:
                choice["token_ids"] = r.token_ids
            choices.append(choice)
        return _response_body(meta, "chat.completion", choices, usage, req.options)

    def stream(self, req: ChatRequest, meta: Meta) -> "ChatStream":
        return ChatStream(self.format, req, meta)


class _OpenAIStream(EndpointStream):
    """Chunks of one object type; the usage chunk at the end when stream_options.include_usage asks for it."""

    def __init__(self, options: GenerationOptions, meta: Meta, obj: str) -> None:
        self.options, self.meta = options, meta
        self.base = _envelope(meta, obj)

    def end(self, usage: Usage) -> list[dict[str, Any]]:
        return [{**self.base, "choices": [], "usage": usage_body(usage)}] if self.options.include_usage else []


class ChatStream(_OpenAIStream):
    """A role chunk per choice, then one chunk per delta; logprobs and token ids ride on the first chunk of each
    engine step, finish_reason on the last."""

    def __init__(self, chat: ChatFormat, req: ChatRequest, meta: Meta) -> None:
        super().__init__(req.options, meta, "chat.completion.chunk")
        self.req = req
        self.choices = [ChatStreamChoice(chat, req) for _ in range(req.options.n)]

    def start(self) -> list[dict[str, Any]]:
        chunks = []
        for i in range(len(self.choices)):
            chunk = {**self.base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]}
            if self.options.return_token_ids:
                chunk["prompt_token_ids"] = self.meta.prompt_ids
            chunks.append(chunk)
        return chunks

    def delta(self, index: int, d: Delta) -> list[dict[str, Any]]:
        c, req = self.choices[index], self.req
        ids = self.options.return_token_ids
        final = d.finish_reason is not None
        pieces = c.pieces(d.text, final, truncated=d.finish_reason == "length")
        if not pieces and (final or (d.token_ids and (ids or req.logprobs))):
            pieces = [{}]                             # nothing to say, but a finish reason or ids to carry
        chunks = []
        for k, piece in enumerate(pieces):
            choice: dict[str, Any] = {"index": index, "delta": piece, "logprobs": None, "finish_reason": None}
            if k == 0:
                if req.logprobs and d.events:
                    choice["logprobs"] = chat_logprobs(self.meta.token_text, d.events)
                if ids:
                    choice["token_ids"] = d.token_ids
            if final and k == len(pieces) - 1:
                reason = d.finish_reason
                choice["finish_reason"] = "tool_calls" if c.called_tools and reason == "stop" else reason
            chunks.append({**self.base, "choices": [choice]})
        return chunks


class Completions(Endpoint[CompletionRequest]):
    """POST /v1/completions."""

    id_prefix = "cmpl-"
    prompt_field = "prompt"

    def parse(self, body: dict, served_name: str) -> CompletionRequest:
        return parse_completion_request(body, served_name)

    def prompt_ids(self, req: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
        if not isinstance(req.prompt, str):
            return req.prompt
        ids = tokenizer.encode(req.prompt)
        if not ids:
            raise bad_request("prompt encodes to no tokens", "prompt")
        return ids

    def response(self, req: CompletionRequest, meta: Meta, results: list[ChoiceResult], usage: Usage
                 ) -> dict[str, Any]:
        choices = []
        for r in results:
            choice: dict[str, Any] = {
                "index": r.index, "text": r.text, "finish_reason": r.finish_reason,
                "logprobs": completion_logprobs(meta.token_text, r.events, 0) if req.logprobs is not None else None}
            if req.options.return_token_ids:
                choice["token_ids"] = r.token_ids
                choice["prompt_token_ids"] = meta.prompt_ids
            choices.append(choice)
        return _response_body(meta, "text_completion", choices, usage, req.options)

    def stream(self, req: CompletionRequest, meta: Meta) -> "CompletionStream":
        return CompletionStream(req, meta)


class CompletionStream(_OpenAIStream):
    def __init__(self, req: CompletionRequest, meta: Meta) -> None:
        super().__init__(req.options, meta, "text_completion")
        self.req = req
        self.offsets = [0] * req.options.n            # text offsets of each choice, for logprobs

    def delta(self, index: int, d: Delta) -> list[dict[str, Any]]:
        choice: dict[str, Any] = {
            "index": index, "text": d.text, "finish_reason": d.finish_reason,
            "logprobs": completion_logprobs(self.meta.token_text, d.events, self.offsets[index])
            if self.req.logprobs is not None and d.events else None}
        self.offsets[index] += len(d.text)
        if self.options.return_token_ids:
            choice["token_ids"] = d.token_ids
        return [{**self.base, "choices": [choice]}]
