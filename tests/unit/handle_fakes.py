"""Stand-ins for what Ray Serve handles return, and for a model backend, for ingress
tests without Ray."""

from __future__ import annotations

import asyncio
import dataclasses

from serve_app.core.calls import ModelInfo


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


class ScriptedStream:
    """A streaming handle call's stand-in: yields (or raises) scripted events; cancellable."""

    def __init__(self, events):
        self.events, self.cancelled = list(events), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.events:
            raise StopAsyncIteration
        event = self.events.pop(0)
        if isinstance(event, BaseException):
            raise event
        return event

    def cancel(self):
        self.cancelled = True


class FakeBackend:
    """The ModelBackend methods (serve_app.ingress.model_client) a test does not script:
    every fake backend derives from it, so none lacks a method the router calls
    (tests/unit/test_model_client.py checks them against the protocol)."""

    def infer(self, call):
        raise NotImplementedError("this test sends no unary calls")

    def infer_stream(self, call):
        raise NotImplementedError("this test streams nothing")

    def info(self):
        raise NotImplementedError("this test reads no model info")

    def stats(self):
        return Pending({})

    def gathering(self):
        return None  # fakes answer each call alone


class ScriptedBackend(FakeBackend):
    """A ModelBackend stand-in that answers from a script: one outcome per call, in order."""

    def __init__(self, *outcomes, delay_s: float = 0.0, info: ModelInfo | None = None):
        self.outcomes, self.delay_s, self.calls, self.pending = list(outcomes), delay_s, [], []
        self.model_info = info

    def infer(self, call):
        self.calls.append(call)
        outcome = self.outcomes.pop(0)
        if self.model_info is not None and dataclasses.is_dataclass(outcome) and outcome.revision is None:
            outcome = dataclasses.replace(outcome, revision=self.model_info.revision)  # as ModelServer.infer
        self.pending.append(Pending(outcome, self.delay_s))
        return self.pending[-1]

    def infer_stream(self, call):
        self.calls.append(call)
        return ScriptedStream(self.outcomes.pop(0))

    def info(self):
        self.calls.append("info")
        return Pending(self.model_info)

    def stats(self):
        return Pending({"rows": 0})
