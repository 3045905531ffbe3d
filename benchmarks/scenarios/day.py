"""The `day` scenario: a compressed day of traffic against three scaling policies at once.

The same daily curve (quiet night, a steep morning ramp, a long peak, an evening tail)
is replayed open loop, at the same moments, against three copies of the service that
differ only in how their model deployment scales:

- ``daily-profile``: serve_app's policy (serve_app/scaling.py) with a load profile,
  built by the production ``serve_app.app.autoscaling_config``;
- ``reactive``: Ray Serve's default policy (queue-length target), with Ray's default
  delays compressed by the same factor as the day;
- ``fixed-peak``: a fixed fleet sized for the peak.

Each copy is the real HTTP proxy and Router in front of a model deployment whose
replicas emulate an accelerator (``benchmarks.harness.stubs.EmulatedAccelerator``: a fixed
number of requests in flight, each taking a fixed service time) because two CPU cores
cannot host several independent GPUs; what is measured is the scaling, not the model.
Replica start-up is real: a new replica process takes seconds here, which the compressed
clock turns into tens of simulated minutes, much like a GPU node's cold start.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import aiohttp

from benchmarks.harness.registry import Context, ScenarioResult, scenario

# Offered load in requests/s (real seconds) at each hour of the simulated day; linear
# in between. The morning ramp (06:00 -> 09:00) goes from 1 to 14 requests/s.
TRAFFIC_CURVE = [(0, 1.0), (6, 1.0), (7, 3.0), (8, 9.0), (9, 14.0), (12, 14.0), (13, 12.0),
                 (17, 12.0), (19, 6.0), (22, 2.0), (24, 1.0)]
SLOTS, SERVICE_S = 2, 0.5  # per replica: 2 requests at once, 0.5 s each -> 4 requests/s
TARGET_ONGOING = 2  # both load-following policies aim at 2 requests per replica
SLO_MS = 1000.0  # p95 latency objective: twice the service time
BUCKET_H = 0.5  # latency buckets, simulated hours
RAMP_HOURS = (6.0, 10.0)  # the morning ramp and the first hour of the peak
PEAK_FLEET = 5  # ceil(14 requests/s / (80% of 4 requests/s per replica))


def rate_at(hour: float) -> float:
    for (h0, r0), (h1, r1) in zip(TRAFFIC_CURVE, TRAFFIC_CURVE[1:]):
        if h0 <= hour <= h1:
            return r0 + (r1 - r0) * (hour - h0) / (h1 - h0)
    return TRAFFIC_CURVE[-1][1]


def arrivals(day_length_s: float, seed: int = 11, rate_scale: float = 1.0) -> list[float]:
    """Non-homogeneous Poisson arrivals (thinning), in real seconds from the day's start;
    ``rate_scale`` scales the whole curve (tiny mode sends a fraction of it)."""
    rng = random.Random(seed)
    peak = max(r for _, r in TRAFFIC_CURVE) * rate_scale
    t, out = 0.0, []
    while True:
        t += rng.expovariate(peak)
        if t >= day_length_s:
            return out
        if rng.random() < rate_at(24.0 * t / day_length_s) * rate_scale / peak:
            out.append(t)


def profile_config(day_length_s: float, anchor_unix_s: float) -> dict[str, Any]:
    """The load profile an operator would write for this traffic (see README)."""

    def window(name, start, end, lo, hi):
        return {"name": name, "start": start, "end": end, "min_replicas": lo, "max_replicas": hi,
                "target_ongoing_requests": TARGET_ONGOING}

    return {
        "timezone": "UTC",
        "prewarm_s": 3600,  # a replica's cold start is ~30-50 simulated minutes here
        "upscale_delay_s": 30,  # Ray's defaults, in the profile's (simulated) clock
        "downscale_delay_s": 600,
        "look_back_period_s": 2,
        "clock": {"day_length_s": day_length_s, "start_time": "00:00", "anchor_unix_s": anchor_unix_s},
        "windows": [
            window("night", "22:00", "06:00", 1, 2),
            window("morning", "06:00", "09:00", 3, 6),
            window("peak", "09:00", "17:00", 4, 6),
            window("evening", "17:00", "22:00", 2, 5),
        ],
    }


def _policies(day_length_s: float, anchor_unix_s: float) -> dict[str, dict[str, Any]]:
    from serve_app.app import autoscaling_config
    from serve_app.config import LoadProfileConfig

    speedup = 86400.0 / day_length_s
    profile = LoadProfileConfig.model_validate(profile_config(day_length_s, anchor_unix_s))
    return {
        "daily-profile": {"autoscaling_config": autoscaling_config("embed", "day", profile)},
        "reactive": {"autoscaling_config": {
            "min_replicas": 1, "max_replicas": 6, "target_ongoing_requests": TARGET_ONGOING,
            "upscale_delay_s": 30 / speedup, "downscale_delay_s": 600 / speedup,
            "look_back_period_s": 2, "metrics_interval_s": 1,
        }},
        "fixed-peak": {"num_replicas": PEAK_FLEET},
    }


@dataclass
class Sample:
    sent_s: float  # real seconds from the day's start
    latency_s: Optional[float]  # None: failed
    status: int
    error: Optional[str] = None  # what a failed request got back (status and body, or the exception)


async def _replay(urls: dict[str, str], offsets: list[float], started: float) -> dict[str, list[Sample]]:
    samples: dict[str, list[Sample]] = {name: [] for name in urls}
    connector = aiohttp.TCPConnector(limit=1024)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one(name: str, url: str, at: float, i: int) -> None:
            body = {"model": "embed", "input": f"request {i} of the day"}
            t0 = time.time()
            error = None
            try:
                async with session.post(f"{url}/v1/embeddings", json=body) as response:
                    payload = await response.read()
                    status = response.status
                if status != 200:
                    error = f"HTTP {status}: {payload[:200]!r}"
            except Exception as exc:
                status, error = 0, f"{type(exc).__name__}: {exc}"
            latency = time.time() - t0 if status == 200 else None
            samples[name].append(Sample(at, latency, status, error))

        async def fire(i: int, at: float) -> None:
            delay = started + at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await asyncio.gather(*(one(name, url, at, i) for name, url in urls.items()))

        await asyncio.gather(*(fire(i, at) for i, at in enumerate(offsets)))
    return samples


def _watch_replicas(apps: list[str], started: float, until: float, period_s: float, out: dict) -> None:
    """Poll Serve for running and starting replicas of each model deployment (thread)."""
    from ray import serve

    from serve_app.config import model_deployment_name

    while time.time() < until:
        status = serve.status().applications
        for app in apps:
            deployment = status.get(app) and status[app].deployments.get(model_deployment_name("embed"))
            states = deployment.replica_states if deployment else {}
            running = states.get("RUNNING", 0)
            starting = sum(states.get(s, 0) for s in ("STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION"))
            out[app].append((time.time() - started, running, running + starting))
        time.sleep(period_s)


def _round3(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 3)


def _p95(values: list[float]) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def _summarise(samples: list[Sample], replicas: list[tuple[float, int, int]], hours_per_s: float) -> dict[str, Any]:
    buckets: dict[int, list[float]] = {}
    for s in samples:
        hour = s.sent_s * hours_per_s
        # A failed request counts as missing the SLO in its bucket.
        buckets.setdefault(int(hour / BUCKET_H), []).append(s.latency_s if s.latency_s is not None else math.inf)
    p95_by_bucket = {b: _p95(v) for b, v in sorted(buckets.items())}
    missed = [b for b, p in p95_by_bucket.items() if p is not None and p * 1000 > SLO_MS]
    ramp = [b for b in missed if RAMP_HOURS[0] <= b * BUCKET_H < RAMP_HOURS[1]]
    replica_hours = 0.0
    for (t0, running, _), (t1, _, _) in zip(replicas, replicas[1:]):
        replica_hours += running * (t1 - t0) * hours_per_s
    ok = [s.latency_s for s in samples if s.latency_s is not None]
    return {
        "requests": len(samples),
        "errors": sum(1 for s in samples if s.latency_s is None),
        "error_samples": [s.error for s in samples if s.error is not None][:3],
        "replica_hours": round(replica_hours, 1),
        "peak_replicas": max((r for _, r, _ in replicas), default=0),
        "p50_ms": round(sorted(ok)[len(ok) // 2] * 1000, 1) if ok else None,
        "p95_ms": round(_p95(ok) * 1000, 1) if ok else None,
        "over_slo_fraction": round(sum(1 for s in samples if s.latency_s is None or s.latency_s * 1000 > SLO_MS)
                                   / max(1, len(samples)), 4),
        "slo_missed_buckets": len(missed),
        "slo_missed_buckets_ramp": len(ramp),
        "p95_by_bucket_ms": {f"{b * BUCKET_H:.1f}": (round(p * 1000, 1) if p != math.inf else None)
                             for b, p in p95_by_bucket.items()},
    }


def _plot(result: dict[str, Any], timelines: dict[str, list], hours_per_s: float, day_length_s: float,
          anchor: float, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from serve_app.config import LoadProfileConfig
    from serve_app.core.schedule import scheduled_bounds

    fig, (ax_rate, ax_rep, ax_lat) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    hours = [h / 10 for h in range(0, 241)]
    ax_rate.plot(hours, [rate_at(h) for h in hours], color="black")
    ax_rate.set(ylabel="offered requests/s", title="day replay: traffic, replicas and p95 latency per policy")
    profile = LoadProfileConfig.model_validate(profile_config(day_length_s, anchor)).to_schedule("day")
    bounds = [scheduled_bounds(profile, profile.now(anchor + h / hours_per_s, anchor)) for h in hours]
    ax_rep.fill_between(hours, [b.min_replicas for b in bounds], [b.max_replicas for b in bounds],
                        step="post", alpha=0.15, color="tab:blue", label="profile floor..ceiling (with prewarm)")
    colors = {"daily-profile": "tab:blue", "reactive": "tab:orange", "fixed-peak": "tab:gray"}
    for name, series in timelines.items():
        xs = [t * hours_per_s for t, _, _ in series]
        ax_rep.step(xs, [r for _, r, _ in series], where="post", color=colors[name], label=f"{name} running")
        ax_rep.step(xs, [d for _, _, d in series], where="post", color=colors[name], linestyle=":", alpha=0.7)
        row = result[name]
        bx = [float(k) + BUCKET_H / 2 for k in row["p95_by_bucket_ms"]]
        by = [v if v is not None else 10 * SLO_MS for v in row["p95_by_bucket_ms"].values()]
        ax_lat.plot(bx, by, marker=".", color=colors[name], label=name)
    ax_rep.set(ylabel="replicas (dotted: incl. starting)")
    ax_lat.axhline(SLO_MS, color="red", linestyle="--", label=f"SLO p95 {SLO_MS:.0f} ms")
    ax_lat.set(ylabel="p95 latency per 30 min, ms", xlabel="simulated hour of day", yscale="log")
    for ax in (ax_rate, ax_rep, ax_lat):
        ax.grid(True, alpha=0.3)
        ax.axvspan(*RAMP_HOURS, color="gold", alpha=0.1)
    ax_rep.legend(fontsize=8, loc="upper left")
    ax_lat.legend(fontsize=8, loc="upper left")
    ax_lat.set_xticks(range(0, 25, 3))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


@scenario
def day(ctx: Context) -> ScenarioResult:
    """A compressed day (24 h in 4 min, quick; 8 min otherwise) replayed open loop against
    three scaling policies at once: the daily profile, Ray's reactive default and a
    fixed fleet sized for the peak. Replica-hours and p95 SLO misses per policy."""
    import threading

    from serve_app.app import router_app
    from serve_app.config import model_deployment_name, parse_app_config

    from benchmarks.harness.stubs import EmulatedAccelerator

    result = ScenarioResult("day", day.__doc__)
    # Tiny: a 12 s day at a fifth of the traffic (the peak within one replica), only to
    # run every step (three policies deployed, replayed, watched, summarised, plotted).
    day_length_s = ctx.pick(480.0, 240.0, tiny=12.0)
    rate_scale = ctx.pick(1.0, 1.0, tiny=0.2)
    hours_per_s = 24.0 / day_length_s
    # Deploy first, start the day once every copy is up (or at the anchor, whichever is later).
    lead_s = ctx.pick(75.0, 75.0, tiny=12.0)
    anchor = time.time() + lead_s
    config = parse_app_config({"models": [{"name": "embed", "source": "emulated", "task": "embedding"}],
                               "router": {"num_cpus": 0.1, "max_ongoing_requests": 2048}, "cache": {"enabled": False}})
    apps = {}
    for name, scaling in _policies(day_length_s, anchor).items():
        model = EmulatedAccelerator.options(
            name=model_deployment_name("embed"), max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.05}, **scaling
        ).bind(384, SLOTS, SERVICE_S, name="embed")
        apps[name] = router_app(config, {"embed": model})
    urls = ctx.cluster.deploy_many(apps)
    wait = anchor - time.time()
    if wait < 0:
        print(f"   deploys took {lead_s - wait:.0f}s, past the {lead_s:.0f} s allowed; the day starts late", flush=True)
        anchor = time.time()
    time.sleep(max(0.0, wait))

    offsets = arrivals(day_length_s, rate_scale=rate_scale)
    timelines: dict[str, list] = {name: [] for name in urls}
    watcher = threading.Thread(target=_watch_replicas, args=(list(urls), anchor, anchor + day_length_s,
                                                             ctx.pick(1.0, 1.0, tiny=0.5), timelines), daemon=True)
    watcher.start()
    samples = asyncio.run(_replay(urls, offsets, anchor))
    watcher.join()
    ctx.cluster.delete(*urls)

    rows = {name: _summarise(samples[name], timelines[name], hours_per_s) for name in urls}
    for name, row in rows.items():
        result.add_row(name, **{k: v for k, v in row.items() if k != "p95_by_bucket_ms"})
    fleet = rows["fixed-peak"]["replica_hours"]

    def vs_fleet(hours: float) -> Optional[float]:  # None (a check not met) if no fleet replica was seen running
        return hours / fleet if fleet else None

    result.derived.update(
        day_length_s=day_length_s, rate_scale=rate_scale, slo_p95_ms=SLO_MS, replica_capacity_rps=SLOTS / SERVICE_S,
        profile_windows=" ".join(
            f"{w['name']} {w['start']}-{w['end']} [{w['min_replicas']},{w['max_replicas']}]"
            for w in profile_config(day_length_s, anchor)["windows"]
        ),
        replica_hours_ratio_profile_vs_fixed=_round3(vs_fleet(rows["daily-profile"]["replica_hours"])),
        replica_hours_ratio_reactive_vs_fixed=_round3(vs_fleet(rows["reactive"]["replica_hours"])),
    )
    out_dir = Path(ctx.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The series behind the plot, kept beside it rather than in the results table.
    (out_dir / "day.json").write_text(json.dumps({
        "p95_by_bucket_ms": {name: row["p95_by_bucket_ms"] for name, row in rows.items()},
        "replicas_timeline_hours_running_desired": {
            name: [(round(t * hours_per_s, 3), r, d) for t, r, d in series] for name, series in timelines.items()
        },
    }))
    result.derived["series"] = "day.json"
    plot = _plot(rows, timelines, hours_per_s, day_length_s, anchor, out_dir / "day.png")
    result.derived["plot"] = plot.name
    result.check("daily-profile replica-hours / fixed-peak fleet", vs_fleet(rows["daily-profile"]["replica_hours"]), 0.6,
                 higher_is_better=False)
    result.check("morning-ramp SLO misses: daily-profile minus reactive (30-min buckets)",
                 rows["daily-profile"]["slo_missed_buckets_ramp"] - rows["reactive"]["slo_missed_buckets_ramp"], -1,
                 higher_is_better=False)
    return result
