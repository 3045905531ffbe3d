"""What a replica records about its batches and generations, each figure once.

:class:`ReplicaObserver` is the one place that turns what happened (a
:class:`~serve_app.core.batching.static.BatchReport`, a continuous row's queue wait, a
finished generation row) into both sinks: the counters behind ``/v1/stats``
(:class:`BatchStats`, read by tests, benchmarks and operators) and the Prometheus
metrics (:class:`serve_app.metrics.BatchMetrics`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from serve_app.core.recent import RecentEvents, mean, percentile
from serve_app.core.batching.static import BatchReport


class BatchStats:
    """Counters behind /v1/stats (read by tests and operators)."""

    def __init__(self, window: int = 256):
        self.requests = 0
        self.rows = 0
        self.batches = 0
        self.model_calls = 0
        self.real_tokens = 0
        self.padded_tokens = 0
        self.cancelled_rows = 0  # generation rows whose caller went away before the end
        self.recent_batch_rows: deque[int] = deque(maxlen=window)
        self.recent_queue_wait_s: deque[float] = deque(maxlen=window)
        # (time, rows, real tokens, padded tokens) per model batch; (time, wait) per row.
        self.last_minute_batches = RecentEvents(60.0)
        self.last_minute_waits = RecentEvents(60.0)

    def snapshot(self) -> dict:
        recent = list(self.recent_batch_rows)
        waits = sorted(self.recent_queue_wait_s)
        return {
            "requests": self.requests,
            "rows": self.rows,
            "batches": self.batches,
            "model_calls": self.model_calls,
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "cancelled_rows": self.cancelled_rows,
            "padding_efficiency": (self.real_tokens / self.padded_tokens) if self.padded_tokens else None,
            "mean_batch_rows": (sum(recent) / len(recent)) if recent else None,
            "max_batch_rows": max(recent) if recent else None,
            "p50_queue_wait_s": waits[len(waits) // 2] if waits else None,
            "last_minute": self._last_minute(),
        }

    def _last_minute(self) -> dict:
        batches = self.last_minute_batches.recent()
        waits = [wait for _, wait in self.last_minute_waits.recent()]
        real = sum(b[2] for b in batches)
        padded = sum(b[3] for b in batches)
        return {
            "batches": len(batches),
            "rows": sum(b[1] for b in batches),
            "mean_batch_rows": mean(b[1] for b in batches),
            "padding_efficiency": real / padded if padded else None,
            "p50_queue_wait_s": percentile(waits, 50),
            "p95_queue_wait_s": percentile(waits, 95),
        }


@dataclass(frozen=True)
class RowTiming:
    """One finished generation row, as its engine saw it (``time.monotonic()`` seconds)."""

    enqueued_at: float
    completion_tokens: int
    first_token_at: Optional[float] = None  # None: no token came, or the engine cannot tell
    # Set by an engine whose rows skip the static batch (continuous): from arrival
    # until the row joined the running batch. Static rows' waits are in their BatchReport.
    queue_wait_s: Optional[float] = None


class ReplicaObserver:
    """Feeds ``/v1/stats`` (:attr:`stats`) and Prometheus (``metrics``) from one call per event.

    ``metrics`` is a :class:`serve_app.metrics.BatchMetrics` (or anything with the same
    attributes, in tests).
    """

    def __init__(self, metrics: Any, stats: Optional[BatchStats] = None):
        self.metrics = metrics
        self.stats = stats if stats is not None else BatchStats()

    def request(self, rows_outside_batches: int = 0) -> None:
        """One call arrived. Rows that will never be in a static batch (the continuous
        engine's) are counted here; batched rows are counted by :meth:`batch`."""
        self.stats.requests += 1
        self.stats.rows += rows_outside_batches

    def cancelled(self, rows: int) -> None:
        self.stats.cancelled_rows += rows

    def batch(self, report: BatchReport) -> None:
        stats, metrics, now = self.stats, self.metrics, report.started_at
        stats.batches += 1
        stats.rows += report.rows
        stats.recent_batch_rows.append(report.rows)
        for wait in report.waits:
            self._queue_wait(wait, now)
        metrics.batch_rows.observe(report.rows)
        for sub_batch in report.sub_batches:
            metrics.call_rows.observe(sub_batch.rows)
            metrics.call_tokens.observe(sub_batch.real_tokens)
            if sub_batch.padded_tokens:
                metrics.padding_efficiency.observe(sub_batch.real_tokens / sub_batch.padded_tokens)
        real, padded = report.real_tokens, report.padded_tokens
        calls = len(report.sub_batches)
        stats.model_calls += calls
        stats.real_tokens += real
        stats.padded_tokens += padded
        metrics.sub_batches.observe(calls)
        metrics.batches.inc()
        metrics.rows.inc(report.rows)
        metrics.model_calls.inc(calls)
        if padded:  # Ray's Counter refuses 0 (image rows have no tokens)
            metrics.real_tokens.inc(real)
            metrics.padded_tokens.inc(padded)
        stats.last_minute_batches.add(report.rows, real, padded, now=now)

    def generation(self, rows: Iterable[RowTiming]) -> None:
        """Time to first token, inter-token latency and generated tokens of finished rows
        (and the continuous engine's queue waits)."""
        finished = time.monotonic()
        generated = 0
        for row in rows:
            generated += row.completion_tokens
            if row.queue_wait_s is not None:
                self._queue_wait(row.queue_wait_s, finished)
            first = row.first_token_at
            if first is None or row.completion_tokens < 1:
                continue
            self.metrics.time_to_first_token.observe(max(0.0, first - row.enqueued_at))
            if row.completion_tokens >= 2:
                self.metrics.inter_token_latency.observe((finished - first) / (row.completion_tokens - 1))
        if generated:
            self.metrics.generated_tokens.inc(generated)

    def _queue_wait(self, wait: float, now: float) -> None:
        self.stats.recent_queue_wait_s.append(wait)
        self.stats.last_minute_waits.add(wait, now=now)
        self.metrics.queue_wait.observe(wait)

    def startup(self, times: Any) -> None:
        """A replica start (a :class:`serve_app.replica.startup.StartupTimes`), phase by phase."""
        for phase, seconds in times.phases.items():
            self.metrics.startup.observe(seconds, tags={"phase": phase})
        self.metrics.startup.observe(times.total_s, tags={"phase": "total"})

    def forget_counters(self) -> None:
        """Start /v1/stats' counters afresh (after the warm-up calls, which are not traffic)."""
        self.stats = BatchStats(self.stats.recent_batch_rows.maxlen or 256)

    def snapshot(self) -> dict:
        return self.stats.snapshot()
