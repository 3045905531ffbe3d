"""Concurrent embedding and classification calls to one model, sent as one Serve request.

Each Serve request costs CPU on both sides of the handle whatever it carries (gRPC,
routing, the replica's request handling): on 2 cores, measured at concurrency 32 with
the shipped MiniLM on vLLM (the recipe benchmark), 2.7 ms in the router and 2.5 ms in
the ModelServer per embedding request sent alone. Sent as one ``ModelServer.infer_many``
per group (about 10 calls at that load), they cost 1.6 and 1.2 ms, and their rows still
batch in the replica as if they had come one by one.

A group forms from what waits while the model's replicas are busy: with fewer than
:data:`GROUPS_PER_REPLICA` groups in flight per replica, a call leaves at once (after
the calls of the same event-loop turn join it), so a lone request never waits for
company. Each call keeps its own outcome: its result, or the error its own input
caused; a failure of the whole group (replica lost, queue full) reaches every call of
it, and each caller then retries or answers by itself (``ModelClient``).

The limits keep Serve's meaning per call, not per group: a group carries at most
``max_ongoing_requests / GROUPS_PER_REPLICA`` calls and ``batching.max_batch_size``
rows (a larger call travels alone), and it and its reply stay within the bytes that
one handle call may carry (three quarters of Ray's gRPC message limit: the sum of
many calls' texts or vectors would fail the whole group), and calls beyond ``max_ongoing_requests`` per replica
plus ``max_queued_requests`` get a 503 at once, as Serve's own full queue does. The
replicas are counted from the answers (each names its replica), so a scale-up widens
the flight within one answer.

Plain asyncio, no Ray: what sends a group is given (``send_many``). The queueing, the
group limits, the timeout and the fan-out are the :class:`~serve_app.core.coalescing.Coalescer`'s,
which the cache's store calls use too; this module adds what is particular to replicas:
the slots follow the replicas seen, Serve's queue limit, and the reply's size.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

from serve_app.core.calls import CallOutcomes, ModelCall
from serve_app.core.coalescing import Coalescer, Waiting

# Groups in flight per replica: one running while the next is on its way, so the
# replica is never idle waiting for the router, and groups stay large under load.
GROUPS_PER_REPLICA = 2

# A replica not heard from for this long, while others answered, no longer counts
# (scaled down, or dead). A quiet spell forgets none: silence from every replica means
# no traffic, not fewer replicas, and a burst after it must be admitted as Serve would.
REPLICA_MEMORY_S = 30.0

# Beyond the latest deadline of a group's calls, before its slot is taken back from a
# replica that never answers (every caller has stopped waiting by then).
_GROUP_GRACE_S = 1.0


@dataclass(frozen=True)
class GatherLimits:
    """A model's limits, per call, as its deployment options set them."""

    max_calls: int  # calls per group
    max_rows: int  # inputs per group
    max_ongoing_per_replica: int  # Serve's max_ongoing_requests
    max_queued: int  # Serve's max_queued_requests
    # Bytes a group and its reply may carry (below the transport's message limit); None: unbounded.
    max_bytes: Optional[int] = None

    @classmethod
    def of(cls, max_ongoing_requests: int, max_queued_requests: int, max_batch_size: int,
           max_bytes: Optional[int] = None) -> "GatherLimits":
        return cls(max_calls=max(1, max_ongoing_requests // GROUPS_PER_REPLICA), max_rows=max_batch_size,
                   max_ongoing_per_replica=max_ongoing_requests, max_queued=max_queued_requests, max_bytes=max_bytes)


def call_bytes(call: ModelCall) -> int:
    """About how many bytes a call's inputs pickle to: its texts' UTF-8 (or 8 per token id)."""
    texts = getattr(call, "texts", None) or ()
    return sum(len(t.encode("utf-8", "surrogatepass")) if isinstance(t, str) else 8 * len(t) for t in texts)


def reply_bytes_per_row(outcome: Any) -> int:
    """About how many bytes one input's answer pickles to (9 per float of a vector)."""
    embeddings = getattr(outcome, "embeddings", None)
    if embeddings:
        return 9 * len(embeddings[0]) + 16
    rankings = getattr(outcome, "rankings", None)
    if rankings:
        return 48 * len(rankings[0]) + 16
    return 0


class CallGatherer(Coalescer[ModelCall, Any]):
    """``await gatherer.submit(call)`` is ``send_many([..., call, ...]).outcomes[i]``."""

    def __init__(self, send_many: Callable[[list[ModelCall]], Awaitable[CallOutcomes]], limits: GatherLimits, *,
                 overloaded: Callable[[], Exception], default_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(
            send_many, timeout_s=self._timeout_s, max_items=limits.max_calls, max_in_flight=GROUPS_PER_REPLICA,
            weight_of=lambda call: call.rows, max_weight=limits.max_rows,
            size_of=call_bytes, max_bytes=limits.max_bytes,
            full_batches_always_leave=True, outcomes=lambda reply: reply.outcomes)
        self.limits = limits
        self._overloaded = overloaded
        self._default_timeout_s = default_timeout_s
        self._clock = clock
        self._replicas: dict[str, float] = {}  # replica id -> when it last answered
        self._reply_row_bytes = 0  # the largest answer per input seen (a vector's size), for the byte bound

    def submit(self, call: ModelCall) -> asyncio.Future:
        """The future of the call's result (its error, if the call failed). Raises the
        ``overloaded`` error at once when the model already holds as many calls as its
        replicas take plus its queue. Cancelling the future drops a call not yet sent."""
        capacity = self.replicas() * self.limits.max_ongoing_per_replica + self.limits.max_queued
        if self.in_flight_items + self.waiting >= capacity:
            raise self._overloaded()
        return super().submit(call)

    def replicas(self) -> int:
        """Replicas that answered within :data:`REPLICA_MEMORY_S` of the latest answer
        from any replica (at least 1)."""
        if self._replicas:
            latest = max(self._replicas.values())
            for replica, seen in list(self._replicas.items()):
                if latest - seen > REPLICA_MEMORY_S:
                    del self._replicas[replica]
        return max(1, len(self._replicas))

    def stats(self) -> dict[str, Any]:
        return {"calls": self.calls, "groups": self.batches,
                "calls_per_group": round(self.calls / self.batches, 2) if self.batches else None,
                "replicas_seen": len(self._replicas), "in_flight_groups": self.in_flight_batches,
                "waiting_calls": self.waiting}

    # ---- the Coalescer's hooks ----------------------------------------------------------

    def slots(self) -> int:
        return GROUPS_PER_REPLICA * self.replicas()

    def item_size(self, waiting: Waiting[ModelCall]) -> int:
        # The group and its reply stay under the transport's limit: a group of large
        # texts, or of many inputs with long vectors, would fail whole.
        return waiting.size + waiting.weight * self._reply_row_bytes

    def answered(self, reply: CallOutcomes) -> None:
        if reply.replica is not None:
            self._replicas[reply.replica] = self._clock()
        if self.limits.max_bytes is not None:
            self._reply_row_bytes = max([self._reply_row_bytes, *(reply_bytes_per_row(o) for o in reply.outcomes)])

    def _timeout_s(self, group: Sequence[ModelCall]) -> float:
        deadlines = [call.deadline for call in group if call.deadline is not None]
        if len(deadlines) < len(group):
            return self._default_timeout_s + _GROUP_GRACE_S
        return max(0.0, max(deadlines) - time.time()) + _GROUP_GRACE_S
