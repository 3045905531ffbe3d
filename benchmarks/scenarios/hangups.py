"""The `hangups` scenario: clients that hang up must cost no other client its answer.

The deployments file's embedding model is served as shipped (router, cache, gathering,
vLLM where installed). 1,000 embedding requests (tiny: 40), each with a text of its
own so every one reaches the model, run 64 at a time; a third of the clients hang up
at a random moment between 50 and 800 ms after sending. Gathered groups, the cache's
batched lookups and write-backs are shared by many requests, so a hang-up that reached
the shared call would fail the patient clients beside it. Every patient client must get
its own vector, and once the load is over the model replica's calls in progress must
return to 0 (nothing left running for clients that are gone).
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import httpx

from benchmarks.harness.registry import TEXTS, Context, ScenarioResult, model_stats, scenario
from benchmarks.harness.service import pick_model

CONCURRENCY = 64
IMPATIENT_SHARE = 1 / 3
HANG_UP_S = (0.05, 0.8)


async def _load(url: str, model: str, requests: int, seed: int = 5) -> dict:
    rng = random.Random(seed)
    plan = [(i, rng.random() < IMPATIENT_SHARE, rng.uniform(*HANG_UP_S)) for i in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    outcome = {"patient": 0, "patient_failed": 0, "patient_samples": [], "impatient": 0, "hung_up": 0,
               "answered_before_hang_up": 0, "latencies": []}

    async def client(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i, impatient, hang_up_s = queue.get_nowait()
            body = {"model": model, "input": f"{TEXTS[i % len(TEXTS)]} (request {i})"}
            timeout = aiohttp.ClientTimeout(total=hang_up_s if impatient else 120)
            started = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/embeddings", json=body, timeout=timeout) as response:
                    payload = await response.json(content_type=None)
                    ok = response.status == 200 and len(payload["data"]) == 1
                    error = None if ok else f"HTTP {response.status}: {str(payload)[:200]}"
            except asyncio.TimeoutError:
                ok, error = None, "hung up"
            except Exception as exc:  # noqa: BLE001 - a failed request is a figure here
                ok, error = False, f"{type(exc).__name__}: {exc}"
            if impatient:
                outcome["impatient"] += 1
                outcome["hung_up" if ok is None else "answered_before_hang_up"] += 1
            else:
                outcome["patient"] += 1
                if ok:
                    outcome["latencies"].append(time.perf_counter() - started)
                else:
                    outcome["patient_failed"] += 1
                    outcome["patient_samples"].append(error)

    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(CONCURRENCY)))
    return outcome


def _drained_s(url: str, model: str, timeout_s: float = 60.0) -> tuple[float | None, int | None]:
    """Seconds until the model replica reports no call in progress (None: not within the timeout)."""
    started = time.monotonic()
    ongoing = None
    while time.monotonic() - started < timeout_s:
        ongoing = model_stats(url, model).get("ongoing_calls")
        if ongoing == 0:
            return time.monotonic() - started, 0
        time.sleep(0.5)
    return None, ongoing


@scenario
def hangups(ctx: Context) -> ScenarioResult:
    """1,000 embedding requests, 64 at a time, a third of whose clients hang up at a random
    moment: every patient client answered, and the replica's calls in progress back to 0."""
    result = ScenarioResult("hangups", hangups.__doc__)
    model = pick_model(ctx.models, "embedding")
    if ctx.application is not None:
        app = ctx.cluster.shipped_app(ctx.application, keep_models=[model["name"]])
    else:
        app = ctx.cluster.models_app([model], cache=True)
    url = ctx.cluster.deploy(app, "hangups")
    httpx.post(f"{url}/v1/embeddings", json={"model": model["name"], "input": "warm up"}, timeout=120)
    requests = ctx.pick(1000, 1000, tiny=40)
    started = time.perf_counter()
    outcome = asyncio.run(_load(url, model["name"], requests))
    elapsed = time.perf_counter() - started
    drained_s, ongoing = _drained_s(url, model["name"])
    ctx.cluster.delete("hangups")

    latencies = sorted(outcome["latencies"])
    result.add_row("patient clients", requests=outcome["patient"], errors=outcome["patient_failed"],
                   concurrency=CONCURRENCY, throughput_rps=round(outcome["patient"] / elapsed, 1),
                   p50_ms=round(latencies[len(latencies) // 2] * 1000, 1) if latencies else None,
                   p95_ms=round(latencies[int(0.95 * (len(latencies) - 1))] * 1000, 1) if latencies else None,
                   error_samples=outcome["patient_samples"][:3])
    result.derived.update(impatient_clients=outcome["impatient"], hung_up=outcome["hung_up"],
                          answered_before_hang_up=outcome["answered_before_hang_up"],
                          seconds_until_no_call_in_progress=None if drained_s is None else round(drained_s, 1),
                          calls_in_progress_after=ongoing)
    answered = (outcome["patient"] - outcome["patient_failed"]) / outcome["patient"] if outcome["patient"] else None
    result.check("patient clients answered (share)", answered, 1.0)
    result.check("model replica's calls in progress 60 s after the load", ongoing, 0, higher_is_better=False)
    return result
