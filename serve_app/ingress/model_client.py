"""Calls from the router to a model's deployment: one typed call, under the request's
deadline, retried on another replica when the one serving it dies, with Serve's
failures turned into the errors clients should see (503 with Retry-After for a full
queue, 503 for a model that could not load, 504 past the deadline).

What is called is a :class:`ModelBackend`: the adapter between our typed calls and one
kind of deployment. :class:`ModelServerBackend` speaks to our ModelServer, whose
methods take the calls as they are; a deployment with another API (Ray Serve LLM's
``LLMServer``, say) gets a backend of its own that translates, and the deadline, retry
and error mapping here stay the same for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from typing import Any, AsyncIterator, Optional, Protocol

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app.config import ModelConfig, RouterConfig
from serve_app.core.calls import CallOutcomes, GenerateCall, ModelCall, ModelInfo, ModelResult, StreamEvent
from serve_app.core.errors import (
    DeadlineExceededError,
    EngineRestartingError,
    ModelUnavailableError,
    OverloadedError,
    ServeAppError,
)
from serve_app.core.shared_tasks import SharedCallCancelled
from serve_app.core.tasks import CAPABILITIES
from serve_app.ingress.call_gathering import CallGatherer, GatherLimits
from serve_app.ingress import request_context
from serve_app.ingress.http_errors import unwrap
from serve_app.ray_env import handle_message_budget_bytes

logger = logging.getLogger("ray.serve")

# Failures that mean "the replica serving this call is gone", or the group it travelled
# in was cancelled: inference has no side effects, so the call may run again.
_REPLICA_LOST = (RayActorError, ActorUnavailableError, SharedCallCancelled)


class PendingCall(Protocol):
    """One call in flight: awaitable for its result, cancellable (Serve's DeploymentResponse)."""

    def __await__(self): ...

    def cancel(self) -> None: ...


class PendingStream(Protocol):
    """One streamed call in flight (Serve's DeploymentResponseGenerator)."""

    def __aiter__(self): ...

    async def __anext__(self) -> StreamEvent: ...

    def cancel(self) -> None: ...


class ModelBackend(Protocol):
    """The calls one kind of model deployment answers, in our typed vocabulary."""

    def infer(self, call: ModelCall) -> PendingCall: ...

    def infer_stream(self, call: GenerateCall) -> PendingStream: ...

    def info(self) -> PendingCall: ...

    def stats(self) -> PendingCall: ...

    def gathering(self) -> Optional[dict]:
        """How this backend gathers concurrent calls (``CallGatherer.stats``); None if it does not."""


class ModelServerBackend:
    """Our ModelServer deployment: its methods take and return the typed calls.

    With ``gather`` (the router's ``gather_calls``, for models whose calls are unary),
    concurrent calls travel together as one ``infer_many`` request
    (:mod:`serve_app.ingress.call_gathering`); each still gets its own outcome.
    """

    def __init__(self, handle: DeploymentHandle, model: Optional[ModelConfig] = None, *,
                 gather: bool = False, router: Optional[RouterConfig] = None):
        # .options() starts the handle's updates from the controller now (Serve starts a
        # handle at its first .options() or .remote()). A handle started by its first
        # request only learns later that its model failed to load, and that request
        # waits for replicas that never come; started early, it gets a 503.
        self.streaming = handle.options(stream=True)
        self.handle = handle
        self.gatherer: Optional[CallGatherer] = None
        if gather and model is not None and CAPABILITIES[model.task].gathered:
            router = router or RouterConfig()
            self.gatherer = CallGatherer(
                self._infer_many,
                GatherLimits.of(model.max_ongoing_requests, model.max_queued_requests, model.batching.max_batch_size,
                                max_bytes=handle_message_budget_bytes()),
                overloaded=lambda: overloaded_error(model.name, router.retry_after_s),
                default_timeout_s=router.request_timeout_s,
            )

    def infer(self, call: ModelCall) -> PendingCall:
        if self.gatherer is not None and not isinstance(call, GenerateCall):
            return self.gatherer.submit(call)
        return self.handle.infer.remote(call)

    async def _infer_many(self, calls: list[ModelCall]) -> CallOutcomes:
        response = self.handle.infer_many.remote(calls)
        try:
            return await response
        except asyncio.CancelledError:  # the group's time ran out: stop it in the replica too
            response.cancel()
            raise
        except Exception as exc:
            if "'infer_many' that does not exist" not in str(unwrap(exc)):
                raise
        # A replica of a release before infer_many, met during a rolling update: each
        # call alone, as that release's router sent them.
        outcomes = await asyncio.gather(*(self.handle.infer.remote(call) for call in calls), return_exceptions=True)
        return CallOutcomes(outcomes=tuple(outcomes))

    def infer_stream(self, call: GenerateCall) -> PendingStream:
        return self.streaming.infer_stream.remote(call)

    def info(self) -> PendingCall:
        return self.handle.info.remote()

    def stats(self) -> PendingCall:
        return self.handle.get_stats.remote()

    def gathering(self) -> Optional[dict]:
        return None if self.gatherer is None else self.gatherer.stats()


class ModelClient:
    """The router's way to every model: ``infer``/``stream``/``info``/``stats`` by model."""

    def __init__(self, backends: dict[str, ModelBackend], config: RouterConfig):
        self.backends = backends
        self.config = config
        self.replica_retries: Counter = Counter()  # per model: calls retried after a replica died

    def gathering(self, model_name: str) -> Optional[dict]:
        """How this router gathers the model's calls (``CallGatherer.stats``), or None."""
        return self.backends[model_name].gathering()

    def request_deadline(self, deadline: Optional[float] = None) -> float:
        """``deadline`` (time.monotonic()), else the request's (``request_context``): one
        request's calls (the revision read, the semantic cache's embedding, the model
        call) all take that one deadline, so a request ends within request_timeout_s of
        its arrival, not one timeout per call."""
        return request_context.deadline(self.config.request_timeout_s) if deadline is None else deadline

    async def infer(self, model: ModelConfig, call: ModelCall, *, deadline: Optional[float] = None) -> ModelResult:
        """The model's answer to ``call`` by ``deadline`` (time.monotonic(); default: the
        request's); rows still queued at the deadline are dropped by the replica rather
        than computed for nobody."""
        deadline = self.request_deadline(deadline)
        call = dataclasses.replace(call, deadline=request_context.wall_clock(deadline))
        return await self._unary(model, lambda backend: backend.infer(call), deadline)

    async def info(self, model: ModelConfig, *, deadline: Optional[float] = None) -> ModelInfo:
        return await self._unary(model, lambda backend: backend.info(), deadline)

    async def stats(self, model: ModelConfig) -> dict:
        return await self._unary(model, lambda backend: backend.stats())

    def _timed_out(self, model: ModelConfig, what: str = "answer") -> DeadlineExceededError:
        return DeadlineExceededError(
            f"model {model.name!r} did not {what} within the request's {self.config.request_timeout_s}s",
            code="timeout")

    async def _unary(self, model: ModelConfig, start, deadline: Optional[float] = None) -> Any:
        """One call by ``deadline`` (time.monotonic(); default: the request's).
        A full queue is a 503 at once; a replica that dies under the call is retried on
        another, a bounded number of times with backoff, while Ray restarts it."""
        deadline = self.request_deadline(deadline)
        for attempt in range(self.config.replica_retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # spent by earlier calls of the request: do not start one more
                raise self._timed_out(model)
            response = start(self.backends[model.name])
            try:
                return await asyncio.wait_for(response, timeout=remaining)
            except asyncio.TimeoutError:
                response.cancel()
                raise self._timed_out(model) from None
            except _REPLICA_LOST as exc:
                if attempt == self.config.replica_retries:
                    raise
                await self._before_retry(model, exc, attempt)
            except Exception as exc:
                error = self._model_error(model, exc)
                # A replica whose engine died answers at once, so it looks idle and keeps
                # drawing calls until its health check fails: the call goes to another.
                if not isinstance(error, EngineRestartingError) or attempt == self.config.replica_retries:
                    raise error from None
                await self._before_retry(model, error, attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def stream(self, model: ModelConfig, call: GenerateCall, *,
                     deadline: Optional[float] = None) -> AsyncIterator[StreamEvent]:
        """The model's streamed generation events, under the request's deadline.

        A replica lost before the first event is retried like a unary call; after it,
        the client already holds part of the answer, so the stream fails instead.
        Leaving early (client gone, deadline) cancels the model's stream, which frees
        its rows in the batch.
        """
        deadline = self.request_deadline(deadline)
        call = dataclasses.replace(call, deadline=request_context.wall_clock(deadline))
        for attempt in range(self.config.replica_retries + 1):
            events = self.backends[model.name].infer_stream(call)
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
                raise self._timed_out(model, "finish") from None
            except _REPLICA_LOST as exc:
                if started or attempt == self.config.replica_retries:
                    raise
                await self._before_retry(model, exc, attempt)
            except Exception as exc:
                error = self._model_error(model, exc)
                if started or not isinstance(error, EngineRestartingError) or attempt == self.config.replica_retries:
                    raise error from None
                await self._before_retry(model, error, attempt)
            finally:
                if not finished:
                    events.cancel()

    async def _before_retry(self, model: ModelConfig, exc: BaseException, attempt: int) -> None:
        self.replica_retries[model.name] += 1
        logger.warning("model %s: replica lost (or shared call cancelled) mid-request (%s); retry %d of %d",
                       model.name, type(exc).__name__, attempt + 1, self.config.replica_retries)
        await asyncio.sleep(0.1 * 2**attempt)

    def _model_error(self, model: ModelConfig, exc: Exception) -> Exception:
        """What a failed model call means to the client."""
        original = unwrap(exc)
        if isinstance(original, ServeAppError):
            return original
        if isinstance(original, DeploymentUnavailableError):
            return ModelUnavailableError(
                f"model {model.name!r} is unavailable: its replicas failed to start (the model replica's "
                "log says why, for example a model that failed to load); the other models still serve"
            )
        if isinstance(original, BackPressureError):
            return overloaded_error(model.name, self.config.retry_after_s)
        return exc


def overloaded_error(model_name: str, retry_after_s: int) -> OverloadedError:
    """The 503 for a model whose queue is full."""
    return OverloadedError(f"model {model_name!r} is at capacity (its queue is full); retry after {retry_after_s}s",
                           retry_after_s=retry_after_s)
