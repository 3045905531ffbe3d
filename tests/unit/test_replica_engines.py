"""Generation in the replica without Ray: the static engine over a fake runtime, the
continuous engine over the tiny random Llama, and the engine factory."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from serve_app.config import BatchingConfig
from serve_app.core.calls import (
    ChatTurn, Completion, GenerateCall, ResponseFormat, SamplingParams, StreamDelta, StreamEnd, ToolsSpec,
)
from serve_app.core.errors import ContextLengthExceededError, DeadlineExceededError, InvalidRequestError
from serve_app.core.models import GenerationResult
from serve_app.replica import engines
from serve_app.replica.engines import ContinuousEngine, StaticEngine, make_engine
from serve_app.replica.stats import ReplicaObserver

from replica_fakes import FakeMetrics, run, server

GREEDY = SamplingParams(temperature=0.0)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


class FakeGenerator:
    """A text-generation runtime without a model: a prompt's ids are its word lengths, and
    it "generates" the prompt's words back, one delta each. A prompt "wait" runs until
    it is cancelled."""

    task, device, dtype, revision, max_input_tokens = "text-generation", "cpu", torch.float32, "rev-g", 20

    def __init__(self):
        self.calls: list[tuple[list, SamplingParams]] = []
        self.started = threading.Event()

    def encode_prompt(self, prompt: str) -> list[int]:
        if not prompt:
            raise InvalidRequestError("prompt is empty; give some text", param="prompt")
        return [len(word) for word in prompt.split()]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return [len(m["content"]) for m in messages]

    def generate(self, requests, params, *, on_delta=None, is_cancelled=None):
        self.calls.append((requests, params))
        self.started.set()
        results = []
        for i, request in enumerate(requests):
            words = [f"w{n}" for n in request.prompt_ids][:request.max_tokens]
            reason = "length"
            if request.prompt_ids == [4]:  # "wait": one word, then nothing until cancelled
                on_delta(i, "w4")
                deadline = time.monotonic() + 10
                while not is_cancelled(i) and time.monotonic() < deadline:
                    time.sleep(0.005)
                reason = "cancelled"
            elif on_delta is not None:
                for word in words:
                    on_delta(i, word)
            results.append(GenerationResult(text="".join(words), token_ids=list(range(len(words))),
                                            finish_reason=reason, prompt_tokens=len(request.prompt_ids),
                                            completion_tokens=len(words), time_to_first_token_s=0.01))
        return results


def static_server(runtime=None):
    return server(runtime or FakeGenerator(), generation={"engine": "static"})


# ---- the static engine ----------------------------------------------------------------


def test_static_generate_returns_completions_in_order():
    ms = static_server()
    result = run(ms.infer(GenerateCall(max_tokens=3, prompts=("a bb", "ccc dddd eeeee ffffff"), sampling=GREEDY)))
    assert result.completions == [Completion("w1w2", "length", 2, 2), Completion("w3w4w5", "length", 4, 3)]
    assert result.prompt_tokens == 6 and result.completion_tokens == 5
    (requests, params), = ms.runtime.calls  # both rows in one generate() call, grouped by sampling
    assert params == GREEDY and len(requests) == 2
    metrics = ms.observer.metrics
    assert metrics.generated_tokens.values == [5] and len(metrics.time_to_first_token.values) == 2
    stats = run(ms.get_stats())
    assert stats["requests"] == 1 and stats["rows"] == 2 and "engine" not in stats
    assert run(ms.info()).engine == "static"


def test_chat_is_one_row_through_the_chat_template():
    ms = static_server()
    call = GenerateCall(max_tokens=4, messages=(ChatTurn("system", "be brief"), ChatTurn("user", "hi")))
    assert run(ms.infer(call)).completions == [Completion("w8w2", "length", 2, 2)]


def test_prompt_over_the_context_names_max_tokens():
    ms = static_server()
    with pytest.raises(ContextLengthExceededError) as info:
        run(ms.infer(GenerateCall(max_tokens=18, prompts=("a", "b c d"))))
    assert info.value.param == "max_tokens"
    assert info.value.message.startswith("prompt (3 tokens) + max_tokens (18) = 21 tokens exceeds the model's "
                                         "context of 20 tokens")
    with pytest.raises(InvalidRequestError) as info:
        run(ms.infer(GenerateCall(max_tokens=1, prompts=("a", ""))))
    assert info.value.param == "prompt[1]"


def test_static_past_deadline_drops_the_rows():
    ms = static_server()
    with pytest.raises(DeadlineExceededError):
        run(ms.infer(GenerateCall(max_tokens=2, prompts=("a",), deadline=time.time() - 1)))
    assert ms.runtime.calls == []


def test_static_stream_sends_deltas_then_one_end_per_row():
    ms = static_server()

    async def main():
        call = GenerateCall(max_tokens=5, prompts=("a bb", "ccc"))
        return [event async for event in ms.infer_stream(call)]

    events = run(main())
    deltas = [e for e in events if isinstance(e, StreamDelta)]
    ends = [e for e in events if isinstance(e, StreamEnd)]
    assert events[-2:] == ends and ends == [StreamEnd(0, "length", 2, 2), StreamEnd(1, "length", 1, 1)]
    assert "".join(d.text for d in deltas if d.index == 0) == "w1w2"
    assert [d.text for d in deltas if d.index == 1] == ["w3"]


def test_static_stream_closed_by_its_consumer_cancels_the_row():
    ms = static_server()

    async def main():
        stream = ms.infer_stream(GenerateCall(max_tokens=5, prompts=("wait",)))
        first = await stream.__anext__()
        await stream.aclose()
        await asyncio.sleep(0.2)  # the model thread sees the cancel at its next step
        return first

    assert run(main()) == StreamDelta(0, "w4")
    assert ms.observer.stats.cancelled_rows == 1


# ---- the continuous engine on the tiny Llama ----------------------------------------------



@pytest.fixture
def continuous(llm):
    ms = server(llm, generation={"engine": "continuous"})
    yield ms
    ms.engine.close()


def test_continuous_streams_deltas_then_ends_like_generate(continuous):
    call = GenerateCall(max_tokens=6, prompts=("Hello world", "Once upon a time"), sampling=GREEDY)

    async def main():
        events = [event async for event in continuous.infer_stream(call)]
        return events, await continuous.infer(call)

    events, result = run(main())
    ends = [e for e in events if isinstance(e, StreamEnd)]
    assert events[-2:] == ends and [e.index for e in ends] == [0, 1]
    for index, completion in enumerate(result.completions):
        assert "".join(e.text for e in events if isinstance(e, StreamDelta) and e.index == index) == completion.text
        assert (ends[index].finish_reason, ends[index].completion_tokens) == (completion.finish_reason,
                                                                             completion.completion_tokens)
    stats = run(continuous.get_stats())
    assert stats["engine"]["kind"] == "continuous" and stats["engine"]["rows_finished"] == 4
    assert stats["requests"] == 2 and stats["rows"] == 4 and stats["batches"] == 0
    assert len(continuous.observer.metrics.queue_wait.values) == 4
    assert run(continuous.info()).engine == "continuous"


def test_cancelling_the_consumer_cancels_the_continuous_row(continuous):
    batcher = continuous.engine.batcher
    forward = batcher._forward

    def slow_forward(*args, **kwargs):  # keep the row running long enough to cancel it mid-way
        time.sleep(0.005)
        return forward(*args, **kwargs)

    batcher._forward = slow_forward

    async def main():
        stream = continuous.infer_stream(GenerateCall(max_tokens=100, prompts=("Hello",), sampling=GREEDY))
        consumer = asyncio.ensure_future(stream.__anext__())
        first = await consumer
        consumer = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        consumer.cancel()  # what Serve does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await consumer
        for _ in range(200):
            if batcher.stats().rows_finished:
                break
            await asyncio.sleep(0.01)
        return first

    assert isinstance(run(main()), StreamDelta)
    assert batcher.stats().rows_cancelled == 1
    assert continuous.observer.stats.cancelled_rows == 1


def test_continuous_retunes_its_batcher(continuous):
    continuous.reconfigure({"max_batch_size": 3, "max_batch_tokens": 500})
    assert (continuous.engine.batcher.max_rows, continuous.engine.batcher.kv_token_budget) == (3, 500)


# ---- the factory --------------------------------------------------------------------------


def test_auto_falls_back_to_static_when_the_cache_cannot_merge(monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise ValueError("sliding window")

    monkeypatch.setattr(engines.ContinuousEngine, "__init__", refuse)
    observer = ReplicaObserver(FakeMetrics())
    args = (FakeGenerator(), BatchingConfig(), observer)
    engine = make_engine(args[0], "auto", *args[1:], submit=None, model_name="m")
    assert isinstance(engine, StaticEngine) and "continuous batching unavailable" in caplog.text
    with pytest.raises(ValueError, match="sliding window"):
        make_engine(args[0], "continuous", *args[1:], submit=None, model_name="m")
    assert make_engine(args[0], "static", *args[1:], submit=None, model_name="m").kind == "static"
    assert ContinuousEngine.kind == "continuous"


@pytest.mark.parametrize("asked, param", [
    ({"n": 2}, "n"),
    ({"logprobs": 0}, "logprobs"),
    ({"response_format": ResponseFormat(type="json_object")}, "response_format"),
    ({"tools": ToolsSpec('[{"type":"function"}]')}, "tools"),
])
def test_the_transformers_engines_refuse_what_only_vllm_does_naming_the_field(asked, param):
    ms = static_server()
    with pytest.raises(InvalidRequestError) as caught:
        run(ms.infer(GenerateCall(max_tokens=2, prompts=("a",), **asked)))
    assert caught.value.param == param
    assert "needs the vLLM engine" in caught.value.message
    assert not ms.runtime.calls, "refused before any row ran"
