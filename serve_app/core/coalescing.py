"""Coalescer: calls made while earlier ones are on their way leave together, as one.

Each call to another process costs CPU on both sides whatever it carries, so calls that
arrive together are cheaper sent as one: the router's cache lookups and write-backs to
the CacheServer (measured on 2 cores: one lookup and one write-back per request took
2.7 ms of CPU per request, a fifth of the request path), and its embedding and
classification calls to a model's replicas (``ingress.call_gathering``: 2.7 and 2.5 ms
in router and replica per call sent alone, 1.6 and 1.2 ms in groups of about 10).

No timer: a call that finds a free slot leaves at once (in the next turn of the event
loop, with whatever else was submitted in that turn), so a quiet service adds no wait.
Calls that arrive while ``max_in_flight`` batches are out queue up and leave together as
soon as a batch returns, so the batch size follows the load by itself, as in continuous
batching. A batch carries at most ``max_items`` items, ``max_weight`` of their weight
(rows) and ``max_bytes`` of their size; an item larger than the bound alone goes alone.

Each caller gets its own outcome: its result, or the exception ``send_many`` put in its
place. If the batch fails, takes longer than its timeout or answers the wrong number of
outcomes, every caller of it gets the exception (``asyncio.TimeoutError`` for a slow
batch, ``SharedCallCancelled`` for a cancelled one) and the slot is free again: a hung
callee cannot hold the coalescer. A caller that stops waiting before its item leaves
takes it out of the batch; one that stops later leaves the others their answers.
Batches run detached from every caller (``core.shared_tasks``). Plain asyncio; one event
loop; no Ray.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, Optional, Sequence, TypeVar, Union

from serve_app.core.shared_tasks import SharedCallCancelled, start_shared

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Waiting(Generic[T]):
    """One submitted item until its batch answers."""

    item: T
    future: asyncio.Future
    weight: int = 1
    size: int = 0


class Coalescer(Generic[T, R]):
    """``await coalescer.call(item)`` is the outcome of ``item`` in ``send_many([..., item, ...])``.

    ``send_many(items)`` returns a reply that ``outcomes(reply)`` (default: the reply
    itself) turns into one outcome per item, in order; an outcome that is an exception is
    raised to that item's caller alone. Subclasses may widen it through three hooks:
    :meth:`slots` (batches allowed in flight now), :meth:`item_size` (what an item counts
    against ``max_bytes``) and :meth:`answered` (the reply, before it is fanned out).
    """

    def __init__(self, send_many: Callable[[list[T]], Awaitable[Any]], *,
                 timeout_s: Union[float, Callable[[Sequence[T]], float]], max_items: int = 256,
                 max_in_flight: int = 2, weight_of: Optional[Callable[[T], int]] = None,
                 max_weight: Optional[int] = None, size_of: Optional[Callable[[T], int]] = None,
                 max_bytes: Optional[int] = None, full_batches_always_leave: bool = False,
                 outcomes: Callable[[Any], Sequence[Any]] = lambda reply: reply):
        if max_items < 1 or max_in_flight < 1 or (not callable(timeout_s) and timeout_s <= 0):
            raise ValueError("max_items and max_in_flight must be >= 1 and timeout_s > 0")
        self._send_many = send_many
        self._timeout_s = timeout_s
        self.max_items = max_items
        self.max_in_flight = max_in_flight
        self._weight_of = weight_of
        self.max_weight = max_weight
        self._size_of = size_of if max_bytes is not None else None
        self.max_bytes = max_bytes
        # True: a full batch leaves even when every slot is taken (what waits here is
        # invisible to the callee's own queue, so it never holds more than one batch).
        self._full_batches_go = full_batches_always_leave
        self._outcomes = outcomes
        self._waiting: deque[Waiting[T]] = deque()
        self._waiting_weight = 0
        self._pump_scheduled = False
        self.in_flight_batches = 0
        self.in_flight_items = 0
        self._tasks: set[asyncio.Task] = set()
        self.calls = 0  # items submitted
        self.batches = 0  # send_many calls made

    # ---- callers -------------------------------------------------------------------------

    async def call(self, item: T) -> R:
        return await self.submit(item)

    def submit(self, item: T) -> asyncio.Future:
        """Queue ``item`` and return the future of its outcome, for a caller that does not
        wait (a write-back): read it in a done callback. Cancelling the future drops an
        item not yet sent."""
        loop = asyncio.get_running_loop()
        waiting = Waiting(item, loop.create_future(), self._weight_of(item) if self._weight_of else 1,
                          self._size_of(item) if self._size_of else 0)
        self._waiting.append(waiting)
        self._waiting_weight += waiting.weight
        self.calls += 1
        if not self._pump_scheduled:
            # On the next turn of the loop: items submitted in this one join the batch.
            self._pump_scheduled = True
            loop.call_soon(self._pump)
        return waiting.future

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # ---- hooks ----------------------------------------------------------------------------

    def slots(self) -> int:
        """Batches allowed in flight now."""
        return self.max_in_flight

    def item_size(self, waiting: Waiting[T]) -> int:
        """What ``waiting`` counts against ``max_bytes``."""
        return waiting.size

    def answered(self, reply: Any) -> None:
        """Called with each reply before its outcomes reach the callers."""

    # ---- batches --------------------------------------------------------------------------

    def _full_batch_waits(self) -> bool:
        return len(self._waiting) >= self.max_items or (
            self.max_weight is not None and self._waiting_weight >= self.max_weight)

    def _pump(self) -> None:
        self._pump_scheduled = False
        while self._waiting and (self.in_flight_batches < self.slots()
                                 or (self._full_batches_go and self._full_batch_waits())):
            batch = self._take_batch()
            if not batch:
                break
            self.in_flight_batches += 1
            self.in_flight_items += len(batch)
            self.batches += 1
            # Detached from the caller whose turn sent it: the batch serves them all.
            task = start_shared(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take_batch(self) -> list[Waiting[T]]:
        batch: list[Waiting[T]] = []
        weight = size = 0
        while self._waiting and len(batch) < self.max_items:
            head = self._waiting[0]
            if batch and self.max_weight is not None and weight + head.weight > self.max_weight:
                break
            head_size = self.item_size(head) if self.max_bytes is not None else 0
            if batch and self.max_bytes is not None and size + head_size > self.max_bytes:
                break
            self._waiting.popleft()
            self._waiting_weight -= head.weight
            if head.future.done():  # its caller stopped waiting before it left
                continue
            batch.append(head)
            weight += head.weight
            size += head_size
        return batch

    async def _send(self, batch: list[Waiting[T]]) -> None:
        items = [w.item for w in batch]
        timeout_s = self._timeout_s(items) if callable(self._timeout_s) else self._timeout_s
        try:
            reply = await asyncio.wait_for(self._send_many(items), timeout_s)
            outcomes = self._outcomes(reply)
            if len(outcomes) != len(batch):
                raise RuntimeError(f"send_many returned {len(outcomes)} results for {len(batch)} items")
            self.answered(reply)
        except asyncio.CancelledError:
            for waiting in batch:  # an error each caller handles, not a cancellation of its own
                if not waiting.future.done():
                    waiting.future.set_exception(SharedCallCancelled("the batch this call travelled in was cancelled"))
            raise
        except Exception as exc:  # noqa: BLE001 - each caller decides what a failure means
            for waiting in batch:
                if not waiting.future.done():
                    waiting.future.set_exception(exc)
        else:
            for waiting, outcome in zip(batch, outcomes):
                if waiting.future.done():  # its caller stopped waiting
                    continue
                if isinstance(outcome, BaseException):
                    waiting.future.set_exception(outcome)
                else:
                    waiting.future.set_result(outcome)
        finally:
            self.in_flight_batches -= 1
            self.in_flight_items -= len(batch)
            self._pump()
