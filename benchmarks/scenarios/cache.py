"""The `cache` scenario: a chat hit against a miss (and the trivial route) over HTTP, and
embeddings on a Zipf-distributed workload with and without the cache."""

from __future__ import annotations

import time

import httpx

from benchmarks.data.workloads import CHAT_PROMPTS
from benchmarks.harness.registry import TEXTS, Context, ScenarioResult, embedding_variant, run_closed, scenario
from benchmarks.harness.service import pick_model, variant


def _zipf_indices(count: int, distinct: int, s: float = 1.1, seed: int = 3) -> list[int]:
    import random

    rng = random.Random(seed)
    weights = [1 / (rank**s) for rank in range(1, distinct + 1)]
    return rng.choices(range(distinct), weights=weights, k=count)


@scenario
def cache(ctx: Context) -> ScenarioResult:
    """The cache: p50 of a chat hit vs a miss over HTTP (sequential, greedy), against the
    trivial-route round trip; and embeddings on a Zipf-distributed workload (s=1.1 over
    200 distinct texts, 16 clients) with and without the cache."""
    import statistics
    import uuid

    result = ScenarioResult("cache", cache.__doc__)
    chat = variant(pick_model(ctx.models, "text-generation"), name="chat", precision=ctx.precision,
                   torch_threads=ctx.torch_threads, num_cpus=ctx.model_cpus)
    embed = embedding_variant(ctx, "embed", max_batch_size=64)
    urls = ctx.cluster.deploy_many({
        "cached": ctx.cluster.models_app([chat, embed], cache=True),
        "uncached": ctx.cluster.models_app([embed]),
    })
    base = urls["cached"]
    trivial = run_closed(base, lambda i: ("/healthz", None), concurrency=1, requests=ctx.pick(100, 100, tiny=10),
                         label="trivial", ctx=ctx, warmup=5)
    result.add(trivial, "trivial route (GET /healthz)")

    misses = []
    with httpx.Client(base_url=base, timeout=300) as http:
        for i in range(ctx.pick(24, 8, tiny=2)):
            body = {"model": "chat", "max_tokens": ctx.pick(16, 16, tiny=4), "temperature": 0,
                    "messages": [{"role": "user", "content": f"{CHAT_PROMPTS[i % len(CHAT_PROMPTS)]} ({uuid.uuid4().hex[:6]})"}]}
            started = time.perf_counter()
            answer = http.post("/v1/chat/completions", json=body)
            if answer.status_code != 200 or answer.headers.get("x-cache") != "miss":
                raise RuntimeError(f"chat miss expected, got {answer.status_code} {answer.headers.get('x-cache')}: "
                                   f"{answer.text[:200]}")
            misses.append((time.perf_counter() - started) * 1000)
    miss_p50 = statistics.median(misses)
    # Every miss was checked above (any other answer raised), so this run had no errors.
    result.add_row("chat miss (unique prompts, sequential)", requests=len(misses), errors=0, concurrency=None,
                   p50_ms=round(miss_p50, 2))
    # Hits: the last chat again and again, with the same client as the trivial route.
    hit_run = run_closed(base, lambda i: ("/v1/chat/completions", body), concurrency=1,
                         requests=ctx.pick(100, 100, tiny=10), label="chat hit", ctx=ctx)
    result.add(hit_run, "chat hit (repeated prompt)")
    hit_p50 = hit_run.percentile_ms(50)

    distinct = [f"{t} #{k}" for k, t in enumerate(TEXTS[:200])]
    order = _zipf_indices(ctx.pick(1200, 400, tiny=24), len(distinct))
    clients = ctx.pick(16, 16, tiny=4)
    make = lambda i: ("/v1/embeddings", {"model": "embed", "input": distinct[order[i % len(order)]]})  # noqa: E731
    for name, url in (("zipf, no cache", urls["uncached"]), ("zipf, cache", urls["cached"])):
        run = run_closed(url, make, concurrency=clients, requests=len(order), label=name, ctx=ctx)
        result.add(run, name)
    ctx.cluster.delete(*urls)
    zipf = {row["variant"]: row for row in result.runs if row["variant"].startswith("zipf")}
    ratio = zipf["zipf, cache"]["throughput_rps"] / zipf["zipf, no cache"]["throughput_rps"]
    trivial_p50 = trivial.percentile_ms(50)
    result.derived.update(hit_over_miss_p50=round(hit_p50 / miss_p50, 4), hit_over_trivial_p50=round(hit_p50 / trivial_p50, 2),
                          zipf_throughput_ratio=round(ratio, 2),
                          zipf_distinct_share=round(len(set(order)) / len(order), 3))
    result.check("chat hit p50 / miss p50", hit_p50 / miss_p50, 0.2, higher_is_better=False)
    result.check("chat hit p50 / trivial-route p50", hit_p50 / trivial_p50, 2.0, higher_is_better=False)
    result.check("Zipf embeddings throughput, cache / no cache", ratio, 1.0)
    return result
