"""Work shared by many callers runs in a task of its own, detached from every caller.

A task created from a request's code copies that request's context variables, and Ray
Serve keeps a request's identity in one of them (``ray.serve.context``'s request
context). A handle call made inside such a task is recorded as that request's child, and
with ``cancel_on_parent_request_cancel`` (which direct ingress, Ray's high-throughput
mode, turns on) Serve cancels it when that one request is cancelled. A gathered group,
a coalesced model call or a batch of cache lookups serves many callers; started from
whichever caller came first, it would die with that caller alone.

:func:`start_shared` starts it in an empty context instead: no caller's request id,
deadline notes or identity reaches it, so no caller's cancellation reaches the others.
A caller that leaves stops waiting for its own share only.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Coroutine, TypeVar

from serve_app.core.errors import ServeAppError

T = TypeVar("T")


def start_shared(coro: Coroutine[Any, Any, T]) -> "asyncio.Task[T]":
    """``coro`` as a task on the running loop, in a fresh empty context (see the module)."""
    loop = asyncio.get_running_loop()
    # The task copies the context it is created in: here, the empty one (works on 3.10,
    # which lacks create_task(context=...)).
    return contextvars.Context().run(loop.create_task, coro)


class SharedCallCancelled(ServeAppError):
    """The shared task a caller waited on was cancelled (its process shutting down, say),
    not the caller: an error the caller handles (the router retries a model call, the
    cache degrades to a miss, a client gets a 503 to retry), never a cancellation that
    would look to asyncio like the caller's own."""

    status_code = 503

    def __init__(self, message: str = "a call shared with other requests was cancelled; retry", *,
                 param: str | None = None, code: str | None = "shared_call_cancelled"):
        super().__init__(message, param=param, code=code)
