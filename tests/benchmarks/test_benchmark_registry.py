"""The benchmark harness without Ray: a failed run fails its scenario (checks, report,
exit status), scenarios register through benchmarks.harness.registry, and the stub replicas
speak the typed replica contract (serve_app.core.calls)."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("ray")

from benchmarks.harness import registry, report  # noqa: E402
from benchmarks.harness.loadgen import RunResult  # noqa: E402
from benchmarks.harness.registry import ERROR_RATE_LIMIT, RunFailed, ScenarioResult, ScenarioSkipped  # noqa: E402
from serve_app.core.calls import ClassifyCall, EmbedCall, EmbedResult, GenerateCall, ModelInfo  # noqa: E402
from serve_app.core.errors import DeadlineExceededError, InvalidRequestError  # noqa: E402

MACHINE = {"cpu": "test cpu", "cpu_flags": [], "cores": 2, "gpu": None, "torch": "t", "transformers": "t", "ray": "r",
           "git_revision": "g"}


def _run(requests: int, errors: int, label: str = "run") -> RunResult:
    run = RunResult(label, "closed", 4, None, requests, errors, 1.0, latencies_s=[0.01] * (requests - errors))
    run.error_samples = ["HTTP 500: b'boom'"] * errors
    return run


def test_a_run_above_the_error_limit_fails_the_scenario_and_every_check():
    result = ScenarioResult("s", "a scenario")
    result.add(_run(100, 3), "bad")  # 3% > 2%
    result.add(_run(100, 0), "good")
    result.check("a ratio", 5.0, 1.0)
    result.finalize()
    assert result.failed and [row["variant"] for row in result.failed_runs] == ["bad"]
    assert result.runs[0]["error_rate"] == 0.03 and result.runs[0]["failed"] is True
    assert all(not check["met"] for check in result.checks)
    ratio = next(c for c in result.checks if c["claim"] == "a ratio")
    assert ratio["target_met"] is True  # the value alone would have met it

    text = report.markdown([_as_dict(result)], MACHINE, "cmd")
    assert "**FAILED: 1 of 1 scenarios (s)**" in text
    assert "bad **(failed run)**" in text
    assert "3 of 100 requests failed" in text and "not met: the scenario failed" in text
    assert report.failed(_as_dict(result))


def test_errors_within_the_limit_leave_the_checks_to_their_values():
    assert ERROR_RATE_LIMIT == 0.02
    result = ScenarioResult("s", "a scenario")
    result.add(_run(100, 2), "ok")  # exactly the limit: not failed
    result.check("met", 2.0, 1.0)
    result.check("missed", 0.5, 1.0)
    result.finalize().finalize()  # idempotent
    assert not result.failed
    met = {c["claim"]: c["met"] for c in result.checks}
    assert met["met"] and not met["missed"]
    error_checks = [c for c in result.checks if c["claim"].startswith("failed requests")]
    assert len(error_checks) == 1 and error_checks[0]["met"] and error_checks[0]["value"] == 0.02
    assert "FAILED" not in report.markdown([_as_dict(result)], MACHINE, "cmd")


def test_rows_recorded_without_a_run_result_are_judged_too():
    result = ScenarioResult("day", "the day")
    result.add_row("reactive", requests=50, errors=50, replica_hours=12.0)  # e.g. every request a 500
    result.runs.append({"variant": "appended directly", "requests": 10, "errors": 5})
    result.check("replica-hours", 0.5, 0.6, higher_is_better=False)
    result.finalize()
    assert [row["variant"] for row in result.failed_runs] == ["reactive", "appended directly"]
    assert not any(check["met"] for check in result.checks)


def test_run_scenario_records_raises_skips_and_cleans_up(monkeypatch):
    class FakeCluster:
        deleted = 0

        def delete_all(self):
            FakeCluster.deleted += 1

    def raises(ctx):
        raise ValueError("no model")

    def all_failed(ctx):
        raise RunFailed(_run(8, 8, label="stack"))

    def skipped(ctx):
        raise ScenarioSkipped("vllm is not installed on this machine")

    monkeypatch.setattr(registry, "SCENARIOS", dict(registry.load_all()))
    for fn in (raises, all_failed, skipped):
        registry.scenario(fn)
    ctx = registry.Context(cluster=FakeCluster(), models=[], quick=True, precision=None, torch_threads=1,
                           gen_torch_threads=1, tiny=True)

    raised = registry.run_scenario("raises", ctx)
    assert raised.failed and raised.error == "ValueError: no model" and not any(c["met"] for c in raised.checks)
    failed = registry.run_scenario("all_failed", ctx)
    assert failed.failed and failed.runs[0]["variant"] == "stack" and failed.runs[0]["error_rate"] == 1.0
    skip = registry.run_scenario("skipped", ctx)
    assert not skip.failed and skip.skip_reason.startswith("vllm") and skip.tiny
    assert FakeCluster.deleted == 3
    assert "Skipped: vllm is not installed" in report.markdown([_as_dict(skip)], MACHINE, "cmd")


def test_every_scenario_module_registers_through_the_registry():
    names = list(registry.load_all())
    assert names[:7] == ["batching", "bucketing", "ceiling", "recipe", "generation", "cache", "trace"]
    assert {"day", "generation-mixed", "precision"} <= set(names)
    assert registry.require_module("json") is None
    assert "not installed" in registry.require_module("surely_not_a_module_here")


def test_context_pick_follows_the_mode():
    def ctx(**mode):
        return registry.Context(cluster=None, models=[], precision=None, torch_threads=1, gen_torch_threads=1, **mode)

    assert ctx(quick=False).pick(3, 2, tiny=1) == 3
    assert ctx(quick=True).pick(3, 2, tiny=1) == 2
    assert ctx(quick=False, tiny=True).pick(3, 2, tiny=1) == 1
    assert ctx(quick=False, tiny=True).pick(3, 2) == 2


# ---- stubs --------------------------------------------------------------------------


def _stub(deployment, *args, **kwargs):
    return deployment.func_or_class(*args, **kwargs)


def test_stubs_answer_embed_calls_with_typed_results():
    from benchmarks.harness.stubs import ConstantEmbedder, EmulatedAccelerator

    async def main():
        for stub in (_stub(ConstantEmbedder, 4), _stub(EmulatedAccelerator, 4, 2, 0.01)):
            result = await stub.infer(EmbedCall(texts=("a b c", "d"), deadline=time.time() + 5))
            assert isinstance(result, EmbedResult)
            assert result.embeddings == [[0.0] * 4, [0.0] * 4] and result.prompt_tokens == 4
            info = await stub.info()
            assert isinstance(info, ModelInfo) and info.task == "embedding" and info.revision
            stats = await stub.get_stats()
            assert stats["requests"] == 1 and stats["rows"] == 2 and stats["model_calls"] == 1
            for key in ("mean_batch_rows", "padding_efficiency", "p95_queue_wait_s"):  # what /v1/stats reads
                assert key in stats["last_minute"]

    asyncio.run(main())


def test_stubs_refuse_other_calls_and_honour_deadlines():
    from benchmarks.harness.stubs import ConstantEmbedder, EmulatedAccelerator

    async def main():
        constant = _stub(ConstantEmbedder, 4)
        for call in (ClassifyCall(texts=("x",)), GenerateCall(max_tokens=4, prompts=("x",))):
            with pytest.raises(InvalidRequestError, match="embeddings only"):
                await constant.infer(call)
        with pytest.raises(InvalidRequestError):
            async for _ in constant.infer_stream(GenerateCall(max_tokens=4, prompts=("x",))):
                pass
        with pytest.raises(DeadlineExceededError):
            await constant.infer(EmbedCall(texts=("late",), deadline=time.time() - 1))

        # One slot of 0.2 s: the second call queues past its 0.1 s deadline and is dropped.
        accelerator = _stub(EmulatedAccelerator, 4, 1, 0.2)
        first = asyncio.ensure_future(accelerator.infer(EmbedCall(texts=("first",))))
        await asyncio.sleep(0.01)
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError) as excinfo:
            await accelerator.infer(EmbedCall(texts=("second",), deadline=time.time() + 0.1))
        assert excinfo.value.status_code == 504
        assert time.monotonic() - started < 0.35  # dropped when its slot came, not served
        await first
        stats = await accelerator.get_stats()
        assert stats["cancelled_rows"] == 1 and stats["rows"] == 1

    asyncio.run(main())


def _as_dict(result: ScenarioResult) -> dict:
    import dataclasses

    return dataclasses.asdict(result)
