"""Application builder: the only place that binds deployments.

``serve run deployments/local.yaml`` imports ``serve_app.app:build_app`` and calls it
with the file's ``args:`` section. A bad section fails here, before any replica starts,
with the field path, the value and the fix.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from serve_app.cache_server import CacheServer
from serve_app.config import AppConfig, ModelConfig, parse_app_config
from serve_app.model_server import ModelServer
from serve_app.router import Router


def deployment_name(model: ModelConfig) -> str:
    return f"ModelServer-{model.name}"


def _model_deployment(model: ModelConfig) -> Application:
    resources = model.resources
    actor_options: dict[str, Any] = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus}
    if resources.accelerator_type:
        actor_options["accelerator_type"] = resources.accelerator_type
    return ModelServer.options(
        name=deployment_name(model),
        num_replicas=model.num_replicas,
        max_ongoing_requests=model.max_ongoing_requests,
        ray_actor_options=actor_options,
        # Batching knobs travel as user_config. Overriding them in the Serve config
        # file's `deployments:` section (see README) reaches live replicas through
        # reconfigure(), without restarting them or reloading the model.
        user_config=model.batching.model_dump(),
        # Loading a model can take minutes on a cold node; keep Serve from declaring
        # the replica failed while it downloads and converts weights.
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=30,
    ).bind(model.model_dump())


def _cache_deployment(config: AppConfig) -> Application | None:
    if not config.cache.enabled:
        return None
    return CacheServer.options(
        name="CacheServer",
        num_replicas=config.cache.num_replicas,
        max_ongoing_requests=4096,  # each call is a dictionary or Redis lookup
        ray_actor_options={"num_cpus": config.cache.num_cpus},
    ).bind(config.cache.model_dump())


def router_app(config: AppConfig, model_apps: dict[str, Application], cache_app: Application | None = None) -> Application:
    """The Router bound to one (bound) deployment per model name, and the cache."""
    return Router.options(
        name="Router",
        num_replicas=config.router.num_replicas,
        max_ongoing_requests=config.router.max_ongoing_requests,
        ray_actor_options={"num_cpus": config.router.num_cpus},
    ).bind(config.model_dump(), model_apps, cache_app)


def build_app_from_config(config: AppConfig) -> Application:
    models = {model.name: _model_deployment(model) for model in config.models}
    return router_app(config, models, _cache_deployment(config))


def build_app(args: dict) -> Application:
    """Entry point for Serve config files (``import_path: serve_app.app:build_app``)."""
    return build_app_from_config(parse_app_config(args))
