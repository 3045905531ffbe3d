"""The `engines` scenario: the same loads, side by side in one run, through four systems.

- ``ours-vllm``: serve_app with ``engine: vllm`` (chat model and embedding model);
- ``ours-transformers``: serve_app on its own runtime (``generation.engine: continuous``
  for chat, ``engine: transformers`` for embeddings);
- ``vllm-server``: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``,
  a subprocess; ``--runner pooling`` for embeddings);
- ``ray-serve-llm``: Ray Serve LLM (``ray.serve.llm``: LLMConfig + build_openai_app) on the
  same vLLM CPU build, in the benchmark's Ray instance.

Every system gets the same precision, context window, batch cap, prefix-caching setting
and KV cache size (:class:`benchmarks.peers.engines.EngineSettings`), and the same requests
over HTTP from the project's load generator. Systems run one after another, never two engines
loaded at once (2 cores): each is started, warmed up, measured and stopped (by its own
pid or application name) before the next starts. Our response cache is off. Our
transformers runtime runs with the run's --gen-torch-threads / --torch-threads (1 by
default, as in the other scenarios); vLLM picks its own threads in every vLLM system.

Run: ``python -m benchmarks run --scenario engines [--quick | --tiny] --out DIR``; vLLM
server logs go to DIR/engines-logs/, the bar chart to DIR/engines.png.

Environment knobs (for reruns of a part): ``ENGINES_SYSTEMS=ours-vllm,vllm-server`` runs
only those systems (the others are listed as skipped, their checks missed);
``ENGINES_ENFORCE_EAGER=0|1`` sets vLLM's enforce_eager for every vLLM system (default:
on in tiny mode only).

Loads:

- ``chat``: streamed chat completions at concurrency 16; each request's prompt and output
  length is drawn (seeded) from the Azure LLM code trace, prompt tokens divided by
  ``PROMPT_SCALE`` and clipped, output tokens (max_tokens) divided by ``OUTPUT_SCALE`` and
  clipped (:mod:`benchmarks.data.workloads`); generated tokens/s, time to first token and
  latency.
- ``embeddings``: the registry's 256 mixed-length texts (4..128 words), one per request,
  at concurrency 32; embeddings/s (= requests/s) and latency.
- ``customer-service``: one long shared system prompt of policy text (about 1,100 tokens)
  and short customer questions (:mod:`benchmarks.data.prompts`), streamed at concurrency 8;
  time to first token and tokens/s. vLLM's server runs it twice, prefix cache on and off,
  to show what its prefix cache is worth.
"""

from __future__ import annotations

import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from benchmarks.data.prompts import customer_questions, policy_prompt
from benchmarks.data.workloads import (
    OUTPUT_SCALE,
    OUTPUT_TOKENS_BOUNDS,
    PROMPT_SCALE,
    PROMPT_TOKENS_BOUNDS,
    TRACE,
    TRACE_ATTRIBUTION,
    ChatRequest,
    chat_requests,
    read_trace_lengths,
    sample_lengths,
)
from benchmarks.harness.loadgen import RunResult
from benchmarks.harness.registry import (
    TEXTS,
    Context,
    RunFailed,
    ScenarioResult,
    ScenarioSkipped,
    require_module,
    run_closed,
    scenario,
)
from benchmarks.harness.service import pick_model, variant
from benchmarks.peers.engines import EngineSettings, VLLMServer, ray_serve_llm_app
from benchmarks.tools import engines_plot

# ---- the loads (pure; their lengths and text are in benchmarks.data) --------------------

MAX_MODEL_LEN = 2048
CHAT_BATCH = 16  # max_num_seqs / max_batch_size for every chat system (= the chat concurrency)
EMBED_BATCH = 32  # the same for embeddings (= the embeddings concurrency)
# MiniLM's max_seq_length (sentence_bert_config.json), which vLLM derives and will not exceed
EMBED_MAX_MODEL_LEN = 256
CS_MAX_TOKENS = 32

SYSTEMS = ("ours-vllm", "ours-transformers", "vllm-server", "ray-serve-llm")
OURS, VLLM_SERVER, RAY_LLM = "ours-vllm", "vllm-server", "ray-serve-llm"
VLLM_SERVER_NO_PREFIX = "vllm-server (prefix cache off)"


def _stream_opts() -> dict:
    return {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0}


def chat_factory(model: str, requests: list[ChatRequest]) -> Callable[[int], tuple[str, dict]]:
    def make(i: int):
        req = requests[i]
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": req.prompt}],
                                        "max_tokens": req.max_tokens, **_stream_opts()}
    return make


def customer_factory(model: str, system_prompt: str, questions: list[str], max_tokens: int):
    def make(i: int):
        return "/v1/chat/completions", {
            "model": model, "max_tokens": max_tokens, **_stream_opts(),
            "messages": [{"role": "system", "content": system_prompt},
                         {"role": "user", "content": questions[i % len(questions)]}]}
    return make


def embedding_factory(model: str, texts: list[str]):
    return lambda i: ("/v1/embeddings", {"model": model, "input": texts[i % len(texts)]})


def completion_tokens(answer: dict) -> float:
    return float((answer.get("usage") or {}).get("completion_tokens") or 0)


# ---- ratios and checks (pure) -----------------------------------------------------------

# (load, metric, whether higher is better) -> the figure a run row holds
METRICS = {
    "tokens_per_s": True, "embeddings_per_s": True, "p95_ms": False, "p50_ms": False,
    "p50_ttft_ms": False, "p95_ttft_ms": False,
}


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, None when either is missing or b is zero (a system that did not run)."""
    if a is None or b is None or b == 0 or (isinstance(a, float) and math.isnan(a)):
        return None
    return round(a / b, 3)


# (claim, load, metric, peer, target); higher_is_better follows METRICS.
CHECKS: list[tuple[str, str, str, str, float]] = [
    ("chat generated tokens/s, ours(vLLM) / vLLM server", "chat", "tokens_per_s", VLLM_SERVER, 0.9),
    ("chat p95 latency, ours(vLLM) / vLLM server", "chat", "p95_ms", VLLM_SERVER, 1.15),
    ("chat generated tokens/s, ours(vLLM) / Ray Serve LLM", "chat", "tokens_per_s", RAY_LLM, 1.0),
    ("embeddings/s, ours(vLLM) / vLLM server", "embeddings", "embeddings_per_s", VLLM_SERVER, 0.9),
    ("embeddings p95 latency, ours(vLLM) / vLLM server", "embeddings", "p95_ms", VLLM_SERVER, 1.15),
    ("embeddings/s, ours(vLLM) / Ray Serve LLM", "embeddings", "embeddings_per_s", RAY_LLM, 1.0),
    ("customer-service p50 time to first token, ours(vLLM) / vLLM server (prefix cache on)",
     "customer-service", "p50_ttft_ms", VLLM_SERVER, 1.2),
    ("customer-service p95 time to first token, ours(vLLM) / vLLM server (prefix cache on)",
     "customer-service", "p95_ttft_ms", VLLM_SERVER, 1.2),
    ("customer-service generated tokens/s, ours(vLLM) / vLLM server (prefix cache on)",
     "customer-service", "tokens_per_s", VLLM_SERVER, 0.9),
]

# Ratios reported beside the checks: ours(vLLM) over each peer, per load and metric.
RATIO_METRICS = {
    "chat": ("tokens_per_s", "p95_ms", "p50_ttft_ms", "p95_ttft_ms"),
    "embeddings": ("embeddings_per_s", "p95_ms"),
    "customer-service": ("tokens_per_s", "p50_ttft_ms", "p95_ttft_ms", "p95_ms"),
}


def derive_ratios(figures: dict[tuple[str, str], dict]) -> dict[str, Optional[float]]:
    """ours(vLLM) / peer for every (load, metric) in RATIO_METRICS and both peers, plus
    what vLLM's prefix cache is worth on the customer-service load (off / on)."""
    out: dict[str, Optional[float]] = {}
    for load, metrics in RATIO_METRICS.items():
        ours = figures.get((load, OURS), {})
        for peer, tag in ((VLLM_SERVER, "vllm_server"), (RAY_LLM, "ray_serve_llm")):
            theirs = figures.get((load, peer), {})
            for metric in metrics:
                out[f"{load}_{metric}_ours_vllm_over_{tag}"] = ratio(ours.get(metric), theirs.get(metric))
    on = figures.get(("customer-service", VLLM_SERVER), {})
    off = figures.get(("customer-service", VLLM_SERVER_NO_PREFIX), {})
    out["vllm_server_prefix_cache_off_over_on_p50_ttft"] = ratio(off.get("p50_ttft_ms"), on.get("p50_ttft_ms"))
    out["vllm_server_prefix_cache_off_over_on_p95_ttft"] = ratio(off.get("p95_ttft_ms"), on.get("p95_ttft_ms"))
    out["vllm_server_prefix_cache_on_over_off_tokens_per_s"] = ratio(on.get("tokens_per_s"), off.get("tokens_per_s"))
    return out


def apply_checks(result: ScenarioResult, figures: dict[tuple[str, str], dict]) -> None:
    """Every CHECKS entry as a check of ``result``; a figure missing (a system that failed
    or did not run) makes its check's value None, so the check is missed, never met."""
    for claim, load, metric, peer, target in CHECKS:
        value = ratio(figures.get((load, OURS), {}).get(metric), figures.get((load, peer), {}).get(metric))
        result.check(claim, value, target, higher_is_better=METRICS[metric])


def figures_of(row: dict) -> dict:
    """The figures of a run row that the ratios use."""
    return {metric: row.get(metric) for metric in METRICS}


# ---- the systems ------------------------------------------------------------------------


@dataclass
class Plan:
    precision: str
    chat: EngineSettings
    chat_no_prefix: EngineSettings
    embed: EngineSettings
    chat_dir: str
    embed_dir: str


def _ours_chat(ctx: Context, plan: Plan, engine: str) -> dict:
    base = pick_model(ctx.models, "text-generation")
    config = variant(base, name="chat", precision=plan.precision, torch_threads=ctx.gen_torch_threads,
                     num_cpus=ctx.model_cpus, max_batch_size=CHAT_BATCH, max_batch_tokens=CHAT_BATCH * MAX_MODEL_LEN)
    generation = config.setdefault("generation", {})
    generation["max_tokens_limit"] = max(generation.get("max_tokens_limit", 0), OUTPUT_TOKENS_BOUNDS[1])
    if engine == "vllm":
        config["engine"] = "vllm"
        generation["engine"] = "vllm"
        config["vllm"] = plan.chat.serve_app_vllm_section()
    else:
        config["engine"] = "transformers"
        generation["engine"] = "continuous"
    return config


def _ours_embed(ctx: Context, plan: Plan, engine: str) -> dict:
    base = pick_model(ctx.models, "embedding")
    config = variant(base, name="embed", precision=plan.precision, torch_threads=ctx.torch_threads,
                     num_cpus=ctx.model_cpus, max_batch_size=EMBED_BATCH, batch_wait_timeout_s=0.01)
    config["engine"] = engine
    if engine == "vllm":
        config["vllm"] = plan.embed.serve_app_vllm_section()
    return config


@contextmanager
def serving(ctx: Context, plan: Plan, system: str, kind: str) -> Iterator[str]:
    """Start ``system`` serving the chat model (``kind`` chat or chat-no-prefix) or the
    embedding model (embed); yields its base URL and stops it on exit."""
    settings = {"chat": plan.chat, "chat-no-prefix": plan.chat_no_prefix, "embed": plan.embed}[kind]
    model_name = "embed" if kind == "embed" else "chat"
    model_dir = plan.embed_dir if kind == "embed" else plan.chat_dir
    app = f"engines-{system.split(' ')[0]}-{kind}"
    if system.startswith("ours-"):
        engine = "vllm" if system == OURS else "transformers"
        config = (_ours_embed if kind == "embed" else _ours_chat)(ctx, plan, engine)
        url = ctx.cluster.deploy(ctx.cluster.models_app([config]), app)
        try:
            yield url
        finally:
            ctx.cluster.delete(app)
    elif system.startswith(VLLM_SERVER):
        server = VLLMServer(model_dir, model_name, settings, log_path=Path(ctx.out_dir) / "engines-logs" / f"{app}.log")
        try:
            yield server.start()
        finally:
            server.stop()
    elif system == RAY_LLM:
        num_cpus = 0.25 if ctx.tiny else 0.5
        try:
            url = ctx.cluster.deploy(ray_serve_llm_app(model_dir, model_name, settings, num_cpus=num_cpus), app)
            yield url
        finally:
            if app in ctx.cluster.deployed:
                ctx.cluster.delete(app)
    else:
        raise ValueError(f"unknown system {system!r}")


# ---- the scenario -----------------------------------------------------------------------


@scenario
def engines(ctx: Context) -> ScenarioResult:
    """Ours on vLLM vs ours on transformers vs vLLM's own OpenAI server vs Ray Serve LLM, the same loads
    one system after another: mixed-length chat from the Azure code trace (concurrency 16, streamed),
    embeddings (256 mixed-length texts, concurrency 32) and a customer-service shape (a ~1,100-token shared
    policy prompt, short questions, streamed; vLLM's server with prefix cache on and off)."""
    from serve_app.core.models.sources import resolve_source

    if not TRACE.is_file():
        raise ScenarioSkipped(f"the Azure trace is not on this machine (expected at {TRACE})")
    result = ScenarioResult("engines", engines.__doc__)
    chat_base, embed_base = pick_model(ctx.models, "text-generation"), pick_model(ctx.models, "embedding")
    precision = ctx.precision or "bf16"
    # Tiny: skip vLLM's compilation so the smoke run starts faster (its figures mean nothing);
    # ENGINES_ENFORCE_EAGER=0/1 overrides, for every vLLM system alike.
    eager = {"0": False, "1": True}.get(os.environ.get("ENGINES_ENFORCE_EAGER", ""), ctx.tiny)
    chat_settings = EngineSettings(precision, MAX_MODEL_LEN, CHAT_BATCH, True, enforce_eager=eager)
    plan = Plan(
        precision=precision, chat=chat_settings,
        chat_no_prefix=EngineSettings(precision, MAX_MODEL_LEN, CHAT_BATCH, False, enforce_eager=eager),
        # Encoder-only pooling models do not use a prefix cache; off for every system.
        embed=EngineSettings(precision, EMBED_MAX_MODEL_LEN, EMBED_BATCH, False, enforce_eager=eager, pooling=True),
        chat_dir=str(resolve_source(chat_base["source"])), embed_dir=str(resolve_source(embed_base["source"])),
    )

    # The loads: the same requests for every system.
    chat_concurrency = ctx.pick(16, 16, tiny=4)
    chat_count = ctx.pick(192, 64, tiny=4)
    lengths = sample_lengths(read_trace_lengths(), chat_count)
    warmup = ctx.pick(4, 4, tiny=1)
    # Warm-up requests come after the measured ones in each list: never the same prompt
    # (a prefix-cache hit), except the customer-service system prompt, whose reuse is the point.
    lengths += sample_lengths(read_trace_lengths(), warmup, seed=31)
    chat_reqs = chat_requests(lengths, max_tokens_cap=ctx.pick(None, None, tiny=8))
    embed_concurrency = ctx.pick(32, 32, tiny=8)
    embed_count = ctx.pick(512, 256, tiny=8)
    texts = TEXTS[:256]
    cs_concurrency = ctx.pick(8, 8, tiny=4)
    cs_count = ctx.pick(128, 48, tiny=4)
    cs_max_tokens = ctx.pick(CS_MAX_TOKENS, CS_MAX_TOKENS, tiny=4)
    system_prompt, questions = policy_prompt(), customer_questions(cs_count + warmup)

    loads = {
        "chat": dict(make=chat_factory("chat", chat_reqs), concurrency=chat_concurrency, requests=chat_count,
                     extract=completion_tokens),
        "customer-service": dict(make=customer_factory("chat", system_prompt, questions, cs_max_tokens),
                                 concurrency=cs_concurrency, requests=cs_count, extract=completion_tokens),
        "embeddings": dict(make=embedding_factory("embed", texts), concurrency=embed_concurrency,
                           requests=embed_count, extract=None),
    }
    # (system, kind it is started as, loads run on it), in the order they run.
    schedule = []
    for system in SYSTEMS:
        schedule.append((system, "chat", ("chat", "customer-service")))
        if system == VLLM_SERVER:
            schedule.append((VLLM_SERVER_NO_PREFIX, "chat-no-prefix", ("customer-service",)))
        schedule.append((system, "embed", ("embeddings",)))

    only = [s.strip() for s in os.environ.get("ENGINES_SYSTEMS", "").split(",") if s.strip()]
    unknown = sorted(set(only) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"ENGINES_SYSTEMS names {unknown}; choose from {', '.join(SYSTEMS)}")
    missing = {VLLM_SERVER: require_module("vllm"), RAY_LLM: require_module("vllm") or require_module("ray.serve.llm")}
    figures: dict[tuple[str, str], dict] = {}
    failures: list[str] = []
    completions: dict[str, float] = {}  # mean completion tokens per request: the same work for every system?
    started_s: dict[str, float] = {}
    for system, kind, names in schedule:
        reason = missing.get(system.split(" ")[0])
        if only and system.split(" ")[0] not in only:
            reason = "not in ENGINES_SYSTEMS"
        if reason:
            result.skip_variant(f"{system} ({kind})", reason)
            continue
        label = f"{system} [{kind}]"
        print(f"   starting {label}", flush=True)
        t0 = time.perf_counter()
        try:
            with serving(ctx, plan, system, kind) as url:
                started_s[f"{system.split(' ')[0]}_{kind}_start_s"] = round(time.perf_counter() - t0, 1)
                for load in names:
                    spec = loads[load]
                    row_name = f"{load}: {system}"
                    try:
                        _warm_up(url, spec, warmup)
                        run = run_closed(url, spec["make"], concurrency=spec["concurrency"], requests=spec["requests"],
                                         label=row_name, ctx=ctx, extract=spec["extract"])
                    except RunFailed as exc:
                        result.add(exc.run, row_name, system=system, load=load)
                        failures.append(f"{row_name}: every request failed, e.g. {exc.run.error_samples[:1]}")
                        continue
                    row = result.add(run, row_name, system=system, load=load, **_row_figures(run, load))
                    figures[(load, system)] = figures_of(row)
                    if "completion_tokens_per_request" in row:
                        completions[f"{load}_{system}"] = row["completion_tokens_per_request"]
        except Exception as exc:  # one system failing to start does not stop the others
            failures.append(f"{label} failed: {type(exc).__name__}: {str(exc)[:600]}")
            print(f"   {failures[-1]}", flush=True)

    measured = chat_reqs[:chat_count]
    result.derived.update(
        precision=precision, max_model_len=MAX_MODEL_LEN, chat_batch_cap=CHAT_BATCH, embed_batch_cap=EMBED_BATCH,
        chat_prefix_caching=True, kv_cache_gib=chat_settings.kv_cache_gib, enforce_eager=eager,
        chat_lengths=(f"trace ContextTokens/{PROMPT_SCALE} clipped to "
                      f"{PROMPT_TOKENS_BOUNDS[0]}..{PROMPT_TOKENS_BOUNDS[1]} "
                      f"(nominal prompt tokens: median {_median([r.prompt_tokens for r in measured])}), "
                      f"GeneratedTokens/{OUTPUT_SCALE} clipped to {OUTPUT_TOKENS_BOUNDS[0]}..{OUTPUT_TOKENS_BOUNDS[1]} "
                      f"as max_tokens (median {_median([r.max_tokens for r in measured])})"),
        customer_service_system_prompt_words=len(system_prompt.split()), customer_service_max_tokens=cs_max_tokens,
        completion_tokens_per_request=completions, **started_s, **derive_ratios(figures),
        vllm_version=_version("vllm"), trace_source=TRACE_ATTRIBUTION,
    )
    apply_checks(result, figures)
    if failures:
        result.error = "; ".join(failures)
    try:
        engines_plot.plot(result, Path(ctx.out_dir), (*SYSTEMS, VLLM_SERVER_NO_PREFIX))
    except Exception as exc:  # a plot is a nicety; the figures are in the table
        print(f"   engines plot not drawn: {exc}", flush=True)
    return result


def _warm_up(url: str, spec: dict, count: int) -> None:
    """``count`` requests from beyond the measured ones (indices requests..requests+count-1),
    all at once, not recorded: the first calls of an engine are slow."""
    import asyncio

    from benchmarks.harness.loadgen import closed_loop

    offset = spec["requests"]
    asyncio.run(closed_loop(url, lambda i: spec["make"](offset + i), concurrency=count, requests=count,
                            label="warm-up", progress=False))


def _row_figures(run: RunResult, load: str) -> dict:
    if load == "embeddings":
        return {"embeddings_per_s": round(run.throughput_rps, 2)}
    return {"tokens_per_s": round(run.units_per_s, 1),
            "completion_tokens_per_request": round(run.units / max(1, run.requests - run.errors), 1)}


def _median(values: list[int]) -> float:
    import statistics

    return statistics.median(values) if values else 0


def _version(dist: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, distributions

    for name in (dist, f"{dist}-cpu"):
        try:
            for found in distributions(name=name):
                return found.version
        except PackageNotFoundError:
            continue
    return None
