"""The `trace` scenario: open loop on the Azure LLM code trace's arrivals and prompt
lengths, embeddings batched against unbatched."""

from __future__ import annotations

from benchmarks.harness.registry import Context, ScenarioResult, ScenarioSkipped, embedding_variant, run_open, scenario


@scenario
def trace(ctx: Context) -> ScenarioResult:
    """Open loop on a real trace: the Azure LLM code trace's arrival bursts and prompt
    lengths (time compressed to a mean 24 requests/s, ContextTokens/40 words, clipped to
    4..128), as embedding requests, batched vs unbatched."""
    from benchmarks.data.workloads import TRACE, TRACE_ATTRIBUTION, trace_requests

    if not TRACE.is_file():
        raise ScenarioSkipped(f"the Azure trace is not on this machine (expected at {TRACE})")
    result = ScenarioResult("trace", trace.__doc__)
    rate = 24.0
    offsets, texts = trace_requests(ctx.pick(900, 300, tiny=24), rate_per_s=rate)
    urls = ctx.cluster.deploy_many({
        "trace-batched": ctx.cluster.models_app(
            [embedding_variant(ctx, "embed", max_batch_size=64, batch_wait_timeout_s=0.01)]),
        "trace-unbatched": ctx.cluster.models_app([embedding_variant(ctx, "embed", max_batch_size=1)]),
    })
    make = lambda i: ("/v1/embeddings", {"model": "embed", "input": texts[i]})  # noqa: E731
    rows = {}
    for app, url in urls.items():
        name = app.removeprefix("trace-")
        run = run_open(url, make, rate_per_s=rate, requests=len(offsets), label=name, ctx=ctx, arrivals_s=offsets)
        rows[name] = result.add(run, name)
    ctx.cluster.delete(*urls)
    b, u = rows["batched"], rows["unbatched"]
    result.derived.update(p95_ratio=round(b["p95_ms"] / u["p95_ms"], 3), source=TRACE_ATTRIBUTION)
    result.check("batched / unbatched p95 latency on the trace", b["p95_ms"] / u["p95_ms"], 1.0, higher_is_better=False)
    return result
