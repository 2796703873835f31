"""What the three APIs share, and the way each of their routes runs (without the app: api.py holds it).

Every generation route is a handler that reads top to bottom (openai_api.py, anthropic.py, responses.py):

    state, engine = serving(request)                                  # 503 while loading or shutting down
    req = parse_chat_request(await read_json(request), ...)           # every field checked once, here (a 400 names it)
    prompt = await asyncio.to_thread(chat.prompt_ids, req, engine.tokenizer)    # templates off the event loop
    with start_generation(state, engine, req.options, [prompt], ...) as gen:   # capacity, then submit
        if req.options.stream:
            return await sse(request, chat_events(chat, req, gen))     # the protocol's chunks, as SSE frames
        return json_response(chat_body(chat, req, gen.meta, await gen.collect(), gen.usage()))

generation.py turns the engine's tokens into text pieces; each protocol module keeps its parsing, its handlers and
its output together. Here: errors in OpenAI's shape, the server's state, reading a body, starting a generation and
writing SSE, the field readers every body uses, the options every generation takes, image parts, response formats
and logprob entries.

A body reaches a protocol as a JSON object (read_json: nesting and encoding checked, every failure a 400).
Parsing checks types and the protocol's own limits (n, top_logprobs, completion logprobs, stop strings, logit_bias
keys and values), each a 400 naming its field; unused_fields walks the fields a protocol knows and does not act on.
Ranges (sampling parameters, token ids inside the vocabulary) and whether the prompt fits are the engine's to decide:
start_generation maps its RequestError to a 400 naming the field the client sent. Image parts are checked as far as
their bytes (scheme, media type, base64) and kept in prompt order on the request (`.images`); the template text gets
tokenizer.IMAGE_MARKER where each one was, and http_images.prepare_images has the engine decode them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from contextlib import closing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Mapping

from aiohttp import web

from .config import Config
from .generation import Generation
from .images import SUPPORTED_MEDIA_TYPES, ImageError, ImageSource, decode_base64, parse_data_url
from .engine import ContextError, RequestError
from .json_body import MAX_JSON_DEPTH, SURROGATE_ESCAPE, json_depth
from .metrics import Metrics
from .parsers import THINK_END
from .sampling import MAX_LOGIT_BIAS, Constraint, SamplingParams

if TYPE_CHECKING:
    from .engine import Engine
    from .generation import Meta
    from .tokenizer import Tokenizer

MAX_N = 8
MAX_STOP_STRINGS = 16
RETRY_AFTER_S = 1
LARGE_BODY = 1 << 20             # bytes: a body past this is measured and parsed in a worker thread
log = logging.getLogger("tinyserve.protocol")


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


dumps: Callable[[Any], str] = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode   # compact UTF-8


def sse_event(obj: dict[str, Any]) -> bytes:       # OpenAI's events are data-only
    return b"data: " + dumps(obj).encode() + b"\n\n"


def sse_named_event(obj: dict[str, Any]) -> bytes:
    """Anthropic's and Responses' events: an `event:` line with the event's type before its data."""
    return f"event: {obj['type']}\ndata: ".encode() + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

def json_response(body: dict[str, Any]) -> web.Response:
    return web.json_response(body, dumps=dumps)


# ---------------------------------------------------------------------------------------------------------------
# Serving a request: the state, the body, the generation, the stream

@dataclass
class ServerState:
    """What the handlers share. `engine` is None while the model loads (/health answers 503 then)."""

    cfg: Config
    engine: Engine | None = None
    metrics: Metrics = None  # type: ignore[assignment]   # set in __post_init__: one registry per app
    draining: bool = False

    def __post_init__(self) -> None:
        self.metrics = self.metrics or Metrics()


STATE: web.AppKey[ServerState] = web.AppKey("tinyserve_state", ServerState)


# A request's server state and engine: 503 while the model loads or the server shuts down.
def serving(request: web.Request) -> tuple[ServerState, Engine]:
    state = request.app[STATE]
    if state.engine is None:
        raise APIError(503, "the model is still loading", headers={"Retry-After": str(RETRY_AFTER_S)})
    if state.draining:
        raise APIError(503, "the server is shutting down")
    return state, state.engine


# The body's JSON object (parse_body); a large one is measured and parsed in a worker thread, off the event loop.
async def read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()                        # raises 413 past client_max_size
    return await asyncio.to_thread(parse_body, raw) if len(raw) > LARGE_BODY else parse_body(raw)


# A request body -> its JSON object; every failure a 400 that says why, never a traceback. The nesting is measured on
# the bytes before parsing (json_body.json_depth: a body nested thousands deep would exhaust the recursion of the
# parser or of whatever walks it after), and strings must be valid Unicode (a lone surrogate escape cannot be
# encoded for the tokenizer).
def parse_body(raw: bytes) -> dict[str, Any]:
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and (depth := json_depth(raw)) > MAX_JSON_DEPTH:
        raise bad_request(f"the request body is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")
    try:
        body = json.loads(raw)
        if SURROGATE_ESCAPE.search(raw):              # rare: check that every string encodes
            json.dumps(body, ensure_ascii=False).encode()
    except UnicodeError as e:
        raise bad_request(f"the request body is not valid UTF-8 / Unicode: {e}") from None
    except (ValueError, RecursionError) as e:        # JSONDecodeError, an integer too long to convert
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


@dataclass
class Fields:
    """Where a protocol's request keeps what the engine's errors are about: its prompt field, its max_tokens field
    (as the client named it), other engine field names it calls otherwise, and its words for a prompt too long
    (Anthropic's, which Claude Code reads to compact; None: OpenAI's code context_length_exceeded)."""

    prompt: str
    max_tokens: str = "max_tokens"
    renamed: Mapping[str, str] = None  # type: ignore[assignment]
    too_long: Callable[[int, int], str] | None = None

    def of(self, engine_field: str) -> str:
        if engine_field == "prompt":
            return self.prompt
        if engine_field == "max_tokens":
            return self.max_tokens
        return (self.renamed or {}).get(engine_field, engine_field)

    def context_error(self, e: ContextError, prompts: list[list[int]]) -> APIError:
        """A prompt or max_tokens past the context, in the protocol's words; with several prompts the message names
        the one that failed: the first this long (the fit depends on the length alone, and they are checked in
        order)."""
        if e.tokens is not None and self.too_long is not None:   # the client reads the numbers: no prefix
            return APIError(400, self.too_long(*e.tokens), code="context_length_exceeded")
        which = [len(p) for p in prompts].index(e.prompt_len) if len(prompts) > 1 else None
        where = f"{self.of(e.field)}[{which}]: " if which is not None else ""
        return APIError(400, where + str(e), self.of(e.field), code="context_length_exceeded")


# Submit a request's generation (use it in `with`: leaving closes it, cancelling what still runs):
# - 503 + Retry-After while the engine holds too many requests for these n x prompts (waiting for room for their
#   images counts as queued), a 400 when they could never fit at once;
# - the engine's checks at each submit (request.Intake: the sampling parameters, each prompt's max_tokens fitted to
#   the context): a 400 naming the field the client sent; a prompt or max_tokens past the context in the protocol's
#   words (Fields.context_error).
def start_generation(state: ServerState, engine: Engine, options: GenerationOptions, prompts: list[list[int]],
                     id_prefix: str, fields: Fields, images: list[Any] = ()) -> closing[Generation]:
    limit = state.cfg.engine.max_running_requests + state.cfg.server.max_queued_requests
    requests = options.n * len(prompts)
    if requests > limit:
        raise bad_request(f"{len(prompts)} prompts x n={options.n} make {requests} requests; this server takes at "
                          f"most {limit} at once (engine.max_running_requests + server.max_queued_requests)",
                          "prompt" if len(prompts) > 1 else "n")
    unfinished = engine.num_unfinished + (engine.images.budget.waiting if engine.images is not None else 0)
    if unfinished + requests > limit:
        raise APIError(503, f"the server is full ({unfinished} requests running or queued, limit {limit}); "
                            "retry later", headers={"Retry-After": str(RETRY_AFTER_S)})
    try:
        return closing(Generation(engine, state.metrics, prompts, options.params, options.n, options.stop, id_prefix,
                                  images))
    except ContextError as e:
        raise fields.context_error(e, prompts) from None
    except RequestError as e:
        raise bad_request(str(e), fields.of(e.field)) from None


SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Server-sent events, each frame as the protocol wrote it; a client that leaves ends it quietly (the generation's
# close() cancels what it had running).
async def sse(request: web.Request, frames: AsyncIterator[bytes]) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        async for frame in frames:
            await response.write(frame)               # raises ConnectionResetError once the client has gone
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client disconnected from %s", request.path)
    return response


# ---------------------------------------------------------------------------------------------------------------
# Field parsing: each failure names its field. A reader checks a value the body has (not None); read_field reads
# one field through a reader, or gives a default when the body leaves it out, so an absent field costs nothing.

def read_field(body: dict, name: str, read: Callable[..., Any], default: Any = None, **limits: Any) -> Any:
    value = body.get(name)
    return default if value is None else read(value, name, **limits)


def number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {value!r}", name)   # json.loads takes NaN: not a number
    return float(value)


def integer(value: Any, name: str, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)                            # 16.0 from some clients
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise bad_request(f"{name} must be {rng}, got {value}", name)
    return value


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be a boolean, got {value!r}", name)
    return value


def stop_strings(value: Any, name: str, one_string: bool = True) -> list[str]:
    """A list of stop strings (OpenAI's `stop` also takes one string; Anthropic's `stop_sequences` does not)."""
    if isinstance(value, str) and one_string:
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request(f"{name} must be {'a string or ' if one_string else ''}a list of strings", name)
    if len(value) > MAX_STOP_STRINGS:
        raise bad_request(f"{name} takes at most {MAX_STOP_STRINGS} strings, got {len(value)}", name)
    return [s for s in value if s]                    # "" would stop at once; OpenAI ignores it


def logit_bias(value: Any, name: str) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}. Every key that is no token id is named at once;
    whether the ids are inside the vocabulary is the engine's to say."""
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object mapping token ids (as strings) to a bias in [-100, 100]",
                          "logit_bias")
    bad = [k for k in value if not _TOKEN_ID.fullmatch(k)]
    if bad:
        shown = ", ".join(repr(k) for k in bad[:8]) + (", ..." if len(bad) > 8 else "")
        raise bad_request(f"logit_bias keys must be token ids (non-negative integers as strings); got {shown}",
                          "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise bad_request(f"logit_bias[{key!r}] must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                              f"got {bias!r}", "logit_bias")
        out[int(key)] = float(bias)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Flags and version markers

_MARKERS_LOGGED: set[tuple[str, str]] = set()


def header_values(headers: Any, name: str) -> set[str]:
    """The comma-separated values of a header sent once or several times (aiohttp's multidict; a plain dict too)."""
    sent = headers.getall(name, []) if hasattr(headers, "getall") else [headers.get(name)] if headers else []
    return {v.strip() for header in sent if header for v in header.split(",")} - {""}


def note_markers(marker: str, values: set[str], known: Mapping[str, str] | set[str] | tuple[str, ...]) -> set[str]:
    """A client's flags and version markers (anthropic-beta, anthropic-version, OpenAI-Beta, Responses `include`)
    say what it may send or would like added; they ask for nothing by themselves. So a value this server does not
    know is logged, once per process, and the request goes on: each field it then actually sends is checked where it
    is read, and one this server cannot honour is refused by name there. Refusing the marker itself would fail every
    request of a client release that merely adds one. Returns `values`."""
    for value in sorted(values):
        if value not in known and (marker, value) not in _MARKERS_LOGGED:
            _MARKERS_LOGGED.add((marker, value))
            log.info("%s: %r is not one this server knows; it changes nothing here (logged once)", marker, value)
    return values


# OpenAI-Beta (`responses=experimental`, `assistants=v2`, ...): no value changes what these routes do.
def note_openai_beta(headers: Any) -> None:
    if "OpenAI-Beta" in headers:
        note_markers("OpenAI-Beta", header_values(headers, "openai-beta"), ())


_TOKEN_ID = re.compile(r"[0-9]{1,12}")

Refusal = Callable[[Any], "str | None"]             # a field's value -> why it is refused; None: it is accepted


# The fields a protocol knows and does not act on, of those the body sends. `refused`: not implemented (for the
# values each rule refuses): a 400 naming the field beats output that silently differs from what the client asked
# for. `ignored`: they change nothing here (documented in docs/api.md), but are type-checked, so a malformed one is
# still a 400 naming it.
def unused_fields(body: dict, refused: dict[str, Refusal], ignored: dict[str, type | tuple[type, ...]]) -> None:
    for name, refuse in refused.items():
        if body.get(name) is not None and (reason := refuse(body[name])):
            raise bad_request(f"{name} is not supported by this server: {reason}", name)
    for name, kind in ignored.items():
        if body.get(name) is not None:
            _check_type(body[name], name, kind)


def _check_type(value: Any, name: str, kind: type | tuple[type, ...]) -> None:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        names = " or ".join(JSON_TYPES.get(k, k.__name__) for k in kinds)
        raise bad_request(f"{name} must be {names}, got {value!r:.40}", name)


JSON_TYPES = {str: "a string", dict: "an object", list: "a list", bool: "a boolean", int: "an integer",
              float: "a number"}


def token_id_list(value: Any, name: str, allow_empty: bool = True) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"{name} must be a list of integer token ids", name)
    if not value and not allow_empty:
        raise bad_request(f"{name} must not be empty", name)
    return list(value)


@dataclass
class GenerationOptions:
    """What every protocol's request gives its generation (params.max_tokens None: the engine picks, up to the end of
    the context)."""

    params: SamplingParams
    max_tokens_field: str            # the name the client used: errors about max_tokens point there
    stop: list[str]
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    continuous_usage: bool = False   # stream_options.continuous_usage_stats (vLLM's): usage on every chunk


# The sampling fields of OpenAI's bodies (and vLLM's extensions), in the order they are read: types here, ranges of
# SamplingParams in the engine. A field left out keeps SamplingParams' default.
SAMPLING_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "min_tokens": integer, "temperature": number, "top_p": number, "top_k": integer, "min_p": number,
    "presence_penalty": number, "frequency_penalty": number, "repetition_penalty": number,
    # JSON integers are unbounded; the sampler's generator takes 64 bits
    "seed": lambda value, name: integer(value, name, lo=-(2 ** 63), hi=2 ** 64 - 1),
    "stop_token_ids": lambda value, name: token_id_list(value or [], name),
    "ignore_eos": boolean,
    "speculative": boolean,                           # extension: false keeps this request off NEXTN
    "logit_bias": logit_bias}


# Sampling and streaming fields (SAMPLING_FIELDS, then the rest); of max_completion_tokens and max_tokens, the newer
# OpenAI name wins.
def parse_options(body: dict, logprobs: int | None, constraint: Constraint | None = None) -> GenerationOptions:
    sampling = {name: read(body[name], name) for name, read in SAMPLING_FIELDS.items() if body.get(name) is not None}
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream = read_field(body, "stream", boolean, False)
    stream_options = read_field(body, "stream_options", stream_options_field, {}, stream=stream)
    return GenerationOptions(
        params=SamplingParams(max_tokens=read_field(body, max_field, integer), logprobs=logprobs,
                              constraint=constraint, **sampling), max_tokens_field=max_field, stream=stream,
        stop=read_field(body, "stop", stop_strings, []), n=read_field(body, "n", integer, 1, lo=1, hi=MAX_N),
        include_usage=read_field(stream_options, "include_usage", boolean, False),
        return_token_ids=read_field(body, "return_token_ids", boolean, False),
        continuous_usage=read_field(stream_options, "continuous_usage_stats", boolean, False))


STREAM_OPTIONS = ("include_usage", "include_obfuscation", "continuous_usage_stats")


def stream_options_field(value: Any, name: str, stream: bool, allowed: tuple[str, ...] = STREAM_OPTIONS
                         ) -> dict[str, Any]:
    """stream_options, which only a stream takes (OpenAI answers 400 otherwise, as vLLM does). include_obfuscation
    pads chunks against length side channels on OpenAI's service; there is nothing to pad here, so it is accepted
    and has no effect."""
    if not isinstance(value, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise bad_request(f"stream_options.{unknown[0]} is not supported (supported: {', '.join(allowed)})",
                          f"stream_options.{unknown[0]}")
    read_field(value, "include_obfuscation", boolean)
    return value


# ---------------------------------------------------------------------------------------------------------------
# Images: every protocol's image parts become ImageSources (bytes as sent) or RemoteImages (fetched by api.py), in
# prompt order; the engine decodes them (engine.images.prepare). Errors name the part.

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


# ---------------------------------------------------------------------------------------------------------------
# Decoding constraints

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def parse_response_format(value: Any, param: str = "response_format", nested: bool = True) -> Constraint | None:
    """response_format {type: text | json_object | json_schema} -> the decoding constraint (None: free text).
    Chat nests the schema ({"type": "json_schema", "json_schema": {"name", "schema", "strict"}}); the Responses
    API's text.format has name / schema / strict beside type (nested=False). Whether the schema compiles is the
    engine's to say (a 400 naming this field); `strict` is accepted either way: the schema is always enforced."""
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


def constraint_after_reasoning(params: SamplingParams, starts_in_reasoning: bool, tokenizer: Tokenizer
                               ) -> SamplingParams:
    """When the prompt opened `<think>`, the output is free up to the model's `</think>` token and constrained after
    it (the constraint carries that token id to the engine)."""
    if params.constraint is None or not starts_in_reasoning:
        return params
    think_end = tokenizer.token_to_id(THINK_END)
    if think_end is None:
        return params
    return replace(params, constraint=replace(params.constraint, start_after=think_end))


# ---------------------------------------------------------------------------------------------------------------
# Logprobs: tokens as text and bytes

def logprob_entry(meta: Meta, token_id: int, logprob: float) -> dict[str, Any]:
    """{"token", "logprob", "bytes"}: bytes are the token's own (Tokenizer.token_bytes), so a client rebuilds a
    character that spans tokens; the text of a token that is part of a character reads "bytes:\\xNN"."""
    return {"token": meta.token_text(token_id), "logprob": logprob, "bytes": list(meta.token_bytes(token_id))}


def logprob_content(meta: Meta, events: list[Any]) -> list[dict[str, Any]]:
    """Chat's logprobs.content (and Responses' output_text logprobs): each token with its top_logprobs list (every
    alternative kept, even two with the same text)."""
    return [{**logprob_entry(meta, e.token_id, e.logprob),
             "top_logprobs": [logprob_entry(meta, t, lp) for t, lp in (e.top_logprobs or [])]} for e in events]
