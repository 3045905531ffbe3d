"""What the continuous batcher (:class:`serve_app.core.continuous.engine.ContinuousBatcher`)
hands out and takes in besides the requests: the sink a request's output goes to, the
handle of a submitted request, the counters snapshot, and the error at shutdown.

This module must never import ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serve_app.core.models import GenerationResult


class GenerationSink(Protocol):
    """Where the engine delivers one request's output. Both methods run on the engine thread.

    ``on_delta(text)`` is called with each non-empty piece of new text, in order; the
    pieces concatenate exactly to the final result's ``text``. ``on_finish(outcome)``
    is called exactly once, last, with the :class:`GenerationResult` (finish_reason
    "stop", "length" or "cancelled") or with the exception that ended the request (a
    model error, or :class:`BatcherClosedError` at shutdown).

    Both must return quickly and must not block on the engine (e.g. hand the value to
    an event loop with ``loop.call_soon_threadsafe``): every other row waits meanwhile.
    They may call the batcher's ``submit`` or ``cancel``. If ``on_delta`` raises, the
    error is logged and the request is cancelled at the next step.
    """

    def on_delta(self, text: str) -> None: ...

    def on_finish(self, outcome: GenerationResult | BaseException) -> None: ...


class BatcherClosedError(RuntimeError):
    """The batcher is shut down: submit() after shutdown(), or a request still pending at shutdown."""


@dataclass(eq=False)
class RowHandle:
    """One submitted request, as the batcher's ``submit`` returns it.

    Pass it to the batcher's ``cancel``. The engine thread fills in the
    timestamps (``time.monotonic()`` seconds) as the request moves on; they are final
    by the time the sink's ``on_finish`` runs.
    """

    request_id: int
    prompt_tokens: int
    submitted_at: float
    admitted_at: float | None = None  # joined the running batch
    first_token_at: float | None = None
    finished_at: float | None = None
    cancel_requested: bool = False

    @property
    def time_to_first_token_s(self) -> float | None:
        """Seconds from submit() to the first token (queueing and prefill included)."""
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def queue_time_s(self) -> float | None:
        """Seconds from submit() until the row joined the batch."""
        return None if self.admitted_at is None else self.admitted_at - self.submitted_at


@dataclass(frozen=True)
class BatcherStats:
    """A snapshot of the batcher's counters, for metrics, read under one lock.

    Taken during a step, a row whose sink already got its result may still count in
    ``active_rows`` until that step ends.
    """

    steps: int  # step() calls that ran the model
    rows_submitted: int
    rows_admitted: int
    rows_finished: int  # all ends: stop, length, cancelled, failed
    rows_cancelled: int
    rows_failed: int  # ended with an exception
    tokens_generated: int
    active_rows: int
    waiting_rows: int
    # The most cache slots (rows x columns, left padding included) the running rows can
    # come to hold, each growing to prompt_tokens + max_tokens; admission keeps it
    # within kv_token_budget (a row alone may exceed it). 0 when idle.
    kv_tokens_reserved: int
    kv_cache_slots: int  # rows x columns of the cache as allocated now (padding included)
