"""The router's gathering of concurrent model calls into one ``infer_many`` request.

The gatherer alone (a fake ``send_many``), the ModelServer's side (``infer_many`` on a
model-less runtime), the ModelClient over a gathering backend (per-call errors, replica
loss retried per caller, generation alone) and the autoscaling load that counts calls.
No Ray is started.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorUnavailableError

from replica_fakes import FakeEncoder, server
from serve_app.config import ModelConfig, RouterConfig
from serve_app.core.calls import CallOutcomes, EmbedCall, EmbedResult, GenerateCall
from serve_app.core.errors import DeadlineExceededError, InvalidRequestError, OverloadedError, ServeAppError
from serve_app.core.tasks import CAPABILITIES
from serve_app.ingress.call_gathering import GROUPS_PER_REPLICA, CallGatherer, GatherLimits
from serve_app.ingress.model_client import ModelClient, ModelServerBackend
from serve_app.scaling import ONGOING_CALLS_METRIC, load
from handle_fakes import FakeBackend


def _answer(call: EmbedCall) -> EmbedResult:
    return EmbedResult(embeddings=[[float(len(t))] for t in call.texts], prompt_tokens=len(call.texts))


class _Replica:
    """``send_many`` of a fake replica: answers each group after ``release`` is set,
    failing the calls whose text is "bad" alone, or the whole group with ``fail_next``."""

    def __init__(self, name: str = "r1", *, hold: bool = False):
        self.name = name
        self.groups: list[list[EmbedCall]] = []
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.fail_next: list[BaseException] = []

    async def send_many(self, calls):
        self.groups.append(list(calls))
        await self.release.wait()
        if self.fail_next:
            raise self.fail_next.pop(0)
        outcomes = tuple(InvalidRequestError("bad input", param="input") if call.texts == ("bad",) else _answer(call)
                         for call in calls)
        return CallOutcomes(outcomes=outcomes, replica=self.name)


def _gatherer(send_many, *, max_ongoing=8, max_queued=8, max_batch=64, timeout_s=5.0) -> CallGatherer:
    return CallGatherer(send_many, GatherLimits.of(max_ongoing, max_queued, max_batch),
                        overloaded=lambda: OverloadedError("full", retry_after_s=1), default_timeout_s=timeout_s)


def _call(*texts: str, deadline=None) -> EmbedCall:
    return EmbedCall(texts=texts, deadline=deadline)


def test_calls_of_one_turn_travel_as_one_group_and_each_gets_its_own_outcome():
    async def scenario():
        replica = _Replica()
        gatherer = _gatherer(replica.send_many)
        futures = [gatherer.submit(_call("a")), gatherer.submit(_call("bad")), gatherer.submit(_call("ccc", "dd"))]
        results = await asyncio.gather(*futures, return_exceptions=True)
        return replica, gatherer, results

    replica, gatherer, results = asyncio.run(scenario())
    assert [len(group) for group in replica.groups] == [3]
    assert results[0] == _answer(_call("a"))
    assert isinstance(results[1], InvalidRequestError)  # only the bad call fails
    assert results[2] == _answer(_call("ccc", "dd"))
    assert gatherer.stats()["calls_per_group"] == 3.0


def test_calls_wait_while_every_slot_is_busy_then_leave_together():
    async def scenario():
        replica = _Replica(hold=True)
        gatherer = _gatherer(replica.send_many, max_ongoing=16)  # groups of up to 8 calls
        first = [gatherer.submit(_call("a"))]
        await asyncio.sleep(0)  # it leaves alone: a lone call never waits for company
        second = [gatherer.submit(_call("b"))]
        await asyncio.sleep(0)  # the second slot (one replica, two groups in flight)
        waiting = [gatherer.submit(_call(str(i))) for i in range(5)]
        await asyncio.sleep(0.01)
        sent_while_busy = [len(group) for group in replica.groups]
        replica.release.set()
        await asyncio.gather(*first, *second, *waiting)
        return sent_while_busy, [len(group) for group in replica.groups]

    sent_while_busy, sent = asyncio.run(scenario())
    assert sent_while_busy == [1] * GROUPS_PER_REPLICA
    assert sent == [1, 1, 5]


def test_groups_are_bounded_by_calls_and_rows_and_a_big_call_travels_alone():
    async def scenario():
        replica = _Replica()
        # max_ongoing 6 -> at most 3 calls per group; max_batch 4 -> at most 4 rows.
        gatherer = _gatherer(replica.send_many, max_ongoing=6, max_queued=64, max_batch=4)
        calls = [_call("a"), _call("b"), _call("c"), _call("d"), _call("e", "f", "g"), _call(*"hijklm"), _call("n")]
        await asyncio.gather(*(gatherer.submit(call) for call in calls))
        return [[call.rows for call in group] for group in replica.groups]

    groups = asyncio.run(scenario())
    assert groups == [[1, 1, 1], [1, 3], [6], [1]]


def test_a_full_model_answers_503_at_once_as_serves_own_queue_does():
    async def scenario():
        replica = _Replica(hold=True)
        gatherer = _gatherer(replica.send_many, max_ongoing=2, max_queued=1)  # 2 + 1 calls per replica
        accepted = [gatherer.submit(_call(str(i))) for i in range(3)]
        with pytest.raises(OverloadedError):
            gatherer.submit(_call("one too many"))
        replica.release.set()
        await asyncio.gather(*accepted)
        return await gatherer.submit(_call("room again"))

    assert asyncio.run(scenario()) == _answer(_call("room again"))


def test_a_failed_group_fails_each_of_its_calls_and_frees_its_slot():
    async def scenario():
        replica = _Replica()
        replica.fail_next.append(ActorUnavailableError("replica died", None))
        gatherer = _gatherer(replica.send_many)
        lost = await asyncio.gather(gatherer.submit(_call("a")), gatherer.submit(_call("b")), return_exceptions=True)
        again = await gatherer.submit(_call("c"))
        return lost, again, gatherer.stats()["in_flight_groups"]

    lost, again, in_flight = asyncio.run(scenario())
    assert all(isinstance(outcome, ActorUnavailableError) for outcome in lost)
    assert again == _answer(_call("c"))
    assert in_flight == 0


def test_a_call_whose_caller_stopped_waiting_is_not_sent():
    async def scenario():
        replica = _Replica(hold=True)
        gatherer = _gatherer(replica.send_many)
        busy = [gatherer.submit(_call("x")), gatherer.submit(_call("y"))]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        gone, kept = gatherer.submit(_call("gone")), gatherer.submit(_call("kept"))
        gone.cancel()
        replica.release.set()
        await asyncio.gather(*busy, kept)
        return [call.texts for group in replica.groups for call in group]

    assert ("gone",) not in asyncio.run(scenario())


def test_a_replica_that_never_answers_gives_its_slot_back_after_the_latest_deadline():
    async def scenario():
        replica = _Replica(hold=True)  # never released
        gatherer = _gatherer(replica.send_many)
        future = gatherer.submit(_call("a", deadline=time.time()))  # its slot comes back after the 1 s grace
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(future, 2.0)
        return gatherer.stats()["in_flight_groups"]

    assert asyncio.run(scenario()) == 0


def test_replicas_counted_from_the_answers_widen_the_flight():
    async def scenario():
        replicas = [_Replica("r1"), _Replica("r2")]
        turn = iter(range(10**6))

        async def send_many(calls):  # Serve's routing, alternating
            return await replicas[next(turn) % 2].send_many(calls)

        gatherer = _gatherer(send_many)
        await asyncio.gather(*(gatherer.submit(_call(str(i))) for i in range(4)))
        await gatherer.submit(_call("once more"))
        return gatherer.replicas()

    assert asyncio.run(scenario()) == 2


def test_a_quiet_spell_forgets_no_replica_and_a_burst_after_it_is_admitted():
    """Silence from every replica is no traffic, not fewer replicas: after a minute
    without requests, a burst gets the capacity of every replica that answered before."""

    async def scenario():
        now = [0.0]
        names = iter(f"r{i % 4}" for i in range(10**6))

        async def send_many(calls):
            return CallOutcomes(outcomes=tuple(_answer(c) for c in calls), replica=next(names))

        gatherer = CallGatherer(send_many, GatherLimits.of(8, 8, 64), default_timeout_s=5.0,
                                overloaded=lambda: OverloadedError("full", retry_after_s=1), clock=lambda: now[0])
        for i in range(8):
            await gatherer.submit(_call(str(i)))
        assert gatherer.replicas() == 4
        now[0] += 600.0  # ten quiet minutes
        burst = [gatherer.submit(_call(str(i))) for i in range(4 * 8 + 8)]  # what 4 replicas and the queue take
        await asyncio.gather(*burst)
        return gatherer.replicas()

    assert asyncio.run(scenario()) == 4


def test_a_replica_silent_while_others_answer_is_forgotten():
    async def scenario():
        now = [0.0]
        replica = ["r1"]

        async def send_many(calls):
            return CallOutcomes(outcomes=tuple(_answer(c) for c in calls), replica=replica[0])

        gatherer = CallGatherer(send_many, GatherLimits.of(8, 8, 64), default_timeout_s=5.0,
                                overloaded=lambda: OverloadedError("full", retry_after_s=1), clock=lambda: now[0])
        await gatherer.submit(_call("a"))
        replica[0] = "r2"
        await gatherer.submit(_call("b"))
        assert gatherer.replicas() == 2
        now[0] += 31.0  # r1 scaled down: only r2 answers from now on
        await gatherer.submit(_call("c"))
        return gatherer.replicas()

    assert asyncio.run(scenario()) == 1


def test_only_calls_of_like_cost_gather():
    gathers = [task for task, can in CAPABILITIES.items() if can.gathered]
    assert sorted(gathers) == ["embedding", "text-classification"]
    # A group answers when its slowest call ends: a long generation or a 64-megapixel
    # image would hold back every small call beside it.


# ---- the replica's side -------------------------------------------------------------


def test_infer_many_answers_each_call_as_infer_would_and_keeps_errors_apart():
    async def scenario():
        ms = server(FakeEncoder("embedding"))
        calls = [_call("one two"), _call("   "), _call("three")]  # an empty text: a 400 of its own call
        reply = await ms.infer_many(calls)
        alone = await ms.infer(calls[2])
        # A 13-letter word fails its sub-batch in the model (RuntimeError): a plain 500.
        broken = await ms.infer_many([_call("abcdefghijklm")])
        return ms, reply, alone, broken.outcomes[0]

    ms, reply, alone, broken = asyncio.run(scenario())
    good, empty, last = reply.outcomes
    assert isinstance(good, EmbedResult) and good.revision == ms.revision
    assert isinstance(empty, InvalidRequestError) and empty.param == "input"
    assert last == alone
    # The exception's text stays in the replica's log: the client learns where to look.
    assert type(broken) is ServeAppError and broken.code == "internal_error"
    assert "unlucky" not in broken.message and "RuntimeError" not in broken.message and "log" in broken.message
    assert ms.ongoing_calls == 0


def test_infer_many_drops_a_call_past_its_deadline_alone():
    async def scenario():
        ms = server(FakeEncoder("embedding"))
        return await ms.infer_many([_call("late", deadline=time.time() - 1), _call("fine")])

    late, fine = asyncio.run(scenario()).outcomes
    assert isinstance(late, DeadlineExceededError)
    assert isinstance(fine, EmbedResult)


def test_replica_reports_its_calls_in_progress_to_the_autoscaler():
    async def scenario():
        ms = server(FakeEncoder("embedding"))
        release = asyncio.Event()
        real = ms._handlers["embed"]

        async def slow(call):
            await release.wait()
            return await real(call)

        ms._handlers["embed"] = slow
        group = asyncio.ensure_future(ms.infer_many([_call("a"), _call("b"), _call("c")]))
        await asyncio.sleep(0.01)
        during = await ms.record_autoscaling_stats()
        release.set()
        await group
        return during, await ms.record_autoscaling_stats()

    during, after = asyncio.run(scenario())
    assert during == {ONGOING_CALLS_METRIC: 3.0}  # one Serve request, three calls
    assert after == {ONGOING_CALLS_METRIC: 0.0}


def _ctx(requests, ongoing=None, queued=0.0):
    metrics = None if ongoing is None else {ONGOING_CALLS_METRIC: dict(enumerate(ongoing))}
    return SimpleNamespace(total_num_requests=requests, total_queued_requests=queued, aggregated_metrics=metrics)


def test_autoscaling_load_counts_calls_not_serve_requests():
    assert load(_ctx(4.0, ongoing=[30.0, 28.0], queued=2.0)) == 60.0  # 2 groups per replica carry 58 calls
    assert load(_ctx(5.0)) == 5.0  # no replica has reported yet: Serve's count
    assert load(_ctx(9.0, ongoing=[3.0])) == 9.0  # Serve's count is larger (requests queued in handles)


# ---- the router's side ----------------------------------------------------------------


class _Pending:
    def __init__(self, coro):
        self._task = asyncio.ensure_future(coro)

    def __await__(self):
        return self._task.__await__()

    def cancel(self):
        self._task.cancel()


class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return _Pending(self._fn(*args))


class _Handle:
    """A DeploymentHandle stand-in in front of a real ModelServer (fake runtime)."""

    is_initialized = True

    def __init__(self, ms, lose_groups: int = 0):
        self.ms = ms
        self.lose_groups = lose_groups
        self.groups: list[int] = []
        self.single: list[object] = []

        async def infer(call):
            self.single.append(call)
            return await ms.infer(call)

        async def infer_many(calls):
            self.groups.append(len(calls))
            if self.lose_groups:
                self.lose_groups -= 1
                raise ActorUnavailableError("replica died", None)
            return await ms.infer_many(calls)

        self.infer, self.infer_many = _Method(infer), _Method(infer_many)

    def options(self, **_):
        return self


def _model(task="embedding") -> ModelConfig:
    return ModelConfig.model_validate({"name": "m", "source": "/nowhere", "task": task})


def test_client_over_a_gathering_backend_errors_per_call_and_retries_each_caller_after_replica_loss():
    async def scenario():
        handle = _Handle(server(FakeEncoder("embedding")), lose_groups=1)
        router = RouterConfig()
        client = ModelClient({"m": ModelServerBackend(handle, _model(), gather=True, router=router)}, router)
        results = await asyncio.gather(*(client.infer(_model(), _call(text)) for text in ("a", "bb", "  ", "ccc")),
                                       return_exceptions=True)
        return handle, client, results

    handle, client, results = asyncio.run(scenario())
    assert handle.groups[0] == 4 and sum(handle.groups[1:]) == 4  # lost once, each caller sent again
    assert [r.embeddings for r in (results[0], results[1], results[3])] == [[[1.0, 1.0]], [[1.0, 2.0]], [[1.0, 3.0]]]
    assert isinstance(results[2], InvalidRequestError)
    assert client.replica_retries["m"] == 4
    assert handle.single == []


def test_generation_and_a_backend_without_gathering_send_each_call_alone():
    generating = _Handle(server(FakeEncoder("embedding")))
    backend = ModelServerBackend(generating, _model("text-generation"), gather=True)
    assert backend.gatherer is None  # generation never gathers

    async def scenario():
        handle = _Handle(server(FakeEncoder("embedding")))
        client = ModelClient({"m": ModelServerBackend(handle, _model(), gather=False)}, RouterConfig())
        await asyncio.gather(*(client.infer(_model(), _call(text)) for text in ("a", "b")))
        gathering = ModelServerBackend(handle, _model(), gather=True)
        call = GenerateCall(max_tokens=1, prompts=("hi",))
        pending = gathering.infer(call)  # a generation call to it goes alone too (and is refused there)
        assert isinstance(pending, _Pending)
        with pytest.raises(InvalidRequestError):
            await pending
        return handle

    handle = asyncio.run(scenario())
    assert handle.groups == [] and len(handle.single) == 3


def test_a_replica_of_an_older_release_without_infer_many_gets_each_call_alone():
    from ray.serve.exceptions import RayServeException

    async def scenario():
        handle = _Handle(server(FakeEncoder("embedding")))

        async def missing(calls):  # what Serve's replica answers for an unknown method
            handle.groups.append(len(calls))
            raise RayServeException("Tried to call a method 'infer_many' that does not exist. Available methods: []")

        handle.infer_many = _Method(missing)
        client = ModelClient({"m": ModelServerBackend(handle, _model(), gather=True)}, RouterConfig())
        results = await asyncio.gather(*(client.infer(_model(), _call(text)) for text in ("a", "bb", "  ")),
                                       return_exceptions=True)
        return handle, results

    handle, results = asyncio.run(scenario())
    assert handle.groups == [3] and len(handle.single) == 3
    assert [r.embeddings for r in results[:2]] == [[[1.0, 1.0]], [[1.0, 2.0]]]
    assert isinstance(results[2], InvalidRequestError)


# ---- a replica whose engine died ------------------------------------------------------


class _DeadEngineFirst(FakeBackend):
    """A backend whose first ``dead`` calls land on a replica whose engine died."""

    def __init__(self, dead: int):
        self.dead, self.calls = dead, 0

    def infer(self, call):
        from serve_app.core.errors import EngineRestartingError

        self.calls += 1
        failing = self.calls <= self.dead

        async def answer():
            if failing:
                raise EngineRestartingError("the model's vLLM engine stopped")
            return _answer(call)

        task = asyncio.ensure_future(answer())
        return task


def test_a_call_that_met_a_dead_engine_is_retried_on_another_replica():
    async def scenario(dead):
        backend = _DeadEngineFirst(dead)
        client = ModelClient({"m": backend}, RouterConfig(replica_retries=2))
        try:
            return await client.infer(_model(), _call("hello")), backend.calls, client.replica_retries["m"]
        except ServeAppError as exc:
            return exc, backend.calls, client.replica_retries["m"]

    assert asyncio.run(scenario(1)) == (_answer(_call("hello")), 2, 1)
    error, calls, retries = asyncio.run(scenario(5))  # every replica dead: a 503 the client may retry
    assert (calls, retries, error.status_code, error.code) == (3, 2, 503, "engine_dead")
    assert error.headers()["Retry-After"]


def test_a_group_and_its_reply_stay_within_the_transports_byte_limit():
    """A group's size is the sum of its calls: many large texts, or many inputs whose
    answers are long vectors, would pass gRPC's message limit and fail together."""

    async def scenario():
        sizes = []

        async def send_many(calls):
            sizes.append([len(c.texts[0]) for c in calls])
            await asyncio.sleep(0.01)
            return CallOutcomes(outcomes=tuple(EmbedResult(embeddings=[[0.5] * 768 for _ in c.texts], prompt_tokens=1)
                                               for c in calls), replica="r1")

        gatherer = CallGatherer(send_many, GatherLimits.of(64, 64, 64, max_bytes=20_000), default_timeout_s=5.0,
                                overloaded=lambda: OverloadedError("full", retry_after_s=1))
        big = [_call("x" * 6_000) for _ in range(6)]  # 36 KB of text: at most three per group
        answers = await asyncio.gather(*(gatherer.submit(c) for c in big))
        text_groups = list(sizes)
        sizes.clear()
        # Now it knows an answer is 768 floats (~7 KB per input): at most two short calls per group.
        await asyncio.gather(*(gatherer.submit(_call("y")) for _ in range(6)))
        return answers, text_groups, list(sizes)

    answers, text_groups, vector_groups = asyncio.run(scenario())
    assert len(answers) == 6 and all(len(a.embeddings[0]) == 768 for a in answers)
    assert all(sum(group) <= 20_000 for group in text_groups) and sum(map(len, text_groups)) == 6
    assert all(len(group) * (9 * 768 + 16) <= 20_000 for group in vector_groups), vector_groups
