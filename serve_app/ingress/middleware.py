"""What wraps every request at the ingress: the guard (body size, API keys) and the
observer (per-model request metrics and the last minute for /v1/stats).

Both read one per-replica object, :class:`IngressState`, from the FastAPI app that
actually serves (``scope["app"].state.ingress``). Serve copies the app into each
replica (it pickles it by value), so module globals would not be shared between the
middleware and the Router; the Router puts its state on the copy it serves (see
``Router.__serve_build_asgi_app__``).

The observer opens each request's context (``request_context``: id, deadline, caller,
notes) when it arrives, the guard adds the caller, and endpoints tell the observer what
they learn through :func:`serve_app.ingress.request_context.note`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from serve_app.ingress import request_context
from serve_app.ingress.auth import ApiKeys, key_identity
from serve_app.config import RouterConfig
from serve_app.core.errors import PayloadTooLargeError, ServeAppError
from serve_app.core.recent import RecentEvents, percentile
from serve_app.ingress.http_errors import error_response
from serve_app.metrics import RequestMetrics

logger = logging.getLogger("ray.serve")

CACHE_HITS = ("hit", "semantic")
CACHE_LOOKUPS = ("hit", "semantic", "miss", "coalesced")
_PUBLIC_PATHS = ("/healthz",)
_ADMIN_PREFIXES = ("/v1/stats", "/v1/cache/")


class Traffic:
    """Requests per model: Prometheus metrics, and the last minute for /v1/stats."""

    def __init__(self) -> None:
        self._metrics: Optional[RequestMetrics] = None
        self.last_minute: dict[str, RecentEvents] = {}

    def observe(self, *, model: Optional[str], endpoint: str, status: int, latency_s: float,
                cache: Optional[str], code: Optional[str]) -> None:
        if self._metrics is None:  # created in the replica, where Serve's metric labels exist
            self._metrics = RequestMetrics()
        self._metrics.observe(model=model or "none", endpoint=endpoint, status=status, latency_s=latency_s, code=code)
        if model is not None:
            self.last_minute.setdefault(model, RecentEvents(60.0)).add(latency_s, status, cache)

    def summary(self, model: str) -> dict:
        events = self.last_minute[model].recent() if model in self.last_minute else []
        ok = [latency for _, latency, status, _ in events if status < 400]
        outcomes = [cache for *_, cache in events if cache in CACHE_LOOKUPS]
        return {
            "requests": len(events),
            "errors": sum(1 for _, _, status, _ in events if status >= 400),
            "p50_latency_s": percentile(ok, 50),
            "p95_latency_s": percentile(ok, 95),
            "cache_hit_rate": (sum(1 for c in outcomes if c in CACHE_HITS) / len(outcomes)) if outcomes else None,
        }


@dataclass
class IngressState:
    """One router replica's request-wide state, kept on its FastAPI app's ``state``."""

    keys: Optional[ApiKeys] = None  # None: auth is off
    max_body_bytes: Optional[int] = None
    # router.request_timeout_s: each request's deadline counts from its arrival.
    request_timeout_s: float = RouterConfig.model_fields["request_timeout_s"].default
    traffic: Traffic = field(default_factory=Traffic)


def ingress_state(app: Any) -> IngressState:
    """The app's IngressState; a default one (no auth, no limit) until the Router sets it."""
    state = getattr(app.state, "ingress", None)
    if state is None:
        state = app.state.ingress = IngressState()
    return state


class RequestObserver:
    """ASGI middleware: times every request and records it by model, endpoint and status.
    Pure ASGI rather than BaseHTTPMiddleware, which would add a task per request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = ingress_state(scope["app"])
        context, token = request_context.begin(state.request_timeout_s)
        status = 500
        started = time.perf_counter()

        async def send_and_note_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            request_context.end(token)
            # The route template, never the raw path: unknown paths must not become labels.
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            try:
                state.traffic.observe(
                    model=context.model, endpoint=endpoint, status=status,
                    latency_s=time.perf_counter() - started, cache=context.cache, code=context.code)
            except Exception:  # observing must never fail a request
                logger.debug("could not record request metrics", exc_info=True)


class IngressGuard:
    """ASGI middleware: what arrives is checked before anything else runs. A body over
    the size limit is refused unread (413); then the API key (401/403), so a caller
    without a key learns nothing from validation errors either."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = ingress_state(scope["app"])
        try:
            receive = self._limit_body(state.max_body_bytes, scope, receive)
            identity = self._authorize(state.keys, scope)
        except ServeAppError as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
            await error_response(exc, headers)(scope, receive, send)
            return
        # The semantic cache's per_key scope reads it. The observer, outside the guard,
        # opened the context; without it (the guard alone) there is no one to tell.
        request_context.note(caller=identity)
        await self.app(scope, receive, send)

    @staticmethod
    def _limit_body(limit: Optional[int], scope, receive):
        if limit is None:
            return receive
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        too_large = PayloadTooLargeError(f"request body is over the {limit}-byte limit")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        seen = 0

        async def counting_receive():  # chunked bodies carry no length: count as they come
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise too_large
            return message

        return counting_receive

    @staticmethod
    def _authorize(keys: Optional[ApiKeys], scope) -> Optional[str]:
        """Refuse a request without a valid key; return the key's identity (a hash), None with auth off."""
        if keys is None:
            return None
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if path in _PUBLIC_PATHS:
            return None
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        keys.authorize(header, admin=path.startswith(_ADMIN_PREFIXES))
        return key_identity(header)
