"""The replica without Ray: ModelServer over fake runtimes, the static batch loop, the stats observer.

Nothing here starts Ray. ``admission_window=False`` hands rows straight to the executor
(``@serve.batch``'s queue needs a replica context); one test runs the real admission
under a stand-in replica context.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from ray import serve

from serve_app.config import BatchingConfig
from serve_app.core.batching.planner import BatchPlan, SubBatch
from serve_app.core.calls import ClassifyCall, ClassifyResult, EmbedCall, EmbedResult, GenerateCall, ModelInfo
from serve_app.core.errors import DeadlineExceededError, InvalidRequestError
from serve_app.core.batching.static import BatchReport, batch_cost, new_row, run_static_batch
from serve_app.replica.model_server import ModelServer
from serve_app.replica.stats import ReplicaObserver, RowTiming

from replica_fakes import FakeEncoder, FakeMetrics, run, server


# ---- ModelServer ----------------------------------------------------------------------


def test_embed_returns_vectors_in_order_and_counts_prompt_tokens():
    runtime = FakeEncoder("embedding")
    ms = server(runtime)
    result = run(ms.infer(EmbedCall(texts=("a bb ccc", "dddd", "ee ff"))))
    assert isinstance(result, EmbedResult)
    assert result.embeddings == [[3.0, 6.0], [1.0, 4.0], [2.0, 4.0]]
    assert result.prompt_tokens == 6
    stats = run(ms.get_stats())
    assert stats["requests"] == 1 and stats["rows"] == 3 and stats["batches"] == 1
    assert stats["real_tokens"] == 6 and stats["replica"] is None and "engine" not in stats
    assert stats["batching"]["max_batch_size"] == 32 and "last_minute" in stats


def test_bad_input_names_its_position():
    ms = server(FakeEncoder("embedding"))
    with pytest.raises(InvalidRequestError) as info:
        run(ms.infer(EmbedCall(texts=("fine", "  ", "fine"))))
    assert info.value.param == "input[1]"
    with pytest.raises(InvalidRequestError) as info:  # a single input keeps the plain name
        run(ms.infer(EmbedCall(texts=("",))))
    assert info.value.param == "input"
    images = server(FakeEncoder("image-classification"))
    with pytest.raises(InvalidRequestError) as info:
        run(images.infer(ClassifyCall(images=(b"png", b""))))
    assert info.value.param == "image[1]"


@pytest.mark.parametrize("task, call, operation", [
    ("embedding", ClassifyCall(texts=("x",)), "text classification"),
    ("embedding", GenerateCall(max_tokens=4, prompts=("x",)), "text generation"),
    ("text-classification", ClassifyCall(images=(b"x",)), "image classification"),
    ("image-classification", EmbedCall(texts=("x",)), "embeddings"),
])
def test_wrong_task(task, call, operation):
    ms = server(FakeEncoder(task))
    with pytest.raises(InvalidRequestError) as info:
        run(ms.infer(call))
    assert info.value.code == "wrong_task" and info.value.param == "model"
    assert info.value.message == f"model 'fake' serves {task}, which does not support {operation}"


def test_streaming_from_a_model_that_does_not_generate_is_wrong_task():
    ms = server(FakeEncoder("embedding"))

    async def main():
        return [event async for event in ms.infer_stream(GenerateCall(max_tokens=4, prompts=("x",)))]

    with pytest.raises(InvalidRequestError) as info:
        run(main())
    assert info.value.code == "wrong_task"


def test_classify_cuts_each_ranking_to_top_k():
    runtime = FakeEncoder("text-classification")
    result = run(server(runtime).infer(ClassifyCall(texts=("good movie", "bad"), top_k=2)))
    assert isinstance(result, ClassifyResult)
    assert result.rankings == [[("positive", 0.6), ("neutral", 0.3)]] * 2
    assert result.prompt_tokens == 3
    images = run(server(FakeEncoder("image-classification")).infer(ClassifyCall(images=(b"a", b"b"), top_k=1)))
    assert images.rankings == [[("positive", 0.6)]] * 2 and images.prompt_tokens == 0


def test_past_deadline_drops_queued_rows():
    runtime = FakeEncoder("embedding")
    ms = server(runtime)
    with pytest.raises(DeadlineExceededError) as info:
        run(ms.infer(EmbedCall(texts=("a", "b"), deadline=time.time() - 1)))
    assert info.value.code == "timeout" and runtime.calls == []  # never computed
    result = run(ms.infer(EmbedCall(texts=("a",), deadline=time.time() + 60)))
    assert result.embeddings == [[1.0, 1.0]]


def test_failing_sub_batch_fails_the_call_with_its_error():
    ms = server(FakeEncoder("embedding"))
    with pytest.raises(RuntimeError, match="unlucky"):
        run(ms.infer(EmbedCall(texts=("a", "thirteenchars"))))


def test_info_and_reconfigure():
    ms = server(FakeEncoder("text-classification"))
    info = run(ms.info())
    # The revision names more than the weights (engine, device; see
    # test_cache_revisions_and_deadlines.py), and loaded_at is when the replica loaded.
    assert info.revision.startswith("rev-1-encoder-") and info.loaded_at <= time.time()
    assert info == ModelInfo(name="fake", task="text-classification", revision=info.revision, max_input_tokens=16,
                             device="cpu", dtype="float32", quantization="none",
                             labels=("negative", "positive", "neutral"), engine=None, loaded_at=info.loaded_at)
    ms.reconfigure({"max_batch_size": 2})
    assert ms.batching.max_batch_size == 2 and ms.batching.max_batch_tokens == ms.config.batching.max_batch_tokens
    run(ms.infer(ClassifyCall(texts=("a", "b", "c"))))
    assert [len(rows) for rows in ms.runtime.calls] == [2, 1]  # the executor keeps to 2 rows a call


@pytest.fixture
def replica_context(monkeypatch):
    """Enough of a replica context for @serve.batch's queue; the queue is dropped after."""
    context = SimpleNamespace(_deployment_config=SimpleNamespace(max_ongoing_requests=256))
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    yield
    # The queue lives on the decorated method, bound to the loop that first used it.
    ModelServer.func_or_class._admit.set_max_batch_size.__self__._queue = None


def test_serve_batch_admission_charges_rows_and_tokens(replica_context):
    runtime = FakeEncoder("embedding")
    model = {"name": "fake", "source": "/nowhere", "task": "embedding",
             "batching": {"max_batch_size": 4, "max_batch_tokens": 4, "batch_wait_timeout_s": 0.05}}
    ms = ModelServer.func_or_class(model, runtime=runtime, metrics=FakeMetrics())

    async def main():
        # Six one-token rows and one two-token row: the token budget (4) closes batches.
        calls = [ms.infer(EmbedCall(texts=(text,))) for text in ("a", "b", "c", "d", "e f", "g")]
        return await asyncio.gather(*calls)

    results = run(main())
    assert [r.prompt_tokens for r in results] == [1, 1, 1, 1, 2, 1]
    assert all(sum(len(row) for row in rows) <= 4 for rows in runtime.calls)
    assert sum(len(rows) for rows in runtime.calls) == 6


# ---- the static batch loop ------------------------------------------------------------


def test_batch_cost_charges_rows_and_tokens():
    batching = BatchingConfig(max_batch_size=4, max_batch_tokens=100)
    assert batch_cost([new_row(None, 10, batching)] * 2) == 2  # rows dominate
    assert batch_cost([new_row(None, 60, batching)] * 2) == 5  # 120 tokens: over the budget of 4
    assert batch_cost([new_row(None, 500, batching)]) == 4  # one long row is charged the budget: runs alone


def test_static_batch_fails_only_the_failed_sub_batch_and_reports_tokens():
    batching = BatchingConfig(max_batch_size=8, max_batch_tokens=1000, sub_batch_overhead_tokens=1)
    rows = [new_row(f"p{i}", n, batching, group=g) for i, (n, g) in enumerate([(2, "a"), (8, "a"), (3, "b"), (8, "a")])]
    calls = []

    def call_model(sub_rows):
        calls.append([r.payload for r in sub_rows])
        if any(r.payload == "p1" for r in sub_rows):
            raise ValueError("boom")
        return [r.payload.upper() for r in sub_rows]

    results, report = run_static_batch(rows, call_model, batching)
    assert sorted(map(sorted, calls)) == [["p0"], ["p1", "p3"], ["p2"]]  # groups never mix
    assert results[0] == "P0" and results[2] == "P2"
    assert isinstance(results[1], ValueError) and results[3] is results[1]
    assert report.rows == 4 and len(report.waits) == 4 and len(report.plans) == 2  # one plan per group
    assert sorted(sb.rows for sb in report.sub_batches) == [1, 1, 2]
    assert report.real_tokens == 21 and report.padded_tokens == 21


def test_static_batch_pads_each_sub_batch_to_its_longest_row():
    batching = BatchingConfig(max_batch_size=8, max_batch_tokens=1000, length_sorting=False)
    rows = [new_row(i, n, batching) for i, n in enumerate([2, 10, 4])]
    results, report = run_static_batch(rows, lambda sub: [r.payload for r in sub], batching)
    assert results == [0, 1, 2]
    (sub_batch,) = report.sub_batches
    assert (sub_batch.rows, sub_batch.real_tokens, sub_batch.padded_tokens) == (3, 16, 30)
    assert (report.real_tokens, report.padded_tokens) == (16, 30)


def test_model_returning_the_wrong_count_fails_its_rows():
    batching = BatchingConfig()
    results, _ = run_static_batch([new_row(0, 1, batching)] * 2, lambda sub: [1], batching)
    assert all(isinstance(r, RuntimeError) for r in results)


# ---- the stats observer ---------------------------------------------------------------


def test_observer_records_each_batch_figure_once_in_both_sinks():
    metrics = FakeMetrics()
    observer = ReplicaObserver(metrics)
    plan = BatchPlan(sub_batches=(SubBatch(indices=(0, 1), padded_length=4, real_tokens=6),
                                  SubBatch(indices=(2,), padded_length=4, real_tokens=4)), num_rows=3)
    report = BatchReport(rows=3, waits=(0.1, 0.2, 0.3), plans=(plan,), started_at=time.monotonic())
    observer.request()
    observer.batch(report)
    snap = observer.snapshot()
    assert (snap["requests"], snap["rows"], snap["batches"], snap["model_calls"]) == (1, 3, 1, 2)
    assert (snap["real_tokens"], snap["padded_tokens"]) == (10, 12)
    assert snap["last_minute"]["rows"] == 3 and snap["p50_queue_wait_s"] == 0.2
    assert metrics.queue_wait.values == [0.1, 0.2, 0.3]
    assert metrics.batch_rows.values == [3] and metrics.rows.values == [3] and metrics.batches.values == [1]
    assert metrics.call_rows.values == [2, 1] and metrics.call_tokens.values == [6, 4]
    assert metrics.padding_efficiency.values == [0.75, 1.0] and metrics.sub_batches.values == [2]
    assert metrics.model_calls.values == [2] and metrics.real_tokens.values == [10]
    assert metrics.padded_tokens.values == [12]


def test_observer_skips_zero_token_counters_and_records_generation():
    metrics = FakeMetrics()
    observer = ReplicaObserver(metrics)
    image_plan = BatchPlan(sub_batches=(SubBatch(indices=(0,), padded_length=0, real_tokens=0),), num_rows=1)
    observer.batch(BatchReport(rows=1, waits=(0.0,), plans=(image_plan,), started_at=time.monotonic()))
    assert "real_tokens" not in vars(metrics)  # Ray's Counter refuses 0
    now = time.monotonic()
    observer.request(rows_outside_batches=2)
    observer.generation([RowTiming(enqueued_at=now - 1, completion_tokens=3, first_token_at=now - 0.5,
                                   queue_wait_s=0.25),
                         RowTiming(enqueued_at=now, completion_tokens=0)])
    assert metrics.generated_tokens.values == [3] and len(metrics.inter_token_latency.values) == 1
    assert metrics.time_to_first_token.values == [pytest.approx(0.5)]
    assert metrics.queue_wait.values == [0.0, 0.25]
    assert observer.snapshot()["rows"] == 3


# ---- start-up and warm-up ----------------------------------------------------------------


def test_the_first_health_check_warms_up_over_the_shapes_then_marks_the_replica_ready():
    from serve_app.replica.startup import warmup_lengths

    runtime = FakeEncoder("embedding")
    runtime.max_input_tokens = 512
    ms = server(runtime, batching={"max_batch_size": 8})
    assert run(ms.get_stats())["startup"]["ready"] is False
    run(ms.check_health())
    # One call per length, then a batch as wide as the replica's: the model ran them all.
    lengths = warmup_lengths(512)
    assert lengths == [4, 16, 64, 256, 496]
    rows_run = sorted(len(row) for call in runtime.calls for row in call)
    assert rows_run.count(4) >= 1 and max(rows_run) == 496 and sum(len(call) for call in runtime.calls) == 5 + 8
    stats = run(ms.get_stats())
    startup = stats["startup"]
    assert startup["ready"] and startup["total_s"] >= startup["warmup_s"] >= 0 and "process_s" in startup
    assert stats["requests"] == 0 and stats["rows"] == 0, "the warm-up is not traffic"
    assert startup["calls_before_ready"] == 0, "the warm-up's own calls are not calls before ready"
    assert ms._metrics.startup.values, "exported: one observation per phase and the total"
    assert run(ms.record_autoscaling_stats())["startup_s"] == pytest.approx(startup["total_s"], abs=0.05)
    calls = len(runtime.calls)
    run(ms.check_health())
    assert len(runtime.calls) == calls, "only the first health check warms up"


def test_generation_warms_up_over_its_shapes_unless_the_engine_ran_them_itself():
    from serve_app.core.calls import GenerateCall
    from serve_app.replica.startup import warmup_calls, warmup_lengths

    full = warmup_calls("text-generation", 2048, 32, chat=True)
    lengths = warmup_lengths(2048)
    assert len(full) == len(lengths) + 2 and max(len(c.prompts or ()) for c in full) == 32
    # vLLM ran its own shapes while it started: one short prompt and one chat turn run our path.
    short = warmup_calls("text-generation", 2048, 32, chat=True, engine_ran_shapes=True)
    assert [(len(c.prompts or ()), len(c.messages or ())) for c in short] == [(1, 0), (0, 1)]
    assert all(isinstance(c, GenerateCall) and c.max_tokens <= 4 for c in short)
    assert len(warmup_calls("text-generation", 2048, 32, engine_ran_shapes=True)) == 1  # no chat template
    # Embeddings keep every shape either way (under a second on 2 cores).
    assert warmup_calls("embedding", 512, 8, engine_ran_shapes=True) == warmup_calls("embedding", 512, 8)


def test_calls_sent_before_the_warm_up_ended_are_counted():
    from serve_app.core.calls import EmbedCall

    ms = server(FakeEncoder("embedding"))
    call = EmbedCall(texts=("a b",))
    run(ms.infer(call))
    run(ms.infer_many([call, call]))
    assert run(ms.get_stats())["startup"]["calls_before_ready"] == 3
    assert ms._metrics.calls_before_ready.values == [1, 1, 1]
    run(ms.check_health())
    run(ms.infer(call))
    assert run(ms.get_stats())["startup"]["calls_before_ready"] == 3, "a ready replica's calls are not counted"


def test_a_replica_with_warmup_off_is_ready_without_calls():
    runtime = FakeEncoder("embedding")
    ms = server(runtime, warmup=False)
    run(ms.check_health())
    assert runtime.calls == [] and run(ms.get_stats())["startup"]["ready"]
