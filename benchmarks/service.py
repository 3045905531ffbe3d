"""Start (or join) Ray, deploy benchmark variants side by side, and tear down."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path
from typing import Any, Optional

import yaml

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_models(config_path: str | Path) -> list[dict]:
    """The ``models`` list of a deployments file's (only) application."""
    document = yaml.safe_load(Path(config_path).read_text())
    (application,) = document["applications"]
    return application["args"]["models"]


def pick_model(models: list[dict], task: str) -> dict:
    for model in models:
        if model["task"] == task:
            return copy.deepcopy(model)
    raise SystemExit(f"the deployments file has no {task} model; benchmarks need one")


def variant(model: dict, *, name: Optional[str] = None, precision: Optional[str] = None,
            torch_threads: Optional[int] = None, num_cpus: Optional[float] = None, **batching: Any) -> dict:
    """A copy of a model config with batching/precision/thread overrides."""
    out = copy.deepcopy(model)
    if name:
        out["name"] = name
    if precision:
        out["precision"] = precision
    resources = out.setdefault("resources", {})
    if torch_threads:
        resources["torch_threads"] = torch_threads
    if num_cpus:
        resources["num_cpus"] = num_cpus
    out.pop("cache", None)  # per-model cache settings may name models this variant lacks
    out.setdefault("batching", {}).update(batching)
    out["max_ongoing_requests"] = max(out.get("max_ongoing_requests", 256), out["batching"].get("max_batch_size", 32))
    return out


class BenchCluster:
    """A Ray instance with Serve's proxy on a free local port."""

    def __init__(self, address: Optional[str] = None):
        import ray
        from ray import serve

        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            # Logical CPUs only place replicas; torch threads decide real core use.
            ray.init(num_cpus=max(8, (os.cpu_count() or 2) * 4), include_dashboard=False, log_to_driver=False)
        self.port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.deployed: list[str] = []

    def url(self, route_prefix: str) -> str:
        return f"http://127.0.0.1:{self.port}{route_prefix.rstrip('/')}"

    def deploy(self, app, name: str) -> str:
        from ray import serve

        route_prefix = f"/{name}"
        serve.run(app, name=name, route_prefix=route_prefix)
        self.deployed.append(name)
        return self.url(route_prefix)

    def deploy_models(self, name: str, models: list[dict], router: Optional[dict] = None, *, cache: bool = False) -> str:
        """Deploy our app with these models. The cache is off unless asked for: the
        throughput scenarios repeat inputs, and hits would measure the cache instead."""
        from serve_app.app import build_app

        args = {
            "models": models,
            "router": router or {"num_cpus": 0.1, "request_timeout_s": 600},
            "cache": {"enabled": cache},
        }
        return self.deploy(build_app(args), name)

    def delete(self, name: str) -> None:
        from ray import serve

        serve.delete(name)
        self.deployed.remove(name)

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
