"""The continuous batcher's memory bound, exception safety and generation_config.

- the KV budget bounds the cache as allocated (rows x padded width), not the rows' own tokens;
- a failure anywhere in a step ends every row it hit exactly once, leaves the layers
  agreeing on their row count, returns the reservation to 0, and the engine goes on;
- the model's generation_config (repetition_penalty) shapes the continuous engine's
  tokens as it shapes the static engine's.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import shutil

import pytest
import torch

from serve_app.core.continuous import kv_cache
from serve_app.core.calls import SamplingParams
from serve_app.core.continuous.engine import ContinuousBatcher
from serve_app.core.models import GenerationRequest, GenerationResult, GenerationRuntime, LoadOptions, load_runtime

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")



class Sink:
    """Counts what the engine delivers; on_finish more than once is recorded, not raised
    (the engine would swallow an assertion raised from a sink)."""

    def __init__(self):
        self.deltas: list[str] = []
        self.outcomes: list = []

    def on_delta(self, text: str) -> None:
        self.deltas.append(text)

    def on_finish(self, outcome) -> None:
        self.outcomes.append(outcome)

    @property
    def outcome(self):
        assert len(self.outcomes) == 1, f"on_finish called {len(self.outcomes)} times"
        return self.outcomes[0]

    @property
    def result(self) -> GenerationResult:
        assert isinstance(self.outcome, GenerationResult), self.outcome
        return self.outcome


def _req(llm, prompt, max_tokens):
    return GenerationRequest(prompt_ids=llm.encode_prompt(prompt), max_tokens=max_tokens)


def _alone(llm, req, params=GREEDY) -> GenerationResult:
    (out,) = llm.generate([req], params)
    return out


def _cache_shape(cache) -> tuple[int, int]:
    """(rows, columns) of a cache's tensors as allocated now; every layer must agree."""
    shapes = {(t.shape[0], t.shape[2]) for layer in cache.layers for t in (layer.keys, layer.values)}
    assert len(shapes) == 1, f"layers disagree on their shape: {shapes}"
    return shapes.pop()


def _allocated_slots(batcher: ContinuousBatcher) -> int:
    """Rows x columns of the cache tensors as allocated now; every layer must agree, and agree with the rows."""
    if batcher._cache is None:
        assert not batcher._active and batcher._mask is None
        return 0
    rows, columns = _cache_shape(batcher._cache)
    assert rows == len(batcher._active) == batcher._mask.shape[0]
    assert columns == batcher._mask.shape[1]
    assert batcher._mask.sum(dim=1).tolist() == [r.cached_len for r in batcher._active]
    return rows * columns


def _drain(batcher: ContinuousBatcher, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        worked = batcher.step()
        _allocated_slots(batcher)
        if not worked:
            return
    raise AssertionError("batcher did not go idle")


# --------------------------------------------------------------------------- the KV budget


def test_peak_slots_is_the_most_a_left_padded_batch_allocates():
    """Against a step-by-step simulation of rows that all run to their limit."""
    rng = random.Random(0)
    for _ in range(300):
        rows = []
        for _ in range(rng.randint(1, 7)):
            cached = rng.randint(1, 40)
            rows.append((cached, cached + rng.randint(0, 40)))
        simulated = 0
        for k in itertools.count():
            alive = [c + k for c, f in rows if c + k <= f]
            if not alive:
                break
            simulated = max(simulated, len(alive) * max(alive))
        assert kv_cache.peak_slots(rows) == simulated, rows
    assert kv_cache.peak_slots([]) == 0


def test_one_long_row_beside_many_short_ones_stays_within_the_budget(llm):
    """The cache is rows x the longest row: short rows joining a long one are charged its width.

    Charging each row its own prompt + max_tokens (an earlier version of this code) admits all
    ten short rows here, and the cache grows to about 11 x 45 slots against a budget of
    about 180.
    """
    long_req = _req(llm, "Hello world", 100)
    shorts = [_req(llm, p, 4) for p in ("Red, green", "One, two", "Monday", "Blue", "Cat", "Dog and cat",
                                        "The sun", "Rain", "Snow fall", "Trees")]
    cost = lambda r: len(r.prompt_ids) + r.max_tokens  # noqa: E731
    budget = cost(long_req) + sum(cost(r) for r in shorts)  # what per-row charging lets in all at once
    batcher = ContinuousBatcher(llm, max_rows=16, kv_token_budget=budget)

    peak = {"slots": 0, "rows_beside_long": 0}
    real_forward = batcher._forward

    def measuring_forward(ids, mask, positions, cache):
        logits = real_forward(ids, mask, positions, cache)
        if cache is batcher._cache:  # the running batch's decode: the cache just grew by one column
            rows, columns = _cache_shape(cache)
            peak["slots"] = max(peak["slots"], rows * columns)
            if long_sink.outcomes == []:
                peak["rows_beside_long"] = max(peak["rows_beside_long"], len(batcher._active) - 1)
        return logits

    batcher._forward = measuring_forward
    long_sink = Sink()
    batcher.submit(long_req, GREEDY, long_sink)
    for _ in range(40):  # the long row grows to ~45 columns alone
        batcher.step()
    short_sinks = [Sink() for _ in shorts]
    for req, sink in zip(shorts, short_sinks):
        batcher.submit(req, GREEDY, sink)
    seen_reserved = []
    for _ in range(500):
        worked = batcher.step()
        stats = batcher.stats()
        slots = _allocated_slots(batcher)
        assert slots == stats.kv_cache_slots <= stats.kv_tokens_reserved or stats.active_rows == 0
        if stats.active_rows > 1:
            assert stats.kv_tokens_reserved <= budget
        seen_reserved.append(stats.kv_tokens_reserved)
        if not worked:
            break
    assert peak["slots"] <= budget, f"{peak['slots']} cache slots allocated against a budget of {budget}"
    assert peak["rows_beside_long"] >= 2, "short rows should still run beside the long one"
    assert long_sink.result.token_ids == _alone(llm, long_req).token_ids
    for req, sink in zip(shorts, short_sinks):
        assert sink.result.token_ids == _alone(llm, req).token_ids
    assert batcher.stats().kv_tokens_reserved == 0 and seen_reserved[-1] == 0


# --------------------------------------------------------------------------- exception safety

# Two rows run; before the third step two more join (one ends at its first token, so
# the prefill cache is cut before the merge) while a running row reaches its limit
# (so the decode cuts it out): that step prefills, cuts, merges, decodes and cuts.
_RUNNING = [("Hello world", 12), ("The sun was warm", 4)]
_JOINING = [("Red, green", 8), ("One", 1)]
_JOIN_STEP = 2


def _run_with(llm, inject) -> tuple[ContinuousBatcher, list[Sink], list[Sink]]:
    batcher = ContinuousBatcher(llm, max_rows=4, kv_token_budget=10_000)
    running = [Sink() for _ in _RUNNING]
    for (prompt, max_tokens), sink in zip(_RUNNING, running):
        batcher.submit(_req(llm, prompt, max_tokens), GREEDY, sink)
    for _ in range(_JOIN_STEP):
        batcher.step()
    joining = [Sink() for _ in _JOINING]
    for (prompt, max_tokens), sink in zip(_JOINING, joining):
        batcher.submit(_req(llm, prompt, max_tokens), GREEDY, sink)
    with inject(batcher):
        try:
            batcher.step()
        except Exception:  # an error the step did not expect is raised, its rows already ended
            pass
    _allocated_slots(batcher)  # the layers agree, with each other and with the rows
    _drain(batcher)
    return batcher, running, joining


def _check_all_ended_and_engine_serves(llm, batcher, running, joining, error_type=RuntimeError):
    specs = _RUNNING + _JOINING
    for (prompt, max_tokens), sink in zip(specs, running + joining):
        outcome = sink.outcome  # exactly once
        alone = _alone(llm, _req(llm, prompt, max_tokens))
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, error_type), outcome
            assert alone.text.startswith("".join(sink.deltas)), prompt  # what it streamed was right
        else:
            assert outcome.token_ids == alone.token_ids, prompt
            assert "".join(sink.deltas) == outcome.text
    stats = batcher.stats()
    assert stats.active_rows == stats.waiting_rows == 0
    assert stats.kv_tokens_reserved == 0 and stats.kv_cache_slots == 0
    assert stats.rows_finished == stats.rows_submitted == len(specs)
    assert stats.rows_failed == sum(isinstance(s.outcome, BaseException) for s in running + joining)
    later = Sink()
    req = _req(llm, "Once upon a time", 10)
    batcher.submit(req, GREEDY, later)
    _drain(batcher)
    assert later.result.token_ids == _alone(llm, req).token_ids


def _fail_once(target, name, *, on_call: int = 1, error=None):
    """A context: ``target.name`` raises ``error`` on its ``on_call``-th call, then behaves again."""
    @contextlib.contextmanager
    def inject(_batcher):
        real = getattr(target, name)
        calls = {"n": 0}

        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == on_call:
                raise error or RuntimeError(f"injected failure in {name} (call {on_call})")
            return real(*args, **kwargs)

        setattr(target, name, wrapper)
        try:
            yield calls
        finally:
            setattr(target, name, real)
    return inject


def _count_torch_cat_in_join_step(llm) -> int:
    counter = {"n": 0}

    @contextlib.contextmanager
    def count(_batcher):
        real = torch.cat

        def wrapper(*args, **kwargs):
            counter["n"] += 1
            return real(*args, **kwargs)

        torch.cat = wrapper
        try:
            yield
        finally:
            torch.cat = real
    _run_with(llm, count)
    return counter["n"]


def test_an_out_of_memory_in_any_torch_cat_of_a_join_step_ends_every_row_once(llm):
    """Every torch.cat the join step makes (prefill and decode forwards, the merge, the masks), failing in turn."""
    calls = _count_torch_cat_in_join_step(llm)
    assert calls >= 4
    for n in range(1, calls + 1):
        error = torch.OutOfMemoryError(f"injected: CUDA out of memory (torch.cat call {n})")
        batcher, running, joining = _run_with(llm, _fail_once(torch, "cat", on_call=n, error=error))
        _check_all_ended_and_engine_serves(llm, batcher, running, joining, error_type=torch.OutOfMemoryError)


@pytest.mark.parametrize("on_call", [1, 2, 3, 4])
def test_a_merge_failing_at_any_layer_leaves_the_running_batch_whole(llm, on_call):
    """Layer 0's keys, layer 0's values, layer 1's keys (after layer 0 merged), layer 1's values."""
    batcher, running, joining = _run_with(llm, _fail_once(kv_cache, "_stack_left_padded", on_call=on_call))
    _check_all_ended_and_engine_serves(llm, batcher, running, joining)
    # the joining rows failed before streaming anything; the running ones were untouched
    assert all(isinstance(s.outcome, RuntimeError) and s.deltas == [] for s in joining)
    assert all(isinstance(s.outcome, GenerationResult) for s in running)


@pytest.mark.parametrize("on_call", [1, 2])
def test_cutting_rows_failing_ends_each_row_once(llm, on_call):
    """Call 1 cuts the prefill cache (a joining row ended at its first token), call 2 the running batch."""
    batcher, running, joining = _run_with(llm, _fail_once(kv_cache, "select_rows", on_call=on_call))
    _check_all_ended_and_engine_serves(llm, batcher, running, joining)
    if on_call == 1:
        assert all(isinstance(s.outcome, RuntimeError) and s.deltas == [] for s in joining)
        assert all(isinstance(s.outcome, GenerationResult) for s in running)
    else:
        # the row that reached its limit ended with its result, once; the others failed
        assert isinstance(running[1].outcome, GenerationResult) and running[1].outcome.finish_reason == "length"


@pytest.mark.parametrize("name,on_call", [("_sample", 1), ("_sample", 2), ("_take", 1), ("_take", 3),
                                          ("_keep_rows", 1), ("_merge", 1), ("_prefill_forward", 1)])
def test_a_failing_engine_helper_ends_every_row_once(llm, name, on_call):
    """The batcher's own steps failing in the join step: sampling (prefill, decode), recording
    a token (a joining row's, a running row's), cutting rows, merging, the prefill forward."""
    # patch the bound method on the instance: the batcher calls self.<name>
    @contextlib.contextmanager
    def on_instance(batcher):
        real = getattr(batcher, name)
        calls = {"n": 0}

        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == on_call:
                raise RuntimeError(f"injected failure in {name}")
            return real(*args, **kwargs)

        setattr(batcher, name, wrapper)
        try:
            yield
        finally:
            delattr(batcher, name)

    batcher, running, joining = _run_with(llm, on_instance)
    _check_all_ended_and_engine_serves(llm, batcher, running, joining)


def test_an_unexpected_error_in_admission_ends_the_running_rows_and_the_engine_goes_on(llm):
    batcher, running, joining = _run_with(llm, _fail_once(kv_cache, "peak_slots"))
    # The step raised before admitting anyone: the running rows were failed, the
    # joining ones still waited and then ran.
    assert all(isinstance(s.outcome, RuntimeError) for s in running)
    _check_all_ended_and_engine_serves(llm, batcher, running, joining)


def test_an_error_in_admission_after_a_row_left_the_queue_ends_that_row_too(llm):
    # The second peak_slots call raises after the first joining row was popped from the
    # queue: that row must end (with the error), not vanish between queue and batch.
    batcher, running, joining = _run_with(llm, _fail_once(kv_cache, "peak_slots", on_call=2))
    assert isinstance(joining[0].outcome, RuntimeError)
    _check_all_ended_and_engine_serves(llm, batcher, running, joining)


# --------------------------------------------------------------------------- generation_config


@pytest.fixture(scope="module")
def penalised_llm(tiny_llama_dir, tmp_path_factory) -> GenerationRuntime:
    """The tiny Llama with a generation_config.json asking for repetition_penalty, as
    Qwen2.5-Instruct's does (1.1 there; stronger here so that the random model's
    greedy tokens change)."""
    path = tmp_path_factory.mktemp("tiny_llama_penalised")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    config_file = path / "generation_config.json"
    config = json.loads(config_file.read_text())
    config["repetition_penalty"] = 1.8
    config_file.write_text(json.dumps(config))
    return load_runtime(LoadOptions(source=str(path), task="text-generation"))


_PROMPTS = [("Hello world", 24, 0), ("Once upon a time there was a little cat", 16, 0), ("Red, green", 20, 3)]


def test_continuous_greedy_honours_generation_config_like_the_static_engine(llm, penalised_llm):
    assert penalised_llm.model.generation_config.repetition_penalty == 1.8
    batcher = ContinuousBatcher(penalised_llm, max_rows=4, kv_token_budget=10_000)
    sinks = [Sink() for _ in _PROMPTS]
    for step in range(200):
        for (prompt, max_tokens, at), sink in zip(_PROMPTS, sinks):
            if at == step:  # rows joining mid-flight, of different prompt lengths
                batcher.submit(_req(penalised_llm, prompt, max_tokens), GREEDY, sink)
        if not batcher.step() and step > 3:
            break
    changed = False
    for (prompt, max_tokens, _), sink in zip(_PROMPTS, sinks):
        static = _alone(penalised_llm, _req(penalised_llm, prompt, max_tokens))
        assert sink.result.token_ids == static.token_ids, prompt
        assert sink.result.text == "".join(sink.deltas) == static.text
        changed |= static.token_ids != _alone(llm, _req(llm, prompt, max_tokens)).token_ids
    assert changed, "the penalty should change the tiny model's greedy tokens, or this test shows nothing"


def test_sampling_applies_generation_config_before_temperature_and_top_p(penalised_llm):
    # top_p this small keeps only the best token: sampling after the penalty is the penalised greedy run.
    req = _req(penalised_llm, "Hello world", 16)
    batcher = ContinuousBatcher(penalised_llm, max_rows=1, kv_token_budget=10_000)
    sink = Sink()
    batcher.submit(req, SamplingParams(temperature=1.0, top_p=1e-6, seed=3), sink)
    _drain(batcher)
    assert sink.result.token_ids == _alone(penalised_llm, req).token_ids


def test_a_plain_generation_config_adds_no_per_row_processing(llm):
    batcher = ContinuousBatcher(llm, max_rows=1, kv_token_budget=10_000)
    batcher.submit(_req(llm, "Hello world", 4), GREEDY, Sink())
    batcher.step()
    (row,) = batcher._active
    assert row.processors is None


@pytest.mark.parametrize("temperature", [4.5e-296, 1e-6, 1e-3])
def test_a_vanishing_temperature_is_an_answer_not_an_error_in_both_engines(llm, temperature):
    # logits / 4.5e-296 is inf and the draw failed on NaN: a 500 after the call was queued.
    params = SamplingParams(temperature=temperature, seed=7)
    assert params.temperature in (0.0, 1e-2), "vLLM's rule: below 1e-5 greedy, else at least 1e-2"
    req = _req(llm, "Hello world", 8)
    static = _alone(llm, req, params)
    batcher = ContinuousBatcher(llm, max_rows=1, kv_token_budget=10_000)
    sink = Sink()
    batcher.submit(req, params, sink)
    _drain(batcher)
    assert len(sink.result.token_ids) == len(static.token_ids) > 0
    if params.greedy:
        assert sink.result.token_ids == static.token_ids == _alone(llm, req).token_ids
