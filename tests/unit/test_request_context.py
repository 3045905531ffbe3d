"""ingress/request_context.py: one context per request, its deadline shared by every call
made for it, its notes, and nothing left behind. No Ray."""

from __future__ import annotations

import asyncio
import time

from serve_app.ingress import request_context


def test_a_request_has_one_deadline_from_its_arrival():
    context, token = request_context.begin(5.0, request_id="r1")
    try:
        assert request_context.current() is context and context.request_id == "r1"
        first = request_context.deadline(60.0)  # the request's, not a fresh one per call
        time.sleep(0.01)
        assert request_context.deadline(60.0) == first == context.deadline
        assert context.deadline - time.monotonic() <= 5.0
    finally:
        request_context.end(token)
    assert request_context.current() is None
    outside = request_context.deadline(60.0)  # outside a request: a request arriving now
    assert 59.0 < outside - time.monotonic() <= 60.0


def test_notes_reach_the_request_they_were_made_in_and_tasks_inherit_it():
    async def request(name: str):
        context, token = request_context.begin(5.0)
        try:
            await asyncio.sleep(0)
            await asyncio.create_task(_note_in_a_task(name))
            return context
        finally:
            request_context.end(token)

    async def _note_in_a_task(name: str):
        request_context.note(model=name, cache="hit")

    async def main():
        return await asyncio.gather(request("a"), request("b"))

    a, b = asyncio.run(main())
    assert (a.model, b.model) == ("a", "b") and a.cache == b.cache == "hit"
    assert a.request_id != b.request_id  # a fresh id outside Serve
    request_context.note(model="nobody")  # outside a request: a no-op


def test_wall_clock_is_the_same_instant():
    deadline = time.monotonic() + 2.0
    assert abs(request_context.wall_clock(deadline) - (time.time() + 2.0)) < 0.05
