"""CallBatcher: calls made while earlier ones are on their way leave together, as one.

Each cache lookup and write-back is a call to another process (the CacheServer
deployment). Under load, that per-call cost, not the store, is most of what the cache
costs: measured on 2 cores, one lookup and one write-back per request took 2.7 ms of CPU
per request between the router and the CacheServer, a fifth of the whole request path.
Sending the keys of requests that arrive together as one call pays it once per batch.

No timer: a call that finds a free slot leaves at once (in the next turn of the event
loop, with whatever else was submitted in that turn), so a quiet service adds no wait.
Calls that arrive while ``max_in_flight`` batches are out queue up, and leave together
as soon as a batch returns. The batch size thus follows the load by itself, as in
continuous batching.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Generic, Optional, Sequence, TypeVar

from serve_app.core.shared_tasks import SharedCallCancelled, start_shared

T = TypeVar("T")
R = TypeVar("R")


class CallBatcher(Generic[T, R]):
    """``await batcher.call(item)`` is ``send_many([item, ...])[i]`` for the batch the item left in.

    ``send_many(items)`` must return one result per item, in order. If it raises, takes
    longer than ``timeout_s`` or returns the wrong number of results, every caller of
    that batch gets the exception (``asyncio.TimeoutError`` for a slow batch,
    ``SharedCallCancelled`` for a cancelled one), and the
    slot is free again: a hung callee cannot hold the batcher. A caller that stops
    waiting (cancelled, or its own timeout) leaves its item in the batch; the others are
    unaffected: batches run detached from every caller (core.shared_tasks). Plain
    asyncio; one event loop.
    """

    def __init__(self, send_many: Callable[[list[T]], Awaitable[Sequence[R]]], *, timeout_s: float,
                 max_batch: int = 256, max_in_flight: int = 2, size_of: Optional[Callable[[T], int]] = None,
                 max_bytes: Optional[int] = None):
        if max_batch < 1 or max_in_flight < 1 or timeout_s <= 0:
            raise ValueError("max_batch and max_in_flight must be >= 1 and timeout_s > 0")
        self._send_many = send_many
        self.timeout_s = timeout_s
        self.max_batch = max_batch
        # With both: a batch also stays within max_bytes of items (as size_of counts
        # them), below the transport's message limit; an item larger alone goes alone.
        self._size_of = size_of
        self.max_bytes = max_bytes
        self.max_in_flight = max_in_flight
        self._queued: list[tuple[T, asyncio.Future]] = []
        self._in_flight = 0
        self._starting = False  # a batch task is created and has not taken its batch yet
        self._tasks: set[asyncio.Task] = set()
        self.calls = 0  # items submitted
        self.batches = 0  # send_many calls made

    async def call(self, item: T) -> R:
        return await self.submit(item)

    def submit(self, item: T) -> asyncio.Future:
        """Queue ``item`` and return the future of its result, for a caller that does not
        wait (a write-back): read its outcome in a done callback."""
        future = asyncio.get_running_loop().create_future()
        self._queued.append((item, future))
        self.calls += 1
        self._start_batches()
        return future

    def _start_batches(self) -> None:
        # One batch task at a time is waiting to run; it takes what is queued when it runs,
        # so items submitted in the same turn of the event loop join it. The next one
        # starts once it has taken its batch.
        if self._queued and not self._starting and self._in_flight < self.max_in_flight:
            self._starting = True
            self._in_flight += 1
            # Detached from the caller that happened to start it: the batch serves them all.
            task = start_shared(self._send_next())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take_batch(self) -> list[tuple[T, asyncio.Future]]:
        count = min(len(self._queued), self.max_batch)
        if self._size_of is not None and self.max_bytes is not None:
            used = 0
            for index, (item, _) in enumerate(self._queued[:count]):
                used += self._size_of(item)
                if index and used > self.max_bytes:
                    count = index
                    break
        batch, self._queued = self._queued[:count], self._queued[count:]
        return batch

    async def _send_next(self) -> None:
        batch = self._take_batch()
        self._starting = False
        try:
            self._start_batches()  # what did not fit, into a second slot
            self.batches += 1
            await self._send(batch)
        finally:
            self._in_flight -= 1
            self._start_batches()

    async def _send(self, batch: list[tuple[T, asyncio.Future]]) -> None:
        try:
            results = await asyncio.wait_for(self._send_many([item for item, _ in batch]), self.timeout_s)
            if len(results) != len(batch):
                raise RuntimeError(f"send_many returned {len(results)} results for {len(batch)} items")
        except asyncio.CancelledError:
            for _, future in batch:  # an error the callers handle, not a cancellation of their own
                if not future.done():
                    future.set_exception(SharedCallCancelled("the batch this call travelled in was cancelled"))
            raise
        except Exception as exc:  # noqa: BLE001 - each caller decides what a failure means
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            if not future.done():  # its caller stopped waiting
                future.set_result(result)
