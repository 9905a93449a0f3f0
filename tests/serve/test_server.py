"""How `twotower serve` runs uvicorn (`twotower.serve.server`): deadlines for request heads, a connection bound and
h11's own refusals in the JSON error shape, a bounded graceful shutdown. Each against a real server on loopback."""

from __future__ import annotations

import json
import socket
import time

from tests.serve.serve_fixtures import live_server, read_answer, wait_until


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _read_answer(conn: socket.socket) -> tuple[bytes, dict]:
    head, body = read_answer(conn)
    return head, json.loads(body)


def test_a_connection_that_does_not_send_its_request_head_in_time_is_closed(index_template):
    """A connection that sent nothing, or a header line a second, stayed open for good (uvicorn's keep-alive timeout
    starts only after an answer): a few hundred of them held every connection the server would take."""
    with live_server(index_template, head_timeout_s=0.5) as (url, app):
        port = _port(url)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle, \
                socket.create_connection(("127.0.0.1", port), timeout=10) as drip:
            drip.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            drip.sendall(b"X-a: b\r\n")
            head, body = _read_answer(drip)  # a socket timeout here: the server is still waiting for the head
            assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower(), head
            assert (body["status"], body["error"], body["field"]) == (408, "request_timeout", "headers")
            assert idle.recv(100) == b""  # closed without a word: it sent nothing
        # a keep-alive connection asks again within the deadline: answered
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            for _ in range(2):
                conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while b"}" not in data:
                    data += conn.recv(65536)
                assert data.startswith(b"HTTP/1.1 200 "), data
            assert conn.recv(100) == b""  # and is closed once idle past it


def test_an_oversized_request_head_is_a_json_431(index_template):
    """h11 refuses a request line and headers over 16 KB that it holds unfinished; uvicorn answered a plain-text 400
    "Invalid HTTP request received." It is now the service's JSON error shape, saying what to do."""
    with live_server(index_template) as (url, app):
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as conn:
            conn.sendall(b"GET /search?q=" + b"a" * 20_000)  # the rest of the head never comes
            head, body = _read_answer(conn)
        assert head.startswith(b"HTTP/1.1 431 ") and b"application/json" in head, head
        assert (body["status"], body["error"], body["field"]) == (431, "too_large", "headers")
        assert "over 16 KB" in body["message"] and "POST /search" in body["message"]
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as conn:  # under it: the app's limit
            conn.sendall(b"GET /search?q=" + b"a" * 12_000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head, body = _read_answer(conn)
        assert head.startswith(b"HTTP/1.1 413 ") and body["field"] == "q", head
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as conn:
            conn.sendall(b"NOT HTTP\r\n\r\n")
            head, body = _read_answer(conn)
        assert head.startswith(b"HTTP/1.1 400 ") and body["message"] == "malformed HTTP request", head


def test_past_the_connection_bound_a_request_is_a_json_503(index_template):
    with live_server(index_template, max_connections=3) as (url, app):
        state = app.state.server.server_state
        port = _port(url)
        with socket.create_connection(("127.0.0.1", port), timeout=10), \
                socket.create_connection(("127.0.0.1", port), timeout=10):
            wait_until(lambda: len(state.connections) == 2, "two connections are open")
            with socket.create_connection(("127.0.0.1", port), timeout=10) as third:
                third.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                head, body = _read_answer(third)
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), head
        assert body["error"] == "unavailable" and "3 connections" in body["message"]
        wait_until(lambda: not state.connections, "the connections are closed")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head, body = _read_answer(conn)
        assert head.startswith(b"HTTP/1.1 200 "), head


def test_a_stalled_request_does_not_hold_a_shutdown_past_its_grace_period(index_template):
    """After SIGTERM, one connection with a stalled body kept the process alive for as long as it stayed open."""
    with live_server(index_template, graceful_shutdown_s=1.0, body_timeout_s=120) as (url, app):
        server = app.state.server
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=10) as conn:
            conn.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"queries\": [")
            wait_until(lambda: server.server_state.tasks, "the request is in flight")
            start = time.monotonic()
            server.should_exit = True
            wait_until(lambda: app.state.service.owner.state == "stopped", "the server stopped", 20)
            took = time.monotonic() - start
        assert took < 10, took  # the grace period (1 s) and the owner's stop
