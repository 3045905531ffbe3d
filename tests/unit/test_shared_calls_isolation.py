"""Shared calls belong to no one caller: a gathered group, a coalesced model call and a
batch of cache lookups run detached from the request that happened to start them.

Ray Serve records a handle call as a child of the request whose context it was made in,
and with direct ingress (the high-throughput mode we ship) cancels the children of a
cancelled request. ``_ServeChildren`` plays that part here with Ray's own request
context variable: a shared call that saw the first caller's request id would be
cancelled with that caller, and every other caller of the group would lose its answer.
No Ray is started.
"""

from __future__ import annotations

import asyncio
import contextvars

import pytest
from ray.serve import context as serve_context

from serve_app.core.cache import SingleFlight
from serve_app.core.coalescing import Coalescer
from serve_app.core.calls import CallOutcomes, EmbedCall, EmbedResult
from serve_app.core.errors import OverloadedError
from serve_app.core.shared_tasks import SharedCallCancelled, start_shared
from serve_app.ingress.call_gathering import CallGatherer, GatherLimits

CALLER_NOTE: contextvars.ContextVar[str] = contextvars.ContextVar("test_caller_note", default="")


class _ServeChildren:
    """Handle calls by the Serve request they were made under, as Ray keeps them
    (``ray.serve.context._in_flight_requests``), and Ray's cancellation of a request's children."""

    def __init__(self):
        self.by_parent: dict[str, list[asyncio.Task]] = {}
        self.seen: list[tuple[str, str]] = []  # (parent request id, caller note) of each call
        self.release = asyncio.Event()

    async def call(self, answer):
        request = serve_context._get_serve_request_context()
        self.seen.append((request._internal_request_id, CALLER_NOTE.get()))
        if request.cancel_on_parent_request_cancel:
            self.by_parent.setdefault(request._internal_request_id, []).append(asyncio.current_task())
        await self.release.wait()
        return answer

    def cancel_request(self, request_id: str) -> None:
        for task in self.by_parent.pop(request_id, []):
            task.cancel()


async def _as_request(request_id: str, work):
    """Run ``work()`` as Serve runs a request's handler under direct ingress."""
    serve_context._serve_request_context.set(serve_context._RequestContext(
        _internal_request_id=request_id, request_id=request_id, cancel_on_parent_request_cancel=True))
    CALLER_NOTE.set(request_id)
    return await work()


def _embed(texts: tuple[str, ...]) -> EmbedResult:
    return EmbedResult(embeddings=[[float(len(t))] for t in texts], prompt_tokens=len(texts))


async def _first_caller_leaves(share, calls: int = 3):
    """``calls`` requests share one call; the first one's request is cancelled, as Serve
    cancels a request whose client hung up; the others must still get their answers."""
    serve = _ServeChildren()
    tasks = [asyncio.create_task(_as_request(f"request-{i}", lambda i=i: share(serve, i))) for i in range(calls)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert serve.seen, "the shared call did not start"
    serve.cancel_request("request-0")
    tasks[0].cancel()
    serve.release.set()
    answers = await asyncio.gather(*tasks[1:])
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    return serve, answers


def test_a_gathered_group_survives_its_first_caller_leaving():
    async def main():
        serve = None

        async def send_many(calls):
            return await serve.call(CallOutcomes(outcomes=tuple(_embed(c.texts) for c in calls), replica="r1"))

        gatherer = CallGatherer(send_many, GatherLimits.of(8, 8, 64), default_timeout_s=5.0,
                                overloaded=lambda: OverloadedError("full"))

        async def share(children, i):
            nonlocal serve
            serve = children
            return await gatherer.submit(EmbedCall(texts=(f"text {i}",)))

        children, answers = await _first_caller_leaves(share)
        assert children.seen == [("", "")], "the group ran under a caller's request context"
        assert [a.embeddings for a in answers] == [[[6.0]], [[6.0]]]

    asyncio.run(main())


def test_a_coalesced_model_call_survives_its_first_caller_leaving():
    async def main():
        flights = SingleFlight()

        async def share(children, i):
            result, _ = await flights.run("same question", lambda: children.call(_embed(("same",))))
            return result

        children, answers = await _first_caller_leaves(share)
        assert children.seen == [("", "")]
        assert answers[0] is answers[1] and answers[0].embeddings == [[4.0]]

    asyncio.run(main())


def test_a_batch_of_cache_lookups_survives_its_first_caller_leaving():
    async def main():
        serve = None

        async def get_many(keys):
            return await serve.call([f"value of {k}" for k in keys])

        batcher = Coalescer(get_many, timeout_s=5.0)

        async def share(children, i):
            nonlocal serve
            serve = children
            return await batcher.call(f"key-{i}")

        children, answers = await _first_caller_leaves(share)
        assert children.seen == [("", "")]
        assert answers == ["value of key-1", "value of key-2"]

    asyncio.run(main())


def test_a_cancelled_shared_call_is_an_error_to_its_callers_not_their_cancellation():
    """At shutdown a shared task can still be cancelled: its callers get an error they
    handle (a retry, a cache miss, a 503), and asyncio does not see them cancelled."""

    async def main():
        never = asyncio.Event()

        async def hang(_items):
            await never.wait()

        batcher = Coalescer(hang, timeout_s=5.0)
        lookup = asyncio.ensure_future(batcher.call("key"))
        await asyncio.sleep(0.01)
        for task in list(batcher._tasks):
            task.cancel()
        with pytest.raises(SharedCallCancelled):
            await lookup

        flights = SingleFlight()
        waiter = asyncio.ensure_future(flights.run("k", never.wait))
        await asyncio.sleep(0.01)
        for task in list(flights._calls.values()):
            task.cancel()
        with pytest.raises(SharedCallCancelled) as raised:
            await waiter
        assert raised.value.status_code == 503

    asyncio.run(main())


def test_start_shared_sees_none_of_the_callers_context():
    async def main():
        CALLER_NOTE.set("caller")
        serve_context._serve_request_context.set(serve_context._RequestContext(
            _internal_request_id="caller", cancel_on_parent_request_cancel=True))

        async def inside():
            return CALLER_NOTE.get(), serve_context._get_serve_request_context().cancel_on_parent_request_cancel

        assert await start_shared(inside()) == ("", False)
        assert CALLER_NOTE.get() == "caller"  # the caller's own context is untouched

    asyncio.run(main())
