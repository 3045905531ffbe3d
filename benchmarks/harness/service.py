"""Start (or join) Ray, deploy benchmark variants side by side, and tear down."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import yaml

from benchmarks.harness.processes import free_port
from serve_app.ray_env import shorten_ingress_drain

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")



def load_application(config_path: str | Path) -> dict:
    """The ``args`` of a deployments file's (only) application: router, cache, models."""
    document = yaml.safe_load(Path(config_path).read_text())
    (application,) = document["applications"]
    return application["args"]


def load_models(config_path: str | Path) -> list[dict]:
    """The ``models`` list of a deployments file's (only) application."""
    return load_application(config_path)["models"]


def pick_model(models: list[dict], task: str) -> dict:
    for model in models:
        if model["task"] == task:
            return copy.deepcopy(model)
    raise SystemExit(f"the deployments file has no {task} model; benchmarks need one")


def variant(model: dict, *, name: Optional[str] = None, precision: Optional[str] = None,
            torch_threads: Optional[int] = None, num_cpus: Optional[float] = None,
            engine: str = "transformers", **batching: Any) -> dict:
    """A copy of a model config with batching/precision/thread overrides. ``engine``
    defaults to transformers: the scenarios that use this measure our batching paths,
    which a deployments file's ``engine: auto`` would hand to vLLM where it is installed."""
    out = copy.deepcopy(model)
    out["engine"] = engine
    generation = out.get("generation") or {}
    if engine == "transformers" and generation.get("engine") == "vllm":
        out["generation"] = {**generation, "engine": "auto"}
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


def random_lora_adapter(base_dir: str | Path, path: Path) -> Path:
    """A random LoRA adapter of the model at ``base_dir`` (peft's layout: rank 8 on q_proj
    and v_proj, init_lora_weights=False so it changes the answers), written once at
    ``path``. For measuring what serving an adapter costs, which does not depend on what
    it learned."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if not (path / "adapter_config.json").is_file():
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(
            r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        model.save_pretrained(path)
    return path


class BenchCluster:
    """A Ray instance with Serve's proxy on a free local port, or (``attach``) the Ray
    instance and proxy a caller already started, e.g. the test session's."""

    def __init__(self, address: Optional[str] = None):
        import ray
        from ray import serve

        if address:
            ray.init(address=address, log_to_driver=False)
            self.metrics_port = None
        else:
            # Logical CPUs only place replicas; torch threads decide real core use.
            # Ray's Prometheus endpoint on a port of our choice, reported every 2 s, for
            # scenarios that read replicas' counters while they run (day-real).
            self.metrics_port: Optional[int] = free_port()
            # Scenarios delete their apps when done: without a load balancer in front of
            # this instance, Ray's 30 s drain per deleted Router only delays the next one.
            shorten_ingress_drain()
            ray.init(num_cpus=max(8, (os.cpu_count() or 2) * 4), include_dashboard=False, log_to_driver=False,
                     _metrics_export_port=self.metrics_port, _system_config={"metrics_report_interval_ms": 2000})
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.deployed: list[str] = []
        self.owns_ray = True

    @property
    def metrics_url(self) -> Optional[str]:
        """This node's Prometheus endpoint, where known."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else None

    @classmethod
    def attach(cls, base_url: str, metrics_port: Optional[int] = None) -> "BenchCluster":
        """Use the Ray instance this process already joined and its running Serve proxy
        at ``base_url`` (e.g. ``http://127.0.0.1:PORT``). close() then deletes only the
        applications deployed through this object and leaves Ray and Serve running."""
        import ray

        if not ray.is_initialized():
            raise RuntimeError("BenchCluster.attach needs ray.init() and serve.start() done first")
        self = cls.__new__(cls)
        self.port = urlsplit(base_url).port
        self.metrics_port = metrics_port
        self.deployed = []
        self.owns_ray = False
        return self

    def url(self, route_prefix: str) -> str:
        return f"http://127.0.0.1:{self.port}{route_prefix.rstrip('/')}"

    def deploy(self, app, name: str) -> str:
        return self.deploy_many({name: app})[name]

    def deploy_many(self, apps: dict[str, Any]) -> dict[str, str]:
        """Deploy several applications at once (their replicas start in parallel), each
        at ``/<name>``; returns their URLs, in the given order, once all are running."""
        from ray import serve
        from ray.serve.api import RunTarget

        for name in apps:  # recorded first, so a failed deploy is still deleted afterwards
            if name not in self.deployed:
                self.deployed.append(name)
        serve.run_many([RunTarget(target=app, name=name, route_prefix=f"/{name}") for name, app in apps.items()])
        return {name: self.url(f"/{name}") for name in apps}

    def models_app(self, models: list[dict], router: Optional[dict] = None, *, cache: bool = False):
        """Our app with these models, built, not deployed. The cache is off unless asked
        for: the throughput scenarios repeat inputs, and hits would measure the cache instead."""
        from serve_app.app import build_app

        args = {
            "models": models,
            "router": router or {"num_cpus": 0.1, "request_timeout_s": 600},
            "cache": {"enabled": cache},
        }
        return build_app(args)

    def shipped_app(self, application: dict, keep_models: list[str]):
        """A deployments file's application as it ships (router, cache and these of its
        models, each exactly as configured), built, not deployed."""
        from serve_app.app import build_app

        models = [copy.deepcopy(m) for m in application["models"] if m["name"] in keep_models]
        for model in models:  # per-model cache settings may name models left out
            cache = model.get("cache") or {}
            if (cache.get("semantic") or {}).get("embedding_model") not in (None, *keep_models):
                model["cache"] = {k: v for k, v in cache.items() if k != "semantic"}
        return build_app({**copy.deepcopy(application), "models": models})

    def deploy_models(self, name: str, models: list[dict], router: Optional[dict] = None, *, cache: bool = False) -> str:
        """Deploy our app with these models (see models_app)."""
        return self.deploy(self.models_app(models, router, cache=cache), name)

    def delete(self, *names: str, timeout_s: float = 120.0) -> None:
        """Delete these applications, all at once, and wait until they are gone."""
        import time

        from ray import serve

        for name in names:
            serve.delete(name, _blocking=False)
        deadline = time.monotonic() + timeout_s
        while set(names) & set(serve.status().applications):
            if time.monotonic() > deadline:
                raise TimeoutError(f"applications {sorted(set(names) & set(serve.status().applications))} "
                                   f"still there {timeout_s:.0f}s after their deletion")
            time.sleep(0.2)
        for name in names:
            if name in self.deployed:
                self.deployed.remove(name)

    def delete_all(self) -> None:
        """Delete every application still deployed through this object."""
        if self.deployed:
            self.delete(*self.deployed)

    def close(self) -> None:
        import ray
        from ray import serve

        if not self.owns_ray:
            self.delete_all()
            return
        serve.shutdown()
        ray.shutdown()
