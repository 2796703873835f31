"""What the agents send, kept: a pass-through proxy between the agents and the server, and the request shapes it
records.

The agents talk to 127.0.0.1:8000 as docs/clients.md sets them up; in the tier that address is this proxy, which
passes every request to the server unchanged and its answer back as it comes (streams chunk by chunk), and keeps a
copy of each request. From the copies come, per release:

  - its shape: the routes, the header names, the values of the protocols' flags and version markers
    (anthropic-beta, anthropic-version, OpenAI-Beta), and every field path of the JSON bodies with the `type` of
    each object on the way (`messages[].content[type=tool_result].content[type=text].text`). A new field, block,
    tool type or flag in a release shows up as a path that is not in the kept shape;
  - one skeleton request per distinct request kind: the body with long strings cut short (JSON kept valid),
    which tests/test_agent_shapes.py sends to a server without the CLI.

tests/agents/shapes/<agent>-<version>.json keeps both; TINYSERVE_AGENTS_RECORD=1 writes them anew.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

# Headers that say how this hop is carried, not what the client asks: not part of a shape, not passed on
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "accept-encoding", "te",
               "upgrade", "proxy-connection"}
# The protocols' flags and version markers, whose values are part of a shape
MARKER_HEADERS = ("anthropic-beta", "anthropic-version", "openai-beta")
# Objects whose keys are names the client chose (a tool's JSON schema, a call's arguments, metadata), not fields
OPAQUE = {"input_schema", "parameters", "properties", "input", "arguments", "metadata", "schema", "definitions",
          "$defs", "client_metadata", "chat_template_kwargs", "patternProperties"}
# Strings kept whole in a skeleton: what the server reads as a value (a thinking block's signature holds its text)
WHOLE = {"type", "role", "name", "id", "tool_use_id", "call_id", "model", "signature", "status", "namespace",
         "tool_choice", "effort", "summary", "display", "media_type", "detail", "syntax", "definition"}
CUT = 48
# This machine's paths, as the agents send them (their working folder and home are pytest's tmp folders), and what a
# kept skeleton says instead
MACHINE_PATHS = [(re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/\s\"'\\]+/home"), "/home/user"),
                 (re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/\s\"'\\]+/project"), "/home/user/project"),
                 (re.compile(r"/tmp/pytest-of-[^/]+(/pytest-\d+)?"), "/tmp"),
                 (re.compile(r"(?<![\w/])/root(?![\w])"), "/home/user")]


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    response: bytearray = field(default_factory=bytearray)   # the server's answer as it was passed on


def answer_text(r: Recorded) -> str:
    """The visible text of a recorded generation's answer (what an agent would show of it): OpenAI chat's content,
    Anthropic's text blocks, the Responses API's output text; streamed or whole. Reasoning and tool calls are not
    visible text."""
    raw = bytes(r.response).decode("utf-8", "replace")
    events = [line[5:].strip() for line in raw.splitlines() if line.startswith("data:")] or [raw]
    text = []
    for event in events:
        try:
            obj = json.loads(event)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        for choice in obj.get("choices") or []:                     # chat: streamed deltas or the whole message
            text.append((choice.get("delta") or choice.get("message") or {}).get("content") or "")
        if obj.get("type") == "content_block_delta" and obj.get("delta", {}).get("type") == "text_delta":
            text.append(obj["delta"].get("text", ""))
        if obj.get("type") == "response.output_text.delta":
            text.append(obj.get("delta", ""))
        if obj.get("type") == "message" and isinstance(obj.get("content"), list):      # Anthropic, not streamed
            text += [b.get("text", "") for b in obj["content"] if isinstance(b, dict) and b.get("type") == "text"]
        if obj.get("object") == "response":                                            # Responses, not streamed
            text += [part.get("text", "") for item in obj.get("output") or [] if item.get("type") == "message"
                     for part in item.get("content") or [] if part.get("type") == "output_text"]
    return "".join(t for t in text if isinstance(t, str))


def body_paths(value: Any, prefix: str = "") -> set[str]:
    """Every field path of a JSON value, lists collapsed to [], an object's `type` written into its path."""
    out: set[str] = set()
    if isinstance(value, dict):
        kind = value.get("type")
        here = f"{prefix[:-2]}[type={kind}]" if isinstance(kind, str) and prefix.endswith("[]") else prefix
        if isinstance(kind, str) and not prefix.endswith("[]") and prefix:
            out.add(f"{prefix}.type={kind}")
        for key, sub in value.items():
            path = f"{here}.{key}" if here else key
            out.add(path)
            if key not in OPAQUE:
                out |= body_paths(sub, path)
    elif isinstance(value, list):
        for item in value:
            out |= body_paths(item, prefix + "[]")
    return out


def request_shape(r: Recorded) -> dict[str, Any]:
    """The parts of one request a release may change."""
    markers = {name: sorted({v.strip() for v in r.headers.get(name, "").split(",")} - {""})
               for name in MARKER_HEADERS if name in r.headers}
    return {"route": f"{r.method} {r.path}", "headers": sorted(set(r.headers) - HOP_HEADERS), "markers": markers,
            "paths": sorted(body_paths(r.body)) if isinstance(r.body, (dict, list)) else []}


def release_shape(requests: list[Recorded]) -> dict[str, list[str]]:
    """The union of a release's request shapes, as flat sorted lists ("route", "header", "marker", "path")."""
    routes, headers, markers, paths = set(), set(), set(), set()
    for r in requests:
        shape = request_shape(r)
        routes.add(shape["route"])
        headers.update(shape["headers"])
        markers.update(f"{name}: {v}" for name, values in shape["markers"].items() for v in values)
        paths.update(f"{shape['route']} {p}" for p in shape["paths"])
    return {"routes": sorted(routes), "headers": sorted(headers), "markers": sorted(markers), "paths": sorted(paths)}


def skeleton(value: Any, key: str = "") -> Any:
    """The value with its long strings cut (a string that holds JSON keeps holding JSON), all structure kept, and
    this machine's paths replaced."""
    if isinstance(value, dict):
        return {k: skeleton(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [skeleton(v, key) for v in value]
    if isinstance(value, str):
        for pattern, replacement in MACHINE_PATHS:
            value = pattern.sub(replacement, value)
    if isinstance(value, str) and len(value) > CUT and key not in WHOLE:
        try:
            inner = json.loads(value)
        except ValueError:
            return value[:CUT] + "..."
        if isinstance(inner, (dict, list)):
            return json.dumps(skeleton(inner), ensure_ascii=False)
        return value[:CUT] + "..."
    return value


def kinds(requests: list[Recorded]) -> list[dict[str, Any]]:
    """One skeleton request per kind (its route, header names, markers and top-level fields), the latest of each."""
    out: dict[str, dict[str, Any]] = {}
    for r in requests:
        shape = request_shape(r)
        top = sorted(r.body) if isinstance(r.body, dict) else []
        kind = json.dumps([shape["route"], shape["headers"], shape["markers"], top])
        headers = {k: v for k, v in r.headers.items() if k in MARKER_HEADERS or k == "content-type"}
        out[kind] = {"method": r.method, "path": r.path, "headers": headers, "body": skeleton(r.body)}
    return list(out.values())


class Recorder:
    """The proxy: listens on `port`, passes everything to `upstream`, records each request."""

    def __init__(self, port: int, upstream: str) -> None:
        self.port, self.upstream = port, upstream
        self.requests: list[Recorded] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="recorder")

    def start(self) -> "Recorder":
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("the recording proxy did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def take(self) -> list[Recorded]:
        taken, self.requests = self.requests, []
        return taken

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._pass)
        runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._session = self._loop.run_until_complete(self._new_session())
        self._ready.set()
        self._loop.run_forever()

    @staticmethod
    async def _new_session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)

    async def _pass(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", "replace")
        headers = {k.lower(): v for k, v in request.headers.items()}
        recorded = Recorded(request.method, request.path, headers, body)
        self.requests.append(recorded)
        sent = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=sent,
                                         data=raw or None) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                recorded.response += chunk
                await response.write(chunk)
            await response.write_eof()
            return response


@dataclass
class ShapeDiff:
    new: dict[str, list[str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return any(self.new.values())

    def __str__(self) -> str:
        return "\n".join(f"  new {part[:-1]}: {item}" for part, items in self.new.items() for item in items)


def compare(kept: dict[str, list[str]], now: dict[str, list[str]]) -> ShapeDiff:
    """What a release sent now that its kept shape does not have (what it no longer sends is no failure: a run
    need not reach every request kind)."""
    return ShapeDiff({part: sorted(set(now[part]) - set(kept.get(part, []))) for part in now})
