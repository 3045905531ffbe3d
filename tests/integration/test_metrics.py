"""Prometheus metrics: after real traffic, every custom metric is exported with a value,
every query of the Grafana dashboard names a metric that a real scrape holds, and
/v1/stats summarises the last minute."""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving_apps import profiled_app

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "serve_app.json"

# Every custom metric, as exported (Ray prefixes "ray_"; counters end in "_total").
# Each must have a non-zero sample after the traffic below.
NONZERO = [
    "ray_serve_app_requests_total",
    "ray_serve_app_request_latency_seconds_count",
    "ray_serve_app_errors_total",
    "ray_serve_app_queue_wait_seconds_count",
    "ray_serve_app_batch_rows_count",
    "ray_serve_app_batch_sub_batches_count",
    "ray_serve_app_model_call_rows_count",
    "ray_serve_app_model_call_tokens_count",
    "ray_serve_app_padding_efficiency_count",
    "ray_serve_app_generated_tokens_total",
    "ray_serve_app_rows_total",
    "ray_serve_app_batches_total",
    "ray_serve_app_model_calls_total",
    "ray_serve_app_real_tokens_total",
    "ray_serve_app_padded_tokens_total",
    "ray_serve_app_cache_requests_total",
    "ray_serve_app_cache_bytes",
    "ray_serve_app_cache_entries",
    "ray_serve_app_schedule_min_replicas",
    "ray_serve_app_schedule_max_replicas",
    "ray_serve_app_schedule_desired_replicas",
    "ray_serve_app_schedule_window_active",
]
# Exported, but zero in a healthy short run.
PRESENT = ["ray_serve_app_cache_evictions", "ray_serve_app_cache_store_errors", "ray_serve_app_schedule_load_replicas"]


def _samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _traffic(client: httpx.Client) -> None:
    # Inputs no other test sends, so the session's cache cannot answer them.
    fresh = uuid.uuid4().hex[:8]
    for i in range(6):
        client.post("/v1/embeddings",
                    json={"model": "tiny-embed", "input": [f"text {i} {fresh}", f"a longer text {fresh} " * (i + 1)]})
    for _ in range(2):  # the second is a cache hit
        client.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 4, "temperature": 0,
                                                  "messages": [{"role": "user", "content": f"metrics {fresh}"}]})
    client.post("/v1/classify", json={"model": "tiny-classifier", "input": f"great {fresh}"})
    bad = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 10_000})
    assert bad.status_code == 400


@pytest.fixture(scope="module")
def scrape(deployed, redeploy_apps_module, metrics_url, tiny_bert_embedding_dir) -> dict:
    # A model under a load profile, so the policy's gauges exist too.
    window = {"name": "all-day", "start": "00:00", "end": "24:00", "min_replicas": 1, "max_replicas": 2,
              "target_ongoing_requests": 8}
    redeploy_apps_module([profiled_app("scaled", tiny_bert_embedding_dir,
                                       {"windows": [window], "look_back_period_s": 2})])
    with httpx.Client(base_url=deployed, timeout=60) as client:
        _traffic(client)
    # Replicas push metrics every second; the agent exports what it has received, and
    # drops a series that has not changed for a while. So keep every sample seen by any
    # scrape until each metric, and each series the test checks below, has shown up.
    seen: dict[str, list[tuple[dict, float]]] = {}
    deadline = time.monotonic() + 90
    while True:
        for name, values in _samples(httpx.get(metrics_url, timeout=10).text).items():
            seen.setdefault(name, []).extend(values)
        missing = [n for n in NONZERO if not any(v > 0 for _, v in seen.get(n, []))]
        missing += [n for n in PRESENT if n not in seen]
        batched = {labels.get("model") for labels, v in seen.get("ray_serve_app_batch_rows_count", []) if v}
        missing += [f"batches of {m}" for m in ("tiny-embed", "tiny-llama", "tiny-classifier") if m not in batched]
        # The series of this test's own traffic, not just any series of each metric:
        # other tests' errors and cache outcomes may have arrived first.
        errors = {(lb.get("model"), lb.get("status")) for lb, v in seen.get("ray_serve_app_errors_total", []) if v}
        missing += [] if ("tiny-llama", "400") in errors else ["the tiny-llama 400 error"]
        outcomes = {lb.get("outcome") for lb, v in seen.get("ray_serve_app_cache_requests_total", []) if v}
        missing += [f"cache {o}" for o in ("hit", "miss") if o not in outcomes]
        if not missing or time.monotonic() > deadline:
            return {"samples": seen, "missing": missing}
        time.sleep(2)


def test_every_custom_metric_is_exported_with_a_value(scrape):
    assert not scrape["missing"], f"not exported (or zero) after traffic: {scrape['missing']}"
    samples = scrape["samples"]
    # The model label is set, and per-model series are what the dashboard groups by.
    models = {labels.get("model") for labels, _ in samples["ray_serve_app_batch_rows_count"]}
    assert {"tiny-embed", "tiny-llama", "tiny-classifier"} <= models, models
    errors = {(labels["model"], labels["status"], labels["code"]) for labels, v in samples["ray_serve_app_errors_total"] if v}
    assert ("tiny-llama", "400", "invalid_request_error") in errors, errors
    outcomes = {labels["outcome"] for labels, v in samples["ray_serve_app_cache_requests_total"] if v}
    assert {"miss", "hit"} <= outcomes, outcomes


def _dashboard_metric_names() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    assert exprs, "the dashboard has no queries"
    names = set()
    for expr in exprs:
        # Metric names: identifiers followed by a selector, a range or the end, that are
        # not PromQL functions or keywords (sum, rate, by, ...).
        for name in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[|\)|$|\s*[-+*/]|\s*>|\s*<)", expr):
            if name.startswith(("ray_", "serve_app_")):
                names.add(name)
    return names


def test_every_dashboard_query_names_an_exported_metric(scrape):
    names = _dashboard_metric_names()
    assert len(names) >= 10, names
    missing = sorted(n for n in names if n not in scrape["samples"])
    assert not missing, f"the dashboard queries metrics that a real scrape lacks: {missing}"


def test_stats_summarise_the_last_minute(scrape, client):
    stats = client.get("/v1/stats").json()
    embed = stats["models"]["tiny-embed"]["last_minute"]
    assert embed["requests"] >= 6 and embed["p95_latency_s"] >= embed["p50_latency_s"] > 0
    assert embed["mean_batch_rows"] >= 1 and 0 < embed["padding_efficiency"] <= 1
    assert embed["replicas"] == 1
    chat = stats["models"]["tiny-llama"]["last_minute"]
    assert chat["errors"] >= 1 and 0 < chat["cache_hit_rate"] < 1
