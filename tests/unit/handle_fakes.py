"""Stand-ins for what Ray Serve handles return, for ingress tests without Ray."""

from __future__ import annotations

import asyncio


class Pending:
    """A DeploymentResponse stand-in: awaitable once, cancellable; raises ``outcome``
    if it is an exception, after ``delay_s``."""

    def __init__(self, outcome, delay_s: float = 0.0):
        self.outcome, self.delay_s, self.cancelled = outcome, delay_s, False

    def __await__(self):
        return self._run().__await__()

    async def _run(self):
        await asyncio.sleep(self.delay_s)
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def cancel(self):
        self.cancelled = True


class Remote:
    """A handle method stand-in: ``.remote(*args)`` calls ``fn``."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)
