"""The `bucketing` scenario: length-sorted sub-batches against one batch padded in arrival
order, both batched: padding efficiency and throughput."""

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
def bucketing(ctx: Context) -> ScenarioResult:
    """Length-sorted sub-batches vs one batch padded in arrival order (both batched)."""
    result = ScenarioResult("bucketing", bucketing.__doc__)
    urls = ctx.cluster.deploy_many({
        "sorted": ctx.cluster.models_app([embedding_variant(ctx, "embed", max_batch_size=64)]),
        "arrival": ctx.cluster.models_app([embedding_variant(ctx, "embed", max_batch_size=64, length_sorting=False)]),
    })
    points = ctx.pick((32, 64), (32, 64), tiny=(16,))
    ref = points[-1]
    rows = {}
    for concurrency in points:
        for name, url in urls.items():
            before = model_stats(url, "embed")
            run = run_closed(url, embedding_request("embed"), concurrency=concurrency,
                             requests=requests_for(concurrency, ctx), label=name, ctx=ctx, warmup=8)
            after = model_stats(url, "embed")
            padded = after["padded_tokens"] - before["padded_tokens"]
            real = after["real_tokens"] - before["real_tokens"]
            calls = after["model_calls"] - before["model_calls"]
            batches = after["batches"] - before["batches"]
            rows[(name, concurrency)] = result.add(
                run, name, padding_efficiency=round(real / padded, 3) if padded else None,
                model_calls_per_batch=round(calls / batches, 2) if batches else None,
            )
    ctx.cluster.delete(*urls)
    s, a = rows[("sorted", ref)], rows[("arrival", ref)]
    result.derived.update(
        sorted_padding_efficiency=s["padding_efficiency"], arrival_padding_efficiency=a["padding_efficiency"],
        **{f"throughput_ratio_c{ref}": s["throughput_rps"] / a["throughput_rps"]},
    )
    result.check("padding efficiency, length-sorted sub-batches", s["padding_efficiency"], 0.85)
    result.check(f"sorted / arrival-order throughput, concurrency {ref}", result.derived[f"throughput_ratio_c{ref}"], 1.0)
    return result
