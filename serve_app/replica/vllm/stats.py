"""vLLM's scheduler figures for ``/v1/stats`` and our Prometheus gauges."""

from __future__ import annotations

import logging
from typing import Any


logger = logging.getLogger("ray.serve")


class EngineStatsLogger:
    """A vLLM stat logger that keeps the engine's latest scheduler figures for
    ``/v1/stats`` and sets our Prometheus gauges: running and waiting requests, KV-cache
    usage, and prefix-cache queries and hits (tokens) for its hit rate.

    vLLM calls :meth:`record` from its output handler after each engine step.
    """

    def __init__(self, model_metrics: Any):
        self.metrics = model_metrics
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.steps = 0  # engine steps that finished at least one request
        self.step_rows = 0  # requests those steps finished

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None and prefix.queries:
                self.prefix_queries += prefix.queries
                self.prefix_hits += prefix.hits
                self.metrics.prefix_cache_queries.inc(prefix.queries)
                if prefix.hits:
                    self.metrics.prefix_cache_hits.inc(prefix.hits)
            self.metrics.engine_running.set(self.running)
            self.metrics.engine_waiting.set(self.waiting)
            self.metrics.kv_cache_usage.set(self.kv_cache_usage)
        if iteration_stats is not None:
            if iteration_stats.num_preempted_reqs:
                self.preemptions += iteration_stats.num_preempted_reqs
            finished = len(iteration_stats.finished_requests)
            if finished:
                self.steps += 1
                self.step_rows += finished

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def snapshot(self) -> dict:
        return {
            "kind": "vllm",
            "running_requests": self.running,
            "waiting_requests": self.waiting,
            "kv_cache_usage": self.kv_cache_usage,
            "prefix_cache_queries_tokens": self.prefix_queries,
            "prefix_cache_hits_tokens": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else None,
            "preemptions": self.preemptions,
            "steps_finishing_requests": self.steps,
            "requests_finished_per_step": self.step_rows / self.steps if self.steps else None,
        }
