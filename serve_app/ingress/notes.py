"""Per-request notes: what endpoints and the error boundary learn about the request
being served (the model it named, its cache outcome, an OpenAI error code), read by
:class:`~serve_app.ingress.middleware.RequestObserver` when the request ends."""

from __future__ import annotations

import contextvars
from typing import Any, Optional

_REQUEST_NOTES: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("serve_app_request", default=None)


def note(**fields: Any) -> None:
    """Tell the observer something about the request being served (no-op outside one)."""
    notes = _REQUEST_NOTES.get()
    if notes is not None:
        notes.update(fields)


def begin() -> tuple[dict, contextvars.Token]:
    """Open the notes of a request: the dict the observer reads, and the token to end them."""
    notes: dict[str, Any] = {"model": None, "cache": None, "code": None}
    return notes, _REQUEST_NOTES.set(notes)


def end(token: contextvars.Token) -> None:
    _REQUEST_NOTES.reset(token)
