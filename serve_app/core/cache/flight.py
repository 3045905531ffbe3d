"""SingleFlight: identical requests in flight at once share one call."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from serve_app.core.shared_tasks import SharedCallCancelled, start_shared

T = TypeVar("T")


def _retrieve(task: asyncio.Future) -> None:
    # Mark the exception as seen: if every caller left, nobody else will read it.
    if not task.cancelled():
        task.exception()


class SingleFlight:
    """Identical requests in flight at once share one call.

    The first caller for a key starts ``fn()`` in a task detached from every caller
    (core.shared_tasks: it carries no caller's request context, so no one caller's
    cancellation reaches it); callers that arrive while
    it runs await the same task (``shared=True``) and get the same result object (do not
    mutate it) or the same exception. Every caller awaits through ``asyncio.shield``, so a
    caller that is cancelled (its client went away) leaves the call running for the
    others; if all callers leave, the call still finishes on its own. The key is freed
    when the call finishes, so a later request runs again (cache it to reuse it).
    Per process: replicas do not coalesce with each other.
    """

    def __init__(self) -> None:
        self._calls: dict[str, asyncio.Future] = {}
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._calls)

    async def run(self, key: str, fn: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        task = self._calls.get(key)
        shared = task is not None
        if shared:
            self.coalesced += 1
        else:

            async def call() -> T:
                return await fn()

            task = start_shared(call())
            self._calls[key] = task
            task.add_done_callback(lambda t: self._done(key, t))
        try:
            return await asyncio.shield(task), shared
        except asyncio.CancelledError:
            if task.cancelled():  # the shared call, not this caller: an error to handle, not ours to propagate
                raise SharedCallCancelled() from None
            raise

    def _done(self, key: str, task: asyncio.Future) -> None:
        if self._calls.get(key) is task:
            del self._calls[key]
        _retrieve(task)
