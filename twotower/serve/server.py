"""How ``twotower serve`` runs uvicorn: the bounds uvicorn leaves open by default, and JSON for the answers it
writes itself.

uvicorn's defaults let one client hold the server: no bound on open connections, no deadline for a request's
line and headers (a connection that sends nothing, or a header line a second, stays open for good), and a
graceful shutdown that waits for every request in flight however long it takes.  `uvicorn_config` sets:

* ``timeout_graceful_shutdown`` (`GRACEFUL_SHUTDOWN_S`): after SIGTERM, requests still in flight that long are
  cancelled and the server stops;
* ``limit_concurrency`` (`MAX_CONNECTIONS`): a request arriving while that many connections are open (or
  requests running) is answered 503 with ``Retry-After``;
* a deadline for a request's line and headers (`HEAD_TIMEOUT_S`), from the connection's opening or the end of
  its previous answer: a connection that has not sent them by then is closed (with a 408 if it sent part of
  them).  uvicorn's keep-alive timeout (5 s) only closes a connection idle *after* an answer;
* the request line and headers together are at most h11's 16 KB (``h11_max_incomplete_event_size``); over it,
  a 431 in the service's JSON error shape (uvicorn wrote a plain-text "Invalid HTTP request received.").

The request body's deadline and size are the app's (`twotower.serve.limits.BodyLimitMiddleware`).  These need
uvicorn's h11 protocol, subclassed here (`protocol_class`), so `twotower serve` uses h11 even where httptools
is installed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from twotower.serve.errors import error_body, error_response

GRACEFUL_SHUTDOWN_S = 30  # a search in flight needs well under a second; a reranked batch of 64 on CPU ~25 s
MAX_CONNECTIONS = 512  # under the common soft limit of 1,024 open files, with room for the index's; 16x the
#                        32 clients of the load benchmark (docs/results.md)
HEAD_TIMEOUT_S = 10.0  # a request line and headers (at most 16 KB) take milliseconds to send
MAX_HEAD_BYTES = 16 * 1024  # h11's default: a GET query string of 1,000 characters fits, percent-encoded
RETRY_AFTER_FULL = "1"


def _raw_response(status: int, reason: str, message: str, field: str | None = None,
                  headers: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    """An HTTP/1.1 answer in the JSON error shape, closing the connection, as bytes for a transport."""
    body = json.dumps(error_body(status, message, field)).encode()
    head = [f"HTTP/1.1 {status} {reason}".encode(), b"content-type: application/json",
            b"content-length: " + str(len(body)).encode(), b"connection: close"]
    head += [name + b": " + value for name, value in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def protocol_class(head_timeout_s: float = HEAD_TIMEOUT_S) -> type:
    """uvicorn's h11 protocol with a deadline for each request's head, the connection bound answered in JSON and
    h11's own 400/431 in JSON.  Made on demand: uvicorn is imported only when serving."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # uvicorn's own check answers a plain-text 503: it is made in `_admit` instead, in JSON
            self.max_concurrency, self.limit_concurrency = self.limit_concurrency, None
            self.app = self._admit(self.app)
            self._head_timer: asyncio.TimerHandle | None = None

        # ---- the request head's deadline
        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timeout, self.cycle)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self, cycle: Any) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.cycle is not cycle or self.conn.their_state is not h11.IDLE:
                return  # a request head arrived since the timer was armed
            if self.conn.trailing_data[0]:  # part of a head: say why the connection closes
                self.transport.write(_raw_response(
                    408, "Request Timeout", f"the request line and headers did not arrive within "
                                            f"{head_timeout_s:g} s", "headers"))
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_head_timer()  # the next request's head (its own check ignores a pipelined one)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        # ---- uvicorn's own answers, in the service's JSON shape
        def send_400_response(self, msg: str) -> None:
            limit = self.config.h11_max_incomplete_event_size or MAX_HEAD_BYTES
            if len(self.conn.trailing_data[0]) > limit:
                status, message = 431, (f"the request line and headers are over {limit // 1024} KB; send a long "
                                        "query or filter in the body of POST /search")
            else:
                status, message = 400, "malformed HTTP request"
            body = json.dumps(error_body(status, message, "headers" if status == 431 else None)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            reason = b"Request Header Fields Too Large" if status == 431 else b"Bad Request"
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
            self.transport.close()

        def _admit(self, app: Any) -> Any:
            async def admit(scope: Any, receive: Any, send: Any) -> None:
                limit = self.max_concurrency
                # as uvicorn counts, before this request's task was added: every connection, other requests
                if limit is not None and (len(self.connections) >= limit or len(self.tasks) - 1 >= limit):
                    self.logger.warning("Exceeded concurrency limit.")
                    response = error_response(503, f"the server has {limit:,} connections open, its limit; retry "
                                                   "shortly", headers={"Retry-After": RETRY_AFTER_FULL,
                                                                       "Connection": "close"})
                    await response(scope, receive, send)
                    return
                await app(scope, receive, send)

            return admit

    return Protocol


def uvicorn_config(app: Any, *, graceful_shutdown_s: float = GRACEFUL_SHUTDOWN_S,
                   max_connections: int = MAX_CONNECTIONS, head_timeout_s: float = HEAD_TIMEOUT_S,
                   **kwargs: Any):
    """A `uvicorn.Config` for `app` with the bounds above; `kwargs` (host, port, log_level, ...) pass through."""
    import uvicorn

    return uvicorn.Config(app, http=protocol_class(head_timeout_s), limit_concurrency=max_connections,
                          timeout_graceful_shutdown=graceful_shutdown_s,
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES, **kwargs)
