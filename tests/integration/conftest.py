"""One Ray instance for the whole integration session; requests go through the real
HTTP proxy on a free local port."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
import yaml
from benchmarks.harness.processes import free_port

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

pytestmark = pytest.mark.integration



METRICS_PORT = free_port()


@pytest.fixture(scope="session")
def serve_instance():
    # Logical CPUs: the fractional replicas below are placed by Ray, while torch
    # threads (set per replica) decide how much of the 2 real cores each uses.
    # Metrics: Ray's Prometheus endpoint on a known port, reported every second
    # (default 10 s) so the scrape test need not wait long.
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="serve_app_tests",
             _metrics_export_port=METRICS_PORT, _system_config={"metrics_report_interval_ms": 1000})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def metrics_url(serve_instance) -> str:
    return f"http://127.0.0.1:{METRICS_PORT}/metrics"


def tiny_app_args(embedding_dir, classifier_dir, llama_dir, vit_dir) -> dict:
    small = {"num_cpus": 0.25, "torch_threads": 1}
    # fp32, not the default precision auto (bf16 on a CPU with bf16 units): tests compare
    # answers across batches and engines to a tolerance only fp32 keeps on every machine.
    # local.yaml's app at /local runs auto.
    return {
        "router": {"num_cpus": 0.25, "request_timeout_s": 60},
        "models": [
            {
                "name": "tiny-embed", "precision": "fp32",
                "source": str(embedding_dir),
                "task": "embedding", "engine": "transformers",
                # A long wait lets a burst of concurrent HTTP requests meet in one batch.
                "batching": {"max_batch_size": 32, "max_batch_tokens": 4096, "batch_wait_timeout_s": 0.1},
                "resources": small,
                "max_inputs_per_request": 8,
            },
            {
                "name": "tiny-classifier", "precision": "fp32",
                "source": str(classifier_dir),
                "task": "text-classification",
                "resources": small,
                "top_k_limit": 2,
            },
            {
                "name": "tiny-llama", "precision": "fp32",
                "source": str(llama_dir),
                "task": "text-generation", "engine": "transformers",
                "batching": {"max_batch_size": 8, "max_batch_tokens": 2048, "batch_wait_timeout_s": 0.05},
                "resources": small,
                # Static: the batching tests here count its batches; test_streaming_api
                # covers the continuous engine.
                "generation": {"default_max_tokens": 8, "max_tokens_limit": 64, "engine": "static"},
            },
            {"name": "tiny-vit", "source": str(vit_dir), "task": "image-classification", "precision": "fp32",
             "resources": small},
        ],
    }


LOCAL_YAML = Path(__file__).resolve().parents[2] / "deployments" / "local.yaml"


def local_app_config() -> dict:
    """deployments/local.yaml's application, moved under /local so both apps coexist."""
    (application,) = yaml.safe_load(LOCAL_YAML.read_text())["applications"]
    return {**application, "name": "local", "route_prefix": "/local"}


def deploy_config(applications: list[dict], timeout_s: float = 600) -> None:
    """Deploy as `serve deploy` / `serve run <file>` do: a declarative config, so a
    change of deployment options only (user_config) reaches live replicas in place."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": applications}))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        statuses = serve.status().applications
        states = {name: statuses[name].status if name in statuses else None for name in (a["name"] for a in applications)}
        if all(state == "RUNNING" for state in states.values()):
            return
        failed = {n: statuses[n].message for n, st in states.items() if st in ("DEPLOY_FAILED", "UNHEALTHY")}
        if failed:
            raise RuntimeError(f"deploy failed: {failed}")
        time.sleep(0.5)
    raise TimeoutError(f"applications not running after {timeout_s}s: {states}")


@pytest.fixture(scope="session")
def tiny_app(tiny_bert_embedding_dir, tiny_bert_classifier_dir, tiny_llama_dir, tiny_vit_dir):
    """The tiny-model application config (served at /), as a deployments file holds it."""
    return {
        "name": "tiny",
        "route_prefix": "/",
        "import_path": "serve_app.app:build_app",
        "args": tiny_app_args(tiny_bert_embedding_dir, tiny_bert_classifier_dir, tiny_llama_dir, tiny_vit_dir),
    }


@pytest.fixture(scope="session")
def deployed(serve_instance, tiny_app):
    """Both applications running: tiny fixture models at /, local.yaml's packaged models at /local."""
    deploy_config([tiny_app, local_app_config()])
    return serve_instance


@pytest.fixture()
def redeploy(deployed, tiny_app):
    """Re-apply the session's config with per-deployment overrides for the tiny app;
    restores the original config afterwards."""

    def apply(deployment_overrides: list[dict]) -> None:
        deploy_config([{**tiny_app, "deployments": deployment_overrides}, local_app_config()])

    yield apply
    deploy_config([tiny_app, local_app_config()])


def _extra_apps(tiny_app):
    def apply(extra_apps: list[dict]) -> None:
        deploy_config([tiny_app, local_app_config(), *extra_apps])

    yield apply
    deploy_config([tiny_app, local_app_config()])


@pytest.fixture()
def redeploy_apps(deployed, tiny_app):
    """Deploy extra applications beside the session's two; removed afterwards."""
    yield from _extra_apps(tiny_app)


@pytest.fixture()
def deploy_apps_without_waiting(deployed, tiny_app):
    """Hand the controller the session's two applications plus extra ones and return at
    once, so a test can watch them start; the extra ones are removed afterwards."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    def apply(extra_apps: list[dict]) -> None:
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(
            {"applications": [tiny_app, local_app_config(), *extra_apps]}))

    yield apply
    deploy_config([tiny_app, local_app_config()])


@pytest.fixture(scope="module")
def redeploy_apps_module(deployed, tiny_app):
    """redeploy_apps for a whole test module."""
    yield from _extra_apps(tiny_app)


@pytest.fixture(scope="session")
def tiny_service(deployed):
    return deployed


@pytest.fixture()
def client(tiny_service):
    with httpx.Client(base_url=tiny_service, timeout=60) as http:
        yield http
