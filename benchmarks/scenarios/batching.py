"""The `batching` scenario: embeddings batched against unbatched, on mixed-length texts,
at concurrencies 1 to 64."""

from __future__ import annotations

from benchmarks.harness.registry import (
    Context,
    ScenarioResult,
    embedding_request,
    embedding_variant,
    model_stats,
    requests_for,
    run_closed,
    scenario,
)


@scenario
def batching(ctx: Context) -> ScenarioResult:
    """Embeddings batched (max_batch_size 64) vs unbatched (max_batch_size 1), mixed lengths."""
    result = ScenarioResult("batching", batching.__doc__)
    urls = ctx.cluster.deploy_many({
        "batched": ctx.cluster.models_app([embedding_variant(ctx, "embed", max_batch_size=64, batch_wait_timeout_s=0.01)]),
        "unbatched": ctx.cluster.models_app([embedding_variant(ctx, "embed", max_batch_size=1)]),
    })
    points = ctx.pick((1, 8, 32, 64), (1, 8, 32, 64), tiny=(8,))
    ref = 32 if 32 in points else points[-1]
    by_point: dict[tuple[str, int], dict] = {}
    for concurrency in points:
        for name, url in urls.items():  # alternate variants at each load point
            run = run_closed(url, embedding_request("embed"), concurrency=concurrency,
                             requests=requests_for(concurrency, ctx), label=name, ctx=ctx, warmup=8)
            by_point[(name, concurrency)] = result.add(run, name)
    for name, url in urls.items():
        stats = model_stats(url, "embed")
        result.derived[f"{name}_mean_batch_rows"] = stats.get("mean_batch_rows")
    ctx.cluster.delete(*urls)
    b, u = by_point[("batched", ref)], by_point[("unbatched", ref)]
    result.derived[f"throughput_ratio_c{ref}"] = b["throughput_rps"] / u["throughput_rps"]
    result.derived[f"p95_ratio_c{ref}"] = b["p95_ms"] / u["p95_ms"]
    result.check(f"batched / unbatched throughput, concurrency {ref}", result.derived[f"throughput_ratio_c{ref}"], 3.0)
    result.check(f"batched / unbatched p95 latency, concurrency {ref}", result.derived[f"p95_ratio_c{ref}"], 1.0,
                 higher_is_better=False)
    return result
