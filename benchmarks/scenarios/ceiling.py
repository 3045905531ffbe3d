"""The `ceiling` scenario: the model's own ceiling (in-process, no Serve), the stack's
ceiling (router and proxy in front of a constant answer), the bound both make, and our
server's share of it."""

from __future__ import annotations

import time

from benchmarks.harness.registry import (
    TEXTS,
    Context,
    ScenarioResult,
    embedding_request,
    embedding_variant,
    requests_for,
    run_closed,
    scenario,
)


def _model_ceiling(ctx: Context, model: dict) -> tuple[float, int, float]:
    """Texts/s of the model alone, in this process: length-sorted at the best batch
    size, and one text at a time (whose ratio bounds what batching can gain)."""
    import torch

    from serve_app.core.batching.planner import plan_batches
    from serve_app.core.models import LoadOptions, load_runtime

    previous = torch.get_num_threads()
    torch.set_num_threads(ctx.torch_threads)
    try:
        runtime = load_runtime(LoadOptions(source=model["source"], task="embedding",
                                           precision=model.get("precision", "fp32"), device="auto"))
        rows = [runtime.tokenize(t) for t in TEXTS[: ctx.pick(512, 256, tiny=16)]]
        runtime.embed(rows[:8])  # warm up kernels
        best = (0.0, 0)
        one_at_a_time = 0.0
        for batch_size in ctx.pick((1, 8, 16, 32, 64), (1, 8, 16, 32, 64), tiny=(1, 8)):
            started = time.perf_counter()
            for start in range(0, len(rows), batch_size):
                chunk = rows[start : start + batch_size]
                plan = plan_batches([len(r) for r in chunk], max_batch_tokens=1 << 20, max_rows=batch_size)
                for sub_batch in plan.sub_batches:
                    runtime.embed([chunk[i] for i in sub_batch.indices])
            rate = len(rows) / (time.perf_counter() - started)
            if batch_size == 1:
                one_at_a_time = rate
            best = max(best, (rate, batch_size))
        return best[0], best[1], one_at_a_time
    finally:
        torch.set_num_threads(previous)


@scenario
def ceiling(ctx: Context) -> ScenarioResult:
    """Model ceiling M (in-process, no Serve), stack ceiling S (router + proxy with a
    constant answer), the bound B = 1/(1/M + 1/S), and our server's share of B."""
    from serve_app.app import router_app
    from serve_app.config import model_deployment_name, parse_app_config

    from benchmarks.harness.stubs import ConstantEmbedder

    result = ScenarioResult("ceiling", ceiling.__doc__)
    ours_model = embedding_variant(ctx, "embed", max_batch_size=64)
    m_rate, m_batch, m_single = _model_ceiling(ctx, ours_model)

    stub_config = parse_app_config({"models": [ours_model], "router": {"num_cpus": 0.1}})
    # The same Router, with the same options, as the real app; only the model differs.
    stub_model = ConstantEmbedder.options(name=model_deployment_name("embed"), max_ongoing_requests=1024,
                                          ray_actor_options={"num_cpus": 0.1}).bind(384, name="embed")
    urls = ctx.cluster.deploy_many({
        "stub": router_app(stub_config, {"embed": stub_model}),
        "ours": ctx.cluster.models_app([ours_model]),
    })
    stub_url, ours_url = urls["stub"], urls["ours"]
    concurrency = ctx.pick(64, 64, tiny=8)

    trivial = run_closed(stub_url, lambda i: ("/healthz", None), concurrency=1, requests=ctx.pick(600, 200, tiny=10),
                         label="trivial-route", ctx=ctx, warmup=10)
    result.add(trivial, "trivial route (GET /healthz)")
    stack = run_closed(stub_url, embedding_request("embed"), concurrency=concurrency,
                       requests=requests_for(concurrency, ctx, 8), label="stack", ctx=ctx, warmup=16)
    result.add(stack, "stack ceiling S (constant answer)")
    ours = run_closed(ours_url, embedding_request("embed"), concurrency=concurrency,
                      requests=requests_for(concurrency, ctx), label="ours", ctx=ctx, warmup=16)
    result.add(ours, "ours (full stack + model)")
    ctx.cluster.delete(*urls)

    s_rate = stack.throughput_rps
    bound = 1 / (1 / m_rate + 1 / s_rate)
    result.derived.update(
        model_ceiling_M_per_s=round(m_rate, 1), model_ceiling_batch_size=m_batch,
        model_one_at_a_time_per_s=round(m_single, 1), batching_gain_bound=round(m_rate / m_single, 2),
        stack_ceiling_S_per_s=round(s_rate, 1), bound_B_per_s=round(bound, 1),
        ours_per_s=round(ours.throughput_rps, 1), server_efficiency=round(ours.throughput_rps / bound, 3),
        latency_floor_p50_ms=trivial.percentile_ms(50),
    )
    result.check(f"server efficiency (ours / B), concurrency {concurrency}", ours.throughput_rps / bound, 0.8)
    return result
