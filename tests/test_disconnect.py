"""A client that goes away costs nothing: a real `tinyserve` process on 127.0.0.1, a streaming and a non-streaming
client that disconnect mid-generation, and the engine's own counters on /metrics showing their requests cancelled and
their pages freed. TCP keepalive on the listening sockets (so half-open connections die too) is checked on a real
accepted connection.

Waits are bounded generously (a loaded 2-core machine); the time it takes is measured by bench/home_box.py.
"""
from __future__ import annotations

import json
import re
import socket
import time

import pytest

from server_util import ServerProcess, free_port, http, server_config

from tinyserve.api import TCP_KEEPALIVE, listening_sockets

LONG = {"prompt": "Hello there, tell me a long story", "max_tokens": 900, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(xdg, tmp_path_factory):
    folder = tmp_path_factory.mktemp("disconnect")
    cfg = server_config(free_port(), {"engine": {"max_running_requests": 4}})
    proc = ServerProcess(folder, cfg, env={"XDG_CACHE_HOME": str(xdg)}).start()
    yield proc
    assert proc.stop() == 0, proc.log()


def metrics(base_url: str) -> dict[str, float]:
    status, _, body = http("GET", base_url + "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        m = re.match(r'^(tinyserve:[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def request_pages(m: dict[str, float]) -> float:
    """Device KV pages held by requests: all pages in use minus those the prefix cache holds."""
    return m["tinyserve:kv_pages_used"] - m["tinyserve:prefix_cache_pages"]


def wait_for(predicate, what: str, timeout: float = 20.0) -> float:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - t0


def send_request(port: int, body: dict) -> socket.socket:
    """POST /v1/completions on a raw socket (so the test decides exactly when the connection goes)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def test_streaming_and_non_streaming_clients_that_leave_are_cancelled_and_freed(server):
    base = server.base_url
    idle = metrics(base)
    assert idle["tinyserve:num_requests_running"] == 0 and request_pages(idle) == 0
    streaming = send_request(server.port, {**LONG, "stream": True})
    got = b""
    while b"data: " not in got:                             # headers, then the first SSE event: it is generating
        chunk = streaming.recv(65536)
        assert chunk, got
        got += chunk
    blocking = send_request(server.port, LONG)              # no byte comes back until it finishes
    wait_for(lambda: metrics(base)["tinyserve:num_requests_running"] == 2, "both requests to run")
    busy = metrics(base)
    assert request_pages(busy) > 0
    generated = busy["tinyserve:generation_tokens_total"]

    streaming.close()                                       # both clients go away mid-generation
    blocking.close()
    took = wait_for(lambda: (lambda m: m["tinyserve:num_requests_running"] == 0 and m[
        "tinyserve:num_requests_waiting"] == 0 and request_pages(m) == 0)(metrics(base)), "the pages to be freed")
    after = metrics(base)
    assert after['tinyserve:request_finished_total{finish_reason="abort"}'] == 2     # cut off, not finished
    assert after["tinyserve:generation_tokens_total"] < generated + 2 * LONG["max_tokens"]
    print(f"freed {took:.2f} s after the clients left")
    # the server goes on serving
    status, _, body = http("POST", base + "/v1/completions", {"prompt": "Hi", "max_tokens": 3})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_a_client_that_leaves_while_queued_is_dropped(xdg, tmp_path):
    """One running slot: the second request waits in the queue; its client leaves; it never runs."""
    cfg = server_config(free_port(), {"engine": {"max_running_requests": 1}})
    with ServerProcess(tmp_path, cfg, env={"XDG_CACHE_HOME": str(xdg)}) as proc:
        first = send_request(proc.port, LONG)
        wait_for(lambda: metrics(proc.base_url)["tinyserve:num_requests_running"] == 1, "the first to run")
        queued = send_request(proc.port, LONG)
        wait_for(lambda: metrics(proc.base_url)["tinyserve:num_requests_waiting"] == 1, "the second to queue")
        queued.close()
        wait_for(lambda: metrics(proc.base_url)["tinyserve:num_requests_waiting"] == 0, "the queued one to go")
        first.close()
        wait_for(lambda: (lambda m: m["tinyserve:num_requests_running"] == 0 and request_pages(m) == 0)(
            metrics(proc.base_url)), "the pages to be freed")
        m = metrics(proc.base_url)
        assert m['tinyserve:request_finished_total{finish_reason="abort"}'] == 2


@pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"), reason="Linux keepalive options")
def test_listening_sockets_keepalive_is_inherited_by_connections():
    socks = listening_sockets("127.0.0.1", 0)
    try:
        (listener,) = socks
        port = listener.getsockname()[1]
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        with socket.create_connection(("127.0.0.1", port)):
            listener.setblocking(True)
            conn, _ = listener.accept()
            with conn:
                assert conn.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
                for name, value in TCP_KEEPALIVE.items():
                    assert conn.getsockopt(socket.IPPROTO_TCP, getattr(socket, name)) == value, name
    finally:
        for s in socks:
            s.close()


def test_listening_on_a_name_binds_each_address_once():
    socks = listening_sockets("localhost", 0)
    try:
        assert socks and len({(s.family, s.getsockname()[0]) for s in socks}) == len(socks)
    finally:
        for s in socks:
            s.close()
