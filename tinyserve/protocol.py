"""The shared layer of the HTTP protocols, without HTTP: errors, JSON and SSE framing, the field readers, generation
options, image parts, decoding constraints, the results the generation skeleton hands back, and the Endpoint that
each protocol implements.

Nothing here knows aiohttp or the engine: api.py reads the JSON, runs the shared generation skeleton and writes
what an Endpoint builds. An Endpoint is one protocol's half of that skeleton (parse, prompt ids, response body,
stream chunks): openai_api.py holds OpenAI's chat completions and completions, anthropic.py Anthropic's Messages,
responses.py OpenAI's Responses. The three chat protocols translate their requests into chat.py's ChatRequest, so
they render one prompt through one template and split the answer with the same parsers.

A body reaches a protocol as a JSON object (json_body.py: nesting and encoding checked, every failure a 400).
Parsing checks types and the protocol's own limits (n, top_logprobs, completion logprobs, stop strings, logit_bias
keys and values), each a 400 naming its field; unused_fields walks the fields a protocol knows and does not act on.
Ranges (sampling parameters, token ids inside the vocabulary) and whether the prompt fits are the engine's to decide:
api.py maps its RequestError to a 400 naming the field the client sent. Image parts are checked as far as their
bytes (scheme, media type, base64) and kept in prompt order on the request (`.images`); the template text gets
tokenizer.IMAGE_MARKER where each one was, and the engine decodes them.
"""
from __future__ import annotations

import codecs
import json
import logging
import math
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generic, Mapping, Protocol, TypeVar

from .images import SUPPORTED_MEDIA_TYPES, ImageError, ImageSource, decode_base64, parse_data_url
from .parsers import THINK_END
from .sampling import MAX_LOGIT_BIAS, Constraint, SamplingParams
from .tokenizer import Tokenizer

MAX_N = 8
MAX_STOP_STRINGS = 16
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


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(obj: dict[str, Any]) -> bytes:
    """OpenAI's events are data-only."""
    return b"data: " + dumps(obj).encode() + b"\n\n"


def sse_named_event(obj: dict[str, Any]) -> bytes:
    """Anthropic's and Responses' events: an `event:` line with the event's type before its data."""
    return f"event: {obj['type']}\ndata: ".encode() + dumps(obj).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


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


def note_openai_beta(headers: Any) -> None:
    """OpenAI-Beta (`responses=experimental`, `assistants=v2`, ...): no value changes what these routes do."""
    note_markers("OpenAI-Beta", header_values(headers, "openai-beta"), ())


_TOKEN_ID = re.compile(r"[0-9]{1,12}")

Refusal = Callable[[Any], "str | None"]             # a field's value -> why it is refused; None: it is accepted


def unused_fields(body: dict, refused: dict[str, Refusal], ignored: dict[str, type | tuple[type, ...]]) -> None:
    """The fields a protocol knows and does not act on, of those the body sends. `refused`: not implemented (for
    the values each rule refuses): a 400 naming the field beats output that silently differs from what the client
    asked for. `ignored`: they change nothing here (documented in docs/api.md), but are type-checked, so a
    malformed one is still a 400 naming it."""
    for name in [n for n in refused if body.get(n) is not None]:
        reason = refused[name](body[name])
        if reason:
            raise bad_request(f"{name} is not supported by this server: {reason}", name)
    for name in [n for n in ignored if body.get(n) is not None]:
        _check_type(body[name], name, ignored[name])


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


def parse_options(body: dict, logprobs: int | None) -> GenerationOptions:
    """Sampling and streaming fields (SAMPLING_FIELDS, then the rest)."""
    sampling = {name: read(body[name], name) for name, read in SAMPLING_FIELDS.items() if body.get(name) is not None}
    # the newer OpenAI name wins
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream = read_field(body, "stream", boolean, False)
    stream_options = read_field(body, "stream_options", stream_options_field, {}, stream=stream)
    return GenerationOptions(
        params=SamplingParams(logprobs=logprobs, **sampling), max_tokens=read_field(body, max_field, integer),
        max_tokens_field=max_field, stop=read_field(body, "stop", stop_strings, []),
        n=read_field(body, "n", integer, 1, lo=1, hi=MAX_N), stream=stream,
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
# Results: what the generation skeleton hands the protocol

@dataclass
class Delta:
    """What one choice produced since the last Delta."""

    text: str
    token_ids: list[int]
    events: list[Any]                 # engine TokenEvents: token_id, logprob, top_logprobs
    finish_reason: str | None = None
    stop_string: str | None = None    # the stop string that ended the choice (finish_reason "stop")
    prompt_logprobs: list[Any] | None = None   # on a choice's first Delta when params.prompt_logprobs asked: prompt
                                               # tokens 1.. as (logprob, [(id, logprob) top-n])


@dataclass
class ChoiceResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    finish_reason: str = "stop"
    stop_string: str | None = None
    prompt_logprobs: list[Any] | None = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None                  # None: not known yet (a stream's first event)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    accepted_prediction_tokens: int | None = None     # NEXTN drafts accepted / rejected; None: speculation off
    rejected_prediction_tokens: int | None = None


@dataclass
class Meta:
    """What every body and chunk of one HTTP request shares."""

    request_id: str
    created: int
    model: str
    prompt_ids: list[int]                             # the prompt (the first one, when a request sends several)
    token_text: Callable[[int], str]                  # one token as logprobs show it (Tokenizer.token_text)
    usage: Callable[[], Usage] | None = None          # the usage so far, once the generation is submitted
    token_bytes: Callable[[int], bytes] | None = None  # the bytes of one token (Tokenizer.token_bytes)
    prompts: list[list[int]] = field(default_factory=list)   # every prompt, in order (choice i: prompt i // n)

    def __post_init__(self) -> None:
        self.prompts = self.prompts or [self.prompt_ids]
        if self.token_bytes is None:
            self.token_bytes = lambda token_id: self.token_text(token_id).encode()


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
# Endpoints: one protocol's half of the generation skeleton in api.py

class EndpointStream(ABC):
    """One streamed response: chunks before, per delta and after the generation. `end` gets the usage as a call,
    made only by a stream that sends it."""

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
    def end(self, usage: Callable[[], Usage]) -> list[dict[str, Any]]: ...


class NamedEventStream(EndpointStream):
    """Anthropic's and Responses' streams: each event is named by its type, and the last one ends the stream (no
    [DONE])."""

    done = b""

    def frame(self, obj: dict[str, Any]) -> bytes:
        return sse_named_event(obj)


class ParsedRequest(Protocol):
    """What the generation skeleton reads of every protocol's typed request."""

    @property
    def options(self) -> GenerationOptions: ...

    @property
    def images(self) -> list[ImageInput]:
        """The image parts, in prompt order."""
        ...

    @property
    def left_out(self) -> list[str]:
        """The types of the tools left out of the prompt (chat.leave_out)."""
        ...


Req = TypeVar("Req", bound=ParsedRequest)


class Endpoint(ABC, Generic[Req]):
    """One protocol's half of the generation skeleton, for its typed request `Req`."""

    id_prefix: str
    prompt_field: str                                 # where the engine's "prompt" errors point
    clamp_max_tokens = False                          # cut a max_tokens past the context instead of a 400

    @abstractmethod
    def parse(self, body: dict, served_name: str, headers: Mapping[str, str] | None = None) -> Req:
        """headers: the HTTP request's, for a protocol that reads them (Anthropic's anthropic-beta)."""

    def context_error(self, err: APIError, tokens: tuple[int, int] | None) -> APIError:
        """The error for a prompt or max_tokens past the context; tokens: (the prompt's length, the most it may be)
        for a prompt too long. A protocol whose clients read the numbers back words it their way."""
        return err

    @abstractmethod
    def prompt_ids(self, req: Req, tokenizer: Tokenizer) -> list[int]:
        """Runs in a worker thread (templates and long prompts would stall every stream on the loop)."""

    def num_prompts(self, req: Req) -> int:
        return 1

    def prompts(self, req: Req, tokenizer: Tokenizer) -> list[list[int]]:
        """Every prompt of the request (one but for a list of prompts on /v1/completions); a worker thread."""
        return [self.prompt_ids(req, tokenizer)]

    @abstractmethod
    def response(self, req: Req, meta: Meta, results: list[ChoiceResult], usage: Usage) -> dict[str, Any]: ...

    @abstractmethod
    def stream(self, req: Req, meta: Meta) -> EndpointStream: ...

    def error_param(self, req: Req, engine_field: str) -> str:
        """The request field an engine RequestError's field ("prompt", "max_tokens", a SamplingParams name, or an
        image's part, which is the client's own field already) stands for."""
        if engine_field == "prompt":
            return self.prompt_field
        if engine_field == "max_tokens":
            return req.options.max_tokens_field
        return engine_field
