"""core.coalescing.Coalescer: calls made together leave as one (the cache's lookups and
write-backs; the call gatherer adds replicas on top, tests/unit/test_call_gathering.py). No Ray."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.core.coalescing import Coalescer


class Callee:
    """send_many that records each batch, answers item * 10 after ``delay_s``, or fails."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.batches, self.fail, self.hang = delay_s, [], None, False

    async def __call__(self, items):
        self.batches.append(list(items))
        if self.hang:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        return [item * 10 for item in items]


def test_a_lone_call_leaves_at_once_and_calls_in_one_turn_leave_together():
    async def main():
        callee = Callee()
        batcher = Coalescer(callee, timeout_s=1.0)
        started = time.perf_counter()
        assert await batcher.call(1) == 10
        assert time.perf_counter() - started < 0.05  # no timer to wait out
        assert await asyncio.gather(*(batcher.call(i) for i in range(5))) == [0, 10, 20, 30, 40]
        return callee, batcher

    callee, batcher = asyncio.run(main())
    assert callee.batches == [[1], [0, 1, 2, 3, 4]]
    assert (batcher.calls, batcher.batches) == (6, 2)


def test_calls_made_while_batches_are_out_queue_and_leave_as_one():
    async def main():
        callee = Callee(delay_s=0.02)
        batcher = Coalescer(callee, timeout_s=1.0, max_in_flight=1)
        first = asyncio.ensure_future(batcher.call(0))
        await asyncio.sleep(0.005)  # the first batch is out
        later = [asyncio.ensure_future(batcher.call(i)) for i in range(1, 8)]
        results = await asyncio.gather(first, *later)
        return callee, results

    callee, results = asyncio.run(main())
    assert results == [i * 10 for i in range(8)]
    assert callee.batches == [[0], [1, 2, 3, 4, 5, 6, 7]]


def test_batches_hold_at_most_max_batch_items():
    async def main():
        callee = Callee()
        batcher = Coalescer(callee, timeout_s=1.0, max_items=3, max_in_flight=1)
        assert await asyncio.gather(*(batcher.call(i) for i in range(7))) == [i * 10 for i in range(7)]
        return callee

    assert [len(b) for b in asyncio.run(main()).batches] == [3, 3, 1]


def test_a_failed_batch_fails_its_callers_only_and_the_next_batch_works():
    async def main():
        callee = Callee()
        batcher = Coalescer(callee, timeout_s=1.0)
        callee.fail = ConnectionError("down")
        outcomes = await asyncio.gather(*(batcher.call(i) for i in range(3)), return_exceptions=True)
        assert all(isinstance(o, ConnectionError) for o in outcomes)
        callee.fail = None
        assert await batcher.call(4) == 40

    asyncio.run(main())


def test_a_hung_batch_times_out_and_frees_its_slot():
    async def main():
        callee = Callee()
        batcher = Coalescer(callee, timeout_s=0.05, max_in_flight=1)
        callee.hang = True
        started = time.perf_counter()
        with pytest.raises(asyncio.TimeoutError):
            await batcher.call(1)
        assert time.perf_counter() - started < 0.5
        callee.hang = False
        assert await batcher.call(2) == 20  # the slot is free again

    asyncio.run(main())


def test_a_wrong_number_of_results_is_an_error_for_every_caller():
    async def main():
        async def short(items):
            return items[:-1]

        batcher = Coalescer(short, timeout_s=1.0)
        outcomes = await asyncio.gather(batcher.call(1), batcher.call(2), return_exceptions=True)
        assert all(isinstance(o, RuntimeError) and "1 results for 2 items" in str(o) for o in outcomes)

    asyncio.run(main())


def test_a_caller_that_stops_waiting_leaves_the_others_their_answers():
    async def main():
        callee = Callee(delay_s=0.05)
        batcher = Coalescer(callee, timeout_s=1.0)
        impatient = asyncio.ensure_future(asyncio.wait_for(batcher.call(1), 0.01))
        patient = asyncio.ensure_future(batcher.call(2))
        with pytest.raises(asyncio.TimeoutError):
            await impatient
        assert await patient == 20
        return callee

    assert [sorted(batch) for batch in asyncio.run(main()).batches] == [[1, 2]]  # one batch


def test_settings_are_checked():
    with pytest.raises(ValueError):
        Coalescer(Callee(), timeout_s=0)
    with pytest.raises(ValueError):
        Coalescer(Callee(), timeout_s=1.0, max_items=0)


def test_submit_queues_without_waiting_and_its_future_carries_the_outcome():
    async def main():
        callee = Callee(delay_s=0.01)
        batcher = Coalescer(callee, timeout_s=1.0)
        done = asyncio.ensure_future(batcher.submit(3))
        assert not done.done()
        assert await done == 30
        callee.fail = ConnectionError("down")
        failed = batcher.submit(4)
        seen = []
        failed.add_done_callback(lambda f: seen.append(f.exception()))
        await asyncio.sleep(0.05)
        assert isinstance(seen[0], ConnectionError)

    asyncio.run(main())


def test_a_quiet_batcher_starts_one_task_per_batch():
    async def main():
        batcher = Coalescer(Callee(), timeout_s=1.0, max_in_flight=2)
        created = []
        loop = asyncio.get_running_loop()
        original = loop.create_task

        def counting(coro, **kw):
            created.append(coro.__qualname__)
            return original(coro, **kw)

        loop.create_task = counting
        for i in range(3):
            assert await batcher.call(i) == i * 10
        return created.count("Coalescer._send"), batcher.batches

    assert asyncio.run(main()) == (3, 3)  # no idle second task per call


def test_a_batch_stays_within_its_byte_budget_and_a_large_item_goes_alone():
    async def scenario():
        sent = []

        async def send_many(items):
            sent.append(list(items))
            await asyncio.sleep(0.01)
            return items

        batcher = Coalescer(send_many, timeout_s=5, max_in_flight=1, size_of=len, max_bytes=10)
        results = await asyncio.gather(*(batcher.call(item) for item in ("aaaa", "bbbb", "cccc", "d" * 30, "ee")))
        return results, sent

    results, sent = asyncio.run(scenario())
    assert results == ["aaaa", "bbbb", "cccc", "d" * 30, "ee"]
    assert all(sum(map(len, batch)) <= 10 or len(batch) == 1 for batch in sent), sent
    assert ["d" * 30] in sent


def test_a_bounded_reply_leaves_out_what_does_not_fit_and_never_sends_nothing():
    from serve_app.core.cache import NOT_SENT, bounded_reply

    assert bounded_reply([b"aaaa", None, b"bbbb", b"cc"], 7) == [b"aaaa", None, NOT_SENT, b"cc"]
    assert bounded_reply([b"x" * 20, b"y"], 7) == [None, b"y"]  # larger than any reply: a miss
    assert bounded_reply([b"aaaa"], None) == [b"aaaa"]
