"""Who is calling: an identity of the request's API key, for the semantic cache's scope.

:class:`~serve_app.ingress.middleware.IngressGuard` sets it once it has accepted the key;
:class:`~serve_app.ingress.response_cache.ResponseCache` reads it to keep one caller's
semantic entries from answering another (``cache.scope: per_key``). Only a hash of the
key travels: the raw key never reaches a namespace, a log line or the CacheServer. A
context variable, like the request notes, because Serve copies the app into each replica
and the endpoint runs inside the guard's ``await``.
"""

from __future__ import annotations

import contextvars
import hashlib
from typing import Optional

_CALLER: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("serve_app_caller", default=None)


def key_identity(authorization: Optional[str]) -> Optional[str]:
    """A stable hash of the bearer key in an ``Authorization`` header; None without one."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    # Domain-separated so that this hash is good for nothing but telling callers apart.
    return hashlib.sha256(b"serve_app caller\0" + token.encode()).hexdigest()[:32]


def begin(identity: Optional[str]) -> contextvars.Token:
    return _CALLER.set(identity)


def end(token: contextvars.Token) -> None:
    _CALLER.reset(token)


def current() -> Optional[str]:
    """The identity of the API key of the request being served; None with auth off."""
    return _CALLER.get()
