"""The `affinity` scenario: product lines on two chat replicas, prefix-affinity routing
against Serve's default router, side by side in one run.

Two SmolLM2 replicas on vLLM serve four product lines. Each line has a system prompt of
its own (about 900 tokens), and the lines' questions come interleaved, streamed at
concurrency 4. The same requests run once per policy, each on a fresh deployment:

- ``balanced``: Serve's power-of-two-choices router (``routing.policy: balanced``);
- ``prefix_affinity``: ours (``serve_app.ingress.affinity``), which sends a line's
  requests to the replica whose vLLM prefix cache holds its prompt.

Each replica's KV cache is capped at ``KV_BLOCKS`` blocks (vLLM's
``num_gpu_blocks_override``), about 3.5 lines' prompts, so one replica cannot hold every
line but the fleet can. This is where affinity pays: the fleet's hot prefixes outgrow
one replica's cache (many product lines, long prompts, KV shared with the decodes). With
1 GiB per replica, all four prompts fit everywhere, and the two policies converge once
each replica has seen each line.

A second variant gives each line its own LoRA adapter (random, untrained: routing does
not depend on what it says). vLLM keeps an adapter's prefixes apart from the base
model's, so affinity keeps a line and its adapter together.

Figures: TTFT p50/p95, generated tokens/s, and vLLM's prefix-cache hit rate over the run.
The hit rate is tokens found in the cache / tokens looked up, summed over both replicas.
It is read from the replicas' ``serve_app_prefix_cache_*_tokens`` counters, scraped from
Ray's metrics endpoint before and after each run.

Run: ``python -m benchmarks run --scenario affinity [--quick | --tiny] --out DIR``;
``AFFINITY_VARIANTS=plain`` skips the adapter variant.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import Optional

import httpx

from benchmarks.data.prompts import PRODUCT_LINES, customer_questions, product_line_prompt
from benchmarks.harness.loadgen import closed_loop
from benchmarks.harness.registry import Context, RunFailed, ScenarioResult, require_module, run_closed, scenario
from benchmarks.harness.service import pick_model, random_lora_adapter, variant
from benchmarks.peers.engines import EngineSettings

POLICIES = ("balanced", "prefix_affinity")
MAX_MODEL_LEN = 1536
KV_BLOCKS = 28  # vLLM's CPU block is 128 tokens: 3,584 tokens, about 3.5 lines' prompts
MAX_TOKENS = 16


def _line_request(i: int, questions: list[str], models: list[str]) -> tuple[str, dict]:
    line = i % len(PRODUCT_LINES)  # the lines interleave: 0, 1, 2, 3, 0, 1, ...
    return "/v1/chat/completions", {
        "model": models[line], "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": product_line_prompt(line)},
                     {"role": "user", "content": questions[i]}]}


def _completion_tokens(answer: dict) -> float:
    return float((answer.get("usage") or {}).get("completion_tokens") or 0)


def prefix_counters(metrics_text: str, model: str = "chat") -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over every replica of ``model``, from a scrape
    of Ray's metrics export (cumulative counters; one app of the scenario runs at a time)."""
    totals = {"hits": 0.0, "queries": 0.0}
    for kind in totals:
        # Ray's export prefixes application metrics with "ray_".
        pattern = re.compile(rf"^(?:ray_)?serve_app_prefix_cache_{kind}_tokens(?:_total)?\{{([^}}]*)\}} (\S+)$",
                             re.M)
        for labels, value in pattern.findall(metrics_text):
            if f'model="{model}"' in labels:
                totals[kind] += float(value)
    return totals["hits"], totals["queries"]


def _metrics_url() -> Optional[str]:
    import ray

    for node in ray.nodes():
        if node.get("Alive") and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


def _settled_counters(metrics_url: str, wait_s: float) -> tuple[float, float]:
    """The counters once Ray's export has caught up: unchanged over more than its
    report interval (10 s by default)."""
    def read() -> tuple[float, float]:
        return prefix_counters(httpx.get(metrics_url, timeout=30).text)

    last, deadline = read(), time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(12)
        now = read()
        if now == last:
            return now
        last = now
    return last


def _adapters(base_dir: Path, out_dir: Path) -> list[dict]:
    """One random LoRA adapter per product line (peft's layout), written once per run."""
    return [{"name": f"chat-{name.replace(' ', '-')}",
             "source": str(random_lora_adapter(base_dir, out_dir / f"adapter-{line}"))}
            for line, name in enumerate(PRODUCT_LINES)]


@scenario
def affinity(ctx: Context) -> ScenarioResult:
    """Four product lines (a ~900-token system prompt each, questions interleaved, streamed at concurrency 4)
    on two SmolLM2 vLLM replicas: prefix-affinity routing against Serve's default router in one run, TTFT,
    tokens/s and vLLM's prefix-cache hit rate; a second variant with a LoRA adapter per line."""
    from serve_app.core.models.sources import resolve_source

    result = ScenarioResult("affinity", affinity.__doc__)
    missing = require_module("vllm")
    if missing:
        result.skip_variant("all", missing)
        return result
    metrics_url = _metrics_url()
    base = pick_model(ctx.models, "text-generation")
    eager = ctx.tiny
    settings = EngineSettings(ctx.precision or "bf16", MAX_MODEL_LEN, 4, True, enforce_eager=eager)
    requests = ctx.pick(96, 48, tiny=8)
    concurrency = 4
    questions = customer_questions(requests + 8)
    variants = [v.strip() for v in os.environ.get("AFFINITY_VARIANTS", "plain,adapters").split(",") if v.strip()]
    if require_module("peft"):
        variants = [v for v in variants if v != "adapters"]
        result.skip_variant("adapters", require_module("peft"))
    figures: dict[tuple[str, str], dict] = {}
    failures = []
    for kind in variants:
        adapters = _adapters(resolve_source(base["source"]), Path(ctx.out_dir) / "affinity-adapters") \
            if kind == "adapters" else []
        models = [a["name"] for a in adapters] or ["chat"] * len(PRODUCT_LINES)
        for policy in POLICIES:
            app = f"affinity-{kind}-{policy.replace('_', '-')}"
            config = variant(base, name="chat", precision=settings.precision, num_cpus=ctx.model_cpus,
                             engine="vllm", max_batch_size=4)
            config.update(num_replicas=2, routing={"policy": policy}, adapters=adapters,
                          vllm={**settings.serve_app_vllm_section(),
                                "engine_args": {"num_gpu_blocks_override": KV_BLOCKS}})
            config.setdefault("generation", {})["engine"] = "vllm"
            label = f"{kind}: {policy}"
            print(f"   starting {label}", flush=True)
            try:
                url = ctx.cluster.deploy(ctx.cluster.models_app([config]), app)
                try:
                    # Warm-up on questions without a line's prompt: both replicas compile
                    # their shapes, and no line's prefix is cached before the run.
                    asyncio.run(closed_loop(url, lambda i: ("/v1/chat/completions", {
                        "model": models[i % len(models)], "max_tokens": 4, "temperature": 0,
                        "messages": [{"role": "user", "content": questions[requests + i]}]}),
                        concurrency=4, requests=8, label="warm-up", progress=False))
                    before = _settled_counters(metrics_url, 30) if metrics_url else None
                    run = run_closed(url, lambda i: _line_request(i, questions, models), concurrency=concurrency,
                                     requests=requests, label=label, ctx=ctx, extract=_completion_tokens)
                    after = _settled_counters(metrics_url, 40) if metrics_url else None
                finally:
                    ctx.cluster.delete(app)
            except RunFailed as exc:
                result.add(exc.run, label, policy=policy, variant_kind=kind)
                failures.append(f"{label}: every request failed, e.g. {exc.run.error_samples[:1]}")
                continue
            except Exception as exc:  # one deployment failing does not stop the others
                failures.append(f"{label} failed: {type(exc).__name__}: {str(exc)[:400]}")
                print(f"   {failures[-1]}", flush=True)
                continue
            hit_rate = None
            if before and after and after[1] > before[1]:
                hit_rate = round((after[0] - before[0]) / (after[1] - before[1]), 3)
            row = result.add(run, label, policy=policy, variant_kind=kind, tokens_per_s=round(run.units_per_s, 1),
                             prefix_cache_hit_rate=hit_rate)
            figures[(kind, policy)] = row
    for kind in variants:
        ours, theirs = figures.get((kind, "prefix_affinity"), {}), figures.get((kind, "balanced"), {})
        for metric in ("p50_ttft_ms", "p95_ttft_ms", "tokens_per_s"):
            a, b = ours.get(metric), theirs.get(metric)
            result.derived[f"{kind}_{metric}_affinity_over_balanced"] = round(a / b, 3) if a and b else None
        result.check(f"{kind}: TTFT p50, affinity / Serve's default router",
                     result.derived[f"{kind}_p50_ttft_ms_affinity_over_balanced"], 0.7, higher_is_better=False)
        result.check(f"{kind}: vLLM prefix-cache hit rate with affinity", ours.get("prefix_cache_hit_rate"), 0.8,
                     higher_is_better=True)
    result.derived.update(replicas=2, product_lines=len(PRODUCT_LINES), kv_blocks_per_replica=KV_BLOCKS,
                          max_model_len=MAX_MODEL_LEN, max_tokens=MAX_TOKENS, concurrency=concurrency,
                          enforce_eager=eager, precision=settings.precision)
    if failures:
        result.error = "; ".join(failures)
    return result
