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


# Seconds: from a cache hit (~ms) to a long generation (minutes).
LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]


class RequestMetrics:
    """Per-model requests at the ingress. Ray's ray_serve_num_http_requests and
    ray_serve_http_request_latency_ms count by route only; the model is in the body."""

    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "serve_app_requests",
            description="HTTP requests by model, endpoint and status code (model 'none' if the body never named one).",
            tag_keys=("model", "endpoint", "status"),
        )
        self.latency = metrics.Histogram(
            "serve_app_request_latency_seconds",
            description="End-to-end latency at the ingress, cache hits included, by model and endpoint.",
            boundaries=LATENCY_BOUNDARIES_S,
            tag_keys=("model", "endpoint"),
        )
        self.errors = metrics.Counter(
            "serve_app_errors",
            description="Requests answered with an error, by model, status and OpenAI error code.",
            tag_keys=("model", "status", "code"),
        )

    def observe(self, *, model: str, endpoint: str, status: int, latency_s: float, code: str | None) -> None:
        self.requests.inc(tags={"model": model, "endpoint": endpoint, "status": str(status)})
        self.latency.observe(latency_s, tags={"model": model, "endpoint": endpoint})
        if status >= 400:
            self.errors.inc(tags={"model": model, "status": str(status), "code": code or "none"})


class BatchMetrics:
    """What batching achieves inside one ModelServer replica (``model`` label fixed).

    Ray's ray_serve_batch_wait_time_ms and ray_serve_actual_batch_size describe the
    @serve.batch admission window; these describe the model calls the executor makes
    after it, which is where padding and waiting for a busy model happen."""

    def __init__(self, model: str) -> None:
        def histogram(name: str, description: str, boundaries: list[float]) -> metrics.Histogram:
            metric = metrics.Histogram(name, description=description, boundaries=boundaries, tag_keys=("model",))
            # A fresh dict each time: Serve adds its replica labels to the dict it is given.
            metric.set_default_tags({"model": model})
            return metric

        def counter(name: str, description: str) -> metrics.Counter:
            metric = metrics.Counter(name, description=description, tag_keys=("model",))
            metric.set_default_tags({"model": model})
            return metric

        def gauge(name: str, description: str) -> metrics.Gauge:
            metric = metrics.Gauge(name, description=description, tag_keys=("model",))
            metric.set_default_tags({"model": model})
            return metric

        sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        self.queue_wait = histogram(
            "serve_app_queue_wait_seconds", "Per input: from arrival at the replica to the start of its model batch.",
            [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
        )
        self.batch_rows = histogram(
            "serve_app_batch_rows", "Inputs (rows) per model batch, before it is split into sub-batches.", sizes
        )
        self.sub_batches = histogram(
            "serve_app_batch_sub_batches", "Length-sorted sub-batches (model calls) per model batch.",
            [1, 2, 3, 4, 6, 8, 12, 16],
        )
        self.call_rows = histogram("serve_app_model_call_rows", "Rows per model call (one sub-batch).", sizes)
        self.call_tokens = histogram(
            "serve_app_model_call_tokens",
            "Real (unpadded) input tokens per model call; for generation, prompt plus max_tokens.",
            [16, 64, 256, 1024, 4096, 16384, 65536],
        )
        self.padding_efficiency = histogram(
            "serve_app_padding_efficiency", "Real tokens / padded tokens per model call (1.0: no padding).",
            [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0],
        )
        self.generated_tokens = counter("serve_app_generated_tokens", "Tokens generated (completion tokens).")
        latency_s = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
        self.time_to_first_token = histogram(
            "serve_app_time_to_first_token_seconds",
            "Per generation row: from arrival at the replica to its first generated token.", latency_s,
        )
        self.inter_token_latency = histogram(
            "serve_app_inter_token_latency_seconds",
            "Per generation row: mean time between its generated tokens after the first.",
            [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1],
        )
        # Exact totals for means and ratios. Ray 2.60's agent rebuilds a histogram's _sum
        # from bucket midpoints, so _sum / _count is only approximate (a 1-row batch
        # reads as 0.5 rows); rate(rows) / rate(batches) is exact.
        # Engines with their own scheduler (vLLM), refreshed after each engine step.
        self.engine_running = gauge("serve_app_engine_running_requests", "Requests in the engine's running batch.")
        self.engine_waiting = gauge("serve_app_engine_waiting_requests", "Requests waiting for the engine's batch.")
        self.kv_cache_usage = gauge("serve_app_kv_cache_usage", "Share of the engine's KV-cache blocks in use (0-1).")
        self.prefix_cache_queries = counter(
            "serve_app_prefix_cache_queries_tokens", "Prompt tokens looked up in the engine's prefix cache.")
        self.prefix_cache_hits = counter(
            "serve_app_prefix_cache_hits_tokens",
            "Prompt tokens found in the engine's prefix cache (hit rate: hits / queries).")
        # Minutes on a cold node, seconds with caches filled.
        self.startup = metrics.Histogram(
            "serve_app_replica_startup_seconds",
            description="Per replica start: seconds of each phase (process: worker start and imports; load: the "
            "model's files; engine: weights, and on vLLM compile and KV-cache sizing; warmup: its warm-up calls) "
            "and total, process start to ready.",
            boundaries=[1, 2, 5, 10, 20, 30, 60, 120, 180, 300, 600, 1200],
            tag_keys=("model", "phase"),
        )
        self.startup.set_default_tags({"model": model})
        self.calls_before_ready = counter(
            "serve_app_calls_before_ready",
            "Calls this replica was sent before its warm-up ended (Serve should send none: it routes to a "
            "replica once its first health check, which runs the warm-up, has passed).")
        self.rows = counter("serve_app_rows", "Inputs run by the model.")
        self.batches = counter("serve_app_batches", "Model batches run.")
        self.model_calls = counter("serve_app_model_calls", "Model calls (sub-batches) run.")
        self.real_tokens = counter("serve_app_real_tokens", "Real input tokens in model calls.")
        self.padded_tokens = counter("serve_app_padded_tokens", "Padded input tokens in model calls (real + padding).")
