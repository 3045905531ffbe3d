"""The `generation-mixed` scenario: generation engines on requests of very different lengths.

Completions whose max_tokens vary widely (8..256, log-uniform, so short answers are
common and long ones frequent enough to matter) arrive open loop (Poisson) and are
streamed, so time to first token is measured at the client. The same arrivals go to
three copies of the same model, one after another:

- ``continuous``: iteration-level batching (``generation.engine: continuous``);
- ``static``: @serve.batch admission, one padded generate() per batch that runs
  until its longest row ends;
- ``unbatched``: static with max_batch_size 1.

Raw story and article openings, not chat questions: a model continuing such text
rarely emits EOS (SmolLM2 ends some chat-style prompts after one token), so each
request really generates its max_tokens and the length mix is the one intended.
"""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path
from typing import Optional

from benchmarks.harness.loadgen import RunResult, open_loop
from benchmarks.harness.registry import Context, ScenarioResult, run_open, scenario
from benchmarks.harness.service import pick_model, variant

MIN_TOKENS, MAX_TOKENS = 8, 256
TINY_TOKENS = (2, 8)  # tiny mode: the same log-uniform mix, over 2..8 tokens
OPENINGS = [
    "Once upon a time, in a small village by the sea,",
    "The history of the railway begins in",
    "In the spring of 1887, a young engineer arrived in the city of",
    "The most important thing to know about load balancers is that",
    "Chapter 1. The storm had been building over the mountains for days, and",
    "A good recipe for bread starts with",
    "The old lighthouse keeper looked out at the grey water and",
    "Scientists studying the deep ocean have found that",
    "When the first settlers reached the valley, they discovered",
    "The museum's new exhibition tells the story of",
    "Every morning, before the shop opened, Maria would",
    "The report on the city's water supply found that",
]
ENGINES = ("continuous", "static", "unbatched")


def max_tokens_mix(count: int, seed: int = 5, bounds: tuple[int, int] = (MIN_TOKENS, MAX_TOKENS)) -> list[int]:
    """Log-uniform max_tokens in [MIN_TOKENS, MAX_TOKENS] (or ``bounds``)."""
    rng = random.Random(seed)
    low, high = math.log(bounds[0]), math.log(bounds[1])
    return [int(round(math.exp(rng.uniform(low, high)))) for _ in range(count)]


def _completion_tokens(answer: dict) -> float:
    return float((answer.get("usage") or {}).get("completion_tokens") or 0)


@scenario(name="generation-mixed")
def generation_mixed(ctx: Context) -> ScenarioResult:
    """Streamed completions, max_tokens 8..256 log-uniform, open-loop Poisson arrivals:
    generated tokens/s, p50/p95 time to first token and total latency, continuous vs
    static vs unbatched, on the same arrivals."""
    result = ScenarioResult("generation-mixed", generation_mixed.__doc__)
    base = pick_model(ctx.models, "text-generation")
    count = ctx.pick(180, 60, tiny=4)
    # Requests/s: with ~70 tokens each on average, about 5x what one row at a time decodes
    # here (~18 tokens/s), so the engines are compared at saturation, not at idle.
    rate = ctx.pick(1.2, 1.2, tiny=4.0)
    bounds = ctx.pick((MIN_TOKENS, MAX_TOKENS), (MIN_TOKENS, MAX_TOKENS), tiny=TINY_TOKENS)
    budgets = max_tokens_mix(count, bounds=bounds)
    common = dict(precision=ctx.precision, torch_threads=ctx.gen_torch_threads, num_cpus=ctx.model_cpus)
    configs = {
        "continuous": variant(base, name="gen", max_batch_size=16, max_batch_tokens=16384, **common),
        "static": variant(base, name="gen", max_batch_size=16, max_batch_tokens=16384, batch_wait_timeout_s=0.2,
                          **common),
        "unbatched": variant(base, name="gen", max_batch_size=1, **common),
    }
    for name, config in configs.items():
        config.setdefault("generation", {}).update(
            engine="continuous" if name == "continuous" else "static", max_tokens_limit=MAX_TOKENS)
    deployed = ctx.cluster.deploy_many({f"mixed-{name}": ctx.cluster.models_app([config]) for name, config in configs.items()})
    urls = {name: deployed[f"mixed-{name}"] for name in configs}

    def make(i: int):
        return "/v1/completions", {
            "model": "gen", "prompt": OPENINGS[i % len(OPENINGS)], "max_tokens": budgets[i],
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
        }

    runs: dict[str, RunResult] = {}
    for name in ENGINES:
        # Warm up: the first generate() call of a replica is slow.
        asyncio.run(open_loop(urls[name], make, rate_per_s=10.0, requests=ctx.pick(2, 2, tiny=1),
                              label=f"{name} warm-up", progress=False))
        run = run_open(urls[name], make, rate_per_s=rate, requests=count, label=name, ctx=ctx,
                       extract=_completion_tokens, seed=17)
        runs[name] = run
        result.add(run, name, tokens_per_s=round(run.units_per_s, 1))
    ctx.cluster.delete(*deployed)

    tps = {name: run.units_per_s for name, run in runs.items()}
    p95_ttft = {name: run.percentile_ms(95, run.ttfts_s) for name, run in runs.items()}
    result.derived.update(
        requests=count, rate_per_s=rate, max_tokens=f"{bounds[0]}..{bounds[1]} log-uniform",
        continuous_vs_static_tokens_per_s=round(tps["continuous"] / tps["static"], 2),
        continuous_vs_static_p95_ttft=_ratio(p95_ttft["continuous"], p95_ttft["static"]),
        static_vs_unbatched_tokens_per_s=round(tps["static"] / tps["unbatched"], 2),
    )
    result.check("continuous / static p95 time to first token", _ratio(p95_ttft["continuous"], p95_ttft["static"]), 1.0,
                 higher_is_better=False)
    result.check("continuous / unbatched generated tokens/s", tps["continuous"] / tps["unbatched"], 1.0)
    _plot(runs, Path(ctx.out_dir))
    return result


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, None when either is missing (no streamed request produced text)."""
    return round(a / b, 3) if a is not None and b else None


def _plot(runs: dict[str, RunResult], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (ax_ttft, ax_total, ax_tps) = plt.subplots(1, 3, figsize=(14, 4))
    for name, run in runs.items():
        for ax, values in ((ax_ttft, run.ttfts_s), (ax_total, run.latencies_s)):
            ordered = sorted(values)
            ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    ax_ttft.set(title="time to first token (CDF)", xlabel="seconds", ylabel="fraction of requests", xscale="log")
    ax_total.set(title="total latency (CDF)", xlabel="seconds", xscale="log")
    names = list(runs)
    ax_tps.bar(names, [runs[n].units_per_s for n in names], color=["C0", "C1", "C2"][: len(names)])
    ax_tps.set(title="generated tokens/s", ylabel="tokens/s")
    for ax in (ax_ttft, ax_total, ax_tps):
        ax.grid(True, alpha=0.3)
    ax_ttft.legend()
    fig.suptitle("generation-mixed: max_tokens 8..256, open-loop arrivals")
    fig.tight_layout()
    path = out_dir / "generation-mixed.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
