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

Plain asyncio, no Ray: what sends a group is given (``send_many``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

from serve_app.core.calls import CallOutcomes, ModelCall
from serve_app.core.shared_tasks import SharedCallCancelled, start_shared

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


@dataclass
class _Waiting:
    call: ModelCall
    rows: int
    future: asyncio.Future
    bytes: int = 0


class CallGatherer:
    """``await gatherer.submit(call)`` is ``send_many([..., call, ...]).outcomes[i]``."""

    def __init__(self, send_many: Callable[[list[ModelCall]], Awaitable[CallOutcomes]], limits: GatherLimits, *,
                 overloaded: Callable[[], Exception], default_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._send_many = send_many
        self.limits = limits
        self._overloaded = overloaded
        self._default_timeout_s = default_timeout_s
        self._clock = clock
        self._waiting: deque[_Waiting] = deque()
        self._waiting_rows = 0
        self._pump_scheduled = False
        self._groups_in_flight = 0
        self._calls_in_flight = 0
        self._replicas: dict[str, float] = {}  # replica id -> when it last answered
        self._reply_row_bytes = 0  # the largest answer per input seen (a vector's size), for the byte bound
        self._tasks: set[asyncio.Task] = set()
        self.calls = 0  # calls submitted
        self.groups = 0  # groups sent

    # ---- what the backend calls ------------------------------------------------------

    def submit(self, call: ModelCall) -> asyncio.Future:
        """The future of the call's result (its error, if the call failed). Raises the
        ``overloaded`` error at once when the model already holds as many calls as its
        replicas take plus its queue. Cancelling the future drops a call not yet sent."""
        replicas = self.replicas()
        capacity = replicas * self.limits.max_ongoing_per_replica + self.limits.max_queued
        if self._calls_in_flight + len(self._waiting) >= capacity:
            raise self._overloaded()
        future = asyncio.get_running_loop().create_future()
        waiting = _Waiting(call, call.rows, future, call_bytes(call) if self.limits.max_bytes else 0)
        self._waiting.append(waiting)
        self._waiting_rows += waiting.rows
        self.calls += 1
        if not self._pump_scheduled:
            # On the next turn of the loop: calls submitted in this one join the group.
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)
        return future

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
        return {"calls": self.calls, "groups": self.groups,
                "calls_per_group": round(self.calls / self.groups, 2) if self.groups else None,
                "replicas_seen": len(self._replicas), "in_flight_groups": self._groups_in_flight,
                "waiting_calls": len(self._waiting)}

    # ---- groups -----------------------------------------------------------------------

    def _pump(self) -> None:
        self._pump_scheduled = False
        slots = GROUPS_PER_REPLICA * self.replicas()
        # A full group leaves even when every slot is taken: what waits here is invisible
        # to Serve's queue and autoscaler, so it never holds more than one group.
        while self._waiting and (self._groups_in_flight < slots or self._full_group_waits()):
            group = self._take_group()
            if not group:
                break
            self._groups_in_flight += 1
            self._calls_in_flight += len(group)
            self.groups += 1
            # Detached from the caller whose turn sent it: the group serves them all.
            task = start_shared(self._send(group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _full_group_waits(self) -> bool:
        return len(self._waiting) >= self.limits.max_calls or self._waiting_rows >= self.limits.max_rows

    def _take_group(self) -> list[_Waiting]:
        group: list[_Waiting] = []
        rows = size = 0
        budget = self.limits.max_bytes
        while self._waiting and len(group) < self.limits.max_calls:
            head = self._waiting[0]
            if group and rows + head.rows > self.limits.max_rows:
                break
            # The group and its reply stay under the transport's limit: a group of large
            # texts, or of many inputs with long vectors, would fail whole.
            head_size = head.bytes + head.rows * self._reply_row_bytes
            if group and budget is not None and size + head_size > budget:
                break
            self._waiting.popleft()
            self._waiting_rows -= head.rows
            if head.future.done():  # its caller stopped waiting before it left
                continue
            group.append(head)
            rows += head.rows
            size += head_size
        return group

    def _timeout_s(self, group: Sequence[_Waiting]) -> float:
        deadlines = [w.call.deadline for w in group if w.call.deadline is not None]
        if len(deadlines) < len(group):
            return self._default_timeout_s + _GROUP_GRACE_S
        return max(0.0, max(deadlines) - time.time()) + _GROUP_GRACE_S

    async def _send(self, group: list[_Waiting]) -> None:
        try:
            reply = await asyncio.wait_for(self._send_many([w.call for w in group]), self._timeout_s(group))
            if len(reply.outcomes) != len(group):
                raise RuntimeError(f"infer_many answered {len(reply.outcomes)} outcomes for {len(group)} calls")
        except asyncio.CancelledError:
            for waiting in group:  # an error each caller handles (retries), not a cancellation of its own
                if not waiting.future.done():
                    waiting.future.set_exception(SharedCallCancelled("the group this call travelled in was cancelled"))
            raise
        except Exception as exc:  # noqa: BLE001 - each caller decides what it means (retry, 503, 504)
            for waiting in group:
                if not waiting.future.done():
                    waiting.future.set_exception(exc)
        else:
            if reply.replica is not None:
                self._replicas[reply.replica] = self._clock()
            if self.limits.max_bytes is not None:
                self._reply_row_bytes = max([self._reply_row_bytes, *(reply_bytes_per_row(o) for o in reply.outcomes)])
            for waiting, outcome in zip(group, reply.outcomes):
                if waiting.future.done():  # its caller stopped waiting
                    continue
                if isinstance(outcome, BaseException):
                    waiting.future.set_exception(outcome)
                else:
                    waiting.future.set_result(outcome)
        finally:
            self._groups_in_flight -= 1
            self._calls_in_flight -= len(group)
            self._pump()
