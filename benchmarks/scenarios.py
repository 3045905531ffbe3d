"""Benchmark scenarios. Each deploys its variants side by side in one Ray instance,
alternates between them at every load point, and returns rows plus derived ratios.

New scenarios (cache, autoscaling, precision...) register with ``@scenario``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import httpx

from benchmarks.loadgen import RunResult, closed_loop
from benchmarks.service import BenchCluster, pick_model, variant
from benchmarks.workloads import CHAT_PROMPTS, mixed_texts


@dataclass
class Context:
    cluster: BenchCluster
    models: list[dict]  # from the deployments file
    quick: bool
    precision: Optional[str]
    torch_threads: int
    gen_torch_threads: int
    progress: bool = True
    out_dir: str = "benchmark-results"  # where scenarios that draw their own plots put them


@dataclass
class ScenarioResult:
    name: str
    description: str
    runs: list[dict] = field(default_factory=list)  # RunResult.summary() + "variant"
    derived: dict[str, Any] = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)  # {"claim", "value", "target", "met"}

    def add(self, run: RunResult, variant_name: str, **extra: Any) -> dict:
        row = {"variant": variant_name, **run.summary(), **extra}
        self.runs.append(row)
        return row

    def check(self, claim: str, value: float, target: float, *, higher_is_better: bool = True) -> None:
        met = value >= target if higher_is_better else value <= target
        self.checks.append({"claim": claim, "value": round(value, 3), "target": target, "met": bool(met)})


SCENARIOS: dict[str, Callable[[Context], ScenarioResult]] = {}


def scenario(fn: Optional[Callable[[Context], ScenarioResult]] = None, *, name: Optional[str] = None):
    """Register a scenario under its function's name, or ``@scenario(name="a-name")``."""

    def register(fn: Callable[[Context], ScenarioResult]) -> Callable[[Context], ScenarioResult]:
        SCENARIOS[name or fn.__name__] = fn
        return fn

    return register(fn) if fn is not None else register


# ---- helpers ------------------------------------------------------------------------

TEXTS = mixed_texts(512, min_words=4, max_words=128, seed=7)


def _embedding_request(model_name: str):
    return lambda i: ("/v1/embeddings", {"model": model_name, "input": TEXTS[i % len(TEXTS)]})


def _run(url: str, make, *, concurrency: int, requests: int, label: str, ctx: Context, extract=None, warmup: int = 0):
    run = asyncio.run(
        closed_loop(url, make, concurrency=concurrency, requests=requests, label=label, extract=extract,
                    warmup=warmup, progress=ctx.progress)
    )
    if run.errors == run.requests:
        raise RuntimeError(f"{label}: every request failed, e.g. {run.error_samples[:2]}")
    return run


def _stats(url: str, model: str) -> dict:
    return httpx.get(f"{url}/v1/stats", timeout=60).json()["models"][model]


def _requests_for(concurrency: int, ctx: Context, per_client: int = 4, floor: int = 64) -> int:
    n = max(floor, per_client * concurrency)
    return n if ctx.quick else 3 * n


def _embedding_variant(ctx: Context, name: str, **batching: Any) -> dict:
    base = pick_model(ctx.models, "embedding")
    return variant(base, name=name, precision=ctx.precision, torch_threads=ctx.torch_threads, num_cpus=1, **batching)


# ---- scenarios ------------------------------------------------------------------------


@scenario
def batching(ctx: Context) -> ScenarioResult:
    """Embeddings batched (max_batch_size 64) vs unbatched (max_batch_size 1), mixed lengths."""
    result = ScenarioResult("batching", batching.__doc__)
    urls = {
        "batched": ctx.cluster.deploy_models(
            "batched", [_embedding_variant(ctx, "embed", max_batch_size=64, batch_wait_timeout_s=0.01)]
        ),
        "unbatched": ctx.cluster.deploy_models("unbatched", [_embedding_variant(ctx, "embed", max_batch_size=1)]),
    }
    by_point: dict[tuple[str, int], dict] = {}
    for concurrency in (1, 8, 32, 64):
        for name, url in urls.items():  # alternate variants at each load point
            run = _run(url, _embedding_request("embed"), concurrency=concurrency,
                       requests=_requests_for(concurrency, ctx), label=name, ctx=ctx, warmup=8)
            by_point[(name, concurrency)] = result.add(run, name)
    for name, url in urls.items():
        stats = _stats(url, "embed")
        result.derived[f"{name}_mean_batch_rows"] = stats["mean_batch_rows"]
        ctx.cluster.delete(name)
    b, u = by_point[("batched", 32)], by_point[("unbatched", 32)]
    result.derived["throughput_ratio_c32"] = b["throughput_rps"] / u["throughput_rps"]
    result.derived["p95_ratio_c32"] = b["p95_ms"] / u["p95_ms"]
    result.check("batched / unbatched throughput, concurrency 32", result.derived["throughput_ratio_c32"], 3.0)
    result.check("batched / unbatched p95 latency, concurrency 32", result.derived["p95_ratio_c32"], 1.0,
                 higher_is_better=False)
    return result


@scenario
def bucketing(ctx: Context) -> ScenarioResult:
    """Length-sorted sub-batches vs one batch padded in arrival order (both batched)."""
    result = ScenarioResult("bucketing", bucketing.__doc__)
    urls = {
        "sorted": ctx.cluster.deploy_models("sorted", [_embedding_variant(ctx, "embed", max_batch_size=64)]),
        "arrival": ctx.cluster.deploy_models(
            "arrival", [_embedding_variant(ctx, "embed", max_batch_size=64, length_sorting=False)]
        ),
    }
    rows = {}
    for concurrency in (32, 64):
        for name, url in urls.items():
            before = _stats(url, "embed")
            run = _run(url, _embedding_request("embed"), concurrency=concurrency,
                       requests=_requests_for(concurrency, ctx), label=name, ctx=ctx, warmup=8)
            after = _stats(url, "embed")
            padded = after["padded_tokens"] - before["padded_tokens"]
            real = after["real_tokens"] - before["real_tokens"]
            calls = after["model_calls"] - before["model_calls"]
            batches = after["batches"] - before["batches"]
            rows[(name, concurrency)] = result.add(
                run, name, padding_efficiency=round(real / padded, 3) if padded else None,
                model_calls_per_batch=round(calls / batches, 2) if batches else None,
            )
    for name in urls:
        ctx.cluster.delete(name)
    s, a = rows[("sorted", 64)], rows[("arrival", 64)]
    result.derived.update(
        sorted_padding_efficiency=s["padding_efficiency"], arrival_padding_efficiency=a["padding_efficiency"],
        throughput_ratio_c64=s["throughput_rps"] / a["throughput_rps"],
    )
    result.check("padding efficiency, length-sorted sub-batches", s["padding_efficiency"], 0.85)
    result.check("sorted / arrival-order throughput, concurrency 64", result.derived["throughput_ratio_c64"], 1.0)
    return result


def _model_ceiling(ctx: Context, model: dict) -> tuple[float, int, float]:
    """Texts/s of the model alone, in this process: length-sorted at the best batch
    size, and one text at a time (whose ratio bounds what batching can gain)."""
    import torch

    from serve_app.core.batching import plan_batches
    from serve_app.core.runtime import LoadOptions, load_runtime

    previous = torch.get_num_threads()
    torch.set_num_threads(ctx.torch_threads)
    try:
        runtime = load_runtime(LoadOptions(source=model["source"], task="embedding",
                                           precision=model.get("precision", "fp32"), device="auto"))
        rows = [runtime.tokenize(t) for t in TEXTS[: 256 if ctx.quick else 512]]
        runtime.embed(rows[:8])  # warm up kernels
        best = (0.0, 0)
        one_at_a_time = 0.0
        for batch_size in (1, 8, 16, 32, 64):
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
    from serve_app.config import parse_app_config

    from benchmarks.stubs import ConstantEmbedder

    result = ScenarioResult("ceiling", ceiling.__doc__)
    ours_model = _embedding_variant(ctx, "embed", max_batch_size=64)
    m_rate, m_batch, m_single = _model_ceiling(ctx, ours_model)

    stub_config = parse_app_config({"models": [ours_model], "router": {"num_cpus": 0.1}})
    # The same Router, with the same options, as the real app; only the model differs.
    stub_app = router_app(stub_config, {"embed": ConstantEmbedder.options(max_ongoing_requests=1024).bind(384)})
    stub_url = ctx.cluster.deploy(stub_app, "stub")
    ours_url = ctx.cluster.deploy_models("ours", [ours_model])

    trivial = _run(stub_url, lambda i: ("/healthz", None), concurrency=1, requests=200 if ctx.quick else 600,
                   label="trivial-route", ctx=ctx, warmup=10)
    result.add(trivial, "trivial route (GET /healthz)")
    stack = _run(stub_url, _embedding_request("embed"), concurrency=64, requests=_requests_for(64, ctx, 8),
                 label="stack", ctx=ctx, warmup=16)
    result.add(stack, "stack ceiling S (constant answer)")
    ours = _run(ours_url, _embedding_request("embed"), concurrency=64, requests=_requests_for(64, ctx),
                label="ours", ctx=ctx, warmup=16)
    result.add(ours, "ours (full stack + model)")
    for name in ("stub", "ours"):
        ctx.cluster.delete(name)

    s_rate = stack.throughput_rps
    bound = 1 / (1 / m_rate + 1 / s_rate)
    result.derived.update(
        model_ceiling_M_per_s=round(m_rate, 1), model_ceiling_batch_size=m_batch,
        model_one_at_a_time_per_s=round(m_single, 1), batching_gain_bound=round(m_rate / m_single, 2),
        stack_ceiling_S_per_s=round(s_rate, 1), bound_B_per_s=round(bound, 1),
        ours_per_s=round(ours.throughput_rps, 1), server_efficiency=round(ours.throughput_rps / bound, 3),
        latency_floor_p50_ms=trivial.percentile_ms(50),
    )
    result.check("server efficiency (ours / B), concurrency 64", ours.throughput_rps / bound, 0.8)
    return result


@scenario
def recipe(ctx: Context) -> ScenarioResult:
    """Ours vs the plain Ray Serve docs recipe (FastAPI + @serve.batch(32, 0.01), tokenizer
    padding in arrival order), same model, precision and threads."""
    from benchmarks.recipe import RecipeEmbedder

    result = ScenarioResult("recipe", recipe.__doc__)
    ours_model = _embedding_variant(ctx, "embed", max_batch_size=64)
    precision = ours_model.get("precision", "fp32")
    recipe_app = RecipeEmbedder.options(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=256).bind(
        ours_model["source"], precision, ctx.torch_threads
    )
    urls = {"ours": ctx.cluster.deploy_models("ours", [ours_model]), "recipe": ctx.cluster.deploy(recipe_app, "recipe")}
    rows = {}
    for concurrency in (8, 32):
        for name, url in urls.items():
            run = _run(url, _embedding_request("embed"), concurrency=concurrency,
                       requests=_requests_for(concurrency, ctx), label=name, ctx=ctx, warmup=8)
            rows[(name, concurrency)] = result.add(run, name)
    for name in urls:
        ctx.cluster.delete(name)
    ratio = rows[("ours", 32)]["throughput_rps"] / rows[("recipe", 32)]["throughput_rps"]
    result.derived["throughput_ratio_c32"] = ratio
    result.check("ours / Ray-docs recipe throughput, concurrency 32", ratio, 1.5)
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
    max_tokens = 64
    common = dict(precision=ctx.precision, torch_threads=ctx.gen_torch_threads, num_cpus=1)
    # This scenario measures static batching; generation-mixed compares the engines.
    base.setdefault("generation", {})["engine"] = "static"
    urls = {
        "batched": ctx.cluster.deploy_models(
            "gen-batched", [variant(base, name="chat", max_batch_size=16, batch_wait_timeout_s=0.5, **common)]
        ),
        "unbatched": ctx.cluster.deploy_models("gen-unbatched", [variant(base, name="chat", max_batch_size=1, **common)]),
    }

    def make(i: int):
        prompt = CHAT_PROMPTS[i % len(CHAT_PROMPTS)]
        return "/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "temperature": 0}

    rows = {}
    for name, url in urls.items():
        requests = (16 if name == "unbatched" else 32) * (1 if ctx.quick else 3)
        run = _run(url, make, concurrency=16, requests=requests, label=name, ctx=ctx, extract=_completion_tokens,
                   warmup=2)
        stats = _stats(url, "chat")
        rows[name] = result.add(run, name, tokens_per_s=round(run.units_per_s, 1),
                                mean_batch_rows=round(stats["mean_batch_rows"] or 0, 2))
    for name in ("gen-batched", "gen-unbatched"):
        ctx.cluster.delete(name)
    ratio = rows["batched"]["tokens_per_s"] / rows["unbatched"]["tokens_per_s"]
    result.derived.update(max_tokens=max_tokens, tokens_per_s_ratio=ratio)
    result.check("batched / unbatched generated tokens/s, 16 clients", ratio, 5.0)
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
                   torch_threads=ctx.torch_threads, num_cpus=1)
    embed = _embedding_variant(ctx, "embed", max_batch_size=64)
    urls = {
        "cached": ctx.cluster.deploy_models("cached", [chat, embed], cache=True),
        "uncached": ctx.cluster.deploy_models("uncached", [embed]),
    }
    base = urls["cached"]
    trivial = _run(base, lambda i: ("/healthz", None), concurrency=1, requests=100, label="trivial", ctx=ctx, warmup=5)
    result.add(trivial, "trivial route (GET /healthz)")

    misses = []
    with httpx.Client(base_url=base, timeout=300) as http:
        for i in range(8 if ctx.quick else 24):
            body = {"model": "chat", "max_tokens": 16, "temperature": 0,
                    "messages": [{"role": "user", "content": f"{CHAT_PROMPTS[i % len(CHAT_PROMPTS)]} ({uuid.uuid4().hex[:6]})"}]}
            started = time.perf_counter()
            answer = http.post("/v1/chat/completions", json=body)
            if answer.status_code != 200 or answer.headers.get("x-cache") != "miss":
                raise RuntimeError(f"chat miss expected, got {answer.status_code} {answer.headers.get('x-cache')}")
            misses.append((time.perf_counter() - started) * 1000)
    miss_p50 = statistics.median(misses)
    result.runs.append({"variant": "chat miss (unique prompts, sequential)", "concurrency": None,
                        "requests": len(misses), "p50_ms": round(miss_p50, 2)})
    # Hits: the last chat again and again, with the same client as the trivial route.
    hit_run = _run(base, lambda i: ("/v1/chat/completions", body), concurrency=1, requests=100, label="chat hit", ctx=ctx)
    result.add(hit_run, "chat hit (repeated prompt)")
    hit_p50 = hit_run.percentile_ms(50)

    distinct = [f"{t} #{k}" for k, t in enumerate(TEXTS[:200])]
    order = _zipf_indices(400 if ctx.quick else 1200, len(distinct))
    make = lambda i: ("/v1/embeddings", {"model": "embed", "input": distinct[order[i % len(order)]]})  # noqa: E731
    for name, url in (("zipf, no cache", urls["uncached"]), ("zipf, cache", urls["cached"])):
        run = _run(url, make, concurrency=16, requests=len(order), label=name, ctx=ctx)
        result.add(run, name)
    for name in urls:
        ctx.cluster.delete(name)
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
    from benchmarks.loadgen import open_loop
    from benchmarks.workloads import TRACE_ATTRIBUTION, trace_requests

    result = ScenarioResult("trace", trace.__doc__)
    rate = 24.0
    offsets, texts = trace_requests(300 if ctx.quick else 900, rate_per_s=rate)
    urls = {
        "batched": ctx.cluster.deploy_models(
            "trace-batched", [_embedding_variant(ctx, "embed", max_batch_size=64, batch_wait_timeout_s=0.01)]
        ),
        "unbatched": ctx.cluster.deploy_models("trace-unbatched", [_embedding_variant(ctx, "embed", max_batch_size=1)]),
    }
    make = lambda i: ("/v1/embeddings", {"model": "embed", "input": texts[i]})  # noqa: E731
    rows = {}
    for name, url in urls.items():
        run = asyncio.run(open_loop(url, make, rate_per_s=rate, requests=len(offsets), label=name,
                                    arrivals_s=offsets, progress=ctx.progress))
        rows[name] = result.add(run, name)
    for name in ("trace-batched", "trace-unbatched"):
        ctx.cluster.delete(name)
    b, u = rows["batched"], rows["unbatched"]
    result.derived.update(p95_ratio=round(b["p95_ms"] / u["p95_ms"], 3), source=TRACE_ATTRIBUTION)
    result.check("batched / unbatched p95 latency on the trace", b["p95_ms"] / u["p95_ms"], 1.0, higher_is_better=False)
    return result


# Scenarios kept in their own modules register on import.
from benchmarks import day, generation_mixed, precision  # noqa: E402,F401
