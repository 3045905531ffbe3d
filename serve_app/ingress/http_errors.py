"""The one error boundary: every error, wherever raised (a body that fails validation,
Starlette's own 404/405, a replica's ServeAppError behind Ray's wrappers, a bug),
becomes an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` with
its HTTP status here, and nowhere else.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.core.errors import HTTPStatusError, InvalidRequestError, ServeAppError
from serve_app.ingress.request_context import note, request_id

logger = logging.getLogger("ray.serve")

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers (RayTaskError keeps it as .cause)."""
    for _ in range(5):  # bounded: a cause chain is never legitimately deep
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def error_response(exc: ServeAppError, headers: Optional[dict] = None) -> JSONResponse:
    note(code=exc.code or exc.error_type)
    return JSONResponse(status_code=exc.status_code, content=exc.to_body(), headers={**exc.headers(), **(headers or {})})


def stream_error(exc: BaseException, model: str) -> ServeAppError:
    """What a stream whose headers are gone reports as its last event."""
    if isinstance(exc, ServeAppError):
        error = exc
    else:
        logger.error("model %s failed mid-stream (request %s)", model, request_id(), exc_info=exc)
        error = ServeAppError("the model failed mid-stream; see the server log", code="internal_error")
    note(code=error.code or error.error_type)
    return error


def _field_path(loc) -> str:
    """'messages.0.role' from pydantic's loc, without 'body' and union-branch tags."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif part != "body" and part.isidentifier() and part not in _TYPE_TAGS:
            parts.append(part)
    return ".".join(parts)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": "value_error"}]
    if errors[0].get("type") == "json_invalid":
        return error_response(InvalidRequestError("request body is not valid JSON", code="invalid_json"))
    param = _field_path(errors[0].get("loc", ()))
    # A union field (str | list[str]) reports one error per branch: say them together.
    same_field = [e for e in errors if _field_path(e.get("loc", ())) == param]
    reasons = " or ".join(dict.fromkeys(e["msg"] for e in same_field))
    message = f"{param}: {reasons}" if param else reasons
    others = len(errors) - len(same_field)
    if others:
        message += f" (and {others} more problem{'s' if others > 1 else ''})"
    return error_response(InvalidRequestError(message, param=param or None, code="invalid_value"))


async def _on_validation_error(request: Request, exc: RequestValidationError):
    return validation_error_response(exc)


async def _on_serve_app_error(request: Request, exc: ServeAppError):
    return error_response(exc)


async def _on_http_error(request: Request, exc: StarletteHTTPException):
    # Starlette's own answers (unknown path, wrong method, unreadable body) in the same
    # OpenAI error shape as ours. A body cut off by IngressGuard's limit arrives here too.
    if isinstance(exc.__cause__, ServeAppError):
        return error_response(exc.__cause__)
    codes = {404: "not_found", 405: "method_not_allowed"}
    error = HTTPStatusError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code, "http_error"))
    return error_response(error, getattr(exc, "headers", None))


async def _on_unexpected_error(request: Request, exc: Exception):
    original = unwrap(exc)
    if isinstance(original, ServeAppError):
        return error_response(original)
    logger.exception("unhandled error on %s %s (request %s)", request.method, request.url.path, request_id())
    return error_response(ServeAppError("internal server error; see the server log", code="internal_error"))


def install(api: FastAPI) -> None:
    """Route every error of ``api`` through this boundary."""
    api.add_exception_handler(RequestValidationError, _on_validation_error)
    api.add_exception_handler(ServeAppError, _on_serve_app_error)
    api.add_exception_handler(StarletteHTTPException, _on_http_error)
    api.add_exception_handler(Exception, _on_unexpected_error)
