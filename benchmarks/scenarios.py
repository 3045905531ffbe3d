"""Benchmark scenarios. Each deploys its variants side by side in one Ray instance,
alternates between them at every load point, and returns rows plus derived ratios.

Scenarios register with ``@scenario`` from :mod:`benchmarks.registry` (which also holds
Context, ScenarioResult and the shared helpers); the day, generation-mixed and
precision scenarios live in their own modules.
"""

from __future__ import annotations

import copy
import time

import httpx

from benchmarks.registry import (
    TEXTS,
    Context,
    ScenarioResult,
    ScenarioSkipped,
    embedding_request,
    embedding_variant,
    model_stats,
    requests_for,
    run_closed,
    run_open,
    scenario,
)
from benchmarks.process_cpu import ProcessCPU, per_request_ms
from benchmarks.service import pick_model, variant
from benchmarks.workloads import CHAT_PROMPTS, mixed_texts


# ---- scenarios ------------------------------------------------------------------------


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


def _model_ceiling(ctx: Context, model: dict) -> tuple[float, int, float]:
    """Texts/s of the model alone, in this process: length-sorted at the best batch
    size, and one text at a time (whose ratio bounds what batching can gain)."""
    import torch

    from serve_app.core.batching import plan_batches
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

    from benchmarks.stubs import ConstantEmbedder

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


# Distinct texts for the recipe scenario, drawn like TEXTS (its first 512 are TEXTS): the
# shipped app caches answers, and a text sent twice would measure its cache, not its serving.
RECIPE_TEXTS = mixed_texts(4096, min_words=4, max_words=128, seed=7)
# Warm-up texts, none of them in RECIPE_TEXTS: the recipe pads each batch to a new shape,
# and torch's CPU kernels for a shape are built at its first use, so the recipe got
# faster round after round (its ratio to ours fell from 1.78 to 1.32 within one run)
# until every variant had seen a few hundred batches.
RECIPE_WARMUP_TEXTS = mixed_texts(1536, min_words=4, max_words=128, seed=8)


@scenario
def recipe(ctx: Context) -> ScenarioResult:
    """The deployments file as shipped (local.yaml as `make serve` runs it: its router, cache
    and embedding model exactly as configured; its chat model, idle under this load, is left
    out) vs the embedding deployment Ray Serve's docs have a user write (FastAPI +
    @serve.batch(32, 0.01), the tokenizer padding each batch in arrival order, Ray's default
    replica options, bf16 where the CPU has it), on the same distinct mixed-length texts.
    A third variant, ours with router.gather_calls off (each call its own Serve request),
    shows what gathering the router's calls gives, side by side."""
    import torch

    from benchmarks.recipe import RecipeEmbedder
    from serve_app.core.models.devices import resolve_precision

    result = ScenarioResult("recipe", recipe.__doc__)
    application = ctx.application or {"models": ctx.models}
    embedder = pick_model(application["models"], "embedding")
    precision, why = resolve_precision("auto", torch.device("cpu"))
    recipe_app = RecipeEmbedder.options(max_ongoing_requests=256).bind(embedder["source"], precision)
    alone = copy.deepcopy(application)
    alone["router"] = {**(alone.get("router") or {}), "gather_calls": False}
    urls = ctx.cluster.deploy_many({"ours": ctx.cluster.shipped_app(application, [embedder["name"]]),
                                    "ours-calls-alone": ctx.cluster.shipped_app(alone, [embedder["name"]]),
                                    "recipe": recipe_app})
    result.derived.update(recipe_precision=f"{precision} ({why})", ours_model=embedder["name"])
    points = ctx.pick((8, 32), (8, 32), tiny=(8,))
    ref = points[-1]
    # Alternating rounds, summed: one short run per variant moved the recipe's figure
    # between 50 and 97 requests/s on 2 cores, more than the difference being measured.
    rounds = ctx.pick(3, 2, tiny=1)
    warmup = ctx.pick(1536, 512, tiny=16)
    for name, url in urls.items():
        run_closed(url, lambda i: ("/v1/embeddings", {"model": embedder["name"], "input": RECIPE_WARMUP_TEXTS[i]}),
                   concurrency=points[-1], requests=warmup, label=f"{name} warm-up", ctx=ctx)
    totals: dict[tuple[str, int], list[float]] = {}  # (variant, concurrency) -> [requests ok, seconds]
    # (variant, concurrency) -> CPU seconds by process role, over its rounds (warm-up requests included)
    cpu_seconds: dict[tuple[str, int], dict[str, float]] = {}
    round_ratios: dict[int, list[float]] = {}
    sent = 0
    for concurrency in points:
        count = requests_for(concurrency, ctx, per_client=8)
        for round_index in range(rounds):
            offset = sent  # both variants get the same texts in a round, none seen before by either
            turn = round_index % len(urls)  # each variant leads one round in turn
            order = list(urls.items())[turn:] + list(urls.items())[:turn]
            rates = {}
            for name, url in order:

                def make(i: int, offset: int = offset, model: str = embedder["name"]):
                    return "/v1/embeddings", {"model": model, "input": RECIPE_TEXTS[(offset + i) % len(RECIPE_TEXTS)]}

                with ProcessCPU(name) as cpu:
                    run = run_closed(url, make, concurrency=concurrency, requests=count, label=name, ctx=ctx, warmup=8)
                result.add(run, name, round=round_index + 1)
                spent = cpu_seconds.setdefault((name, concurrency), {})
                for role, seconds in cpu.seconds.items():
                    spent[role] = spent.get(role, 0.0) + seconds
                total = totals.setdefault((name, concurrency), [0.0, 0.0])
                total[0] += run.requests - run.errors
                total[1] += run.duration_s
                rates[name] = run.throughput_rps
            round_ratios.setdefault(concurrency, []).append(rates["ours"] / rates["recipe"] if rates["recipe"] else 0.0)
            sent += count + 8
    # After the traffic: how vLLM batched it, and how the router gathered its calls.
    stats = model_stats(urls["ours"], embedder["name"])
    result.derived.update(ours_engine=stats.get("engine"), ours_gathering=stats.get("gathering"))
    ctx.cluster.delete(*urls)
    throughput = {key: ok / seconds if seconds else 0.0 for key, (ok, seconds) in totals.items()}
    for concurrency in points:
        for name in urls:
            result.derived[f"{name}_rps_c{concurrency}"] = round(throughput[(name, concurrency)], 1)
        result.derived[f"round_ratios_c{concurrency}"] = [round(r, 2) for r in round_ratios[concurrency]]
    ratio = throughput[("ours", ref)] / throughput[("recipe", ref)] if throughput[("recipe", ref)] else 0.0
    result.derived[f"throughput_ratio_c{ref}"] = round(ratio, 3)
    # Where a request's CPU goes, per variant at the reference concurrency.
    result.derived[f"cpu_ms_per_request_c{ref}"] = {
        name: per_request_ms(cpu_seconds[(name, ref)], totals[(name, ref)][0] + 8 * rounds) for name in urls}
    if throughput[("ours-calls-alone", ref)]:
        result.derived[f"gathering_gain_c{ref}"] = round(throughput[("ours", ref)] / throughput[("ours-calls-alone", ref)], 3)
    result.check(f"ours (as shipped) / Ray-docs recipe throughput, concurrency {ref} ({rounds} alternating rounds)",
                 ratio, 1.5)
    return result


def _completion_tokens(answer: dict) -> float:
    return float(answer["usage"]["completion_tokens"])


@scenario
def generation(ctx: Context) -> ScenarioResult:
    """Chat completions from 16 concurrent clients, max_tokens 64, greedy, static engine: generated
    tokens/s batched (max_batch_size 16, batch_wait_timeout_s 0.5) vs unbatched
    (max_batch_size 1). A short wait split the 16 clients into two out-of-phase static
    batches (6.8 rows per batch at 0.05 s); half a second is small against a generation."""
    result = ScenarioResult("generation", generation.__doc__)
    base = pick_model(ctx.models, "text-generation")
    max_tokens = ctx.pick(64, 64, tiny=4)
    clients = ctx.pick(16, 16, tiny=4)
    common = dict(precision=ctx.precision, torch_threads=ctx.gen_torch_threads, num_cpus=ctx.model_cpus)
    # This scenario measures static batching; generation-mixed compares the engines.
    base.setdefault("generation", {})["engine"] = "static"
    urls = ctx.cluster.deploy_many({
        "gen-batched": ctx.cluster.models_app(
            [variant(base, name="chat", max_batch_size=16, batch_wait_timeout_s=0.5, **common)]),
        "gen-unbatched": ctx.cluster.models_app([variant(base, name="chat", max_batch_size=1, **common)]),
    })

    def make(i: int):
        prompt = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
        return "/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "temperature": 0}

    rows = {}
    for app, url in urls.items():
        name = app.removeprefix("gen-")
        requests = ctx.pick((16 if name == "unbatched" else 32) * 3, 16 if name == "unbatched" else 32, tiny=clients)
        run = run_closed(url, make, concurrency=clients, requests=requests, label=name, ctx=ctx,
                         extract=_completion_tokens, warmup=2)
        stats = model_stats(url, "chat")
        rows[name] = result.add(run, name, tokens_per_s=round(run.units_per_s, 1),
                                mean_batch_rows=round(stats.get("mean_batch_rows") or 0, 2))
    ctx.cluster.delete(*urls)
    ratio = rows["batched"]["tokens_per_s"] / rows["unbatched"]["tokens_per_s"]
    result.derived.update(max_tokens=max_tokens, tokens_per_s_ratio=ratio)
    result.check(f"batched / unbatched generated tokens/s, {clients} clients", ratio, 5.0)
    return result


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


@scenario
def trace(ctx: Context) -> ScenarioResult:
    """Open loop on a real trace: the Azure LLM code trace's arrival bursts and prompt
    lengths (time compressed to a mean 24 requests/s, ContextTokens/40 words, clipped to
    4..128), as embedding requests, batched vs unbatched."""
    from benchmarks.workloads import TRACE, TRACE_ATTRIBUTION, trace_requests

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
