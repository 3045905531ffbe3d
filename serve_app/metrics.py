"""Custom Prometheus metrics (ray.serve.metrics adds application, deployment and
replica labels). Ray's built-in serve metrics already cover request counts, latency
and the @serve.batch queue; these cover what only this app knows."""

from __future__ import annotations

from ray.serve import metrics


class CacheMetrics:
    """Cache outcomes as the router sees them, and the store's state."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "serve_app_cache_requests",
            description="Requests by cache outcome: hit, semantic, miss, coalesced (shared an in-flight call), "
            "bypass (not cacheable).",
            tag_keys=("model", "outcome"),
        )
        self.errors = metrics.Counter(
            "serve_app_cache_errors", description="Cache calls that failed or timed out and became misses."
        )

    def outcome(self, model: str, outcome: str) -> None:
        self.requests.inc(tags={"model": model, "outcome": outcome})


class StoreMetrics:
    """Gauges of the CacheServer's store, refreshed on each stats read and write."""

    def __init__(self) -> None:
        self.evictions = metrics.Gauge("serve_app_cache_evictions", description="Entries evicted for the byte budget.")
        self.bytes = metrics.Gauge("serve_app_cache_bytes", description="Bytes held by the memory store.")
        self.entries = metrics.Gauge("serve_app_cache_entries", description="Entries held by the memory store.")
        self.store_errors = metrics.Gauge("serve_app_cache_store_errors", description="Store calls that failed.")

    def update(self, *, evictions, size_bytes, entries, store_errors) -> None:
        for gauge, value in (
            (self.evictions, evictions),
            (self.bytes, size_bytes),
            (self.entries, entries),
            (self.store_errors, store_errors),
        ):
            if value is not None:
                gauge.set(value)
