"""The HTTP server: the aiohttp app, its middlewares (errors, auth) and the small routes.

    POST /v1/chat/completions   POST /v1/completions                (OpenAI's: openai_api.py)
    POST /v1/messages   POST /v1/messages/count_tokens              (Anthropic's Messages: anthropic.py)
    POST /v1/responses                                              (OpenAI's Responses, stateless: responses.py)
    GET /v1/models   GET /v1/models/{model}   GET /health   GET /metrics   POST /flush_cache
    GET /v1/loads (and GET /loads: the worker's load for a gateway such as SMG: loads.py)
    GET /api/hello (Anthropic's reachability probe)   GET /   GET /status.json (the status page: status.py)

Each generation route is a handler in its protocol's module that reads top to bottom over one generation pipeline
(protocol.py says how: parse, render, start_generation, then SSE or one JSON body; generation.py turns the engine's
tokens into text). This module is the app around them: the routes, the error shape every failure leaves in (never a
traceback; Anthropic's shape on its routes), the API key, and the listening sockets. The engine stays the only owner
of pages and state; the handlers only submit, iterate and cancel.

Why the bounded queue: SGLang and vLLM queue without limit, so a burst piles up minutes of waiting requests that
clients have long given up on. start_generation answers 503 + Retry-After instead once more than
max_running_requests + server.max_queued_requests requests are in the engine.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import socket
import time
from typing import Any

from aiohttp import web

from . import anthropic, loads, openai_api, responses, status
from .config import Config
from .engine import Engine
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .protocol import STATE, APIError, ServerState, bad_request, dumps, error_body, serving

log = logging.getLogger("tinyserve.api")

# TCP keepalive of the listening sockets (accepted connections inherit it): a client whose machine went away without
# closing (laptop lid, Wi-Fi gone: a half-open connection) is found dead after 60 s idle + 3 probes 10 s apart, and
# TCP_USER_TIMEOUT drops a connection whose sent data stays unacknowledged as long (keepalive does not probe while
# data is in flight, as under a stream). Then its handler is cancelled and so is its request.
TCP_KEEPALIVE = {"TCP_KEEPIDLE": 60, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3, "TCP_USER_TIMEOUT": 90_000}
LISTEN_BACKLOG = 128
# Routes that say nothing and need no key: the health check, and Anthropic's reachability probe (Claude Code sends
# `HEAD /api/hello` to ANTHROPIC_BASE_URL when it starts, to open the connection early)
OPEN_PATHS = ("/health", "/api/hello")


# ---------------------------------------------------------------------------------------------------------------
# The app

# The generation routes, by path: their responses' statuses are counted in tinyserve:requests
GENERATION_ROUTES = {"/v1/chat/completions": openai_api.chat_completions, "/v1/completions": openai_api.completions,
                     "/v1/messages": anthropic.messages, "/v1/responses": responses.create_response}


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
    app[STATE] = ServerState(cfg=cfg, engine=engine)
    for path, handler in GENERATION_ROUTES.items():
        app.router.add_post(path, handler)
    app.router.add_post("/v1/messages/count_tokens", anthropic.count_tokens)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model:.+}", model_info)
    app.router.add_get("/health", health)
    app.router.add_get("/api/hello", hello)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/flush_cache", flush_cache)
    status.add_routes(app, get_state)
    loads.add_routes(app, get_state)
    return app


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


# Every failure leaves in the error shape; never a traceback to the client.
@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response = await handler(request)
    except APIError as e:
        response = _refused(request, e)
    except web.HTTPException as e:                    # routing (404, 405) and body size (413) from aiohttp
        if e.status < 400:
            raise
        response = _refused(request, _http_error(request, e))
    except (asyncio.CancelledError, ConnectionResetError):
        raise                                         # the client went away; the handler cleaned up
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        response = error_response(APIError(500, "internal server error (logged on the server)"), request.path)
    if request.path in GENERATION_ROUTES:
        request.app[STATE].metrics.on_response(response.status)
    return response


def _http_error(request: web.Request, e: web.HTTPException) -> APIError:
    cfg = request.app[STATE].cfg
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
# The small routes

def _model_card(engine: Engine) -> dict[str, Any]:
    return {"id": engine.served_name, "object": "model", "created": int(time.time()), "owned_by": "tinyserve",
            "max_model_len": engine.context_length}


async def models(request: web.Request) -> web.Response:
    _, engine = serving(request)
    return web.json_response({"object": "list", "data": [_model_card(engine)]})


async def model_info(request: web.Request) -> web.Response:
    """GET /v1/models/{model} (the SDKs' models.retrieve): the served model, or 404 naming what is served."""
    _, engine = serving(request)
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
    _, engine = serving(request)
    tiers = [t for t in request.query.get("tiers", "").split(",") if t]
    unknown = sorted(set(tiers) - {"device", "host", "file"})
    if unknown:
        raise bad_request(f"unknown tier {unknown[0]!r} in ?tiers= (device, host, file)", "tiers")
    include_file = "file" in tiers                   # the persistent tier is emptied only when asked
    if await engine.call(engine.flush_cache, include_file):   # on the compute thread, between two steps
        flushed = "device and host tiers" + (" and the file tier" if include_file else "")
        return web.json_response({"message": f"prefix cache flushed ({flushed})"})
    raise bad_request("cannot flush the prefix cache while requests hold it; retry when idle")
