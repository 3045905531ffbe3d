"""The `generation` scenario: chat completions, static engine, batched against unbatched:
generated tokens/s from 16 concurrent clients."""

from __future__ import annotations

from benchmarks.data.workloads import CHAT_PROMPTS
from benchmarks.harness.registry import Context, ScenarioResult, model_stats, run_closed, scenario
from benchmarks.harness.service import pick_model, variant


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
