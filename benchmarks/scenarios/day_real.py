"""The `day-real` scenario: a compressed day replayed on real replicas, MiniLM on vLLM,
under three scaling policies, one after another.

The `day` scenario replays a whole day on stub replicas that start in a second. This
one pays what a real replica costs: each policy scales the shipped MiniLM (vLLM, eager on
a CPU by default, else its compile cache reused; warm-up before ready) through the real
HTTP proxy and Router, so a replica added at the morning ramp takes its real start-up,
tens of seconds here, which the compressed clock turns into simulated hours. The policies
run in turn, not at once, on the same arrivals: two cores hold one policy's replicas, not
three fleets.

- ``daily-profile``: serve_app's policy with the load profile an operator would write
  for this traffic (``PROFILE_WINDOWS``); its prewarm lead comes from the start-ups its
  replicas report (``prewarm_margin_s`` set), printed with the result;
- ``reactive``: Ray Serve's default policy (a queue-length target), Ray's default
  delays compressed by the same factor as the day;
- ``fixed-peak``: the profile's peak floor, all day.

Each replica gets one engine thread. On a cluster a replica is a unit of capacity (a
GPU); on two cores it is not: every replica, the proxy and the router share the same
two cores, so three replicas answer no faster than one, and a replica that starts
takes CPU from those that serve. What a day here measures is what the fleet costs and
what its starts cost the traffic, at a load one replica could carry. The router does
not gather calls here: Ray's default policy counts Serve requests, and a gathered group
would read as one (the daily profile reads the replicas' own call counts either way),
so every copy sends one request per call.

Before the policies, one replica starts and stops: a compiling engine's cache is then
filled (MiniLM runs eager on a CPU by default and compiles nothing), as on a cluster that
serves day after day, so the first policy's day does not pay (or plan its prewarm lead
with) a fresh machine's one-time compile. That replica also answers the
replay's inputs closed loop, and the day's load is scaled to it (peak at
``LOAD_OF_CAPACITY`` of its rate, at most the curve as written): CPU types differ
several-fold, and a day the fixed fleet cannot serve compares nothing.

Per policy it counts replica-seconds (running, and billed: running plus starting),
the p95 latency of each 30-minute bucket of the simulated day against the SLO, the
buckets missed on the morning ramp, failed requests (none allowed), and the calls sent
to a replica before its warm-up ended (``serve_app_calls_before_ready``, scraped from
Ray's metrics endpoint while the day runs).
"""

from __future__ import annotations

import asyncio
import copy
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import httpx

from benchmarks.harness.registry import (Context, ScenarioResult, ScenarioSkipped, require_module, run_closed,
                                         scenario)
from benchmarks.harness.service import pick_model

# Offered load (requests/s, real seconds) at simulated hours; linear in between. The day
# replayed runs from FIRST_HOUR to LAST_HOUR: a night, a morning ramp, a peak, a lower
# afternoon and an evening as quiet as the night.
NIGHT_RPS, PEAK_RPS, AFTERNOON_RPS = 5.0, 30.0, 15.0
TRAFFIC_CURVE = [(0.0, NIGHT_RPS), (7.0, NIGHT_RPS), (8.5, PEAK_RPS), (12.0, PEAK_RPS), (13.0, AFTERNOON_RPS),
                 (15.0, AFTERNOON_RPS), (16.0, NIGHT_RPS), (24.0, NIGHT_RPS)]
FIRST_HOUR, LAST_HOUR = 2.0, 22.0
RAMP_HOURS = (7.0, 10.0)  # the morning ramp and the first peak hours: where a late start shows
BUCKET_H = 0.5  # SLO buckets, simulated hours
SLO_P95_MS = 250.0  # p95 objective per bucket; one replica alone answers the peak at p95 ~100 ms here
PEAK_FLEET = 3  # the profile's peak floor, and the fixed fleet
TARGET_ONGOING = 2  # both load-following policies aim at 2 calls per replica
PROFILE_WINDOWS = [  # name, start, end, min, max
    ("night", "20:00", "07:00", 1, 2),
    ("morning", "07:00", "12:00", PEAK_FLEET, PEAK_FLEET),
    ("afternoon", "12:00", "16:00", 1, PEAK_FLEET),
    ("evening", "16:00", "20:00", 1, 2),
]
PREWARM_MARGIN_H = 0.25  # on top of the measured start-up p95
# The peak offered, as a share of what one replica answers closed-loop on this machine
# (measured before the day): CPU types differ several-fold (bf16 units or not), and a day
# the fixed fleet cannot serve compares noise. Never above the curve as written.
LOAD_OF_CAPACITY = 0.5
CAPACITY_CONCURRENCY = 8


def rate_at(hour: float) -> float:
    for (h0, r0), (h1, r1) in zip(TRAFFIC_CURVE, TRAFFIC_CURVE[1:]):
        if h0 <= hour <= h1:
            return r0 + (r1 - r0) * (hour - h0) / (h1 - h0)
    return TRAFFIC_CURVE[-1][1]


def rate_scale_for(capacity_rps: float) -> float:
    """The factor on TRAFFIC_CURVE that puts its peak at LOAD_OF_CAPACITY of one
    replica's measured rate, at most 1."""
    return round(min(1.0, LOAD_OF_CAPACITY * capacity_rps / PEAK_RPS), 3)


def replay_text(i: int) -> str:
    """Request i's input: inputs that differ, so nothing is shared, of 60 to 170 tokens
    (the engine's work, not the HTTP path, is most of a call's cost)."""
    return f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (6 + i % 12)


def arrivals(hour_s: float, *, seed: int = 7, rate_scale: float = 1.0) -> list[float]:
    """Poisson arrivals (by thinning) from FIRST_HOUR to LAST_HOUR, in real seconds from
    the replay's start, with ``hour_s`` real seconds to a simulated hour."""
    import random

    rng = random.Random(seed)
    top = max(r for _, r in TRAFFIC_CURVE) * rate_scale
    length_s = (LAST_HOUR - FIRST_HOUR) * hour_s
    t, out = 0.0, []
    while True:
        t += rng.expovariate(top)
        if t >= length_s:
            return out
        if rng.random() < rate_at(FIRST_HOUR + t / hour_s) * rate_scale / top:
            out.append(t)


def profile_config(hour_s: float, anchor_unix_s: float) -> dict[str, Any]:
    """The load profile for this traffic, on a clock where ``anchor_unix_s`` is FIRST_HOUR."""
    speedup = 3600.0 / hour_s
    return {
        "timezone": "UTC",
        # Until a replica has reported its start-up: a guess of one simulated hour.
        "prewarm_s": 3600,
        "prewarm_margin_s": PREWARM_MARGIN_H * 3600,
        # Ray's defaults, in the profile's (simulated) clock.
        "upscale_delay_s": 30,
        "downscale_delay_s": 600,
        "look_back_period_s": 2,  # real seconds: Serve's own window
        "clock": {"day_length_s": 24 * hour_s, "start_time": f"{int(FIRST_HOUR):02d}:00",
                  "anchor_unix_s": anchor_unix_s},
        "windows": [{"name": n, "start": s, "end": e, "min_replicas": lo, "max_replicas": hi,
                     "target_ongoing_requests": TARGET_ONGOING} for n, s, e, lo, hi in PROFILE_WINDOWS],
    }


def model_config(base: dict, policy: str, hour_s: float, anchor_unix_s: float, cpus: float) -> tuple[dict, dict]:
    """The model entry (as shipped, on vLLM, one engine thread) and the load profiles of
    the app args for one policy; ``reactive`` gets its autoscaling config separately."""
    model = copy.deepcopy(base)
    model.pop("cache", None)
    model.update(engine="vllm", name="embed")
    model["resources"] = {**(model.get("resources") or {}), "num_cpus": cpus, "torch_threads": 1}
    profiles: dict[str, Any] = {}
    if policy == "daily-profile":
        model["load_profile"] = "day"
        profiles["day"] = profile_config(hour_s, anchor_unix_s)
    elif policy == "fixed-peak":
        model["num_replicas"] = PEAK_FLEET
    return model, profiles


def reactive_autoscaling(hour_s: float) -> dict[str, Any]:
    """Ray Serve's default policy, its default delays (30 s up, 600 s down) compressed."""
    speedup = 3600.0 / hour_s
    return {"min_replicas": 1, "max_replicas": PEAK_FLEET, "target_ongoing_requests": TARGET_ONGOING,
            "upscale_delay_s": 30 / speedup, "downscale_delay_s": 600 / speedup,
            "look_back_period_s": 2, "metrics_interval_s": 1}


@dataclass
class Sample:
    sent_s: float  # real seconds from the replay's start
    latency_s: Optional[float]  # None: failed
    error: Optional[str] = None


async def _replay(url: str, offsets: list[float], started: float) -> list[Sample]:
    import aiohttp

    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=1024)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one(i: int, at: float) -> None:
            delay = started + at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {"model": "embed", "input": replay_text(i)}
            t0 = time.time()
            try:
                async with session.post(f"{url}/v1/embeddings", json=body) as response:
                    payload = await response.read()
                    if response.status != 200:
                        samples.append(Sample(at, None, f"HTTP {response.status}: {payload[:200]!r}"))
                        return
            except Exception as exc:
                samples.append(Sample(at, None, f"{type(exc).__name__}: {exc}"))
                return
            samples.append(Sample(at, time.time() - t0))

        await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets)))
    return samples


# Ray exports an application's metrics with a ray_ prefix, counters with _total.
_BEFORE_READY = re.compile(r'^(?:ray_)?serve_app_calls_before_ready(?:_total)?\{([^}]*)\}\s+([0-9.eE+-]+)', re.M)


def calls_before_ready(metrics_text: str, app: str) -> dict[str, float]:
    """Per replica of ``app``: the serve_app_calls_before_ready counter in Prometheus text."""
    out: dict[str, float] = {}
    for labels, value in _BEFORE_READY.findall(metrics_text):
        tags = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if tags.get("application") == app:
            out[tags.get("replica", "?")] = float(value)
    return out


class Watcher(threading.Thread):
    """Polls Serve for the model deployment's running and starting replicas and, where
    Ray's metrics endpoint is known, each replica's calls before ready."""

    def __init__(self, app: str, started: float, until: float, period_s: float, metrics_url: Optional[str]):
        super().__init__(daemon=True)
        self.app, self.started, self.until, self.period_s, self.metrics_url = app, started, until, period_s, metrics_url
        self.timeline: list[tuple[float, int, int]] = []  # (real s from start, running, running + starting)
        self.before_ready: dict[str, float] = {}  # replica -> highest count seen
        self.scraped = False  # the app's replicas' serve_app metrics were seen (a 0 is a count, not a gap)

    def run(self) -> None:
        from ray import serve

        from serve_app.config import model_deployment_name

        while time.time() < self.until:
            try:
                status = serve.status().applications.get(self.app)
                deployment = status and status.deployments.get(model_deployment_name("embed"))
                states = deployment.replica_states if deployment else {}
                running = states.get("RUNNING", 0)
                starting = sum(states.get(s, 0) for s in ("STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION"))
                self.timeline.append((time.time() - self.started, running, running + starting))
                if self.metrics_url:
                    text = httpx.get(self.metrics_url, timeout=5).text
                    self.scraped = self.scraped or f'application="{self.app}"' in text
                    for replica, count in calls_before_ready(text, self.app).items():
                        self.before_ready[replica] = max(count, self.before_ready.get(replica, 0.0))
            except Exception as exc:  # a slow controller or scrape skips one poll, not the day
                print(f"   watcher: {type(exc).__name__}: {exc}", flush=True)
            time.sleep(self.period_s)


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]


def summarise(samples: list[Sample], timeline: list[tuple[float, int, int]], hour_s: float) -> dict[str, Any]:
    """One policy's day: replica-seconds, SLO buckets (a failed request misses its bucket)."""
    buckets: dict[int, list[float]] = {}
    for s in samples:
        hour = FIRST_HOUR + s.sent_s / hour_s
        buckets.setdefault(int(hour / BUCKET_H), []).append(s.latency_s if s.latency_s is not None else math.inf)
    p95_by_bucket = {b: _p95(v) for b, v in sorted(buckets.items())}
    missed = [b for b, p in p95_by_bucket.items() if p * 1000 > SLO_P95_MS]
    running_s = billed_s = 0.0
    for (t0, running, total), (t1, _, _) in zip(timeline, timeline[1:]):
        running_s += running * (t1 - t0)
        billed_s += total * (t1 - t0)
    ok = sorted(s.latency_s for s in samples if s.latency_s is not None)
    return {
        "requests": len(samples),
        "errors": sum(1 for s in samples if s.latency_s is None),
        "error_samples": [s.error for s in samples if s.error][:3],
        "replica_s_running": round(running_s, 1),
        "replica_s_billed": round(billed_s, 1),
        "peak_replicas": max((r for _, r, _ in timeline), default=0),
        "p50_ms": round(ok[len(ok) // 2] * 1000, 1) if ok else None,
        "p95_ms": round(_p95(ok) * 1000, 1) if ok else None,
        "buckets": len(p95_by_bucket),
        "slo_met_buckets_fraction": round(1 - len(missed) / max(1, len(p95_by_bucket)), 3),
        "slo_missed_buckets": len(missed),
        "slo_missed_buckets_ramp": sum(1 for b in missed if RAMP_HOURS[0] <= b * BUCKET_H < RAMP_HOURS[1]),
        "missed_hours": [b * BUCKET_H for b in missed],
    }


def _startups(url: str) -> dict[str, Any]:
    """The answering replica's start-up split, from /v1/stats."""
    try:
        stats = httpx.get(f"{url}/v1/stats", timeout=30).json()["models"]["embed"]
        return stats.get("startup") or {}
    except Exception:
        return {}


def _lead_line(app: str) -> Optional[str]:
    """The daily-profile policy's last decision line that names its prewarm lead (the
    controller's log), so the result says which start-up the schedule planned with."""
    import glob
    import os

    import ray

    try:
        logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    except Exception:
        return None
    last = None
    for path in sorted(glob.glob(os.path.join(logs, "serve", "controller_*.log")), key=os.path.getmtime):
        with open(path, errors="replace") as f:
            for line in f:
                if "serve_app schedule: model=embed" in line and "prewarm lead" in line:
                    last = line.split("serve_app schedule: ", 1)[1].strip()
    return last


def _prepare(ctx: Context, result: ScenarioResult, base: dict, cpus: float) -> dict[str, Any]:
    """Start one replica of the model, measure it, stop it. A compiling engine's cache is
    then filled, as on a cluster serving day after day, so that no policy's day pays (or plans
    its prewarm lead with) the one-time compile of a fresh machine; its start-up is
    reported, not counted. Its rate on the replay's inputs, closed loop, sets the day's
    load (:func:`rate_scale_for`)."""
    model, _ = model_config(base, "fixed-peak", 20.0, time.time(), cpus)
    model["num_replicas"] = 1
    app = "day-real-prepare"
    began = time.time()
    url = ctx.cluster.deploy(ctx.cluster.models_app([model]), app)
    ready_s = time.time() - began
    startup = _startups(url)
    label = "one replica, closed loop (sets the load)"
    run = run_closed(url, lambda i: ("/v1/embeddings", {"model": "embed", "input": replay_text(i)}),
                     concurrency=CAPACITY_CONCURRENCY, requests=ctx.pick(400, 200, tiny=16), warmup=16,
                     label=label, ctx=ctx)
    result.add(run, label)
    ctx.cluster.delete(app)
    # None where the engine compiled nothing (MiniLM runs eager on a CPU by default).
    compile_cache = startup.get("compile_cache", "unknown") or "none, the engine runs eager"
    return {"ready_s": round(ready_s, 1), "compile_cache": compile_cache,
            "capacity_rps": round(run.throughput_rps, 1)}


@scenario(name="day-real")
def day_real(ctx: Context) -> ScenarioResult:
    """A compressed day (02:00-22:00) on real MiniLM replicas on vLLM, three policies in
    turn (daily profile, Ray's reactive default, fixed peak fleet): replica-seconds,
    p95 SLO misses per 30-minute bucket, ramp misses, calls before ready, start-ups."""
    missing = require_module("vllm")
    if missing:
        raise ScenarioSkipped(missing)
    from ray import serve

    from serve_app.app import build_app, router_app
    from serve_app.config import model_deployment_name, parse_app_config

    result = ScenarioResult("day-real", day_real.__doc__)
    hour_s = ctx.pick(20.0, 12.0, tiny=2.0)
    base = pick_model(ctx.models, "embedding")
    cpus = 0.25  # per replica: logical, so three fit beside the router; the engine thread is what runs
    rows: dict[str, dict[str, Any]] = {}
    filled = _prepare(ctx, result, base, cpus)
    rate_scale = 0.1 if ctx.tiny else rate_scale_for(filled["capacity_rps"])
    print(f"   a first replica ready in {filled['ready_s']:.0f} s (compile cache: {filled['compile_cache']}); "
          f"it answered {filled['capacity_rps']:g}/s closed loop: the peak is {PEAK_RPS * rate_scale:g}/s", flush=True)
    offsets = arrivals(hour_s, rate_scale=rate_scale)
    print(f"   {len(offsets)} requests over {(LAST_HOUR - FIRST_HOUR) * hour_s:.0f} s per policy "
          f"({hour_s:.0f} s per simulated hour)", flush=True)
    for policy in ("daily-profile", "reactive", "fixed-peak"):
        app = f"day-real-{policy}"
        # The replay starts at the profile clock's anchor, which its config names before
        # the deploy: a lead that covers a first (compiling) start. The other policies
        # keep no clock, and their day starts once they are deployed.
        lead_s = 150.0 if policy == "daily-profile" else 0.0
        anchor = time.time() + lead_s
        model, profiles = model_config(base, policy, hour_s, anchor, cpus)
        args = {"models": [model], "router": {"num_cpus": 0.1, "request_timeout_s": 60, "gather_calls": False,
                                             "max_ongoing_requests": 2048},
                "cache": {"enabled": False}, "load_profiles": profiles}
        if policy == "reactive":
            from serve_app.app import model_deployment

            config = parse_app_config(args)
            deployment = model_deployment(config.models[0], config, replicas={"autoscaling_config":
                                                                              reactive_autoscaling(hour_s)})
            application = router_app(config, {"embed": deployment})
        else:
            application = build_app(args)
        began = time.time()
        url = ctx.cluster.deploy(application, app)
        deployed_s = time.time() - began
        if policy != "daily-profile":
            anchor = time.time() + 2.0
        wait = anchor - time.time()
        if wait < 0:
            raise RuntimeError(f"{policy}: the deploy took {deployed_s:.0f} s, past the {lead_s:.0f} s lead")
        print(f"   {policy}: deployed in {deployed_s:.0f} s; the day starts in {wait:.0f} s", flush=True)
        first_start = _startups(url)
        time.sleep(wait)
        length_s = (LAST_HOUR - FIRST_HOUR) * hour_s
        watcher = Watcher(app, anchor, anchor + length_s, ctx.pick(1.0, 1.0, tiny=0.5), ctx.cluster.metrics_url)
        watcher.start()
        samples = asyncio.run(_replay(url, offsets, anchor))
        watcher.join()
        row = summarise(samples, watcher.timeline, hour_s)
        row["deploy_to_ready_s"] = round(deployed_s, 1)
        row["first_replica_startup"] = first_start
        row["calls_before_ready"] = sum(watcher.before_ready.values()) if watcher.scraped else None
        if policy == "daily-profile":
            row["prewarm_lead"] = _lead_line(app)
        states = serve.status().applications[app].deployments[model_deployment_name("embed")].replica_states
        row["replicas_at_end"] = states.get("RUNNING", 0)
        ctx.cluster.delete(app)
        rows[policy] = row
        result.add_row(policy, **{k: v for k, v in row.items() if k not in ("requests", "errors")},
                       requests=row["requests"], errors=row["errors"])
        print(f"   {policy}: {row['replica_s_billed']:.0f} replica-s billed, SLO met in "
              f"{row['slo_met_buckets_fraction']:.0%} of buckets, {row['slo_missed_buckets_ramp']} ramp misses, "
              f"{row['errors']} failed", flush=True)

    fleet = rows["fixed-peak"]["replica_s_billed"]
    result.derived.update(
        compile_cache_before_the_day=f"{filled['compile_cache']} (first replica ready in {filled['ready_s']:g} s)",
        one_replica_closed_loop_rps=filled["capacity_rps"],
        hour_s=hour_s, rate_scale=rate_scale, slo_p95_ms=SLO_P95_MS, peak_fleet=PEAK_FLEET,
        traffic=" ".join(f"{h:g}h:{r * rate_scale:g}/s" for h, r in TRAFFIC_CURVE),
        profile_windows=" ".join(f"{n} {s}-{e} [{lo},{hi}]" for n, s, e, lo, hi in PROFILE_WINDOWS),
        billed_ratio_profile_vs_fixed=round(rows["daily-profile"]["replica_s_billed"] / fleet, 3) if fleet else None,
        billed_ratio_reactive_vs_fixed=round(rows["reactive"]["replica_s_billed"] / fleet, 3) if fleet else None,
    )
    result.check("fixed-peak fleet: share of 30-min buckets within the p95 SLO (the load is servable)",
                 rows["fixed-peak"]["slo_met_buckets_fraction"], 0.95)
    result.check("daily-profile replica-seconds (billed) / fixed-peak fleet's",
                 result.derived["billed_ratio_profile_vs_fixed"], 0.6, higher_is_better=False)
    result.check("morning-ramp SLO misses: daily-profile minus reactive (30-min buckets)",
                 rows["daily-profile"]["slo_missed_buckets_ramp"] - rows["reactive"]["slo_missed_buckets_ramp"], -1,
                 higher_is_better=False)
    counted = [r["calls_before_ready"] for r in rows.values() if r["calls_before_ready"] is not None]
    if counted:
        result.check("calls sent to a replica before its warm-up ended, all policies", sum(counted), 0,
                     higher_is_better=False)
    return result
