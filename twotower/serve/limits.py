"""Bounds on what one request may ask for, and the middleware that enforces the body size.

The limits exist so that one client cannot make the single model owner spend minutes on
one request (a 10,000-query batch, ``k`` of a million) or make the server buffer an
unbounded body.  A body over ``max_body_bytes`` is refused with 413 as soon as its declared
``Content-Length`` (or, for a chunked body, the bytes read so far) passes the limit, and a body
still incomplete ``timeout_s`` after the request arrived is refused with 408 (a client trickling
its body a few bytes a second held its connection, and a graceful shutdown, open for as long as
it liked).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from twotower.serve.errors import ApiError, error_response


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (the CLI exposes ``--max-body-mb``; the rest are fixed defaults)."""

    max_body_bytes: int = 4 * 1024 * 1024
    max_query_chars: int = 1000
    max_k: int = 100
    max_recall_k: int = 1000
    max_batch_queries: int = 64
    max_documents: int = 1000
    max_ids: int = 10_000

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"limit {name} must be a positive integer, got {value!r}")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit:,} bytes", "body")


def too_slow(timeout_s: float) -> ApiError:
    # Connection: close: the rest of the body may still come, and must not be read as the next request
    return ApiError(408, f"the request body did not arrive within {timeout_s:g} s; send it at once", "body",
                    headers={"Connection": "close"})


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with a 413 JSON error, and bodies not complete `timeout_s` seconds
    after the request arrived with a 408 (pure ASGI: nothing is buffered here).  Once the body is complete,
    ``receive`` passes through untouched (a handler may wait on it for ``http.disconnect``)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await error_response(400, "Content-Length is not a number", "Content-Length")(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await error_response(413, str(too_large(self.max_bytes).detail), "body")(scope, receive, send)
                return
        seen = 0
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s
        complete = False

        async def limited() -> Message:
            nonlocal seen, complete
            if complete or deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise too_slow(self.timeout_s) from None  # FastAPI re-raises HTTPExceptions from body parsing
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise too_large(self.max_bytes)
                complete = not message.get("more_body", False)
            else:  # http.disconnect
                complete = True
            return message

        await self.app(scope, limited, send)
