"""One context per request at the ingress: its id, its deadline, who is calling, and the
notes the observer records when it ends.

:class:`~serve_app.ingress.middleware.RequestObserver` opens it when a request arrives
(so the deadline counts from arrival), :class:`~serve_app.ingress.middleware.IngressGuard`
adds the caller once it has accepted the key, and everything below reads it: the
endpoints and the response cache take the deadline from it, the semantic cache the
caller, the error boundary and the cache write their notes into it. A context variable,
because Serve copies the app into each replica and the endpoint runs inside the
middleware's ``await``; tasks started from the request inherit it (shared work detaches
from it, ``core.shared_tasks``).

The deadline reaches the replica on the typed call (``call.deadline``, wall-clock time,
since the replica's clock is another process's); the request id reaches it through
Serve's own request context, which Serve carries across handle calls.
"""

from __future__ import annotations

import contextvars
import dataclasses
import time
import uuid
from typing import Any, Optional

from ray.serve.context import _get_serve_request_context

_CURRENT: contextvars.ContextVar[Optional["RequestContext"]] = contextvars.ContextVar(
    "serve_app_request", default=None)


@dataclasses.dataclass
class RequestContext:
    request_id: str
    deadline: float  # time.monotonic() by which every call made for the request must end
    caller: Optional[str] = None  # a hash of the request's API key (auth.key_identity); None with auth off
    # Notes for the observer: the model the request named, its cache outcome, its error code.
    model: Optional[str] = None
    cache: Optional[str] = None
    code: Optional[str] = None


def wall_clock(monotonic_deadline: float) -> float:
    """A time.monotonic() instant as time.time(): the replica's clock is the wall clock."""
    return time.time() + (monotonic_deadline - time.monotonic())


def serve_request_id() -> str:
    """Serve's id of the request being served (the one its logs and replicas see); a fresh
    one outside Serve, whose context then holds an empty id."""
    return _get_serve_request_context().request_id or uuid.uuid4().hex


def begin(timeout_s: float, request_id: Optional[str] = None) -> tuple[RequestContext, contextvars.Token]:
    """Open the context of a request arriving now; the token ends it."""
    context = RequestContext(request_id=request_id or serve_request_id(), deadline=time.monotonic() + timeout_s)
    return context, _CURRENT.set(context)


def end(token: contextvars.Token) -> None:
    _CURRENT.reset(token)


def current() -> Optional[RequestContext]:
    """The context of the request being served; None outside one."""
    return _CURRENT.get()


def request_id() -> str:
    """The id of the request being served, for log lines; "-" outside one."""
    context = _CURRENT.get()
    return context.request_id if context is not None else "-"


def note(**fields: Any) -> None:
    """Tell the observer something about the request being served (no-op outside one)."""
    context = _CURRENT.get()
    if context is not None:
        for name, value in fields.items():
            setattr(context, name, value)


def deadline(timeout_s: float) -> float:
    """The deadline of the request being served; outside one (a health check, a status
    read), that of a request arriving now with ``timeout_s``."""
    context = _CURRENT.get()
    return context.deadline if context is not None else time.monotonic() + timeout_s
