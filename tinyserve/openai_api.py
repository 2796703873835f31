"""OpenAI's chat completions and completions: POST /v1/chat/completions and POST /v1/completions, each a route
handler that reads top to bottom, its request parsing above it and its response body and stream chunks below.

A chat request becomes chat.py's ChatRequest, as the Anthropic and Responses requests do; the messages keep OpenAI's
shape (the one the chat template takes) and the function tools go to the template as sent. chat.ChatFormat renders
the prompt and splits the answer into reasoning_content, content and tool_calls with the configured parsers.

A completion request holds one or more prompts (text or token ids); choice i answers prompt i // n. echo puts each
prompt before its answer, and with logprobs the prompt's own logprobs first (the first token's null): the engine
computes them from the prefill (SamplingParams.prompt_logprobs). Every field of OpenAI's is honoured, refused by
name (CHAT_REFUSED, COMPLETION_REFUSED: what is not implemented, and other servers' extensions that would shape the
output) or, where it changes nothing here, type-checked and documented as such (IGNORED; docs/api.md).
"""
from __future__ import annotations

import asyncio
import codecs
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, AsyncIterator

from aiohttp import web

from .chat import ChatFormat, ChatRequest, ChatStreamChoice, chat_tools, function_tool, function_tools
from .generation import Choice, Meta, Piece, Usage
from .http_images import prepare_images
from .protocol import (SSE_DONE, APIError, Fields, GenerationOptions, ImageInput, bad_request, boolean,
                       image_from_url, integer, json_response, logprob_content, note_openai_beta, parse_options,
                       parse_response_format, read_field, read_json, serving, sse, sse_event, start_generation,
                       token_id_list, unused_fields)
from .sampling import MAX_LOGPROBS
from .tokenizer import SYSTEM_ROLES, MessageError, Tokenizer, content_text, tool_call_arguments

MAX_COMPLETION_LOGPROBS = 5
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
CHAT_TOOL = '{"type": "function", "function": {...}}'


# ---------------------------------------------------------------------------------------------------------------
# POST /v1/chat/completions: parse the body, render the prompt (in a worker thread: templates take time; with images,
# the ids grow by each image's tokens), start the generation, then SSE chunks or one JSON body.

async def chat_completions(request: web.Request) -> web.StreamResponse:
    state, engine = serving(request)
    note_openai_beta(request.headers)
    req = parse_chat_request(await read_json(request), engine.served_name, state.cfg.server.fetch_image_urls)
    chat = ChatFormat.of(state.cfg)
    fields = Fields("messages", req.options.max_tokens_field)
    prompt = await asyncio.to_thread(chat.prompt_ids, req, engine.tokenizer)
    prompt, images = await prepare_images(state, engine, req.images, prompt, fields) if req.images else (prompt, ())
    with start_generation(state, engine, req.options, [prompt], "chatcmpl-", fields, images) as gen:
        if req.options.stream:
            return await sse(request, chat_events(chat, req, gen.meta, gen.pieces()))
        return json_response(chat_body(chat, req, gen.meta, await gen.collect(), gen.usage()))


def _check_model(body: dict, served_name: str) -> None:
    if (model := body.get("model")) is not None and model != served_name:
        raise _model_error(model, served_name)


def _model_error(model: Any, served_name: str) -> APIError:
    if not isinstance(model, str):
        return bad_request(f"model must be a string, got {model!r}", "model")
    return APIError(404, f"model {model!r} is not served here; this server serves {served_name!r}", "model",
                    code="model_not_found")


def _chat_image(part: dict, param: str, fetch: bool) -> ImageInput:
    """{"type": "image_url", "image_url": {"url", "detail"}} (or the URL as a bare string); detail means nothing to
    Qwen's processor and is ignored."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise bad_request(f"{param}.image_url must be {{\"url\": \"data:image/...;base64,...\"}} or the URL as a "
                          "string", param)
    return image_from_url(url, param, fetch)


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


# The messages as the template takes them, and their image parts in order. A message of text alone is taken as sent;
# anything else is _message_parts's.
def _parse_messages(value: Any, fetch_image_urls: bool) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    messages, images = [], []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{p} must be an object with role and content", p)
        if (role := m.get("role")) not in CHAT_ROLES:
            raise bad_request(f"{p}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", f"{p}.role")
        messages.append({"role": "system" if role == "developer" else role,   # templates know "system"
                         "content": m.get("content")})
        if not isinstance(m.get("content"), str) or len(m) > 2:
            _message_parts(m, messages[-1], p, images, fetch_image_urls)
    return messages, images


def _message_parts(m: dict, msg: dict[str, Any], p: str, images: list[ImageInput], fetch_image_urls: bool) -> None:
    """Content parts (joined into the text; the images appended to `images`), an assistant's earlier tool calls and
    reasoning, a name or a tool_call_id, into msg."""
    role, content = m["role"], m.get("content")
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


def _chat_tool(tool: dict[str, Any], p: str) -> dict[str, Any]:
    fn = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise bad_request(f"{p} must be {CHAT_TOOL}", p)
    function_tool(fn, f"{p}.function")                # the checks: the template takes the tool as it was sent
    return tool


def _template_kwargs(kwargs: Any, name: str) -> dict[str, Any]:
    if not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
    for reserved in ("messages", "tools", "add_generation_prompt"):
        if reserved in kwargs:
            raise bad_request(f"chat_template_kwargs must not set {reserved!r}", "chat_template_kwargs")
    if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
        raise bad_request("chat_template_kwargs.enable_thinking must be a boolean",
                          "chat_template_kwargs.enable_thinking")
    return dict(kwargs)


# Fields of OpenAI's that change nothing here (docs/api.md says why), and fields we know and do not implement
IGNORED = {"user": str, "metadata": dict, "service_tier": str, "safety_identifier": str, "prompt_cache_key": str,
           "prompt_cache_retention": str, "prompt_cache_options": dict, "verbosity": str, "prediction": dict}
# vLLM's / SGLang's extensions a client may send expecting them to shape the output
NOT_IMPLEMENTED = {
    name: (lambda value, name=name: f"{name} (an extension of other servers) is not implemented")
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                 "structured_outputs", "regex", "ebnf", "use_beam_search", "prompt_logprobs", "truncate_prompt_tokens",
                 "allowed_token_ids", "bad_words", "logits_processors", "chat_template", "documents")}
NOT_IMPLEMENTED.update({
    "include_stop_str_in_output": lambda v: "the stop string is never part of the output" if v else None,
    "skip_special_tokens": lambda v: "special tokens are always left out of the text" if v is not True else None,
    "return_tokens_as_token_ids": lambda v: "logprobs show tokens as text and bytes" if v else None,
    "store": lambda v: "this server stores no completions (send store: false or leave it out)" if v else None})
CHAT_REFUSED = {
    **NOT_IMPLEMENTED,
    "functions": lambda v: "functions is deprecated by OpenAI; send tools",
    "function_call": lambda v: "function_call is deprecated by OpenAI; send tool_choice",
    "audio": lambda v: "audio output is not available (text only)",
    "modalities": lambda v: None if v == ["text"] else 'only ["text"] is available',
    "web_search_options": lambda v: "this server runs no built-in tools",
}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def _reasoning_effort(effort: Any, name: str) -> str:
    """reasoning_effort "none" turns thinking off (chat_template_kwargs.enable_thinking, when given, wins); other
    efforts leave the template's default: Qwen's templates take no budget."""
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}",
                          "reasoning_effort")
    return effort


def _check_continued(add_generation_prompt: bool, messages: list[dict[str, Any]]) -> None:
    if add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    if messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs an assistant message last", "continue_final_message")


# fetch_image_urls (server.fetch_image_urls): http(s) image URLs become RemoteImages instead of a 400.
# continue_final_message, add_generation_prompt and echo are vLLM's extensions for a prefill, which continue the last
# (assistant) message instead of closing it; echo puts that message's text before the answer.
def parse_chat_request(body: dict, served_name: str, fetch_image_urls: bool = False) -> ChatRequest:
    _check_model(body, served_name)
    unused_fields(body, CHAT_REFUSED, IGNORED)
    constraint = read_field(body, "response_format", parse_response_format)
    messages, images = _parse_messages(body.get("messages"), fetch_image_urls)
    if body.get("tool_choice") not in (None, "none") and not body.get("tools"):
        raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
    tools, tool_choice = None, "auto" if body.get("tool_choice") is None else body["tool_choice"]
    if body.get("tools") is not None:             # else nothing to check: the choice is "auto" or "none" (above)
        tools, tool_choice = chat_tools(function_tools(body["tools"], _chat_tool, CHAT_TOOL), tool_choice)
    logprobs = read_field(body, "logprobs", boolean, False)
    top_logprobs = read_field(body, "top_logprobs", integer, 0, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    options = parse_options(body, top_logprobs if logprobs else None, constraint)
    template_kwargs = read_field(body, "chat_template_kwargs", _template_kwargs) or {}
    if read_field(body, "reasoning_effort", _reasoning_effort) == "none":
        template_kwargs.setdefault("enable_thinking", False)
    cont = read_field(body, "continue_final_message", boolean, False)
    gen = read_field(body, "add_generation_prompt", boolean, not cont)
    echo = read_field(body, "echo", boolean, False)
    if cont:
        _check_continued(gen, messages)
    return ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice, template_kwargs=template_kwargs,
                       logprobs=logprobs, top_logprobs=top_logprobs, options=options, images=images,
                       continue_final=cont, add_generation_prompt=gen,
                       parallel_tool_calls=read_field(body, "parallel_tool_calls", boolean, True),
                       echo=messages[-1]["content"] if echo and messages[-1]["role"] == "assistant" else "")


def chat_body(chat: ChatFormat, req: ChatRequest, meta: Meta, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    out = []
    for c in choices:
        message, finish = chat.message(req, c)
        if req.echo:
            message["content"] = req.echo + (message["content"] or "")
        choice: dict[str, Any] = {"index": c.index, "message": message,
                                  "logprobs": {"content": logprob_content(meta, c.events)} if req.logprobs else None,
                                  "finish_reason": finish}
        if req.options.return_token_ids:
            choice["token_ids"] = c.token_ids
        out.append(choice)
    return _response_body(meta, "chat.completion", out, usage, req.options)


UNFINISHED = {"logprobs": None, "finish_reason": None}     # a chat chunk's choice before its logprobs and finish


# A role chunk per choice, then a chunk per delta of its text (reasoning_content, content, tool_calls, as the parsers
# split it): logprobs and token ids ride on the first chunk of each piece, finish_reason on a last chunk with an empty
# delta, as OpenAI's. A chunk that carries text, logprobs or token ids has a string content ("" when it has no text of
# its own), so `text += delta.content` works. The usage chunk at the end with stream_options.include_usage; the usage
# so far on every chunk with vLLM's continuous_usage_stats (_chunk).
async def chat_events(chat: ChatFormat, req: ChatRequest, meta: Meta, pieces: AsyncIterator[Piece]
                      ) -> AsyncIterator[bytes]:
    options, obj, parsed = req.options, "chat.completion.chunk", []
    chunk = partial(_chunk, meta, obj, options)
    for i in range(options.n):
        parsed.append(ChatStreamChoice(chat, req))
        first = chunk({"index": i, "delta": {"role": "assistant", "content": ""}, **UNFINISHED})
        if options.return_token_ids:
            first["prompt_token_ids"] = meta.prompts[0]
        yield sse_event(first)
        if req.echo:
            yield sse_event(chunk({"index": i, "delta": {"content": req.echo}, **UNFINISHED}))
    async for p in pieces:
        deltas = parsed[p.choice].pieces(p.text, p.finish_reason is not None, truncated=p.finish_reason == "length")
        if not deltas and p.token_ids and (options.return_token_ids or req.logprobs):
            deltas = [{"content": ""}]                # no text of its own, but logprobs or ids to carry
        for k, delta in enumerate(deltas):
            choice: dict[str, Any] = {"index": p.choice, "delta": delta, **UNFINISHED}
            if k == 0 and req.logprobs and p.events:
                choice["logprobs"] = {"content": logprob_content(meta, p.events)}
            if k == 0 and options.return_token_ids:
                choice["token_ids"] = p.token_ids
            yield sse_event(chunk(choice))
        if p.finish_reason is not None:
            finish = "tool_calls" if parsed[p.choice].called_tools and p.finish_reason == "stop" else p.finish_reason
            yield sse_event(chunk({"index": p.choice, "delta": {}, "logprobs": None, "finish_reason": finish}))
    if options.include_usage:
        yield sse_event({**_envelope(meta, obj), "choices": [], "usage": usage_body(meta.usage())})
    yield SSE_DONE


# ---------------------------------------------------------------------------------------------------------------
# POST /v1/completions

async def completions(request: web.Request) -> web.StreamResponse:
    state, engine = serving(request)
    note_openai_beta(request.headers)
    req = parse_completion_request(await read_json(request), engine.served_name)
    prompts = await asyncio.to_thread(completion_prompts, req, engine.tokenizer)
    fields = Fields("prompt", req.options.max_tokens_field)
    with start_generation(state, engine, req.options, prompts, "cmpl-", fields) as gen:
        if req.options.stream:
            return await sse(request, completion_events(req, gen.meta, gen.pieces()))
        return json_response(completion_body(req, gen.meta, await gen.collect(), gen.usage()))


@dataclass
class CompletionRequest:
    prompt: Any                       # as sent: read by completion_prompts
    logprobs: int | None
    options: GenerationOptions
    echo: bool = False                # each choice's text (and logprobs) starts with its prompt's
    prompt_only: bool = False         # echo with max_tokens 0: the prompt alone (one token is generated, not sent)
    echo_texts: list[str] = field(default_factory=list)   # each prompt as text, set with the prompt ids
    images: list[ImageInput] = field(default_factory=list)   # none: a completion prompt is text or token ids
    left_out: list[str] = field(default_factory=list)        # no tools

    @property
    def extras(self) -> bool:                         # echo, logprobs or return_token_ids: CompletionExtras fills them
        return self.echo or self.logprobs is not None or self.options.return_token_ids


COMPLETION_REFUSED = {
    **NOT_IMPLEMENTED,
    "suffix": lambda v: None if v == "" else "no fill-in-the-middle (send the text before the gap as the prompt)",
}


def parse_completion_request(body: dict, served_name: str) -> CompletionRequest:
    _check_model(body, served_name)
    unused_fields(body, COMPLETION_REFUSED, IGNORED)
    logprobs = read_field(body, "logprobs", integer, lo=0, hi=MAX_COMPLETION_LOGPROBS)
    echo = read_field(body, "echo", boolean, False)
    options = parse_options(body, logprobs)
    best_of = read_field(body, "best_of", integer, lo=1)
    if best_of is not None and best_of != options.n:
        raise bad_request(f"best_of={best_of} is not supported by this server: it returns the n it samples (best_of "
                          "may only equal n)", "best_of")
    prompt_only = echo and options.params.max_tokens == 0
    if prompt_only:                                   # the engine generates at least one token; it is not sent
        options.params = replace(options.params, max_tokens=1)
    if echo and logprobs is not None:                 # the prompt's own logprobs, from its prefill
        options.params = replace(options.params, prompt_logprobs=logprobs)
    return CompletionRequest(body.get("prompt"), logprobs, options, echo=echo, prompt_only=prompt_only)


# OpenAI's prompt: a string, a list of token ids, or a list of either (one choice per prompt, times n; choice i answers
# prompt i // n) -> each prompt's ids, on a worker thread (encoding a long text takes time); with echo, each prompt's
# text as it is echoed (a text prompt as sent, token ids as they decode).
def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    prompts = req.prompt
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise bad_request("prompt must be a string, a list of token ids, or a non-empty list of those", "prompt")
    out = []
    for k, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
        if not p or not isinstance(p, (str, list)):
            raise bad_request(f"{where} must not be empty" if p in ("", []) else
                              f"{where} must be a string or a list of token ids", where)
        ids = tokenizer.encode(p) if isinstance(p, str) else token_id_list(p, where)
        if not ids:
            raise bad_request(f"{where} encodes to no tokens", where)
        out.append(ids)
    if req.echo:
        req.echo_texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    return out


def completion_body(req: CompletionRequest, meta: Meta, choices: list[Choice], usage: Usage) -> dict[str, Any]:
    extras = CompletionExtras(req, meta) if req.extras else None
    out = []
    for c in choices:
        choice: dict[str, Any] = {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
        if extras is not None:
            extras.add(choice, c.index, c, final=True, whole=True)
        out.append(choice)
    if req.prompt_only:
        usage = replace(usage, completion_tokens=0)
    return _response_body(meta, "text_completion", out, usage, req.options)


# One chunk per piece (the extras as the body has them, on each choice's first chunk).
async def completion_events(req: CompletionRequest, meta: Meta, pieces: AsyncIterator[Piece]
                            ) -> AsyncIterator[bytes]:
    extras = CompletionExtras(req, meta) if req.extras else None
    async for p in pieces:
        choice = {"index": p.choice, "text": p.text, "finish_reason": p.finish_reason, "logprobs": None}
        if extras is not None:
            extras.add(choice, p.choice, p, final=p.finish_reason is not None)
        yield sse_event(_chunk(meta, "text_completion", req.options, choice))
    if req.options.include_usage:
        usage = replace(meta.usage(), completion_tokens=0) if req.prompt_only else meta.usage()
        yield sse_event({**_envelope(meta, "text_completion"), "choices": [], "usage": usage_body(usage)})
    yield SSE_DONE


class CompletionExtras:
    """What echo, logprobs and return_token_ids add to a completion's choices, in the body and in a stream's chunks
    alike: a choice's first (or only) one carries its prompt's text (echo), the prompt's logprobs (echo with
    logprobs) and its prompt's ids (return_token_ids); echo with max_tokens 0 (prompt_only) sends the prompt alone.
    With logprobs, each choice's text so far gives their offsets."""

    def __init__(self, req: CompletionRequest, meta: Meta) -> None:
        self.req, self.meta = req, meta
        count = len(meta.prompts) * req.options.n
        self.offsets, self.started = [TextOffsets() for _ in range(count)], [False] * count

    def add(self, choice: dict[str, Any], k: int, got: Piece | Choice, final: bool, whole: bool = False) -> None:
        """Fill choice k's fields from what it got (a piece, or the whole choice: then its logprobs are there even
        without a token)."""
        req, prompt_index = self.req, k // self.req.options.n
        first, self.started[k] = not self.started[k], True
        text, events, ids = ("", [], []) if req.prompt_only else (got.text, got.events, got.token_ids)
        tokens = _scored(events) if req.logprobs is not None else []
        if first and req.echo:
            text = req.echo_texts[prompt_index] + text
            if req.logprobs is not None:
                tokens = _echoed(self.meta.prompts[prompt_index], got.prompt_logprobs) + tokens
        choice["text"] = text
        if req.prompt_only and got.finish_reason:
            choice["finish_reason"] = "length"
        if req.logprobs is not None and (tokens or whole):
            choice["logprobs"] = completion_logprobs(self.meta, tokens, self.offsets[k], final)
        if req.options.return_token_ids:
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = self.meta.prompts[prompt_index]


def _scored(events: list[Any]) -> list[LegacyToken]:
    return [(e.token_id, e.logprob, e.top_logprobs) for e in events]


def _echoed(prompt: list[int], prompt_logprobs: list[Any] | None) -> list[LegacyToken]:
    """The prompt's tokens with their logprobs: the first has none; the others come from the prefill."""
    scored = prompt_logprobs or [(None, None)] * (len(prompt) - 1)
    return [(prompt[0], None, None)] + [(t, lp, top) for t, (lp, top) in zip(prompt[1:], scored)]


class TextOffsets:
    """Each token's share of a choice's text, decoded as the tokens come (completions' tokens and text_offset): a
    token inside a character adds "" and the one that completes it the whole character, so the tokens join into
    the text; a token starts where the text stood before it."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, data: bytes, final: bool = False) -> tuple[int, str]:
        """(where the token starts, the text it adds); final: the choice's last token (a character left open
        ends there, as U+FFFD)."""
        at = self.chars
        piece = self._decoder.decode(data, final)
        self.chars += len(piece)
        return at, piece


LegacyToken = tuple[int, "float | None", "list[tuple[int, float]] | None"]   # id, logprob, top-n (None: unscored)


def completion_logprobs(meta: Meta, tokens: list[LegacyToken], offsets: TextOffsets, final: bool = True
                        ) -> dict[str, Any]:
    """Completions' logprobs: tokens (each one's share of the text, so that they join into it, as vLLM gives them),
    token_logprobs, top_logprobs (the top-n and the chosen token, keyed by their own text, "bytes:\\xNN" for part of
    a character; a second token with the same text is keyed "token_id:N"), text_offset. The first prompt token
    (echo) has no logprob: null in both lists, as OpenAI and vLLM give it. final: these tokens end the choice."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for k, (token_id, logprob, top) in enumerate(tokens):
        at, piece = offsets.advance(meta.token_bytes(token_id), final and k == len(tokens) - 1)
        out["tokens"].append(piece)
        out["token_logprobs"].append(logprob)
        out["text_offset"].append(at)
        if logprob is None:
            out["top_logprobs"].append(None)
            continue
        alternatives: dict[str, float] = {}
        owner: dict[str, int] = {}
        for t, lp in [*(top or []), (token_id, logprob)]:
            key = meta.token_text(t)
            if owner.get(key, t) != t:
                key = f"token_id:{t}"
            if key not in owner:
                owner[key], alternatives[key] = t, lp
        out["top_logprobs"].append(alternatives)
    return out


# ---------------------------------------------------------------------------------------------------------------
# What both bodies and both streams share

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


def _envelope(meta: Meta, obj: str) -> dict[str, Any]:
    return {"id": meta.request_id, "object": obj, "created": meta.created, "model": meta.model}


# A stream's chunk of one choice: the envelope, and with vLLM's stream_options.continuous_usage_stats the usage so far.
def _chunk(meta: Meta, obj: str, options: GenerationOptions, choice: dict[str, Any]) -> dict[str, Any]:
    out = {"id": meta.request_id, "object": obj, "created": meta.created, "model": meta.model, "choices": [choice]}
    if options.continuous_usage:
        out["usage"] = usage_body(meta.usage())
    return out


def _response_body(meta: Meta, obj: str, choices: list[dict[str, Any]], usage: Usage, options: GenerationOptions
                   ) -> dict[str, Any]:
    body = {**_envelope(meta, obj), "choices": choices, "usage": usage_body(usage)}
    if options.return_token_ids and len(meta.prompts) == 1:   # several prompts: each choice carries its own
        body["prompt_token_ids"] = meta.prompts[0]
    return body
