"""A real Prometheus: it scrapes the live service's metrics endpoint, and after traffic
every query of the Grafana dashboard (each panel target, rows included, and each
template-variable query) returns at least one series through Prometheus's query API.

test_metrics checks the metric *names* of the dashboard against one scrape; this checks
the queries themselves: labels, suffixes, selectors, rate windows and vector matching.
Needs a `prometheus` binary: `make prometheus-server` (which `make test` runs) unpacks
Debian's package into .venv/prometheus, else one on PATH; the test runs its own process
(own port, config and storage), never a service.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from dashboard_panels import DASHBOARD, all_panels
from benchmarks.harness.processes import free_port, stop_process
from serving_apps import profiled_app

pytestmark = pytest.mark.integration

_UNPACKED = Path(__file__).resolve().parents[2] / ".venv" / "prometheus" / "usr" / "bin" / "prometheus"
PROMETHEUS = str(_UNPACKED) if os.access(_UNPACKED, os.X_OK) else shutil.which("prometheus")
# Where `make test` can fetch it (apt-get and dpkg-deb, no root needed) a missing binary is
# a broken set-up, and the test fails below instead of skipping.
SET_UP_INSTALLS_IT = shutil.which("apt-get") is not None and shutil.which("dpkg-deb") is not None
if PROMETHEUS is None and not SET_UP_INSTALLS_IT:
    pytest.skip("no prometheus binary: `make prometheus-server` unpacks Debian's package into .venv/prometheus "
                "(needs apt-get and dpkg-deb); or put one on PATH", allow_module_level=True)

# Ray reports every second here (the session fixture). Late in the full suite (every
# test's deployments' series) one scrape of its endpoint took over a second on 2 cores,
# and on a slower CI machine over 3 s for 90 s running; Prometheus's timeout may not pass
# its interval, so both are 5 s.
SCRAPE_INTERVAL_S = 5
# Grafana's $__rate_interval is max($__interval + scrape interval, 4 x scrape interval);
# a 1 h dashboard on a wide panel gives about a minute, and a minute holds 12 scrapes here.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__interval_ms": "15000",
                    "__range": "1h", "__range_s": "3600", "__range_ms": "3600000"}
# ${name}, ${name:format}, $name and the old [[name]].
VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)\]\]")
LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<selector>.+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$")



# ---- the dashboard's queries, as Grafana sends them -------------------------------------


def dashboard_targets(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title / refId, expr) of every target with an expression."""
    targets = []
    for panel in all_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if isinstance(target.get("expr"), str) and target["expr"].strip():
                targets.append((f"{panel.get('title')!r} {target.get('refId', '')}".strip(), target["expr"]))
    return targets


def _variable_query(variable: dict) -> str:
    query = variable.get("query")
    if isinstance(query, dict):
        query = query.get("query")
    return query or variable.get("definition") or ""


def substitute(expr: str, values: dict[str, str]) -> str:
    def replace(match: re.Match) -> str:
        name = next(group for group in match.groups() if group)
        if name not in values:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return values[name]

    return VARIABLE.sub(replace, expr)


class PromAPI:
    def __init__(self, base: str):
        self.http = httpx.Client(base_url=base, timeout=30)

    def _get(self, path: str, **params) -> dict:
        body = self.http.get(path, params=params).json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self._get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def label_values(self, label: str, selector: str | None) -> list[str]:
        params = {"start": time.time() - 3600, "end": time.time()}
        if selector:
            params["match[]"] = selector
        return self._get(f"/api/v1/label/{label}/values", **params)

    def series(self, selector: str) -> list[dict]:
        return self._get("/api/v1/series", **{"match[]": selector, "start": time.time() - 3600, "end": time.time()})


def _regex_literal(value: str) -> str:
    """A value inside a PromQL "..." regex, as Grafana escapes it: each regex metacharacter
    behind a backslash, then the string literal's own escaping."""
    regex = re.sub(r"([\\.^$*+?()\[\]{}|])", r"\\\1", value)
    return regex.replace("\\", "\\\\").replace('"', '\\"')


def template_values(dashboard: dict, prom: PromAPI) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The value Grafana gives each variable when "All" is selected (its allValue, else
    every value its query finds, as a regex), and each query variable's values."""
    values = dict(GRAFANA_BUILTINS)
    found: dict[str, list[str]] = {}
    for variable in dashboard.get("templating", {}).get("list", []):
        name, kind = variable["name"], variable.get("type")
        if kind == "datasource":
            values[name] = "prometheus"
        elif kind == "query":
            match = LABEL_VALUES.match(_variable_query(variable))
            assert match, f"variable {name}: not a label_values() query: {_variable_query(variable)!r}"
            selector = substitute(match["selector"], values) if match["selector"] else None
            found[name] = prom.label_values(match["label"], selector)
            if variable.get("includeAll") and variable.get("allValue"):
                values[name] = variable["allValue"]
            else:
                values[name] = "(" + "|".join(_regex_literal(v) for v in found[name]) + ")" if found[name] else ""
        else:  # custom, constant, interval, textbox: the current value
            current = variable.get("current", {}).get("value", variable.get("query", ""))
            values[name] = "(" + "|".join(current) + ")" if isinstance(current, list) else str(current)
    return values, found


def _is_number(sample: dict) -> bool:
    """Not NaN (0/0, a quantile of empty buckets) nor an infinity (x/0)."""
    return sample["value"][1] not in ("NaN", "+Inf", "-Inf")


# ---- Prometheus, scraping the live service ------------------------------------------------


@pytest.fixture(scope="module")
def prometheus(metrics_url, tmp_path_factory):
    """Base URL of a Prometheus process of this test's own, scraping Ray's endpoint."""
    if PROMETHEUS is None:
        pytest.fail("no prometheus binary although this machine has apt-get and dpkg-deb: run "
                    "`make prometheus-server`, which unpacks Debian's package into .venv/prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    target = urlsplit(metrics_url)
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "scrape_timeout": f"{SCRAPE_INTERVAL_S}s",
                   "evaluation_interval": "15s"},
        "scrape_configs": [{"job_name": "ray", "metrics_path": target.path or "/metrics",
                            "static_configs": [{"targets": [target.netloc]}]}],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (work / "prometheus.log").open("w")
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"prometheus exited {process.returncode}: {(work / 'prometheus.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus not ready after 60 s"
            time.sleep(0.25)
        yield base
    finally:
        stop_process(process, timeout_s=15)
        log.close()


def _traffic(client: httpx.Client, fresh: str) -> None:
    """Requests that make every panel's series move: batched embeddings, classifications,
    chat (plain, streamed, a repeat that the cache answers), an error."""
    for i in range(4):
        texts = [f"text {i} {fresh}", f"a longer text {fresh} " * (i + 1)]
        assert client.post("/v1/embeddings", json={"model": "tiny-embed", "input": texts}).status_code == 200
    assert client.post("/v1/classify", json={"model": "tiny-classifier", "input": f"great {fresh}"}).status_code == 200
    chat = {"model": "tiny-llama", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": f"prometheus {fresh}"}]}
    for _ in range(2):  # the second is a cache hit
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
    streamed = {**chat, "stream": True, "messages": [{"role": "user", "content": f"stream {fresh}"}]}
    with client.stream("POST", "/v1/chat/completions", json=streamed) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())  # all of it: leaving early would cancel the row
    assert "data: [DONE]" in lines, lines[-3:]
    bad = client.post("/v1/completions", json={"model": "tiny-llama", "prompt": "x", "max_tokens": 10_000})
    assert bad.status_code == 400


@pytest.fixture(scope="module")
def scraped(deployed, redeploy_apps_module, prometheus, tiny_bert_embedding_dir):
    """Prometheus, after two waves of traffic it scraped: the first makes the series
    exist, the second moves them, so rates and quantiles over the window have values."""
    started = time.monotonic()
    # A model under a load profile, so the scaling row's gauges exist.
    window = {"name": "all-day", "start": "00:00", "end": "24:00", "min_replicas": 1, "max_replicas": 2,
              "target_ongoing_requests": 8}
    redeploy_apps_module([profiled_app("scaled", tiny_bert_embedding_dir,
                                       {"windows": [window], "look_back_period_s": 2})])
    prom = PromAPI(prometheus)
    deadline = time.monotonic() + 180
    while not [s for s in prom.query('up{job="ray"} == 1')]:
        if time.monotonic() > deadline:
            targets = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
            pytest.fail(f"Ray's endpoint never scraped: {[(t['scrapeUrl'], t['lastError']) for t in targets]}")
        time.sleep(0.5)
    with httpx.Client(base_url=deployed, timeout=60) as client:
        _traffic(client, uuid.uuid4().hex[:8])
        # The first wave's counters in Prometheus before the second wave (a new series'
        # first sample is its baseline: rate() counts only what comes after it).
        deadline = time.monotonic() + 60
        while not prom.query('ray_serve_app_errors_total{model="tiny-llama"}') \
                or not prom.query('ray_serve_app_generated_tokens_total{model="tiny-llama"}'):
            assert time.monotonic() < deadline, "the first wave's metrics never reached Prometheus"
            time.sleep(1)
        time.sleep(3 * SCRAPE_INTERVAL_S)
        _traffic(client, uuid.uuid4().hex[:8])
    return prom, started


def _diagnose(prom: PromAPI, expr: str) -> str:
    """What Prometheus holds of each metric an expression names (for a failure message)."""
    lines = []
    for name in sorted(set(re.findall(r"\b(ray_[a-zA-Z0-9_:]+)", expr))):
        series = prom.series(f'{{__name__="{name}"}}')
        label_sets = sorted({json.dumps({k: v for k, v in s.items() if k not in ("__name__", "instance", "job")},
                                        sort_keys=True) for s in series})
        lines.append(f"    {name}: {len(series)} series" + (f", e.g. {label_sets[:3]}" if label_sets else ""))
    return "\n".join(lines)


def test_every_dashboard_query_returns_series_from_a_real_prometheus(scraped):
    prom, started = scraped
    dashboard = json.loads(DASHBOARD.read_text())
    targets = dashboard_targets(dashboard)
    assert len(targets) >= 20, targets

    # Template variables: their queries find values too (Grafana's label_values()).
    deadline = time.monotonic() + 60
    while True:
        values, found = template_values(dashboard, prom)
        empty_variables = [name for name, vals in found.items() if not vals]
        if not empty_variables or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert not empty_variables, f"template variables without values: {empty_variables} ({found})"
    assert {"tiny-embed", "tiny-llama", "tiny-classifier"} <= set(found.get("model", [])), found

    queries = [(where, substitute(expr, values)) for where, expr in targets]
    for where, query in queries:
        assert "$" not in query and "[[" not in query, f"{where}: unsubstituted variable in {query!r}"

    # Poll: histograms and gauges reach Prometheus a report interval or two after the
    # traffic. Each query keeps its latest answer with a number (else its latest answer).
    results: dict[str, list[dict]] = {}
    deadline = time.monotonic() + 90
    while True:
        for _, query in queries:
            answer = prom.query(query)
            if any(_is_number(s) for s in answer) or not any(_is_number(s) for s in results.get(query, [])):
                results[query] = answer
        empty = [(w, q) for w, q in queries if not results[q]]
        no_number = [(w, q) for w, q in queries if results[q] and not any(_is_number(s) for s in results[q])]
        if not (empty or no_number) or time.monotonic() > deadline:
            break
        time.sleep(2)
    print(f"\n{len(queries)} dashboard queries and {len(found)} variable queries evaluated by Prometheus "
          f"{time.monotonic() - started:.0f} s after this module's set-up began:")
    for where, query in queries:
        numbers = [s for s in results[query] if _is_number(s)]
        print(f"  {len(results[query]):3d} series ({len(numbers)} with a number)  {where}")
    assert not empty, "dashboard queries that return no series after traffic:\n" + "\n".join(
        f"  {where}: {query}\n{_diagnose(prom, query)}" for where, query in empty)
    # After two waves of traffic every query also has a number (not only NaN: a ratio or
    # quantile over rates that never moved).
    assert not no_number, "dashboard queries with only NaN series after traffic:\n" + "\n".join(
        f"  {where}: {query}" for where, query in no_number)
