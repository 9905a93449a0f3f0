"""Every error the service returns is one JSON object naming what was wrong, with the right status.

    {"status": 400, "error": "bad_request", "field": "k", "message": "k must be between 1 and 100, got 0"}

``field`` is the request's own name for the value (a query parameter, ``documents[3]._id``,
``body``), never an internal one, so a client can point at it.  Unexpected exceptions are
logged with their traceback on the server and answered with a plain 500: no stack trace
ever leaves the process.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

CODES = {
    400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
    408: "request_timeout", 409: "conflict", 413: "too_large", 431: "too_large", 499: "client_closed",
    500: "internal",
    503: "unavailable",
}


class ApiError(StarletteHTTPException):
    """A refusal with a status, the request field at fault (or None) and optional per-item details.

    A Starlette HTTPException so that FastAPI re-raises it untouched even from inside body
    parsing (the body-size limit raises it from ``receive``).
    """

    def __init__(self, status: int, message: str, field: str | None = None, details: Any = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status, detail=message, headers=headers)
        self.field = field
        self.details = details


def error_body(status: int, message: str, field: str | None = None, details: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"status": status, "error": CODES.get(status, "error"), "message": message}
    if field is not None:
        body["field"] = field
    if details is not None:
        body["details"] = details
    return body


def error_response(status: int, message: str, field: str | None = None, details: Any = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, field, details), status_code=status, headers=headers)


def field_name(loc: Sequence[Any]) -> str:
    """A pydantic error location as the client wrote it: ('body', 'documents', 3, 'text') -> documents[3].text."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


# pydantic names a failed union member after the location ("ids", 1, "str" and "ids", 1, "int"): in words
_UNION_MEMBERS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean"}


def _union_message(errors: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(field, message) when the first error is one member of a union that every member failed, else None."""
    loc = tuple(errors[0].get("loc", ()))
    if not loc or loc[-1] not in _UNION_MEMBERS:
        return None
    members = [e["loc"][-1] for e in errors if tuple(e.get("loc", ()))[:-1] == loc[:-1]
               and tuple(e.get("loc", ()))[-1:] and e["loc"][-1] in _UNION_MEMBERS]
    if len(members) < 2:
        return None
    field = field_name(loc[:-1])
    return field, f"{field} must be {' or '.join(_UNION_MEMBERS[m] for m in members)}"


def _validation_message(err: dict[str, Any]) -> tuple[str, str]:
    """(field, message) for the first pydantic error, worded for a person."""
    kind, loc = err.get("type", ""), err.get("loc", ())
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return "body", f"malformed JSON body: {detail}".rstrip(": ")
    field = field_name(loc)
    if kind == "extra_forbidden":
        return field, f"unknown field {field!r}"
    if kind == "missing":
        return field, f"{field} is required"
    if field == "body" and kind in ("model_attributes_type", "dict_type", "model_type"):
        return field, "the body must be a JSON object"
    return field, f"{field}: {err.get('msg', 'invalid value')}"


def _is_json(media_type: str) -> bool:
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def install_handlers(app: FastAPI) -> None:
    """Turn FastAPI's, Starlette's and our own exceptions into the one JSON error shape."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, ApiError):
            return error_response(exc.status_code, str(exc.detail), exc.field, exc.details, exc.headers)
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's words
            return error_response(400, "the body could not be read as JSON (it must be UTF-8 text)", "body")
        if exc.status_code == 404 and message == "Not Found":
            message = f"no such path: {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Report an unknown field first: it is most often the cause of a "missing" one (a misspelt name).
        errors = sorted(exc.errors(), key=lambda e: {"json_invalid": 0, "extra_forbidden": 1}.get(e.get("type"), 2))
        field, message = (_union_message(errors) or _validation_message(errors[0])) if errors else \
            ("body", "invalid request")
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if field == "body" and errors[0].get("type") != "json_invalid" and not _is_json(media):
            # FastAPI reads a body sent as another type as no JSON at all: "the body must be a JSON object"
            return error_response(400, "send the body as JSON, with 'Content-Type: application/json' (got "
                                       f"{repr(media) if media else 'no Content-Type'})", "Content-Type")
        return error_response(400, message, field)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal error (the server log has the details)")
