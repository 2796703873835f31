"""The HTTP server: OpenAI-compatible routes over aiohttp.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    GET /health   GET /metrics   POST /flush_cache

A request goes: JSON body -> parse_*_request (hand-written validation, a 400 naming the field) -> chat template and
tokenizer (in a worker thread: long prompts would stall every stream) -> Generation (the n engine requests behind
one HTTP request) -> either one JSON response or an SSE stream. The engine stays the only owner of pages and
state; this module only submits, iterates and cancels.

Why the bounded queue: SGLang and vLLM queue without limit, so a burst piles up minutes of waiting requests that
clients have long given up on. We answer 503 + Retry-After instead once more than max_running_requests +
server.max_queued_requests requests are in the engine.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from aiohttp import web

from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .parsers import Qwen3CoderToolParser, Qwen3ReasoningParser, make_tool_parser, prompt_opens_reasoning
from .sampling import MAX_LOGPROBS, SamplingParams
from .tokenizer import IncrementalDetokenizer

log = logging.getLogger("tinyserve.api")

MAX_N = 8
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
RETRY_AFTER_S = 1


# ---------------------------------------------------------------------------------------------------------------
# Errors

class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, *, type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.code = code
        self.headers = headers or {}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "internal_error", 503: "service_unavailable"}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None, type: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(err: APIError) -> web.Response:
    return web.json_response(error_body(err.status, err.message, err.param, err.type, err.code),
                             status=err.status, headers=err.headers, dumps=_dumps)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------------------------
# App state

@dataclass
class ServerState:
    """What the handlers share. `engine` is None while the model loads (/health answers 503 then)."""

    cfg: Any
    engine: Any = None
    metrics: Metrics | None = None
    draining: bool = False
    streams: set = field(default_factory=set)        # RequestStreams submitted and not yet finished
    _token_text: dict[int, str] = field(default_factory=dict)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (cached: the same ids come back all the time)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.engine.tokenizer.decode([token_id])
            self._token_text[token_id] = text
        return text


STATE: web.AppKey[ServerState] = web.AppKey("tinyserve_state", ServerState)


def get_state(app: web.Application) -> ServerState:
    return app[STATE]


def set_engine(app: web.Application, engine: Any) -> None:
    """Attach the engine once it has loaded: the server can listen (and answer /health 503) before."""
    app[STATE].engine = engine


def create_app(engine: Any, cfg: Any) -> web.Application:
    """The aiohttp application. `engine` may be None and set later with set_engine (loading)."""
    max_body = int(cfg.server.max_request_body_mb * 1024 * 1024)
    app = web.Application(client_max_size=max_body, middlewares=[_error_middleware, _auth_middleware])
    state = ServerState(cfg=cfg, engine=engine)
    state.metrics = Metrics(lambda: state.engine) if cfg.metrics.enabled else None
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/flush_cache", flush_cache)
    return app


# ---------------------------------------------------------------------------------------------------------------
# Middlewares

_GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure leaves in the error shape; never a traceback to the client."""
    state = request.app[STATE]
    try:
        response = await handler(request)
    except APIError as e:
        response = error_response(e)
    except web.HTTPException as e:                    # routing (404, 405) and body size (413) from aiohttp
        if e.status < 400:
            raise
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}",
                   413: f"request body is larger than server.max_request_body_mb "
                        f"({state.cfg.server.max_request_body_mb:g} MB)"}.get(e.status, e.reason)
        response = error_response(APIError(e.status, message, headers={
            k: v for k, v in e.headers.items() if k.lower() == "allow"}))
    except (asyncio.CancelledError, ConnectionResetError):
        raise                                         # the client went away; the handler cleaned up
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        response = error_response(APIError(500, "internal server error (logged on the server)"))
    if state.metrics is not None and request.path in _GENERATION_PATHS:
        state.metrics.on_response(response.status)
    return response


@web.middleware
async def _auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[STATE].cfg.server.api_key
    if key and request.path != "/health":
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
    return await handler(request)


# ---------------------------------------------------------------------------------------------------------------
# Request parsing: one dataclass per request kind, validated by hand so every message names its field.

_MISSING = object()


def _number(body: dict, name: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)                            # 16.0 from some clients
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad_request(f"{name} must be {rng}, got {value}", name)
    return value


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {value!r}", name)
    return value


def _stop_strings(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("stop must be a string or a list of strings", "stop")
    if len(value) > MAX_STOP_STRINGS:
        raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(value)}", "stop")
    return [s for s in value if s]                    # "" would stop at once; OpenAI ignores it


def _token_ids(value: Any, name: str, vocab_size: int, allow_empty: bool = True) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"{name} must be a list of integer token ids", name)
    if not value and not allow_empty:
        raise bad_request(f"{name} must not be empty", name)
    for t in value:
        if not 0 <= t < vocab_size:
            raise bad_request(f"{name} holds token id {t}, outside the vocabulary [0, {vocab_size})", name)
    return list(value)


@dataclass
class GenerationOptions:
    """The fields both endpoints share. `params.max_tokens` is set once the prompt length is known."""

    params: SamplingParams
    max_tokens: int | None           # None: up to the end of the context
    max_tokens_field: str
    stop: list[str]
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool


def _check_model(body: dict, served_name: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {model!r}", "model")
    if model != served_name:
        raise APIError(404, f"model {model!r} is not served here; this server serves {served_name!r}",
                       "model", code="model_not_found")


def _parse_options(body: dict, vocab_size: int, logprobs: int | None) -> GenerationOptions:
    """Sampling and streaming fields. Types are checked here, ranges by SamplingParams.validate."""
    if body.get("max_completion_tokens") is not None:   # the newer OpenAI name wins
        max_field = "max_completion_tokens"
    else:
        max_field = "max_tokens"
    max_tokens = _integer(body, max_field, None, lo=1)
    top_k = _integer(body, "top_k", 0)
    params = SamplingParams(
        max_tokens=max_tokens or 1,
        min_tokens=_integer(body, "min_tokens", 0, lo=0),
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=top_k,
        min_p=_number(body, "min_p", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        seed=_integer(body, "seed", None, lo=-(2 ** 63), hi=2 ** 64 - 1),
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids", vocab_size),
        ignore_eos=_boolean(body, "ignore_eos", False),
        logprobs=logprobs,
    )
    if max_tokens is not None and params.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({params.min_tokens}) must not exceed {max_field} ({max_tokens})",
                          "min_tokens")
    _validate_params(replace(params, max_tokens=max(max_tokens or 1, params.min_tokens, 1)))
    stream = _boolean(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        include_usage = _boolean(stream_options, "include_usage", False)
    return GenerationOptions(
        params=params, max_tokens=max_tokens, max_tokens_field=max_field, stop=_stop_strings(body),
        n=_integer(body, "n", 1, lo=1, hi=MAX_N), stream=stream, include_usage=include_usage,
        return_token_ids=_boolean(body, "return_token_ids", False))


def _validate_params(params: SamplingParams) -> None:
    try:
        params.validate()
    except ValueError as e:                           # its messages start with the field name
        message = str(e)
        raise bad_request(message, message.split(" ", 1)[0]) from None


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

    @property
    def enable_thinking(self) -> bool:
        return bool(self.template_kwargs.get("enable_thinking", True))


def _text_content(value: Any, param: str, allow_none: bool) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts joined by newlines."""
    if value is None:
        if allow_none:
            return ""
        raise bad_request(f"{param} is required", param)
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{param}[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}} "
                                  "(only text parts are supported)", f"{param}[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{param} must be a string or a list of text parts", param)


def _assistant_tool_calls(value: Any, param: str) -> list[dict[str, Any]]:
    """Earlier tool calls in the history. Arguments become dicts: the Qwen templates iterate over them."""
    if not isinstance(value, list):
        raise bad_request(f"{param} must be a list", param)
    calls = []
    for j, call in enumerate(value):
        p = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{p} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", p)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise bad_request(f"{p}.function.arguments is not valid JSON", f"{p}.function.arguments") from None
        if not isinstance(args, dict):
            raise bad_request(f"{p}.function.arguments must be a JSON object", f"{p}.function.arguments")
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": fn["name"], "arguments": args}})
    return calls


def _parse_messages(value: Any) -> list[dict[str, Any]]:
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
        msg["content"] = _text_content(m.get("content"), f"{p}.content", allow_none=role == "assistant")
        if role == "assistant":
            if m.get("tool_calls"):
                msg["tool_calls"] = _assistant_tool_calls(m["tool_calls"], f"{p}.tool_calls")
            if isinstance(m.get("reasoning_content"), str):
                msg["reasoning_content"] = m["reasoning_content"]
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad_request(f"{p}.{key} must be a string", f"{p}.{key}")
                msg[key] = m[key]
        out.append(msg)
    return out


def _parse_tools(body: dict) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("tools must be a list", "tools")
        for i, tool in enumerate(tools):
            p = f"tools[{i}]"
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise bad_request(f"{p} must be {{\"type\": \"function\", \"function\": {{...}}}}", p)
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad_request(f"{p}.function.name must be a non-empty string", f"{p}.function.name")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise bad_request(f"{p}.function.parameters must be a JSON schema object",
                                  f"{p}.function.parameters")
        tools = tools or None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    # "required" and a named function are accepted but not enforced (no constrained decoding); a named function
    # limits what is parsed as a call.
    try:
        make_tool_parser(tools, choice)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from None
    return tools, choice


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


def _reject_unsupported(body: dict, fields: dict[str, Any]) -> None:
    """OpenAI fields we know but do not implement: a clear 400 beats silently different output."""
    for name, ok in fields.items():
        value = body.get(name)
        if value is not None and not ok(value):
            raise bad_request(f"{name}={value!r} is not supported by this server", name)


def parse_chat_request(body: dict, served_name: str, vocab_size: int) -> ChatRequest:
    _check_model(body, served_name)
    _reject_unsupported(body, {"response_format": lambda v: isinstance(v, dict) and v.get("type") == "text"})
    messages = _parse_messages(body.get("messages"))
    tools, tool_choice = _parse_tools(body)
    logprobs = _boolean(body, "logprobs", False)
    top_logprobs = _integer(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs and not logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    options = _parse_options(body, vocab_size, top_logprobs if logprobs else None)
    return ChatRequest(messages=messages, tools=tools, tool_choice=tool_choice,
                       template_kwargs=_parse_template_kwargs(body), logprobs=logprobs,
                       top_logprobs=top_logprobs, options=options)


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    logprobs: int | None
    options: GenerationOptions


def parse_completion_request(body: dict, served_name: str, vocab_size: int) -> CompletionRequest:
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
        prompt = _token_ids(prompt, "prompt", vocab_size, allow_empty=False)
    else:
        raise bad_request("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    logprobs = _integer(body, "logprobs", None, lo=0, hi=MAX_COMPLETION_LOGPROBS)
    return CompletionRequest(prompt=prompt, logprobs=logprobs, options=_parse_options(body, vocab_size, logprobs))


# ---------------------------------------------------------------------------------------------------------------
# Prompt preparation

def _resolve_max_tokens(options: GenerationOptions, prompt_len: int, engine: Any, prompt_field: str
                        ) -> SamplingParams:
    context = engine.context_length
    pool = getattr(getattr(engine, "plan", None), "kv_tokens", None) or context
    if prompt_len >= context:
        raise bad_request(f"the prompt is {prompt_len} tokens long, but the context is {context} tokens "
                          "(there must be room for at least one generated token)", prompt_field)
    room = context - prompt_len
    # No max_tokens: up to the end of the context (vLLM's default), but never past what the KV pool can hold,
    # which on a small card or the CPU can be less than the context.
    max_tokens = options.max_tokens if options.max_tokens is not None else max(1, min(room, pool - prompt_len))
    if max_tokens > room:
        raise bad_request(f"{options.max_tokens_field} ({max_tokens}) plus the prompt ({prompt_len} tokens) is "
                          f"longer than the context ({context} tokens); at most {room} tokens fit",
                          options.max_tokens_field)
    params = replace(options.params, max_tokens=max_tokens,
                     min_tokens=min(options.params.min_tokens, max_tokens))
    return params


def _render_chat(engine: Any, req: ChatRequest) -> tuple[str, list[int]]:
    """Chat template + tokenizer; runs in a worker thread."""
    try:
        text = engine.tokenizer.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=True,
                                                    **req.template_kwargs)
    except ValueError as e:                           # e.g. the template's raise_exception on a bad history
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
    return text, engine.tokenizer.encode(text)


async def _in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


# ---------------------------------------------------------------------------------------------------------------
# Generation: the n engine requests behind one HTTP request

@dataclass
class Delta:
    """What one choice produced since the last Delta."""

    text: str
    token_ids: list[int]
    events: list[Any]                 # engine TokenEvents (logprobs)
    finish_reason: str | None = None


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    finish_reason: str = "stop"


class Generation:
    """Submits n requests for one prompt, turns their token events into text deltas (stop strings applied),
    records metrics, and cancels whatever is unfinished on close(): client gone, stop string, or shutdown."""

    def __init__(self, state: ServerState, prompt_ids: list[int], params: SamplingParams, n: int, stop: list[str],
                 request_id: str, arrival: float) -> None:
        self.state = state
        self.prompt_ids = prompt_ids
        self.stop = stop
        self.arrival = arrival
        self.streams: list[Any] = []
        try:
            for i in range(n):
                seed = params.seed if params.seed is None or n == 1 else (params.seed + i) % 2 ** 64
                stream = state.engine.submit(prompt_ids, replace(params, seed=seed), f"{request_id}-{i}")
                self.streams.append(stream)
                state.streams.add(stream)
        except ValueError as e:
            self.close()
            raise bad_request(str(e)) from None

    def close(self) -> None:
        for stream in self.streams:
            if stream in self.state.streams:          # not finished: client gone, error, or shutdown
                stream.cancel()
                self._finished(stream, "abort")

    async def deltas(self, index: int) -> AsyncIterator[Delta]:
        """One choice's deltas; the last one carries finish_reason."""
        stream = self.streams[index]
        detok = IncrementalDetokenizer(self.state.engine.tokenizer, self.stop)
        metrics = self.state.metrics
        last = None
        async for events in stream:
            now = time.monotonic()
            if metrics is not None:
                if last is None:
                    metrics.on_first_token(now - self.arrival)
                metrics.on_tokens(len(events), None if last is None else now - last)
            last = now
            ids = [e.token_id for e in events]
            text = detok.add(ids)
            if detok.stopped:                               # a stop string: the rest of the text is cut
                stream.cancel()
                self._finished(stream, "stop")
                yield Delta(text, ids, events, "stop")
                return
            if text or ids:
                yield Delta(text, ids, events)
        reason = stream.result.finish_reason or "abort"
        self._finished(stream, reason)
        yield Delta(detok.flush(), [], [], reason)

    def _finished(self, stream: Any, reason: str) -> None:
        if stream not in self.state.streams:          # counted once
            return
        self.state.streams.discard(stream)
        if self.state.metrics is not None:
            r = stream.result
            self.state.metrics.on_finished(reason, r.prompt_tokens, getattr(r, "cached_tokens_by_tier", None),
                                           time.monotonic() - self.arrival)

    async def merged(self) -> AsyncIterator[tuple[int, Delta]]:
        """All choices' deltas as they come (one choice: no extra task or queue)."""
        if len(self.streams) == 1:
            async for d in self.deltas(0):
                yield 0, d
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for d in self.deltas(i):
                    await queue.put((i, d))
            except Exception as e:                    # surfaced in the consumer
                await queue.put((i, e))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.streams))]
        try:
            open_ = len(tasks)
            while open_:
                i, item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self) -> list[ChoiceResult]:
        results = [ChoiceResult(i) for i in range(len(self.streams))]
        async for i, d in self.merged():
            r = results[i]
            r.text += d.text
            r.token_ids += d.token_ids
            r.events += d.events
            if d.finish_reason is not None:
                r.finish_reason = d.finish_reason
        return results

    def usage(self, results: list[ChoiceResult]) -> dict[str, Any]:
        completion = sum(len(r.token_ids) for r in results)
        prompt = len(self.prompt_ids)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if self.state.cfg.metrics.cache_report:
            first = self.streams[0].result    # the other choices share the prompt (and hit what the first wrote)
            usage["prompt_tokens_details"] = {
                "cached_tokens": first.cached_tokens,
                "cached_tokens_by_tier": dict(getattr(first, "cached_tokens_by_tier", None) or {})}
        return usage


# ---------------------------------------------------------------------------------------------------------------
# Parsers (per choice: they are stateful)

def _reasoning_parser(state: ServerState, req: ChatRequest) -> Qwen3ReasoningParser | None:
    if state.cfg.parsers.reasoning != "qwen3":
        return None
    return Qwen3ReasoningParser(starts_in_reasoning=req.starts_in_reasoning, enabled=req.enable_thinking)


def _tool_parser(state: ServerState, req: ChatRequest) -> Qwen3CoderToolParser | None:
    if state.cfg.parsers.tool_call != "qwen3_coder":
        return None
    return make_tool_parser(req.tools, req.tool_choice)


# ---------------------------------------------------------------------------------------------------------------
# Response building

def _chat_logprobs(state: ServerState, events: list[Any]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        tok = state.token_text(token_id)
        return {"token": tok, "logprob": logprob, "bytes": list(tok.encode("utf-8"))}

    content = []
    for e in events:
        item = entry(e.token_id, e.logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in (e.top_logprobs or [])]
        content.append(item)
    return {"content": content}


def _completion_logprobs(state: ServerState, events: list[Any], offset: int) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for e in events:
        tok = state.token_text(e.token_id)
        tokens.append(tok)
        token_logprobs.append(e.logprob)
        top.append({state.token_text(t): lp for t, lp in (e.top_logprobs or [(e.token_id, e.logprob)])})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _envelope(request_id: str, obj: str, created: int, model: str) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created, "model": model}


def chat_message(state: ServerState, req: ChatRequest, r: ChoiceResult) -> tuple[dict[str, Any], str]:
    """Split a finished choice's text into reasoning, content and tool calls."""
    message: dict[str, Any] = {"role": "assistant"}
    content: str | None = r.text
    reasoning = _reasoning_parser(state, req)
    if reasoning is not None:
        message["reasoning_content"], content = reasoning.parse(r.text)
    finish = r.finish_reason
    tools = _tool_parser(state, req)
    if tools is not None and content:
        content, calls = tools.parse(content)
        if calls:
            message["tool_calls"] = calls
            if finish == "stop":
                finish = "tool_calls"
    message["content"] = content if content or "tool_calls" not in message else None
    return message, finish


def build_chat_response(state: ServerState, gen: Generation, req: ChatRequest, results: list[ChoiceResult],
                        request_id: str, created: int) -> dict[str, Any]:
    body = _envelope(request_id, "chat.completion", created, state.engine.served_name)
    choices = []
    for r in results:
        message, finish = chat_message(state, req, r)
        choice: dict[str, Any] = {"index": r.index, "message": message,
                                  "logprobs": _chat_logprobs(state, r.events) if req.logprobs else None,
                                  "finish_reason": finish}
        if req.options.return_token_ids:
            choice["token_ids"] = r.token_ids
        choices.append(choice)
    body["choices"] = choices
    body["usage"] = gen.usage(results)
    if req.options.return_token_ids:
        body["prompt_token_ids"] = gen.prompt_ids
    return body


def build_completion_response(state: ServerState, gen: Generation, req: CompletionRequest,
                              results: list[ChoiceResult], request_id: str, created: int) -> dict[str, Any]:
    body = _envelope(request_id, "text_completion", created, state.engine.served_name)
    choices = []
    for r in results:
        choice: dict[str, Any] = {
            "index": r.index, "text": r.text, "finish_reason": r.finish_reason,
            "logprobs": _completion_logprobs(state, r.events, 0) if req.logprobs is not None else None}
        if req.options.return_token_ids:
            choice["token_ids"] = r.token_ids
            choice["prompt_token_ids"] = gen.prompt_ids
        choices.append(choice)
    body["choices"] = choices
    body["usage"] = gen.usage(results)
    if req.options.return_token_ids:
        body["prompt_token_ids"] = gen.prompt_ids
    return body


# ---------------------------------------------------------------------------------------------------------------
# Streaming (SSE)

class _SSE:
    """An event-stream response; write() raises ConnectionResetError once the client has gone."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, obj: dict[str, Any]) -> None:
        await self.response.write(b"data: " + _dumps(obj).encode() + b"\n\n")

    async def done(self) -> web.StreamResponse:
        try:
            await self.response.write(b"data: [DONE]\n\n")
            await self.response.write_eof()
        except ConnectionResetError:
            pass
        return self.response


class ChatStreamChoice:
    """One choice's parsers while streaming: text deltas in, OpenAI delta dicts out."""

    def __init__(self, state: ServerState, req: ChatRequest) -> None:
        self.reasoning = _reasoning_parser(state, req)
        self.tools = _tool_parser(state, req)
        self.called_tools = False

    def pieces(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Deltas for this text: reasoning_content, then content and tool_calls in the order they came."""
        out: list[dict[str, Any]] = []
        content = text
        if self.reasoning is not None:
            reasoning_text, content = self.reasoning.feed(text)
            if final:
                r2, c2 = self.reasoning.finish()
                reasoning_text, content = reasoning_text + r2, content + c2
            if reasoning_text:
                out.append({"reasoning_content": reasoning_text})
        if self.tools is None:
            if content:
                out.append({"content": content})
            return out
        tool_deltas = self.tools.feed(content) if content else []
        if final:
            tool_deltas += self.tools.finish()
        for d in tool_deltas:
            self.called_tools = self.called_tools or "tool_calls" in d
        return out + tool_deltas


async def stream_chat(request: web.Request, state: ServerState, gen: Generation, req: ChatRequest,
                      request_id: str, created: int) -> web.StreamResponse:
    """SSE: a role chunk per choice, then one chunk per delta; logprobs and token ids ride on the first chunk of
    each engine step, finish_reason on the last."""
    sse = _SSE(request)
    await sse.open()
    base = _envelope(request_id, "chat.completion.chunk", created, state.engine.served_name)
    per_choice = [ChatStreamChoice(state, req) for _ in gen.streams]
    counts = [0] * len(gen.streams)
    ids = req.options.return_token_ids
    try:
        for i in range(len(gen.streams)):
            chunk = {**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
            if ids:
                chunk["prompt_token_ids"] = gen.prompt_ids
            await sse.send(chunk)
        async for i, d in gen.merged():
            c = per_choice[i]
            final = d.finish_reason is not None
            counts[i] += len(d.token_ids)
            pieces = c.pieces(d.text, final)
            if not pieces and (final or (d.token_ids and (ids or req.logprobs))):
                pieces = [{}]                         # nothing to say, but a finish reason or ids to carry
            for k, piece in enumerate(pieces):
                choice: dict[str, Any] = {"index": i, "delta": piece, "logprobs": None, "finish_reason": None}
                if k == 0:
                    if req.logprobs and d.events:
                        choice["logprobs"] = _chat_logprobs(state, d.events)
                    if ids:
                        choice["token_ids"] = d.token_ids
                if final and k == len(pieces) - 1:
                    reason = d.finish_reason
                    choice["finish_reason"] = "tool_calls" if c.called_tools and reason == "stop" else reason
                await sse.send({**base, "choices": [choice]})
        if req.options.include_usage:
            await sse.send({**base, "choices": [], "usage": _stream_usage(gen, counts)})
    except APIError as e:                             # after the headers went out: an error event
        await sse.send(error_body(e.status, e.message, e.param))
    except ConnectionResetError:                      # the client left; the handler's finally cancels
        log.debug("client disconnected from %s", request_id)
        return sse.response
    return await sse.done()


async def stream_completion(request: web.Request, state: ServerState, gen: Generation, req: CompletionRequest,
                            request_id: str, created: int) -> web.StreamResponse:
    sse = _SSE(request)
    await sse.open()
    base = _envelope(request_id, "text_completion", created, state.engine.served_name)
    counts = [0] * len(gen.streams)
    offsets = [0] * len(gen.streams)
    try:
        async for i, d in gen.merged():
            counts[i] += len(d.token_ids)
            choice: dict[str, Any] = {
                "index": i, "text": d.text, "finish_reason": d.finish_reason,
                "logprobs": _completion_logprobs(state, d.events, offsets[i])
                if req.logprobs is not None and d.events else None}
            offsets[i] += len(d.text)
            if req.options.return_token_ids:
                choice["token_ids"] = d.token_ids
            await sse.send({**base, "choices": [choice]})
        if req.options.include_usage:
            await sse.send({**base, "choices": [], "usage": _stream_usage(gen, counts)})
    except APIError as e:
        await sse.send(error_body(e.status, e.message, e.param))
    except ConnectionResetError:                      # the client left; the handler's finally cancels
        log.debug("client disconnected from %s", request_id)
        return sse.response
    return await sse.done()


def _stream_usage(gen: Generation, counts: list[int]) -> dict[str, Any]:
    return gen.usage([ChoiceResult(i, token_ids=[0] * n) for i, n in enumerate(counts)])


# ---------------------------------------------------------------------------------------------------------------
# Handlers

def _check_serving(state: ServerState) -> None:
    if state.engine is None:
        raise APIError(503, "the model is still loading", headers={"Retry-After": str(RETRY_AFTER_S)})
    if state.draining:
        raise APIError(503, "the server is shutting down")


def _check_capacity(state: ServerState, n: int) -> None:
    cfg = state.cfg
    limit = cfg.engine.max_running_requests + cfg.server.max_queued_requests
    if len(state.streams) + n > limit:
        raise APIError(503, f"the server is full ({len(state.streams)} requests running or queued, limit {limit}); "
                            "retry later", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()                        # raises 413 past client_max_size
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _vocab_size(engine: Any) -> int:
    return engine.model_config.vocab_size


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    _check_serving(state)
    body = await _read_json(request)
    engine = state.engine
    req = parse_chat_request(body, engine.served_name, _vocab_size(engine))
    _check_capacity(state, req.options.n)
    prompt_text, prompt_ids = await _in_thread(_render_chat, engine, req)
    req.starts_in_reasoning = prompt_opens_reasoning(prompt_text)
    params = _resolve_max_tokens(req.options, len(prompt_ids), engine, "messages")
    request_id = "chatcmpl-" + uuid.uuid4().hex
    created = int(time.time())
    gen = Generation(state, prompt_ids, params, req.options.n, req.options.stop, request_id, arrival)
    try:                                              # close() cancels on any exit: done, error, client gone
        if req.options.stream:
            return await stream_chat(request, state, gen, req, request_id, created)
        results = await gen.collect()
        return web.json_response(build_chat_response(state, gen, req, results, request_id, created), dumps=_dumps)
    finally:
        gen.close()


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    _check_serving(state)
    body = await _read_json(request)
    engine = state.engine
    req = parse_completion_request(body, engine.served_name, _vocab_size(engine))
    _check_capacity(state, req.options.n)
    if isinstance(req.prompt, str):
        prompt_ids = await _in_thread(engine.tokenizer.encode, req.prompt)
        if not prompt_ids:
            raise bad_request("prompt encodes to no tokens", "prompt")
    else:
        prompt_ids = req.prompt
    params = _resolve_max_tokens(req.options, len(prompt_ids), engine, "prompt")
    request_id = "cmpl-" + uuid.uuid4().hex
    created = int(time.time())
    gen = Generation(state, prompt_ids, params, req.options.n, req.options.stop, request_id, arrival)
    try:
        if req.options.stream:
            return await stream_completion(request, state, gen, req, request_id, created)
        results = await gen.collect()
        return web.json_response(build_completion_response(state, gen, req, results, request_id, created),
                                 dumps=_dumps)
    finally:
        gen.close()


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _check_serving(state)
    engine = state.engine
    return web.json_response({"object": "list", "data": [{
        "id": engine.served_name, "object": "model", "created": int(time.time()), "owned_by": "tinyserve",
        "max_model_len": engine.context_length}]})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is None:
        return web.json_response({"status": "loading"}, status=503)
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.metrics is None:
        raise APIError(404, "metrics are off (metrics.enabled = false)")
    body = state.metrics.render()                    # on the loop: engine.stats() is not thread-safe
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def flush_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _check_serving(state)
    tiers = [t for t in request.query.get("tiers", "").split(",") if t]
    unknown = sorted(set(tiers) - {"device", "host", "file"})
    if unknown:
        raise bad_request(f"unknown tier {unknown[0]!r} in ?tiers= (device, host, file)", "tiers")
    include_file = "file" in tiers                   # the persistent tier is emptied only when asked
    if await asyncio.to_thread(state.engine.flush_cache, include_file):
        flushed = "device and host tiers" + (" and the file tier" if include_file else "")
        return web.json_response({"message": f"prefix cache flushed ({flushed})"})
    raise bad_request("cannot flush the prefix cache while requests hold it; retry when idle")
