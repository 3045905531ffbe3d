"""Benchmark-only stand-ins for ModelServer behind our Router. Never used by the service.

They implement the real replica's API (``serve_app.core.calls.ModelServerAPI``, checked
by a test): ``infer(EmbedCall) -> EmbedResult``, ``infer_many`` (the router gathers
concurrent calls into it, and counts replicas by the id its answer carries),
``info() -> ModelInfo``, ``check_health`` and ``get_stats() -> dict`` with the real
replica's counter keys. Like the real replica they honour
``call.deadline``: a call whose deadline passed while it waited fails with
DeadlineExceededError (a 504), and any call other than an EmbedCall (or a streamed
call) is refused with InvalidRequestError (a 400), as ModelServer refuses a task its
model does not serve.

- ``ConstantEmbedder`` answers at once with a constant of the right shape, so the HTTP
  proxy + router path can be measured alone (the stack ceiling S of ``ceiling``).
- ``EmulatedAccelerator`` has a GPU replica's timing without a GPU (the ``day`` scenario).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Optional, Sequence

from ray import serve

from serve_app.core.calls import CallOutcomes, EmbedCall, EmbedResult, ModelCall, ModelInfo, answer_each
from serve_app.core.errors import DeadlineExceededError, InvalidRequestError, ServeAppError
from serve_app.replica.stats import BatchStats


def _expired(deadline: Optional[float]) -> Optional[DeadlineExceededError]:
    """The real replica's error for a row whose caller's deadline passed while it waited."""
    if deadline is not None and time.time() > deadline:
        return DeadlineExceededError("the request's deadline passed while it waited for the model", code="timeout")
    return None


class _StubEmbedder:
    """What both stubs share: the call contract, info() and the real replica's stats
    counters (serve_app.replica.stats.BatchStats). Each call is one "batch" of its
    texts; tokens are words, and nothing is padded."""

    kind = "stub"

    def __init__(self, dimensions: int, name: str):
        self.name = name
        self.vector = [0.0] * dimensions
        self.stats = BatchStats()

    def _embed_call(self, call: Any) -> EmbedCall:
        if not isinstance(call, EmbedCall):
            raise InvalidRequestError(
                f"model {self.name!r} is a benchmark stub that serves embeddings only, not {type(call).__name__}",
                param="model", code="wrong_task")
        return call

    async def _wait_and_compute(self, call: EmbedCall) -> None:
        """The model's share of the call (none here); raises if the deadline passed while it waited."""
        error = _expired(call.deadline)
        if error is not None:
            raise error

    async def infer(self, call: EmbedCall) -> EmbedResult:
        call = self._embed_call(call)
        self.stats.requests += 1
        arrived = time.monotonic()
        try:
            await self._wait_and_compute(call)
        except DeadlineExceededError:
            self.stats.cancelled_rows += len(call.texts)
            raise
        tokens = sum(len(text.split()) for text in call.texts)
        self._record(len(call.texts), tokens, self._queue_wait_s(arrived))
        return EmbedResult(embeddings=[list(self.vector) for _ in call.texts], prompt_tokens=tokens)

    async def infer_many(self, calls: Sequence[ModelCall]) -> CallOutcomes:
        return await answer_each(self.infer, calls, replica=_replica_id(), unexpected=lambda exc: ServeAppError(
            f"benchmark stub {self.name!r} failed: {type(exc).__name__}: {exc}", code="internal_error"))

    async def check_health(self) -> None:
        pass

    async def infer_stream(self, call: Any) -> AsyncIterator[Any]:
        raise InvalidRequestError(f"model {self.name!r} is a benchmark stub that does not stream",
                                  param="model", code="wrong_task")
        yield  # pragma: no cover  (an async generator, as handle.options(stream=True) expects)

    async def info(self) -> ModelInfo:
        return ModelInfo(name=self.name, task="embedding", revision=f"{self.kind}-{len(self.vector)}",
                         max_input_tokens=512, device="cpu", dtype="float32", quantization="none")

    def _queue_wait_s(self, arrived: float) -> float:
        return 0.0

    def _record(self, rows: int, tokens: int, wait_s: float) -> None:
        """One call as the real replica counts one batch of one model call."""
        stats, now = self.stats, time.monotonic()
        stats.rows += rows
        stats.batches += 1
        stats.model_calls += 1
        stats.real_tokens += tokens
        stats.padded_tokens += tokens
        stats.recent_batch_rows.append(rows)
        stats.last_minute_batches.add(rows, tokens, tokens, now=now)
        stats.recent_queue_wait_s.append(wait_s)
        stats.last_minute_waits.add(wait_s, now=now)

    def _batching(self) -> dict:
        return {"kind": self.kind}

    async def get_stats(self) -> dict:
        """The real ModelServer's keys (its batching counters, a last_minute summary)."""
        return {"replica": _replica_id(), "batching": self._batching(), **self.stats.snapshot()}


def _replica_id() -> Optional[str]:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a replica (a direct call in a test)
        return None


@serve.deployment
class ConstantEmbedder(_StubEmbedder):
    """Answers at once with zero vectors of ``dimensions``: the stack ceiling's model."""

    kind = "constant"

    def __init__(self, dimensions: int, name: str = "embed"):
        super().__init__(dimensions, name)


@serve.deployment
class EmulatedAccelerator(_StubEmbedder):
    """A GPU replica's timing without a GPU, for the `day` scaling scenario: at most
    ``slots`` calls run at once, each takes ``service_s``, the rest queue in the
    replica (where Ray Serve's autoscaler sees them). Sleeping costs no CPU, so a
    2-core machine can host several such replicas whose capacity really adds up. A call
    whose deadline passed while it queued is dropped with a 504, as the real replica
    drops such rows, and frees its slot at once."""

    kind = "emulated"

    def __init__(self, dimensions: int, slots: int, service_s: float, name: str = "embed"):
        super().__init__(dimensions, name)
        self.slot_count = slots
        self.slots = asyncio.Semaphore(slots)
        self.service_s = service_s

    async def _wait_and_compute(self, call: EmbedCall) -> None:
        async with self.slots:
            error = _expired(call.deadline)
            if error is not None:
                raise error
            await asyncio.sleep(self.service_s)

    def _queue_wait_s(self, arrived: float) -> float:
        return max(0.0, time.monotonic() - arrived - self.service_s)

    def _batching(self) -> dict:
        return {"kind": self.kind, "slots": self.slot_count, "service_s": self.service_s}
