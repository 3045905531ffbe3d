"""The main panels of dashboards/serve_app.json, drawn from a live deployment without Grafana.

    python -m benchmarks.tools.dashboard_plot --url http://127.0.0.1:8000 \\
        --metrics http://127.0.0.1:8080/metrics --duration-s 150 --out docs/dashboard.png

Sends a mixed load to a running deployment (deployments/local.yaml: embeddings to
``minilm`` with texts of mixed length, repeated and fresh chat completions to
``smollm2`` so that the cache hits, and a few bad requests), scrapes the Prometheus
endpoint every few seconds, and computes from the counters and histogram buckets of
consecutive scrapes what the dashboard's PromQL computes: rates as counter deltas over
the trailing window, quantiles as ``histogram_quantile`` does over bucket deltas.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections import Counter, defaultdict

import aiohttp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

WORDS = ("serve batch cache replica model token latency queue window padding schedule request "
         "embedding answer prompt route metric scrape budget").split()
CHAT_PROMPTS = ["What is Ray Serve?", "Name three colours.", "Say hello in French."]

Scrape = dict[str, list[tuple[dict, float]]]  # sample name -> [(labels, value)]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 8, 20, 60, 150])))


async def _post(session: aiohttp.ClientSession, path: str, body: dict, statuses: Counter) -> None:
    try:
        async with session.post(path, json=body) as response:
            await response.read()
            statuses[f"{body.get('model')} {response.status}"] += 1
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        statuses[f"{body.get('model')} {type(exc).__name__}"] += 1


async def send_load(url: str, duration_s: float, statuses: Counter, embed_rps: float = 3.0,
                    chat_every_s: float = 4.0, seed: int = 0) -> None:
    """Embeddings at ``embed_rps``, a chat completion every ``chat_every_s`` (two in three
    repeat a prompt, so they hit the cache), and a 404 and a 400 every 30 s."""
    rng = random.Random(seed)
    tasks: set[asyncio.Task] = set()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(base_url=url, timeout=timeout) as session:
        start = time.monotonic()
        next_chat, next_404, next_400 = start + 2, start + 5, start + 20
        while (now := time.monotonic()) < start + duration_s:
            bodies = [("/v1/embeddings", {"model": "minilm", "input": [_text(rng) for _ in range(rng.randint(1, 4))]})]
            if now >= next_chat:
                next_chat += chat_every_s
                fresh = f"Write a line about {' and '.join(rng.sample(WORDS, 3))}."
                prompt = rng.choice(CHAT_PROMPTS) if rng.random() < 2 / 3 else fresh
                bodies.append(("/v1/chat/completions", {"model": "smollm2", "max_tokens": 16, "temperature": 0,
                                                        "messages": [{"role": "user", "content": prompt}]}))
            if now >= next_404:
                next_404 += 30
                bodies.append(("/v1/embeddings", {"model": "no-such-model", "input": "x"}))
            if now >= next_400:  # max_tokens over the model's limit
                next_400 += 30
                bodies.append(("/v1/chat/completions", {"model": "smollm2", "max_tokens": 100_000,
                                                        "messages": [{"role": "user", "content": "x"}]}))
            for path, body in bodies:
                task = asyncio.create_task(_post(session, path, body, statuses))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(embed_rps))
        await asyncio.gather(*tasks)


async def scrape_every(metrics_url: str, interval_s: float, stop: asyncio.Event) -> list[tuple[float, Scrape]]:
    scrapes: list[tuple[float, Scrape]] = []
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.get(metrics_url) as response:
                text = await response.text()
            samples: Scrape = defaultdict(list)
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    samples[sample.name].append((sample.labels, sample.value))
            scrapes.append((time.monotonic(), samples))
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass
    return scrapes


def total_by(scrape: Scrape, name: str, by: tuple[str, ...], where: dict | None = None) -> dict[tuple, float]:
    """``sum by (by) (name{where})`` at one scrape."""
    out: dict[tuple, float] = defaultdict(float)
    for labels, value in scrape.get(name, []):
        if all(labels.get(k) == v for k, v in (where or {}).items()):
            out[tuple(labels.get(k, "") for k in by)] += value
    return out


def increase_by(old: Scrape, new: Scrape, name: str, by: tuple[str, ...], where: dict | None = None) -> dict:
    """``sum by (by) (increase(name[window]))``; a series new in ``new`` started at 0."""
    before, after = total_by(old, name, by, where), total_by(new, name, by, where)
    return {key: max(0.0, value - before.get(key, 0.0)) for key, value in after.items()}


def quantile(q: float, buckets: dict[float, float]) -> float:
    """``histogram_quantile`` over cumulative bucket counts {le: count}."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


def quantile_by_model(q: float, old: Scrape, new: Scrape, histogram: str) -> dict[str, float]:
    per_model: dict[str, dict[float, float]] = defaultdict(dict)
    for (model, le), value in increase_by(old, new, f"{histogram}_bucket", ("model", "le")).items():
        per_model[model][float(le)] = value
    return {model: quantile(q, buckets) for model, buckets in per_model.items()}


def ratio_by_model(old: Scrape, new: Scrape, numerator: str, denominator: str) -> dict[str, float]:
    """increase(numerator) / increase(denominator), by model: exact counters, as on the dashboard."""
    top = increase_by(old, new, numerator, ("model",))
    bottom = increase_by(old, new, denominator, ("model",))
    return {key[0]: top.get(key, 0.0) / n if n else math.nan for key, n in bottom.items()}


def cache_hit_rate(old: Scrape, new: Scrape, _seconds: float = 0.0) -> dict[str, float]:
    outcomes = increase_by(old, new, "ray_serve_app_cache_requests_total", ("model", "outcome"))
    hits, lookups = defaultdict(float), defaultdict(float)
    for (model, outcome), n in outcomes.items():
        hits[model] += n if outcome in ("hit", "semantic") else 0.0
        lookups[model] += n if outcome in ("hit", "semantic", "miss", "coalesced") else 0.0
    return {model: hits[model] / n if n else math.nan for model, n in lookups.items()}


def per_second(counts: dict[tuple, float], seconds: float) -> dict[str, float]:
    return {" ".join(key): n / seconds for key, n in counts.items()}


PANELS = {  # title (as on the dashboard), unit -> f(old, new, seconds) -> {series: value}
    ("Requests/s by model", "req/s"): lambda o, n, s: per_second(
        increase_by(o, n, "ray_serve_app_requests_total", ("model",)), s),
    ("End-to-end latency by model (p95)", "s"): lambda o, n, s: quantile_by_model(
        0.95, o, n, "ray_serve_app_request_latency_seconds"),
    ("Queue wait by model (p95)", "s"): lambda o, n, s: quantile_by_model(0.95, o, n, "ray_serve_app_queue_wait_seconds"),
    ("Rows per model batch (mean)", "rows"): lambda o, n, s: ratio_by_model(
        o, n, "ray_serve_app_rows_total", "ray_serve_app_batches_total"),
    ("Padding efficiency (all tokens)", "real/padded"): lambda o, n, s: ratio_by_model(
        o, n, "ray_serve_app_real_tokens_total", "ray_serve_app_padded_tokens_total"),
    ("Cache hit rate by model", "fraction"): cache_hit_rate,
    ("Generated tokens/s by model", "tokens/s"): lambda o, n, s: per_second(
        increase_by(o, n, "ray_serve_app_generated_tokens_total", ("model",)), s),
    ("Errors/s by model, status, code", "req/s"): lambda o, n, s: per_second(
        increase_by(o, n, "ray_serve_app_errors_total", ("model", "status", "code")), s),
    ("Running replicas (healthy)", "replicas"): lambda o, n, s: {
        key[0]: v for key, v in total_by(n, "ray_serve_deployment_replica_healthy", ("deployment",)).items()
        if key[0].startswith("ModelServer-")},
}


def series(scrapes: list[tuple[float, Scrape]], window_s: float) -> dict:
    """For each panel: {series: ([t], [value])}, each point over the trailing window."""
    start = scrapes[0][0]
    out: dict = {panel: defaultdict(lambda: ([], [])) for panel in PANELS}
    for i in range(1, len(scrapes)):
        t_new, new = scrapes[i]
        j = max((k for k in range(i) if t_new - scrapes[k][0] >= window_s - 0.5), default=None)
        if j is None:  # less than one window since the first scrape
            continue
        t_old, old = scrapes[j]
        for panel, compute in PANELS.items():
            for name, value in compute(old, new, t_new - t_old).items():
                out[panel][name][0].append(t_new - start)
                out[panel][name][1].append(value)
    return out


def draw(data: dict, out: str, title: str) -> None:
    fig, axes = plt.subplots(3, 3, figsize=(15, 10), constrained_layout=True)
    for ax, ((panel, unit), lines) in zip(axes.flat, data.items()):
        for k, (name, (ts, values)) in enumerate(sorted(lines.items())):  # styles keep equal lines apart
            ax.plot(ts, values, label=name, marker=".", markersize=3, linewidth=1.2, linestyle=["-", "--", ":"][k % 3])
        ax.set_ylim(bottom=0, top=max([1e-9, *(v for _, vs in lines.values() for v in vs if v == v)]) * 1.15)
        ax.set_title(panel, fontsize=10)
        ax.set_ylabel(unit, fontsize=8)
        ax.set_xlabel("seconds since start", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.savefig(out, dpi=110)


def summary(data: dict) -> None:
    for (panel, unit), lines in data.items():
        parts = []
        for name, (_, values) in sorted(lines.items()):
            finite = [v for v in values if not math.isnan(v)]
            if finite:
                parts.append(f"{name}: mean {sum(finite) / len(finite):.3g}, min {min(finite):.3g}, max {max(finite):.3g}")
        print(f"{panel} [{unit}]: " + ("; ".join(parts) or "no data"))


async def run(args: argparse.Namespace) -> dict:
    stop, statuses = asyncio.Event(), Counter()
    scraper = asyncio.create_task(scrape_every(args.metrics, args.scrape_interval_s, stop))
    await send_load(args.url, args.duration_s, statuses)
    await asyncio.sleep(2 * args.scrape_interval_s)  # replicas push metrics every few seconds
    stop.set()
    scrapes = await scraper
    outcomes = increase_by(scrapes[0][1], scrapes[-1][1], "ray_serve_app_cache_requests_total", ("model", "outcome"))
    print("responses:", dict(sorted(statuses.items())), f"scrapes: {len(scrapes)}")
    print("cache outcomes:", {" ".join(key): int(n) for key, n in sorted(outcomes.items())})
    return series(scrapes, args.window_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.dashboard_plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the deployment's HTTP address")
    parser.add_argument("--metrics", default="http://127.0.0.1:8080/metrics", help="its Prometheus endpoint")
    parser.add_argument("--duration-s", type=float, default=150)
    parser.add_argument("--scrape-interval-s", type=float, default=5)
    parser.add_argument("--window-s", type=float, default=20, help="trailing window of each rate (PromQL's [20s])")
    parser.add_argument("--out", default="docs/dashboard.png")
    args = parser.parse_args(argv)
    data = asyncio.run(run(args))
    summary(data)
    draw(data, args.out, f"serve_app dashboard, main panels: {args.duration_s:.0f} s of mixed load, "
                         f"scraped every {args.scrape_interval_s:.0f} s, rates over {args.window_s:.0f} s")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
