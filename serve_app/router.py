"""The HTTP ingress: an OpenAI-compatible API in front of the model deployments.

It validates requests, routes each to its model's deployment and shapes the answer as
the OpenAI API does, so the official ``openai`` client works with ``base_url`` pointed
here. It is the single error boundary: every error, wherever raised, becomes an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` here, and nowhere
else.
"""

# No `from __future__ import annotations`: Serve's ingress re-signs these methods and
# FastAPI then cannot resolve string annotations, turning bodies into query params.
import asyncio
import base64
import binascii
import contextvars
import importlib
import json
import logging
import time
import uuid
from collections import Counter
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Optional, Union

import cachetools
import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig, ModelConfig, model_deployment_name
from serve_app.core.auth import ApiKeys
from serve_app.core.cache import (
    SingleFlight,
    cache_key,
    decode_value,
    encode_value,
    is_cacheable,
    semantic_namespace,
)
from serve_app.core.errors import (
    DeadlineExceededError,
    HTTPStatusError,
    InvalidRequestError,
    ModelNotFoundError,
    ModelUnavailableError,
    OverloadedError,
    PayloadTooLargeError,
    ServeAppError,
)
from serve_app.core.recent import RecentEvents, percentile
from serve_app.metrics import CacheMetrics, RequestMetrics

logger = logging.getLogger("ray.serve")

# ---- request bodies (OpenAI's field names and ranges) ----------------------------


class _Body(BaseModel):
    # Unknown OpenAI fields are ignored as OpenAI's own server ignores them, but the
    # ones that would change the answer and that we do not implement are refused below.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1)
    user: Optional[str] = None


class EmbeddingBody(_Body):
    input: Union[str, list[str]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingBody(_Body):
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional["StreamOptions"] = None
    logprobs: Optional[Union[bool, int]] = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionBody(_SamplingBody):
    prompt: Union[str, list[str]]
    echo: bool = False


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[_TextPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionBody(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1)


class ClassifyBody(_Body):
    input: Optional[Union[str, list[str]]] = None
    image: Optional[Union[str, list[str]]] = Field(
        None, description="Base64-encoded image bytes (optionally a data: URL); never fetched from a URL."
    )
    top_k: int = Field(1, ge=1)

    @field_validator("image")
    @classmethod
    def _no_urls(cls, value):
        images = [value] if isinstance(value, str) else (value or [])
        if any(item.startswith(("http://", "https://")) for item in images):
            raise ValueError("images must be sent as base64, not fetched from a URL")
        return value


# ---- helpers ----------------------------------------------------------------------


def _as_list(value: Union[str, list[str]], field: str, limit: int) -> list[str]:
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise InvalidRequestError(f"'{field}' must not be empty", param=field)
    if len(items) > limit:
        raise InvalidRequestError(
            f"'{field}' has {len(items)} items; this model accepts at most {limit} per request", param=field
        )
    return items


def _decode_image(data: str, param: str) -> bytes:
    if data.startswith("data:"):
        _, _, data = data.partition(",")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image is not valid base64", param=param) from None
    if not raw:
        raise InvalidRequestError("image is empty", param=param)
    return raw


def _usage(prompt_tokens: int, completion_tokens: Optional[int] = None) -> dict:
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + (completion_tokens or 0)}
    if completion_tokens is not None:
        usage["completion_tokens"] = completion_tokens
    return usage


def _unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers (RayTaskError keeps it as .cause)."""
    for _ in range(5):  # bounded: a cause chain is never legitimately deep
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def _clip(value: Any, limit: int = 500) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _sse(payload: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def error_response(exc: ServeAppError, headers: Optional[dict] = None) -> JSONResponse:
    _note(code=exc.code or exc.error_type)
    return JSONResponse(status_code=exc.status_code, content=exc.to_body(), headers={**exc.headers(), **(headers or {})})


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc) -> str:
    """'messages.0.role' from pydantic's loc, without 'body' and union-branch tags."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif part != "body" and part.isidentifier() and part not in _TYPE_TAGS:
            parts.append(part)
    return ".".join(parts)


def _validation_error_response(exc: RequestValidationError) -> JSONResponse:
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


# ---- per-request observation ----------------------------------------------------------

# Filled while a request runs: the model it named (once known to be served), its cache
# outcome and, for errors, the OpenAI error code. Read by the middleware afterwards.
_REQUEST_NOTES: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("serve_app_request", default=None)
_CACHE_HITS = ("hit", "semantic")
_CACHE_LOOKUPS = ("hit", "semantic", "miss", "coalesced")


def _note(**fields: Any) -> None:
    notes = _REQUEST_NOTES.get()
    if notes is not None:
        notes.update(fields)


class Traffic:
    """Requests per model: Prometheus metrics, and the last minute for /v1/stats. One per
    router replica, kept on the FastAPI app's state, which is what both the middleware
    and the endpoints see (Serve copies the app into each replica, so a module global
    would not be shared with it)."""

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
        outcomes = [cache for *_, cache in events if cache in _CACHE_LOOKUPS]
        return {
            "requests": len(events),
            "errors": sum(1 for _, _, status, _ in events if status >= 400),
            "p50_latency_s": percentile(ok, 50),
            "p95_latency_s": percentile(ok, 95),
            "cache_hit_rate": (sum(1 for c in outcomes if c in _CACHE_HITS) / len(outcomes)) if outcomes else None,
        }


def _traffic(app) -> Traffic:
    traffic = getattr(app.state, "traffic", None)
    if traffic is None:
        traffic = app.state.traffic = Traffic()
    return traffic


class RequestObserver:
    """ASGI middleware: times every request and records it by model, endpoint and status.
    Pure ASGI rather than BaseHTTPMiddleware, which would add a task per request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        notes: dict[str, Any] = {"model": None, "cache": None, "code": None}
        token = _REQUEST_NOTES.set(notes)
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
            _REQUEST_NOTES.reset(token)
            # The route template, never the raw path: unknown paths must not become labels.
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            try:
                _traffic(scope["app"]).observe(model=notes["model"], endpoint=endpoint, status=status,
                                latency_s=time.perf_counter() - started, cache=notes["cache"], code=notes["code"])
            except Exception:  # observing must never fail a request
                logger.debug("could not record request metrics", exc_info=True)


class _GuardState:
    keys: Optional[ApiKeys] = None  # None: auth is off
    max_body_bytes: Optional[int] = None


# Set by Router.__init__ through the imported module (see there), read by IngressGuard.
GUARD = _GuardState()
_PUBLIC_PATHS = ("/healthz",)
_ADMIN_PREFIXES = ("/v1/stats", "/v1/cache/")


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
        try:
            receive = self._limit_body(scope, receive)
            self._authorize(scope)
        except ServeAppError as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
            await error_response(exc, headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _limit_body(scope, receive):
        limit = GUARD.max_body_bytes
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
    def _authorize(scope) -> None:
        keys = GUARD.keys
        if keys is None:
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if path in _PUBLIC_PATHS:
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        keys.authorize(header, admin=path.startswith(_ADMIN_PREFIXES))


# ---- the ingress ----------------------------------------------------------------------

api = FastAPI(title="serve_app", description="Hugging Face models on Ray Serve, OpenAI-compatible.")
# The last added runs first: the observer records every request, refused ones included.
api.add_middleware(IngressGuard)
api.add_middleware(RequestObserver)


@api.exception_handler(RequestValidationError)
async def _on_validation_error(request: Request, exc: RequestValidationError):
    return _validation_error_response(exc)


@api.exception_handler(ServeAppError)
async def _on_serve_app_error(request: Request, exc: ServeAppError):
    return error_response(exc)


@api.exception_handler(StarletteHTTPException)
async def _on_http_error(request: Request, exc: StarletteHTTPException):
    # Starlette's own answers (unknown path, wrong method, unreadable body) in the same
    # OpenAI error shape as ours. A body cut off by IngressGuard's limit arrives here too.
    if isinstance(exc.__cause__, ServeAppError):
        return error_response(exc.__cause__)
    codes = {404: "not_found", 405: "method_not_allowed"}
    error = HTTPStatusError(exc.status_code, str(exc.detail), code=codes.get(exc.status_code, "http_error"))
    return error_response(error, getattr(exc, "headers", None))


@api.exception_handler(Exception)
async def _on_unexpected_error(request: Request, exc: Exception):
    original = _unwrap(exc)
    if isinstance(original, ServeAppError):
        return error_response(original)
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(ServeAppError("internal server error; see the server log", code="internal_error"))


# How stale the controller's view of the model deployments may be in /healthz and stats.
_STATES_MAX_AGE_S = 5.0
# ModelServer methods that queue rows for the model and take the request's deadline.
_INFERENCE_METHODS = frozenset({"embed", "classify_texts", "classify_images", "generate"})


@serve.deployment
@serve.ingress(api)
class Router:
    def __init__(
        self,
        app_config: dict,
        model_handles: dict[str, DeploymentHandle],
        cache_handle: Optional[DeploymentHandle] = None,
    ):
        self.config = AppConfig.model_validate(app_config)
        self.models: dict[str, ModelConfig] = {m.name: m for m in self.config.models}
        auth = self.config.auth
        keys = None
        if auth.enabled:  # no keys found fails the replica's start, naming where it looked
            keys = ApiKeys.load(user_env=auth.api_keys_env, user_file=auth.api_keys_file,
                                admin_env=auth.admin_keys_env, admin_file=auth.admin_keys_file)
        # Serve pickles this class's methods by value, each with a copy of the module
        # globals it uses; the middleware runs against the real module, so reach it there.
        guard = importlib.import_module(__name__).GUARD
        guard.keys, guard.max_body_bytes = keys, self.config.router.max_body_bytes
        logger.info("API keys: %s", "required" if keys else "off")
        self.handles = model_handles
        for handle in model_handles.values():
            # Start each handle's updates from the controller now. A handle started by
            # its first request only learns later that its model failed to load, and that
            # request waits for replicas that never come; started early, it gets a 503.
            if not handle.is_initialized:
                handle._init()
        self.cache = cache_handle if self.config.cache.enabled else None
        self.created = int(time.time())
        # Identical requests in flight at once share one model call (per router replica).
        self.flights = SingleFlight()
        # The hot tier: encoded answers this replica just computed or fetched, for
        # router_hot_ttl_s. Repeats skip the CacheServer round trip, and a request whose
        # lookup raced a write-back is served here instead of calling the model again.
        self._hot = cachetools.TTLCache(
            maxsize=max(1, self.config.cache.router_hot_bytes), ttl=self.config.cache.router_hot_ttl_s, getsizeof=len
        )
        self._background: set[asyncio.Task] = set()
        self._revisions: dict[str, tuple[str, float]] = {}
        self.cache_outcomes: Counter = Counter()
        self.replica_retries: Counter = Counter()  # per model: calls retried after a replica died
        self.cache_metrics = CacheMetrics()
        self._cache_errors = 0
        self._cache_error_logged_at = 0.0
        self._states: tuple[dict[str, dict], float] = ({}, float("-inf"))

    def _model(self, name: str, task: str, endpoint: str) -> ModelConfig:
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models))
            raise ModelNotFoundError(f"model {name!r} does not exist; this service serves: {known}")
        _note(model=name)
        if model.task != task:
            raise InvalidRequestError(
                f"model {name!r} is a {model.task} model; {endpoint} needs a {task} model",
                param="model",
                code="wrong_task",
            )
        return model

    async def _call(self, model: ModelConfig, method: str, *args, **kwargs) -> Any:
        """One model call with the request's deadline. A full queue is a 503 at once; a
        replica that dies under the call is retried on another (inference has no side
        effects), a bounded number of times with backoff, while Ray restarts it."""
        router = self.config.router
        deadline = time.monotonic() + router.request_timeout_s
        if method in _INFERENCE_METHODS:  # rows still queued at the deadline are dropped, not computed
            kwargs["deadline"] = time.time() + router.request_timeout_s
        for attempt in range(router.replica_retries + 1):
            response = getattr(self.handles[model.name], method).remote(*args, **kwargs)
            try:
                return await asyncio.wait_for(response, timeout=max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                response.cancel()
                raise DeadlineExceededError(
                    f"model {model.name!r} did not answer within {router.request_timeout_s}s", code="timeout"
                ) from None
            except (RayActorError, ActorUnavailableError) as exc:
                if attempt == router.replica_retries:
                    raise
                await self._before_retry(model, exc, attempt)
            except Exception as exc:
                raise self._model_error(model, exc) from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _before_retry(self, model: ModelConfig, exc: BaseException, attempt: int) -> None:
        self.replica_retries[model.name] += 1
        logger.warning("model %s: replica lost mid-request (%s); retry %d of %d",
                       model.name, type(exc).__name__, attempt + 1, self.config.router.replica_retries)
        await asyncio.sleep(0.1 * 2**attempt)

    def _model_error(self, model: ModelConfig, exc: Exception) -> Exception:
        """What a failed model call means to the client."""
        original = _unwrap(exc)
        if isinstance(original, ServeAppError):
            return original
        if isinstance(original, DeploymentUnavailableError):
            return ModelUnavailableError(
                f"model {model.name!r} is unavailable: its replicas failed to start (the model replica's "
                "log says why, for example a model that failed to load); the other models still serve"
            )
        if isinstance(original, BackPressureError):
            retry_after_s = self.config.router.retry_after_s
            return OverloadedError(
                f"model {model.name!r} is at capacity (its queue is full); retry after {retry_after_s}s",
                retry_after_s=retry_after_s,
            )
        return exc

    async def _stream(self, model: ModelConfig, **kwargs) -> AsyncIterator[dict]:
        """The model's streamed generation events, under the request's deadline.

        A replica lost before the first event is retried like a unary call; after it,
        the client already holds part of the answer, so the stream fails instead.
        Leaving early (client gone, deadline) cancels the model's stream, which frees
        its rows in the batch.
        """
        router = self.config.router
        deadline = time.monotonic() + router.request_timeout_s
        kwargs["deadline"] = time.time() + router.request_timeout_s
        handle = self.handles[model.name].options(stream=True)
        for attempt in range(router.replica_retries + 1):
            events = handle.generate_stream.remote(**kwargs)
            started = finished = False
            try:
                while True:
                    try:
                        event = await asyncio.wait_for(events.__anext__(), max(0.0, deadline - time.monotonic()))
                    except StopAsyncIteration:
                        finished = True
                        return
                    started = True
                    yield event
            except asyncio.TimeoutError:
                raise DeadlineExceededError(
                    f"model {model.name!r} did not finish within {router.request_timeout_s}s", code="timeout"
                ) from None
            except (RayActorError, ActorUnavailableError) as exc:
                if started or attempt == router.replica_retries:
                    raise
                await self._before_retry(model, exc, attempt)
            except Exception as exc:
                raise self._model_error(model, exc) from None
            finally:
                if not finished:
                    events.cancel()

    def _log_payload(self, model: ModelConfig, inputs: Any, outputs: Any = None) -> None:
        """Prompts and answers reach the log only when router.log_payloads asks for it."""
        if self.config.router.log_payloads:
            logger.info("payload model=%s input=%s output=%s", model.name, _clip(inputs), _clip(outputs))

    # ---- caching ----------------------------------------------------------------------

    async def _cache_call(self, method: str, *args, timeout_s: Optional[float] = None) -> Any:
        """A CacheServer call that can only miss: errors and slowness return None."""
        if self.cache is None:
            return None
        try:
            call = getattr(self.cache, method).remote(*args)
            return await asyncio.wait_for(call, timeout=timeout_s or self.config.cache.call_timeout_s)
        except Exception as exc:  # degrade, never fail: the model still answers
            self._cache_errors += 1
            self.cache_metrics.errors.inc()
            now = time.monotonic()
            if now - self._cache_error_logged_at > 30:
                logger.warning("cache %s failed (%d errors so far), serving without it: %r", method, self._cache_errors, exc)
                self._cache_error_logged_at = now
            return None

    async def _revision(self, model: ModelConfig) -> str:
        """The model's revision for cache keys, re-read every revision_refresh_s, so a
        newly loaded revision makes the old entries unreachable."""
        if model.cache.revision:
            return model.cache.revision
        known = self._revisions.get(model.name)
        now = time.monotonic()
        if known and now - known[1] < self.config.cache.revision_refresh_s:
            return known[0]
        try:
            revision = (await self._call(model, "info"))["revision"]
        except Exception:
            if known:  # keep serving with the last known revision
                return known[0]
            raise
        self._revisions[model.name] = (revision, now)
        return revision

    async def _embed_for_cache(self, model_name: str, text: str) -> Optional[list[float]]:
        try:
            out = await self._call(self.models[model_name], "embed", [text])
            return out["embeddings"][0]
        except Exception as exc:  # the semantic cache is best effort
            logger.warning("semantic cache: embedding with %s failed: %r", model_name, exc)
            return None

    def _remember(self, key: str, encoded: bytes) -> None:
        try:
            self._hot[key] = encoded
        except ValueError:  # larger than the whole hot tier: the store still has it
            pass

    def _hot_get(self, key: str) -> Any:
        encoded = self._hot.get(key)
        return None if encoded is None else decode_value(encoded)

    def _write_back(self, key: str, output: Any, ttl_s: Optional[float], namespace: Optional[str], vector) -> None:
        """Store a fresh answer without making the client wait for the write."""
        encoded = encode_value(output)
        self._remember(key, encoded)

        async def write() -> None:
            await self._cache_call("set", key, encoded, ttl_s)
            if namespace is not None and vector is not None:
                await self._cache_call("semantic_add", namespace, vector, key)

        task = asyncio.create_task(write())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _answer(
        self,
        model: ModelConfig,
        payload: Any,
        params: dict,
        compute: Callable[[], Awaitable[Any]],
        response: Response,
        *,
        semantic_text: Optional[str] = None,
    ) -> Any:
        """The model's output for a request: from the cache when possible, else from one
        (possibly shared) model call. Sets the ``x-cache`` header."""
        outcome, output = await self._lookup_or_compute(model, payload, params, compute, semantic_text)
        self.cache_outcomes[(model.name, outcome)] += 1
        self.cache_metrics.outcome(model.name, outcome)
        _note(cache=outcome)
        response.headers["x-cache"] = "miss" if outcome in ("bypass", "coalesced") else outcome
        return output

    async def _lookup_or_compute(self, model, payload, params, compute, semantic_text) -> tuple[str, Any]:
        if self.cache is None or not model.cache.enabled or not is_cacheable(model.task, params):
            return "bypass", await compute()
        revision = await self._revision(model)
        key = cache_key(model=model.name, revision=revision, task=model.task, payload=payload, params=params)
        hot = self._hot_get(key)
        if hot is not None:
            return "hit", hot
        stored = await self._cache_call("get", key)
        if stored is not None:
            self._remember(key, stored)
            return "hit", decode_value(stored)
        hot = self._hot_get(key)  # answered while our lookup was on its way
        if hot is not None:
            return "hit", hot
        namespace = vector = None
        semantic = model.cache.semantic
        if semantic is not None and semantic_text:
            namespace = semantic_namespace(model=model.name, revision=revision, task=model.task, params=params)
            vector = await self._embed_for_cache(semantic.embedding_model, semantic_text)
            if vector is not None:
                found = await self._cache_call("semantic_get", namespace, vector, semantic.threshold)
                if found is not None:
                    return "semantic", decode_value(found[2])

        async def compute_and_store() -> Any:
            output = await compute()
            # Inside the flight, so that from the moment the flight ends the answer is
            # already in the hot tier: no gap in which a late duplicate calls the model.
            self._write_back(key, output, model.cache.ttl_s, namespace, vector)
            return output

        output, shared = await self.flights.run(key, compute_and_store)
        return ("coalesced" if shared else "miss"), output

    # ---- endpoints ---------------------------------------------------------------

    @api.get("/healthz")
    async def healthz(self) -> dict:
        """200 while this router serves. A model whose deployment cannot serve (it
        failed to load, or has no healthy replica) makes the status "degraded" and is
        listed with Serve's reason; the other models keep serving, so a load balancer
        should not pull this ingress for it."""
        unavailable = {
            name: state for name, state in (await self._deployment_states()).items()
            if state["status"] in ("DEPLOY_FAILED", "UNHEALTHY") and not state["running"]
        }
        body: dict[str, Any] = {"status": "degraded" if unavailable else "ok", "models": sorted(self.models)}
        if unavailable:
            body["unavailable"] = unavailable
        return body

    @api.get("/v1/models")
    async def list_models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {"id": m.name, "object": "model", "created": self.created, "owned_by": "serve_app", "task": m.task}
                for m in self.config.models
            ],
        }

    @api.get("/v1/stats")
    async def stats(self, request: Request) -> dict:
        """Per model: the last minute at a glance (requests, latency, batching, cache,
        replicas), then the cumulative batching counters of the replica that answered."""
        names = list(self.models)
        # A model that cannot answer (it failed to load) gets its error, not a failed page.
        snapshots, replicas = await asyncio.gather(
            asyncio.gather(*(self._call(self.models[n], "get_stats") for n in names), return_exceptions=True),
            self._running_replicas(),
        )
        outcomes: dict[str, dict[str, int]] = {}
        for (name, outcome), count in self.cache_outcomes.items():
            outcomes.setdefault(name, {})[outcome] = count
        cache = await self._cache_call("stats", timeout_s=5) if self.cache is not None else None
        models = {}
        for name, snapshot in zip(names, snapshots):
            if isinstance(snapshot, BaseException):
                error = snapshot if isinstance(snapshot, ServeAppError) else None
                snapshot = {"error": error.message if error else f"stats unavailable: {type(snapshot).__name__}"}
            batching = snapshot.pop("last_minute", None) or {}
            models[name] = {
                "last_minute": {
                    **_traffic(request.app).summary(name),
                    "mean_batch_rows": batching.get("mean_batch_rows"),
                    "padding_efficiency": batching.get("padding_efficiency"),
                    "p95_queue_wait_s": batching.get("p95_queue_wait_s"),
                    "replicas": replicas.get(name),
                },
                **snapshot,
            }
        return {
            "scope": "last_minute: this router replica's requests and one model replica's batches",
            "models": models,
            "replica_retries": dict(self.replica_retries),
            "cache": {**(cache or {}), "router_outcomes": outcomes, "router_cache_errors": self._cache_errors,
                      "coalesced": self.flights.coalesced},
        }

    async def _running_replicas(self) -> dict[str, Optional[int]]:
        """RUNNING replicas per model deployment, from the Serve controller."""
        return {name: state["running"] for name, state in (await self._deployment_states()).items()}

    async def _deployment_states(self) -> dict[str, dict]:
        """Per model: its deployment's status, RUNNING replicas and Serve's message,
        read from the controller at most every few seconds (health checks call this)."""
        now = time.monotonic()
        cached, read_at = self._states
        if now - read_at < _STATES_MAX_AGE_S:
            return cached
        try:
            app = serve.get_replica_context().app_name
            status = await asyncio.wait_for(asyncio.to_thread(serve.status), timeout=5)
            deployments = status.applications[app].deployments
        except Exception:  # health and stats must answer even when the controller is slow
            logger.debug("could not read deployment states", exc_info=True)
            return cached
        states = {}
        for name in self.models:
            deployment = deployments.get(model_deployment_name(name))
            if deployment is not None:
                states[name] = {
                    "status": str(getattr(deployment.status, "value", deployment.status)),
                    "running": deployment.replica_states.get("RUNNING", 0),
                    "message": deployment.message,
                }
        self._states = (states, now)
        return states

    @api.delete("/v1/cache/{model_name}")
    async def drop_cache(self, model_name: str) -> dict:
        """Drop every cached answer of one model (all revisions)."""
        if model_name not in self.models:
            raise ModelNotFoundError(f"model {model_name!r} does not exist", param="model_name")
        if self.cache is None:
            raise InvalidRequestError("the cache is disabled in this deployment", code="cache_disabled")
        # Model names cannot hold ':' (config), so this prefix is exactly the model's keys.
        for key in [k for k in list(self._hot) if k.startswith(f"{model_name}:")]:
            self._hot.pop(key, None)
        dropped = await self._cache_call("drop_model", model_name, timeout_s=60)
        if dropped is None:
            raise ServeAppError("the cache store did not answer; try again", code="cache_unavailable")
        return dropped

    @api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingBody, response: Response) -> dict:
        model = self._model(body.model, "embedding", "/v1/embeddings")
        if body.dimensions is not None:
            raise InvalidRequestError("'dimensions' is not supported; omit it for the model's full size", param="dimensions")
        texts = _as_list(body.input, "input", model.max_inputs_per_request)
        out = await self._answer(model, texts, {}, lambda: self._call(model, "embed", texts), response)
        self._log_payload(model, texts)
        data = []
        for index, vector in enumerate(out["embeddings"]):
            if body.encoding_format == "base64":
                # OpenAI's base64 format: little-endian float32 bytes (the openai client's default).
                encoded: Any = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
            else:
                encoded = vector
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        return {"object": "list", "data": data, "model": model.name, "usage": _usage(out["prompt_tokens"])}

    def _sampling_args(self, body: _SamplingBody, model: ModelConfig, max_tokens: Optional[int]) -> dict:
        limits = model.generation
        if body.stream_options is not None and not body.stream:
            raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")
        if body.n != 1:
            raise InvalidRequestError("only n=1 is supported", param="n")
        if body.logprobs:
            raise InvalidRequestError("logprobs are not supported", param="logprobs")
        max_tokens = limits.default_max_tokens if max_tokens is None else max_tokens
        if max_tokens > limits.max_tokens_limit:
            raise InvalidRequestError(
                f"max_tokens is {max_tokens}; this model allows at most {limits.max_tokens_limit}", param="max_tokens"
            )
        stop = body.stop_list()
        if len(stop) > limits.max_stop_sequences:
            raise InvalidRequestError(
                f"{len(stop)} stop sequences given; at most {limits.max_stop_sequences} allowed", param="stop"
            )
        if any(not s for s in stop):
            raise InvalidRequestError("stop sequences must not be empty strings", param="stop")
        return {
            "max_tokens": max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stop": stop,
            "seed": body.seed,
        }

    async def _event_stream(self, model: ModelConfig, body: _SamplingBody, chunk: Callable[..., dict],
                            **call) -> StreamingResponse:
        """Server-sent events in OpenAI's chunk format for a streamed generation.

        The first model event is awaited here, so anything that fails before the model
        produced a token (a bad prompt, a full queue, an unavailable model) is still a
        plain HTTP error; a failure after it can only be reported in the stream.
        ``chunk(index=, text=, finish_reason=, usage=)`` builds one chunk's body.
        """
        events = self._stream(model, **call)
        first = await events.__anext__()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def sse() -> AsyncIterator[bytes]:
            prompt_tokens = completion_tokens = 0
            texts: dict[int, list[str]] = {}
            try:
                for opening in chunk(opening=True):
                    yield _sse(opening)
                event: Optional[dict] = first
                while event is not None:
                    if "text" in event:
                        texts.setdefault(event["index"], []).append(event["text"])
                        yield _sse(chunk(index=event["index"], text=event["text"]))
                    else:  # a row finished
                        prompt_tokens += event["prompt_tokens"]
                        completion_tokens += event["completion_tokens"]
                        yield _sse(chunk(index=event["index"], finish_reason=event["finish_reason"]))
                    event = await anext(events, None)
                if include_usage:
                    yield _sse({**chunk(usage=True), "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
                yield b"data: [DONE]\n\n"
                self._log_payload(model, call.get("prompts") or call.get("messages"),
                                  ["".join(texts.get(i, ())) for i in sorted(texts)])
            except Exception as exc:  # headers are gone: the error travels as the last event
                error = exc if isinstance(exc, ServeAppError) else ServeAppError(
                    "the model failed mid-stream; see the server log", code="internal_error")
                if not isinstance(exc, ServeAppError):
                    logger.exception("model %s failed mid-stream", model.name)
                _note(code=error.code or error.error_type)
                yield _sse(error.to_body())
            finally:
                await events.aclose()

        # Streams skip the response cache: x-cache says "miss" as for any computed answer.
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "x-cache": "miss"})

    @api.post("/v1/completions")
    async def completions(self, body: CompletionBody, response: Response):
        model = self._model(body.model, "text-generation", "/v1/completions")
        if body.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        prompts = _as_list(body.prompt, "prompt", model.max_inputs_per_request)
        sampling = self._sampling_args(body, model, body.max_tokens)
        if body.stream:
            head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": model.name}

            def chunk(*, opening=False, usage=False, index=0, text="", finish_reason=None):
                if opening:
                    return []  # completions chunks carry no role announcement
                if usage:
                    return dict(head)
                return {**head, "choices": [{"index": index, "text": text, "logprobs": None,
                                             "finish_reason": finish_reason}]}

            return await self._event_stream(model, body, chunk, prompts=prompts, **sampling)
        results = await self._answer(
            model,
            prompts,
            sampling,
            lambda: self._call(model, "generate", prompts=prompts, **sampling),
            response,
            semantic_text=prompts[0] if len(prompts) == 1 else None,
        )
        self._log_payload(model, prompts, [r["text"] for r in results])
        choices = [
            {"index": i, "text": r["text"], "logprobs": None, "finish_reason": r["finish_reason"]}
            for i, r in enumerate(results)
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model.name,
            "choices": choices,
            "usage": _usage(sum(r["prompt_tokens"] for r in results), sum(r["completion_tokens"] for r in results)),
        }

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionBody, response: Response):
        model = self._model(body.model, "text-generation", "/v1/chat/completions")
        if not body.messages:
            raise InvalidRequestError("'messages' must not be empty", param="messages")
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
        ]
        sampling = self._sampling_args(body, model, body.max_completion_tokens or body.max_tokens)
        if body.stream:
            head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": model.name}

            def chunk(*, opening=False, usage=False, index=0, text=None, finish_reason=None):
                if opening:  # OpenAI's first chunk announces the role
                    return [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}]
                if usage:
                    return dict(head)
                delta = {} if text is None else {"content": text}
                return {**head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}]}

            return await self._event_stream(model, body, chunk, messages=messages, **sampling)
        (result,) = await self._answer(
            model,
            messages,
            sampling,
            lambda: self._call(model, "generate", messages=messages, **sampling),
            response,
            semantic_text="\n".join(f"{m['role']}: {m['content']}" for m in messages),
        )
        self._log_payload(model, messages, result["text"])
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model.name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result["text"]},
                    "logprobs": None,
                    "finish_reason": result["finish_reason"],
                }
            ],
            "usage": _usage(result["prompt_tokens"], result["completion_tokens"]),
        }

    @api.post("/v1/classify")
    async def classify(self, body: ClassifyBody, response: Response) -> dict:
        if (body.input is None) == (body.image is None):
            raise InvalidRequestError("send exactly one of 'input' (text) or 'image' (base64)", param="input")
        if body.input is not None:
            model = self._model(body.model, "text-classification", "/v1/classify with 'input'")
            texts = _as_list(body.input, "input", model.max_inputs_per_request)
            call = ("classify_texts", texts)
        else:
            model = self._model(body.model, "image-classification", "/v1/classify with 'image'")
            encoded = _as_list(body.image, "image", model.max_inputs_per_request)
            param = lambda i: "image" if len(encoded) == 1 else f"image[{i}]"  # noqa: E731
            call = ("classify_images", [_decode_image(e, param(i)) for i, e in enumerate(encoded)])
        if body.top_k > model.top_k_limit:
            raise InvalidRequestError(f"top_k is {body.top_k}; at most {model.top_k_limit} allowed", param="top_k")
        method, inputs = call
        out = await self._answer(
            model, inputs, {"top_k": body.top_k}, lambda: self._call(model, method, inputs, body.top_k), response
        )
        self._log_payload(model, inputs if method == "classify_texts" else f"{len(inputs)} image(s)", out["results"])
        data = [
            {"index": i, "labels": [{"label": label, "score": score} for label, score in ranked]}
            for i, ranked in enumerate(out["results"])
        ]
        return {"object": "list", "model": model.name, "data": data, "usage": _usage(out["prompt_tokens"])}
