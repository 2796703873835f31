"""The OpenAI protocol without HTTP: request bodies -> typed requests, results -> response bodies and SSE chunks.

Nothing here knows aiohttp or the engine: api.py reads the JSON, runs the shared generation skeleton and writes
what an Endpoint builds. An Endpoint is one protocol's half of that skeleton (parse, prompt ids, response body,
stream chunks); Chat and Completions are the two OpenAI ones, and new protocols (Anthropic Messages, Responses)
plug in as further Endpoints.

Parsing checks types and the protocol's own limits (n, top_logprobs, completion logprobs, stop strings), each a
400 naming its field. Ranges (sampling parameters, token ids inside the vocabulary) and whether the prompt fits are
the engine's to decide: api.py maps its RequestError to a 400 naming the field the client sent. Image parts are
checked as far as their bytes (scheme, media type, base64) and kept in prompt order on the request (`.images`); the
template text gets tokenizer.IMAGE_MARKER where each one was, and the engine decodes them.
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .grammar import Constraint
from .images import SUPPORTED_MEDIA_TYPES, ImageError, ImageSource, decode_base64, parse_data_url
from .parsers import (THINK_END, Qwen3CoderToolParser, Qwen3ReasoningParser, make_tool_parser,
                      prompt_opens_reasoning)
from .sampling import MAX_LOGPROBS, SamplingParams
from .tokenizer import SYSTEM_ROLES, MessageError, content_text, tool_call_arguments

MAX_N = 8
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP_STRINGS = 16
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


# ---------------------------------------------------------------------------------------------------------------
# Errors and wire format

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, *, type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(err: APIError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(obj: dict[str, Any]) -> bytes:
    """OpenAI's events are data-only (Anthropic's and Responses' would add an `event:` line)."""
    return b"data: " + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------------------
# Field parsing: each failure names its field

def _number(body: dict, name: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {value!r}", name)   # json.loads takes NaN: not a number
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


def _token_ids(value: Any, name: str, allow_empty: bool = True) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"{name} must be a list of integer token ids", name)
    if not value and not allow_empty:
        raise bad_request(f"{name} must not be empty", name)
    return list(value)


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


@dataclass
class GenerationOptions:
    """What every protocol's request gives the skeleton. `params.max_tokens` is a placeholder until the engine
    fits the request (sampling_params)."""

    params: SamplingParams
    max_tokens: int | None           # None: the engine picks (up to the end of the context)
    max_tokens_field: str            # the name the client used: errors about max_tokens point there
    stop: list[str]
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse_options(body: dict, logprobs: int | None) -> GenerationOptions:
    """Sampling and streaming fields: types here, ranges of SamplingParams in the engine."""
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = SamplingParams(                          # the newer OpenAI name wins (above)
        min_tokens=_integer(body, "min_tokens", 0),
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_integer(body, "top_k", 0),
        min_p=_number(body, "min_p", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        # JSON integers are unbounded; the sampler's generator takes 64 bits
        seed=_integer(body, "seed", None, lo=-(2 ** 63), hi=2 ** 64 - 1),
        stop_token_ids=_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"),
        ignore_eos=_boolean(body, "ignore_eos", False),
        logprobs=logprobs,
        speculative=_boolean(body, "speculative", True),     # extension: false keeps this request off NEXTN
    )
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    return GenerationOptions(
        params=params, max_tokens=_integer(body, max_field, None), max_tokens_field=max_field,
        stop=_stop_strings(body), n=_integer(body, "n", 1, lo=1, hi=MAX_N), stream=_boolean(body, "stream", False),
        include_usage=_boolean(stream_options or {}, "include_usage", False),
        return_token_ids=_boolean(body, "return_token_ids", False))


def sampling_params(options: GenerationOptions, max_tokens: int) -> SamplingParams:
    """The request's SamplingParams once the engine has fitted max_tokens. A min_tokens past a max_tokens the
    engine chose is cut to it; past one the client chose, it stays (and the engine rejects it)."""
    min_tokens = options.params.min_tokens
    if options.max_tokens is None:
        min_tokens = min(min_tokens, max_tokens)
    return replace(options.params, max_tokens=max_tokens, min_tokens=min_tokens)


# ---------------------------------------------------------------------------------------------------------------
# Images: every protocol's image parts become ImageSources (bytes as sent) or RemoteImages (fetched by api.py), in
# prompt order; the engine decodes them (engine.intake.prepare_images). Errors name the part.

FETCH_OFF = ("remote image URLs are not fetched (server.fetch_image_urls = false); send the image as a data: URL "
             "(data:image/png;base64,...)")
MEDIA_TYPES = ", ".join(t for t in SUPPORTED_MEDIA_TYPES if t != "image/jpg")   # image/jpg: an alias clients send


@dataclass(frozen=True)
class RemoteImage:
    """An http(s) image URL, allowed by server.fetch_image_urls: api.py fetches it into an ImageSource."""

    param: str                        # the part it came from, e.g. "messages[1].content[0]"
    url: str


ImageInput = ImageSource | RemoteImage              # one image part, as parsed


def image_bytes(media_type: Any, data: Any, param: str) -> ImageSource:
    """A declared media type and base64 text (an Anthropic base64 source) -> ImageSource."""
    if not isinstance(media_type, str) or media_type.lower() not in SUPPORTED_MEDIA_TYPES:
        raise bad_request(f"{param}: unsupported image media type {media_type!r}; supported: {MEDIA_TYPES}", param)
    if not isinstance(data, str):
        raise bad_request(f"{param}: the image data must be a base64 string", param)
    try:
        return ImageSource(param, decode_base64(data, "the image data"), media_type.lower())
    except ImageError as e:
        raise bad_request(f"{param}: {e}", param) from None


def image_from_url(url: Any, param: str, fetch: bool) -> ImageInput:
    """An image URL as a client sent it: a data: URL (decoded here), or http(s) when server.fetch_image_urls lets
    the server fetch it; anything else is a 400 naming the part."""
    if not isinstance(url, str) or not url.strip():
        raise bad_request(f"{param}: the image URL must be a non-empty string", param)
    scheme = url.strip().split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        if not fetch:
            raise bad_request(f"{param}: {FETCH_OFF}", param)
        return RemoteImage(param, url.strip())
    if scheme != "data":
        accepted = "a data: URL or an http(s) URL" if fetch else "a data: URL (data:image/png;base64,...)"
        shown = f"scheme {scheme!r}" if scheme and len(scheme) <= 16 else "no scheme"   # never echo a long URL
        raise bad_request(f"{param}: unsupported image URL ({shown}); send {accepted}", param)
    try:
        media_type, data = parse_data_url(url)
    except ImageError as e:
        raise bad_request(f"{param}: {e}", param) from None
    if media_type not in SUPPORTED_MEDIA_TYPES:
        raise bad_request(f"{param}: unsupported image media type {media_type!r}; supported: {MEDIA_TYPES}", param)
    return ImageSource(param, data, media_type)


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

    @property
    def enable_thinking(self) -> bool:
        return bool(self.template_kwargs.get("enable_thinking", True))


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
    # "required" and a named function force one call when the tool-call parser is on (Chat.prompt_ids sets the
    # grammar constraint); a named function also limits what is parsed as a call.
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


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def parse_response_format(value: Any, param: str = "response_format", nested: bool = True) -> Constraint | None:
    """response_format {type: text | json_object | json_schema} -> the decoding constraint (None: free text).
    Chat nests the schema ({"type": "json_schema", "json_schema": {"name", "schema", "strict"}}); the Responses
    API's text.format has name / schema / strict beside type (nested=False). Whether the schema compiles is the
    engine's to say (a 400 naming this field); `strict` is accepted either way: the schema is always enforced."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        got = value.get("type") if isinstance(value, dict) else value
        raise bad_request(f"{param}.type must be one of {', '.join(RESPONSE_FORMATS)}; got {got!r}", f"{param}.type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    spec, where = (value.get("json_schema"), f"{param}.json_schema") if nested else (value, param)
    if not isinstance(spec, dict):
        raise bad_request(f"{where} must be an object with name and schema", where)
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise bad_request(f"{where}.name must be a string", f"{where}.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.schema must be a JSON schema object", f"{where}.schema")
    return Constraint.json_schema(schema)


def forced_tool_call(tools: list[dict[str, Any]] | None, tool_choice: Any) -> Constraint | None:
    """tool_choice "required" (one call of any tool) or {"type": "function", "function": {"name"}} (a call of that
    one) -> the "tool_call" constraint (grammar.py); None when the choice forces nothing (auto, none, no tools)."""
    if not tools:
        return None
    if tool_choice == "required":
        return Constraint.tool_call(tools)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        return Constraint.tool_call(tools, tool_choice["function"].get("name"))
    return None


def constraint_after_reasoning(params: SamplingParams, starts_in_reasoning: bool, tokenizer: Any) -> SamplingParams:
    """When the prompt opened `<think>`, the output is free up to the model's `</think>` token and constrained after
    it (the constraint carries that token id to the engine)."""
    if params.constraint is None or not starts_in_reasoning:
        return params
    think_end = tokenizer.token_to_id(THINK_END)
    if think_end is None:
        return params
    return replace(params, constraint=replace(params.constraint, start_after=think_end))


def parse_chat_request(body: dict, served_name: str, fetch_image_urls: bool = False) -> ChatRequest:
    """fetch_image_urls (server.fetch_image_urls): http(s) image URLs become RemoteImages instead of a 400."""
    _check_model(body, served_name)
    constraint = parse_response_format(body.get("response_format"))
    images: list[ImageInput] = []
    messages = _parse_messages(body.get("messages"), images, fetch_image_urls)
    tools, tool_choice = _parse_tools(body)
    logprobs = _boolean(body, "logprobs", False)
    top_logprobs = _integer(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
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
        prompt = _token_ids(prompt, "prompt", allow_empty=False)
    else:
        raise bad_request("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    logprobs = _integer(body, "logprobs", None, lo=0, hi=MAX_COMPLETION_LOGPROBS)
    return CompletionRequest(prompt=prompt, logprobs=logprobs, options=parse_options(body, logprobs))


# ---------------------------------------------------------------------------------------------------------------
# Results: what the generation skeleton hands the protocol

@dataclass
class Delta:
    """What one choice produced since the last Delta."""

    text: str
    token_ids: list[int]
    events: list[Any]                 # engine TokenEvents: token_id, logprob, top_logprobs
    finish_reason: str | None = None
    stop_string: str | None = None    # the stop string that ended the choice (finish_reason "stop")


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_string: str | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None                  # None: not reported (metrics.cache_report = false)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    accepted_prediction_tokens: int | None = None     # NEXTN drafts accepted / rejected; None: speculation off
    rejected_prediction_tokens: int | None = None


@dataclass
class Meta:
    """What every body and chunk of one HTTP request shares."""

    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    token_text: Callable[[int], str]                  # one token as text, for logprobs
    usage: Callable[[], Usage] | None = None          # the usage so far, once the generation is submitted


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


# ---------------------------------------------------------------------------------------------------------------
# Endpoints: one protocol's half of the generation skeleton in api.py

class EndpointStream(ABC):
    """One streamed response: chunks before, per delta and after the generation."""

    done: bytes = SSE_DONE                            # what ends the event stream

    def frame(self, obj: dict[str, Any]) -> bytes:
        return sse_event(obj)

    def error(self, err: APIError) -> dict[str, Any]:
        """An error after the headers went out: sent as one more event."""
        return error_body(err)

    def start(self) -> list[dict[str, Any]]:
        return []

    @abstractmethod
    def delta(self, index: int, d: Delta) -> list[dict[str, Any]]: ...

    @abstractmethod
    def end(self, usage: Usage) -> list[dict[str, Any]]: ...


class Endpoint(ABC):
    """Requests it parses have `.options` (GenerationOptions) and `.images` (the image parts, in prompt order)."""

    id_prefix: str
    prompt_field: str                                 # where the engine's "prompt" errors point
    clamp_max_tokens = False                          # cut a max_tokens past the context instead of a 400

    @abstractmethod
    def parse(self, body: dict, served_name: str) -> Any:
        """The typed request; it has `.options` (GenerationOptions) and `.images`."""

    @abstractmethod
    def prompt_ids(self, req: Any, tokenizer: Any) -> list[int]:
        """Runs in a worker thread (templates and long prompts would stall every stream on the loop)."""

    @abstractmethod
    def response(self, req: Any, meta: Meta, results: list[ChoiceResult], usage: Usage) -> dict[str, Any]: ...

    @abstractmethod
    def stream(self, req: Any, meta: Meta) -> EndpointStream: ...

    def error_param(self, req: Any, engine_field: str) -> str:
        """The request field an engine RequestError's field ("prompt", "max_tokens", a SamplingParams name, or an
        image's part, which is the client's own field already) stands for."""
        if engine_field == "prompt":
            return self.prompt_field
        if engine_field == "max_tokens":
            return req.options.max_tokens_field
        return engine_field


class Chat(Endpoint):
    """POST /v1/chat/completions. The parser names come from the config's [parsers] table ("" = off);
    fetch_image_urls is server.fetch_image_urls."""

    id_prefix = "chatcmpl-"
    prompt_field = "messages"

    def __init__(self, reasoning_parser: str = "", tool_parser: str = "", fetch_image_urls: bool = False) -> None:
        self.reasoning_parser = reasoning_parser
        self.tool_parser = tool_parser
        self.fetch_image_urls = fetch_image_urls

    def parse(self, body: dict, served_name: str) -> ChatRequest:
        return parse_chat_request(body, served_name, self.fetch_image_urls)

    def prompt_ids(self, req: ChatRequest, tokenizer: Any) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=True,
                                                 **req.template_kwargs)
        except ValueError as e:                       # e.g. the template's raise_exception on a bad history
            raise bad_request(f"the chat template rejected the messages: {e}", "messages") from None
        req.starts_in_reasoning = prompt_opens_reasoning(text)
        if self.tool_parser == "qwen3_coder":
            constraint = forced_tool_call(req.tools, req.tool_choice)
            if constraint is not None:                # the answer is the call: it replaces any response_format
                req.options.params = replace(req.options.params, constraint=constraint)
        req.options.params = constraint_after_reasoning(req.options.params, req.starts_in_reasoning, tokenizer)
        return tokenizer.encode(text)

    # parsers are per choice: they are stateful
    def reasoning(self, req: ChatRequest) -> Qwen3ReasoningParser | None:
        if self.reasoning_parser != "qwen3":
            return None
        return Qwen3ReasoningParser(starts_in_reasoning=req.starts_in_reasoning, enabled=req.enable_thinking)

    def tools(self, req: ChatRequest) -> Qwen3CoderToolParser | None:
        if self.tool_parser != "qwen3_coder":
            return None
        return make_tool_parser(req.tools, req.tool_choice)

    def message(self, req: ChatRequest, r: ChoiceResult) -> tuple[dict[str, Any], str]:
        """Split a finished choice's text into reasoning, content and tool calls; the finish reason to report."""
        message: dict[str, Any] = {"role": "assistant"}
        content: str | None = r.text
        reasoning = self.reasoning(req)
        if reasoning is not None:
            message["reasoning_content"], content = reasoning.parse(r.text)
        finish = r.finish_reason
        tools = self.tools(req)
        if tools is not None and content:
            content, calls = tools.parse(content)
            if calls:
                message["tool_calls"] = calls
                if finish == "stop":
                    finish = "tool_calls"
        message["content"] = content if content or "tool_calls" not in message else None
        return message, finish

    def response(self, req: ChatRequest, meta: Meta, results: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
        body = _envelope(meta, "chat.completion")
        choices = []
        for r in results:
            message, finish = self.message(req, r)
            choice: dict[str, Any] = {"index": r.index, "message": message,
                                      "logprobs": chat_logprobs(meta.token_text, r.events) if req.logprobs else None,
                                      "finish_reason": finish}
            if req.options.return_token_ids:
                choice["token_ids"] = r.token_ids
            choices.append(choice)
        body["choices"] = choices
        body["usage"] = usage_body(usage)
        if req.options.return_token_ids:
            body["prompt_token_ids"] = meta.prompt_ids
        return body

    def stream(self, req: ChatRequest, meta: Meta) -> "ChatStream":
        return ChatStream(self, req, meta)


class ChatStreamChoice:
    """One choice's parsers while streaming: text deltas in, OpenAI delta dicts out."""

    def __init__(self, chat: Chat, req: ChatRequest) -> None:
        self.reasoning = chat.reasoning(req)
        self.tools = chat.tools(req)
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


class ChatStream(EndpointStream):
    """A role chunk per choice, then one chunk per delta; logprobs and token ids ride on the first chunk of each
    engine step, finish_reason on the last."""

    def __init__(self, chat: Chat, req: ChatRequest, meta: Meta) -> None:
        self.req, self.meta = req, meta
        self.base = _envelope(meta, "chat.completion.chunk")
        self.choices = [ChatStreamChoice(chat, req) for _ in range(req.options.n)]

    def start(self) -> list[dict[str, Any]]:
        chunks = []
        for i in range(len(self.choices)):
            chunk = {**self.base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                               "logprobs": None, "finish_reason": None}]}
            if self.req.options.return_token_ids:
                chunk["prompt_token_ids"] = self.meta.prompt_ids
            chunks.append(chunk)
        return chunks

    def delta(self, index: int, d: Delta) -> list[dict[str, Any]]:
        c, req = self.choices[index], self.req
        ids = req.options.return_token_ids
        final = d.finish_reason is not None
        pieces = c.pieces(d.text, final)
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

    def end(self, usage: Usage) -> list[dict[str, Any]]:
        return [{**self.base, "choices": [], "usage": usage_body(usage)}] if self.req.options.include_usage else []


class Completions(Endpoint):
    """POST /v1/completions."""

    id_prefix = "cmpl-"
    prompt_field = "prompt"

    def parse(self, body: dict, served_name: str) -> CompletionRequest:
        return parse_completion_request(body, served_name)

    def prompt_ids(self, req: CompletionRequest, tokenizer: Any) -> list[int]:
        if not isinstance(req.prompt, str):
            return req.prompt
        ids = tokenizer.encode(req.prompt)
        if not ids:
            raise bad_request("prompt encodes to no tokens", "prompt")
        return ids

    def response(self, req: CompletionRequest, meta: Meta, results: list[ChoiceResult], usage: Usage
                 ) -> dict[str, Any]:
        body = _envelope(meta, "text_completion")
        choices = []
        for r in results:
            choice: dict[str, Any] = {
                "index": r.index, "text": r.text, "finish_reason": r.finish_reason,
                "logprobs": completion_logprobs(meta.token_text, r.events, 0) if req.logprobs is not None else None}
            if req.options.return_token_ids:
                choice["token_ids"] = r.token_ids
                choice["prompt_token_ids"] = meta.prompt_ids
            choices.append(choice)
        body["choices"] = choices
        body["usage"] = usage_body(usage)
        if req.options.return_token_ids:
            body["prompt_token_ids"] = meta.prompt_ids
        return body

    def stream(self, req: CompletionRequest, meta: Meta) -> "CompletionStream":
        return CompletionStream(req, meta)


class CompletionStream(EndpointStream):
    def __init__(self, req: CompletionRequest, meta: Meta) -> None:
        self.req, self.meta = req, meta
        self.base = _envelope(meta, "text_completion")
        self.offsets = [0] * req.options.n            # text offsets of each choice, for logprobs

    def delta(self, index: int, d: Delta) -> list[dict[str, Any]]:
        choice: dict[str, Any] = {
            "index": index, "text": d.text, "finish_reason": d.finish_reason,
            "logprobs": completion_logprobs(self.meta.token_text, d.events, self.offsets[index])
            if self.req.logprobs is not None and d.events else None}
        self.offsets[index] += len(d.text)
        if self.req.options.return_token_ids:
            choice["token_ids"] = d.token_ids
        return [{**self.base, "choices": [choice]}]

    def end(self, usage: Usage) -> list[dict[str, Any]]:
        return [{**self.base, "choices": [], "usage": usage_body(usage)}] if self.req.options.include_usage else []
