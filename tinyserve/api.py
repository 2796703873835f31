"""The HTTP server: OpenAI- and Anthropic-compatible routes over aiohttp.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models   GET /v1/models/{model}
    POST /v1/responses   (OpenAI's Responses API, stateless, responses.py)
    POST /v1/messages   POST /v1/messages/count_tokens   (Anthropic's Messages API, anthropic.py)
    GET /health   GET /metrics   POST /flush_cache   GET /api/hello (Anthropic's reachability probe)
    GET /   GET /status.json   (the operator's status page and its numbers, status.py)

This module is the HTTP layer only: routes, middlewares (errors, auth), reading JSON, SSE, disconnects, and the
Generation (the n engine requests behind one HTTP request). What a body means and what a response looks like is
the protocol modules' (an Endpoint each: openai_api.py, anthropic.py, responses.py; their shared layer protocol.py).
Every generation route runs one skeleton, `generate`: parse (protocol) -> prompt ids (protocol, in a worker thread:
templates and long prompts would stall every stream; a completions request may hold several prompts) -> the engine
fits max_tokens to each (past the context: a 400 with OpenAI's code context_length_exceeded) and validates the
sampling parameters -> Generation -> stream or collect -> body (protocol). The engine stays the only owner of pages and
state; this module only submits, iterates and cancels.

Images: a request's image parts are parsed (protocol) into their bytes, or, with server.fetch_image_urls, into http(s)
URLs http_images.py fetches (aiohttp, at most server.max_request_body_mb each). After the prompt ids,
the engine decodes them and widens each image's one pad to its token count (engine.intake.prepare_images, in a worker
thread); the widened ids are the prompt from then on (max_tokens fitting, usage, return_token_ids).

Why the bounded queue: SGLang and vLLM queue without limit, so a burst piles up minutes of waiting requests that
clients have long given up on. We answer 503 + Retry-After instead once more than max_running_requests +
server.max_queued_requests requests are in the engine.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import hmac
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Sequence

from aiohttp import web

from . import anthropic, responses, status
from .config import Config
from .engine import Engine, RequestError
from .http_images import prepare_images
from .json_body import parse_json_body
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics
from .openai_api import Chat, Completions
from .protocol import (APIError, ChoiceResult, Delta, Endpoint, EndpointStream, Meta, Req, Usage, bad_request, dumps,
                       error_body, sampling_params)
from .sampling import SamplingParams
from .tokenizer import IncrementalDetokenizer

log = logging.getLogger("tinyserve.api")

RETRY_AFTER_S = 1
# TCP keepalive of the listening sockets (accepted connections inherit it): a client whose machine went away without
# closing (laptop lid, Wi-Fi gone: a half-open connection) is found dead after 60 s idle + 3 probes 10 s apart, and
# TCP_USER_TIMEOUT drops a connection whose sent data stays unacknowledged as long (keepalive does not probe while
# data is in flight, as under a stream). Then its handler is cancelled and so is its request.
TCP_KEEPALIVE = {"TCP_KEEPIDLE": 60, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 90_000}
LISTEN_BACKLOG = 128
LARGE_BODY = 1 << 20             # bytes: a body past this is measured and parsed in a worker thread
# Routes that say nothing and need no key: the health check, and Anthropic's reachability probe (Claude Code sends
# `HEAD /api/hello` to ANTHROPIC_BASE_URL when it starts, to open the connection early)
OPEN_PATHS = ("/health", "/api/hello")


# ---------------------------------------------------------------------------------------------------------------
# App state

@dataclass
class ServerState:
    """What the handlers share. `engine` is None while the model loads (/health answers 503 then)."""

    cfg: Config
    engine: Engine | None = None
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    endpoints: dict[str, Endpoint[Any]] = field(default_factory=dict)   # generation routes by path
    history: status.History = field(default_factory=status.History)      # the status page's last hour


STATE: web.AppKey[ServerState] = web.AppKey("tinyserve_state", ServerState)


def get_state(app: web.Application) -> ServerState:
    return app[STATE]


def set_engine(app: web.Application, engine: Engine) -> None:
    """Attach the engine once it has loaded: the server can listen (and answer /health 503) before."""
    app[STATE].engine = engine


def create_app(engine: Engine | None, cfg: Config) -> web.Application:
    """The aiohttp application. `engine` may be None and set later with set_engine (loading)."""
    max_body = int(cfg.server.max_request_body_mb * 1024 * 1024)
    auth = [_auth_middleware] if cfg.server.api_key else []          # no key: every route is open
    app = web.Application(client_max_size=max_body, middlewares=[_error_middleware, *auth])
    state = ServerState(cfg=cfg, engine=engine, endpoints=_endpoints(cfg))
    app[STATE] = state
    for path, endpoint in state.endpoints.items():
        app.router.add_post(path, functools.partial(generate, endpoint=endpoint))
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model_info)
    app.router.add_get("/health", health)
    app.router.add_get("/api/hello", hello)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/flush_cache", flush_cache)
    status.add_routes(app, get_state)
    return app


def _endpoints(cfg: Config) -> dict[str, Endpoint[Any]]:
    """The generation routes: one protocol Endpoint each, all served by `generate`."""
    fetch = cfg.server.fetch_image_urls
    return {"/v1/chat/completions": Chat(cfg.parsers.reasoning, cfg.parsers.tool_call, fetch),
            "/v1/completions": Completions(),
            "/v1/messages": anthropic.Messages(cfg.parsers.reasoning, cfg.parsers.tool_call, fetch),
            "/v1/responses": responses.Responses(cfg.parsers.reasoning, cfg.parsers.tool_call, fetch)}


def set_keepalive(sock: socket.socket) -> None:
    """SO_KEEPALIVE and, where the platform has them, the TCP_KEEPALIVE timings."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in TCP_KEEPALIVE.items():
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening TCP sockets on every address `host` resolves to (as asyncio's create_server binds them), with
    keepalive set so that every accepted connection inherits it; serve them with aiohttp's SockSite. Raises
    OSError (nothing left open) when one cannot be bound."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)   # the IPv4 address has its own
            set_keepalive(sock)
            sock.bind(address)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


# ---------------------------------------------------------------------------------------------------------------
# Middlewares

def error_response(err: APIError, path: str = "") -> web.Response:
    """OpenAI's error shape, or Anthropic's on the Anthropic routes (its clients parse only their own)."""
    body = anthropic.error_body(err) if anthropic.is_anthropic_path(path) else error_body(err)
    return web.json_response(body, status=err.status, headers=err.headers, dumps=dumps)


def _refused(request: web.Request, err: APIError) -> web.Response:
    """A refused request, logged one line each (the operator sees what a client was told; /health's 503 while
    loading or draining is its answer, not a refusal)."""
    if request.path != "/health":
        log.warning("%s %s: %d %s", request.method, request.path, err.status, err.message)
    return error_response(err, request.path)


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure leaves in the error shape; never a traceback to the client."""
    state = request.app[STATE]
    try:
        response = await handler(request)
    except APIError as e:
        response = _refused(request, e)
    except web.HTTPException as e:                    # routing (404, 405) and body size (413) from aiohttp
        if e.status < 400:
            raise
        response = _refused(request, _http_error(request, e, state.cfg))
    except (asyncio.CancelledError, ConnectionResetError):
        raise                                         # the client went away; the handler cleaned up
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        response = error_response(APIError(500, "internal server error (logged on the server)"), request.path)
    if request.path in state.endpoints:
        state.metrics.on_response(response.status)
    return response


def _http_error(request: web.Request, e: web.HTTPException, cfg: Config) -> APIError:
    message = {404: f"no route {request.method} {request.path}",
               405: f"method {request.method} not allowed on {request.path}",
               413: f"request body is larger than server.max_request_body_mb "
                    f"({cfg.server.max_request_body_mb:g} MB)"}.get(e.status, e.reason)
    return APIError(e.status, message, headers={k: v for k, v in e.headers.items() if k.lower() == "allow"})


@web.middleware
async def _auth_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """`Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients), on every route but
    OPEN_PATHS; in the app when server.api_key is set."""
    if request.path not in OPEN_PATHS:
        _check_key(request, request.app[STATE].cfg.server.api_key)
    return await handler(request)


def _check_key(request: web.Request, key: str) -> None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "basic":                     # a browser on the status page: any user, the key as password
        try:
            given = base64.b64decode(given.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            given = ""
    else:
        given = given.strip() if scheme.lower() == "bearer" else request.headers.get("x-api-key", "")
    if not given or not hmac.compare_digest(given.encode(), key.encode()):
        # the status page's routes ask a browser for the key (as the password); API clients get no prompt
        challenge = {"WWW-Authenticate": 'Basic realm="tinyserve"'} if request.path in ("/", "/status.json") \
            else None
        raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>' or "
                            "'x-api-key: <key>')", code="invalid_api_key", headers=challenge)


# ---------------------------------------------------------------------------------------------------------------
# Generation: the n engine requests behind one HTTP request

class Generation:
    """Submits n requests for each prompt (choice k * n + i is prompt k's i-th), turns their token events into text
    deltas (stop strings applied), records metrics, and cancels whatever is unfinished on close(): client gone, stop
    string, or shutdown. Raises the engine's RequestError before submitting anything when the parameters are out of
    range. params: per prompt (max_tokens is fitted to each). `images`: what engine.intake.prepare_images returned
    for the (one) prompt's ids; every choice sees the same ones."""

    def __init__(self, state: ServerState, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 n: int, stop: list[str], request_id: str, arrival: float, images: Sequence[Any] = ()) -> None:
        self.engine = engine
        self.metrics = state.metrics
        self.prompts, self.n = prompts, n
        self.stop = stop
        self.arrival = arrival
        self.streams: list[Any] = []
        self.completion_tokens = 0
        self._open: set[int] = set()                  # choices not finished yet
        try:                                          # the first submit validates params: a bad one submits nothing
            for prompt, p in zip(prompts, params):
                for i in range(n):
                    seed = p.seed if p.seed is None or n == 1 else (p.seed + i) % 2 ** 64
                    index = len(self.streams)
                    self.streams.append(self.engine.submit(prompt, replace(p, seed=seed), f"{request_id}-{index}",
                                                           images=images))
                    self._open.add(index)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for i in list(self._open):                   # not finished: client gone, error, or shutdown
            self.streams[i].cancel()
            self._finished(i, "abort")

    def _finished(self, index: int, reason: str) -> None:
        if index not in self._open:                   # counted once
            return
        self._open.discard(index)
        r = self.streams[index].result
        tiers = r.report["cached_by_tier"]
        # one line per request with its cache match, so prompt drift (0 cached on every turn) shows in the log
        log.info("%s: %s, prompt %d tokens, %d from the prefix cache (device %d, host %d, file %d), %d generated",
                 r.request_id, reason, r.prompt_tokens, r.cached_tokens, tiers["device"], tiers["host"],
                 tiers["file"], r.completion_tokens)
        drafts = self.engine.drafts(r)
        self.metrics.on_finished(reason, r.prompt_tokens, tiers, time.monotonic() - self.arrival,
                                 drafts.rounds if drafts else 0, drafts.accepted if drafts else 0)

    async def deltas(self, index: int) -> AsyncIterator[Delta]:
        """One choice's deltas; the last one carries finish_reason."""
        stream = self.streams[index]
        detok = IncrementalDetokenizer(self.engine.tokenizer, self.stop)
        last = None
        async for events in stream:
            # the prompt's logprobs (when asked for) come with the first tokens
            prompt_logprobs = stream.result.report.get("prompt_logprobs") if last is None else None
            now = time.monotonic()
            if last is None:
                r = stream.result
                self.metrics.on_first_token(now - self.arrival, warm=2 * r.cached_tokens >= r.prompt_tokens > 0)
            self.metrics.on_tokens(len(events), None if last is None else now - last)
            last = now
            taken = len(detok.token_ids)
            text = detok.add([e.token_id for e in events])
            events = events[:len(detok.token_ids) - taken]     # nothing after a stop string counts
            ids = [e.token_id for e in events]
            self.completion_tokens += len(ids)
            if detok.stopped:                         # a stop string: the rest of the text is cut
                stream.cancel()
                self._finished(index, "stop")
                yield Delta(text, ids, events, "stop", detok.stop_reason, prompt_logprobs)
                return
            if text or ids:
                yield Delta(text, ids, events, prompt_logprobs=prompt_logprobs)
        reason = stream.result.finish_reason or "abort"
        self._finished(index, reason)
        yield Delta(detok.flush(), [], [], reason)

    async def merged(self) -> AsyncIterator[tuple[int, Delta]]:
        """All choices' deltas as they come (one choice: no extra task or queue)."""
        if len(self.streams) > 1:
            async for item in self._merged_choices():
                yield item
            return
        async for d in self.deltas(0):
            yield 0, d

    async def _merged_choices(self) -> AsyncIterator[tuple[int, Delta]]:
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
            if d.prompt_logprobs is not None:
                r.prompt_logprobs = d.prompt_logprobs
            if d.finish_reason is not None:
                r.finish_reason = d.finish_reason
                r.stop_string = d.stop_string
        return results

    def usage(self) -> Usage:
        firsts = [s.result for s in self.streams[::self.n]]    # each prompt's first choice: the others share its
        by_tier = [r.report["cached_by_tier"] for r in firsts]  # prompt (and hit what the first wrote)
        usage = Usage(sum(map(len, self.prompts)), self.completion_tokens, sum(r.cached_tokens for r in firsts),
                      {tier: sum(t[tier] for t in by_tier) for tier in by_tier[0]})
        drafts = [self.engine.drafts(s.result) for s in self.streams]
        if drafts[0] is not None:                     # speculative decoding is on
            usage.accepted_prediction_tokens = sum(d.accepted for d in drafts)
            usage.rejected_prediction_tokens = sum(d.drafted - d.accepted for d in drafts)
        return usage


# ---------------------------------------------------------------------------------------------------------------
# The generation skeleton, shared by every protocol

def _serving_engine(state: ServerState) -> Engine:
    """The engine, for a request: 503 while the model loads or the server shuts down."""
    if state.engine is None:
        raise APIError(503, "the model is still loading", headers={"Retry-After": str(RETRY_AFTER_S)})
    if state.draining:
        raise APIError(503, "the server is shutting down")
    return state.engine


def _check_capacity(engine: Engine, cfg: Config, n: int, prompts: int) -> None:
    """503 + Retry-After while the engine holds too many requests for these n x prompts; 400 when they could never
    fit at once."""
    limit = cfg.engine.max_running_requests + cfg.server.max_queued_requests
    if n * prompts > limit:
        raise bad_request(f"{prompts} prompts x n={n} make {n * prompts} requests; this server takes at most {limit} "
                          "at once (engine.max_running_requests + server.max_queued_requests)",
                          "prompt" if prompts > 1 else "n")
    n *= prompts
    unfinished = engine.num_unfinished + engine.intake.image_budget.waiting    # waiting for image memory: queued
    if unfinished + n > limit:
        raise APIError(503, f"the server is full ({unfinished} requests running or queued, limit {limit}); "
                            "retry later", headers={"Retry-After": str(RETRY_AFTER_S)})


async def _read_json(request: web.Request) -> dict[str, Any]:
    """The body's JSON object (json_body.parse_json_body: nesting capped, every failure a 400); a large body is
    measured and parsed in a worker thread, off the event loop."""
    raw = await request.read()                        # raises 413 past client_max_size
    if len(raw) > LARGE_BODY:
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


def _fit(engine: Engine, endpoint: Endpoint[Req], req: Req, prompt: list[int], which: int | None) -> int:
    """The max_tokens a prompt gets (intake.fit_max_tokens); a prompt or max_tokens past the context is a 400 with
    OpenAI's code context_length_exceeded. which: the prompt's index when the request sends several."""
    try:
        return engine.intake.fit_max_tokens(len(prompt), req.options.max_tokens, endpoint.clamp_max_tokens)
    except RequestError as e:
        param = endpoint.error_param(req, e.field)
        where = f"{param}[{which}]: " if which is not None else ""
        raise endpoint.context_error(APIError(400, where + str(e), param, code="context_length_exceeded"),
                                     e.tokens) from None


async def generate(request: web.Request, endpoint: Endpoint[Req]) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    engine = _serving_engine(state)
    body = await _read_json(request)
    req = endpoint.parse(body, engine.served_name, request.headers)
    if req.left_out:
        state.metrics.on_tools_left_out(req.left_out)
    options = req.options
    _check_capacity(engine, state.cfg, options.n, endpoint.num_prompts(req))
    prompts = await asyncio.to_thread(endpoint.prompts, req, engine.tokenizer)
    images: list[Any] = []
    if req.images:                                    # the ids grow by each image's tokens
        prompt_ids, images = await prepare_images(engine, state.cfg, endpoint, req, prompts[0])
        prompts = [prompt_ids]
    tokenizer = engine.tokenizer
    meta = Meta(endpoint.id_prefix + uuid.uuid4().hex, int(time.time()), engine.served_name, prompts[0],
                tokenizer.token_text, token_bytes=tokenizer.token_bytes, prompts=prompts)
    params = [sampling_params(options, _fit(engine, endpoint, req, p, k if len(prompts) > 1 else None))
              for k, p in enumerate(prompts)]
    try:                                              # the engine decides what is in range
        gen = Generation(state, engine, prompts, params, options.n, options.stop, meta.request_id, arrival, images)
    except RequestError as e:
        raise bad_request(str(e), endpoint.error_param(req, e.field)) from None
    images = []                                       # the requests hold them now (and drop their pixels once encoded)
    meta.usage = gen.usage
    try:                                              # close() cancels on any exit: done, error, client gone
        if options.stream:
            return await _stream(request, gen, endpoint.stream(req, meta))
        results = await gen.collect()
        return web.json_response(endpoint.response(req, meta, results, gen.usage()), dumps=dumps)
    finally:
        gen.close()


async def _stream(request: web.Request, gen: Generation, out: EndpointStream) -> web.StreamResponse:
    """Server-sent events; a client that leaves ends it quietly (the caller's close() cancels the rest)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)

    async def send(chunks: list[dict[str, Any]]) -> None:
        for chunk in chunks:
            await response.write(out.frame(chunk))    # raises ConnectionResetError once the client has gone

    try:
        try:
            await send(out.start())
            async for i, d in gen.merged():
                await send(out.delta(i, d))
            await send(out.end(gen.usage))
        except APIError as e:                         # after the headers went out: an error event
            log.warning("%s %s: %d %s (in the stream)", request.method, request.path, e.status, e.message)
            await send([out.error(e)])
        await response.write(out.done)
        await response.write_eof()
    except ConnectionResetError:
        log.debug("client disconnected from %s", request.path)
    return response


# ---------------------------------------------------------------------------------------------------------------
# Other routes

async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the length of the prompt a Messages request renders to, images included (each
    counts its tokens, as in the generation's usage)."""
    state = request.app[STATE]
    engine = _serving_engine(state)
    endpoint = state.endpoints["/v1/messages"]
    assert isinstance(endpoint, anthropic.Messages)
    req = endpoint.parse_count(await _read_json(request), request.headers)
    ids = await asyncio.to_thread(endpoint.prompt_ids, req, engine.tokenizer)
    if req.images:
        ids, _ = await prepare_images(engine, state.cfg, endpoint, req, ids)
    return web.json_response({"input_tokens": len(ids)}, dumps=dumps)


def _model_card(engine: Engine) -> dict[str, Any]:
    return {"id": engine.served_name, "object": "model", "created": int(time.time()), "owned_by": "tinyserve",
            "max_model_len": engine.context_length}


async def models(request: web.Request) -> web.Response:
    engine = _serving_engine(request.app[STATE])
    return web.json_response({"object": "list", "data": [_model_card(engine)]})


async def model_info(request: web.Request) -> web.Response:
    """GET /v1/models/{model} (the SDKs' models.retrieve): the served model, or 404 naming what is served."""
    engine = _serving_engine(request.app[STATE])
    name = request.match_info["model"]
    if name != engine.served_name:
        raise APIError(404, f"model {name!r} is not served here; this server serves {engine.served_name!r}",
                       "model", code="model_not_found")
    return web.json_response(_model_card(engine))


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is None:
        return web.json_response({"status": "loading"}, status=503)
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok"})


async def hello(request: web.Request) -> web.Response:
    """The server is there (a GET or HEAD that opens a client's connection); nothing about its state."""
    return web.json_response({})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    stats = await engine.call(engine.stats) if engine is not None else None   # the engine thread owns its state
    body = state.metrics.render(stats)
    return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})


async def flush_cache(request: web.Request) -> web.Response:
    engine = _serving_engine(request.app[STATE])
    tiers = [t for t in request.query.get("tiers", "").split(",") if t]
    unknown = sorted(set(tiers) - {"device", "host", "file"})
    if unknown:
        raise bad_request(f"unknown tier {unknown[0]!r} in ?tiers= (device, host, file)", "tiers")
    include_file = "file" in tiers                   # the persistent tier is emptied only when asked
    if await engine.call(engine.flush_cache, include_file):   # on the compute thread, between two steps
        flushed = "device and host tiers" + (" and the file tier" if include_file else "")
        return web.json_response({"message": f"prefix cache flushed ({flushed})"})
    raise bad_request("cannot flush the prefix cache while requests hold it; retry when idle")
