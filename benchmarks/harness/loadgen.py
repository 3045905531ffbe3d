"""An asyncio HTTP load generator: closed loop (fixed concurrency) and open loop
(Poisson arrivals at a fixed rate), with latency percentiles and a progress bar."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import aiohttp
from tqdm import tqdm

# Each request body is built by the caller: (path, json body). Results may carry a
# per-request measure (e.g. generated tokens) extracted from the JSON answer.
RequestFactory = Callable[[int], tuple[str, Optional[dict]]]
Extract = Callable[[dict], float]


@dataclass
class RunResult:
    """What one load run measured."""

    label: str
    mode: str  # "closed" or "open"
    concurrency: Optional[int]
    rate_per_s: Optional[float]
    requests: int
    errors: int
    duration_s: float
    latencies_s: list[float] = field(default_factory=list, repr=False)
    units: float = 0.0  # sum of the extracted measure (e.g. tokens), if any
    error_samples: list[str] = field(default_factory=list, repr=False)
    ttfts_s: list[float] = field(default_factory=list, repr=False)  # streamed requests: time to first text

    @property
    def throughput_rps(self) -> float:
        return (self.requests - self.errors) / self.duration_s if self.duration_s else 0.0

    @property
    def units_per_s(self) -> float:
        return self.units / self.duration_s if self.duration_s else 0.0

    def percentile_ms(self, q: float, values: Optional[list[float]] = None) -> Optional[float]:
        values = self.latencies_s if values is None else values
        if not values:
            return None
        ordered = sorted(values)
        index = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
        return ordered[index] * 1000

    def summary(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "mode": self.mode,
            "concurrency": self.concurrency,
            "rate_per_s": self.rate_per_s,
            "requests": self.requests,
            "errors": self.errors,
            "duration_s": round(self.duration_s, 3),
            "throughput_rps": round(self.throughput_rps, 2),
            "units_per_s": round(self.units_per_s, 2),
            "p50_ms": _round(self.percentile_ms(50)),
            "p95_ms": _round(self.percentile_ms(95)),
            "p99_ms": _round(self.percentile_ms(99)),
            "error_samples": self.error_samples[:3],
            **({"p50_ttft_ms": _round(self.percentile_ms(50, self.ttfts_s)),
                "p95_ttft_ms": _round(self.percentile_ms(95, self.ttfts_s))} if self.ttfts_s else {}),
        }


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value, 2)


async def _one(
    session: aiohttp.ClientSession, base_url: str, make: RequestFactory, i: int, extract: Optional[Extract], result: RunResult
) -> None:
    path, body = make(i)
    started = time.perf_counter()
    method, options = ("GET", {}) if body is None else ("POST", {"json": body})
    streamed = bool(body and body.get("stream"))
    first_text_at = None
    try:
        async with session.request(method, base_url + path, **options) as response:
            status = response.status
            if streamed and status == 200:
                payload, first_text_at = await _read_stream(response)
            else:
                payload = await response.read()
    except Exception as exc:  # connection errors count as errors, not crashes
        result.errors += 1
        result.error_samples.append(f"{type(exc).__name__}: {exc}")
        return
    elapsed = time.perf_counter() - started
    if status != 200 or (streamed and b'"error"' in payload):
        result.errors += 1
        result.error_samples.append(f"HTTP {status}: {payload[:200]!r}")
        return
    result.latencies_s.append(elapsed)
    if first_text_at is not None:
        result.ttfts_s.append(first_text_at - started)
    if extract is not None:
        result.units += extract(json.loads(payload))


async def _read_stream(response: aiohttp.ClientResponse) -> tuple[bytes, Optional[float]]:
    """Read an OpenAI server-sent event stream. Returns the JSON the caller's extract
    sees (``{"usage": ...}`` from the last chunk, or the error event) and when the first
    text arrived (perf_counter seconds)."""
    first_text_at = None
    usage = None
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            return data, first_text_at
        for choice in event.get("choices") or ():
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text and first_text_at is None:
                first_text_at = time.perf_counter()
        if event.get("usage"):
            usage = event["usage"]
    return json.dumps({"usage": usage}).encode(), first_text_at


def _session(concurrency: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=max(concurrency, 1) * 2, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600))


async def closed_loop(
    base_url: str,
    make: RequestFactory,
    *,
    concurrency: int,
    requests: int,
    label: str,
    extract: Optional[Extract] = None,
    warmup: int = 0,
    progress: bool = True,
) -> RunResult:
    """``concurrency`` clients, each sending its next request when the last returns."""
    async with _session(concurrency) as session:
        if warmup:
            scratch = RunResult(label, "closed", concurrency, None, warmup, 0, 0.0)
            await asyncio.gather(*(_one(session, base_url, make, i, None, scratch) for i in range(warmup)))
        result = RunResult(label, "closed", concurrency, None, requests, 0, 0.0)
        counter = iter(range(requests))
        bar = tqdm(total=requests, desc=f"{label} c={concurrency}", leave=False, disable=not progress)

        async def client() -> None:
            for i in counter:
                await _one(session, base_url, make, i, extract, result)
                bar.update(1)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        result.duration_s = time.perf_counter() - started
        bar.close()
    return result


async def open_loop(
    base_url: str,
    make: RequestFactory,
    *,
    rate_per_s: float,
    requests: int,
    label: str,
    extract: Optional[Extract] = None,
    seed: int = 0,
    arrivals_s: Optional[Sequence[float]] = None,
    progress: bool = True,
) -> RunResult:
    """Requests arrive on a Poisson process at ``rate_per_s`` (or at the given
    ``arrivals_s`` offsets, e.g. from a trace), whether or not earlier ones finished."""
    if arrivals_s is None:
        rng = random.Random(seed)
        offsets, t = [], 0.0
        for _ in range(requests):
            t += rng.expovariate(rate_per_s)
            offsets.append(t)
    else:
        offsets = list(arrivals_s)[:requests]
    result = RunResult(label, "open", None, rate_per_s, len(offsets), 0, 0.0)
    bar = tqdm(total=len(offsets), desc=f"{label} {rate_per_s}/s", leave=False, disable=not progress)
    async with _session(256) as session:
        started = time.perf_counter()

        async def fire(i: int, at: float) -> None:
            delay = at - (time.perf_counter() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            await _one(session, base_url, make, i, extract, result)
            bar.update(1)

        await asyncio.gather(*(fire(i, at) for i, at in enumerate(offsets)))
        result.duration_s = time.perf_counter() - started
    bar.close()
    return result
