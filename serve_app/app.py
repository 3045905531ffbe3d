"""Application builder: the only place that binds deployments.

``serve run deployments/local.yaml`` imports ``serve_app.app:build_app`` and calls it
with the file's ``args:`` section. A bad section fails here, before any replica starts,
with the field path, the value and the fix.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from serve_app.cache_server import CacheServer
from serve_app.config import AppConfig, LoadProfileConfig, ModelConfig, model_deployment_name, parse_app_config
from serve_app.replica.model_server import ModelServer
from serve_app.ingress.affinity import ROUTER_CLASS as AFFINITY_ROUTER
from serve_app.ingress.router import Router
from serve_app.scaling import POLICY_IMPORT_PATH


def autoscaling_config(model_name: str, profile_name: str, profile: LoadProfileConfig) -> dict[str, Any]:
    """Ray Serve autoscaling for a model that follows a daily load profile.

    Serve's own bounds are the profile's widest (the policy narrows them per window),
    and Serve's delays are zero because the policy applies the profile's own delays to
    load-driven changes only: a window opening or closing must act at once.
    """
    schedule = profile.to_schedule(profile_name)
    return {
        "min_replicas": schedule.min_replicas,
        "max_replicas": schedule.max_replicas,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "look_back_period_s": profile.look_back_period_s,
        "metrics_interval_s": min(10.0, profile.look_back_period_s / 2),
        "policy": {
            "policy_function": POLICY_IMPORT_PATH,
            "policy_kwargs": {
                "model": model_name,
                "profile_name": profile_name,
                "profile": profile.model_dump(mode="json"),
            },
        },
    }


def drain_s(config: AppConfig) -> float:
    """How long a stopping Router or ModelServer replica (a redeploy, a scale-down) waits
    for the requests it holds. The router ends every request within
    ``router.request_timeout_s`` of its arrival (504 past it), so a replica stopped that
    long after its last new request holds none; Serve's default of 20 s force-killed a
    replaced Router whose requests were still waiting for the model's new replica, and
    the client got a bare 500. The margin covers Serve's own shutdown loop; a replica
    with nothing in flight stops at once whatever this is."""
    return config.router.request_timeout_s + 5.0


def model_deployment(model: ModelConfig, config: AppConfig, *, replicas: dict[str, Any] | None = None) -> Application:
    """The model's ModelServer deployment, bound. ``replicas`` (``num_replicas`` or an
    ``autoscaling_config``) replaces what the config asks for: a benchmark compares
    Ray's own policies on the same deployment this way."""
    resources = model.resources
    # Ray sets CUDA_VISIBLE_DEVICES to the GPU(s) it assigns, so the replica's "cuda" is
    # its own share; accelerator_type makes Ray place it only on nodes with that GPU.
    actor_options: dict[str, Any] = {"num_cpus": resources.num_cpus, "num_gpus": resources.num_gpus}
    if resources.accelerator_type:
        actor_options["accelerator_type"] = resources.accelerator_type
    placement: dict[str, Any] = {}
    if model.engine == "vllm" and model.vllm.tensor_parallel_size > 1:
        # A tensor-parallel vLLM engine runs one Ray actor per GPU shard in the replica's
        # placement group (vLLM's Ray executor finds it), as Ray Serve LLM places them:
        # the replica's own bundle holds no GPU, one bundle per shard holds one, all on
        # one node so the shards talk over NVLink/PCIe, not the network.
        shards = model.vllm.tensor_parallel_size
        shard = {"GPU": 1, "CPU": 1}
        if resources.accelerator_type:  # the shards, not only the replica, on that GPU type
            shard[f"accelerator_type:{resources.accelerator_type}"] = 0.001
        placement = {
            "placement_group_bundles": [{"CPU": resources.num_cpus}] + [dict(shard) for _ in range(shards)],
            "placement_group_strategy": "STRICT_PACK",
        }
        actor_options["num_gpus"] = 0
    if replicas is not None:
        replicas = dict(replicas)
    elif model.load_profile:
        replicas = {
            "autoscaling_config": autoscaling_config(
                model.name, model.load_profile, config.load_profiles[model.load_profile]
            )
        }
    else:
        replicas = {"num_replicas": model.num_replicas or 1}
    if model.prefix_affinity():
        # The router's handle picks the replica holding the call's prompt prefix (ingress.affinity).
        replicas["request_router_config"] = {
            "request_router_class": AFFINITY_ROUTER,
            "request_router_kwargs": {"imbalanced_requests": model.routing.imbalanced_requests}}
    return ModelServer.options(
        name=model_deployment_name(model.name),
        **replicas,
        max_ongoing_requests=model.max_ongoing_requests,
        # Bounded: past it the router answers 503 at once instead of queueing forever.
        max_queued_requests=model.max_queued_requests,
        ray_actor_options=actor_options,
        **placement,
        # Batching knobs travel as user_config. Overriding them in the Serve config
        # file's `deployments:` section (see docs/configuration.md) reaches live replicas through
        # reconfigure(), without restarting them or reloading the model.
        user_config=model.batching.model_dump(),
        # Loading a model can take minutes on a cold node; keep Serve from declaring
        # the replica failed while it downloads and converts weights.
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=drain_s(config),
    ).bind(model.model_dump())


def _cache_deployment(config: AppConfig) -> Application | None:
    if not config.cache.enabled:
        return None
    return CacheServer.options(
        name="CacheServer",
        num_replicas=config.cache.num_replicas,
        max_ongoing_requests=4096,  # each call is a dictionary or Redis lookup
        ray_actor_options={"num_cpus": config.cache.num_cpus, "resources": config.cache.ray_resources},
    ).bind(config.cache.model_dump())


def router_app(config: AppConfig, model_apps: dict[str, Application], cache_app: Application | None = None) -> Application:
    """The Router bound to one (bound) deployment per model name, and the cache."""
    return Router.options(
        name="Router",
        num_replicas=config.router.num_replicas,
        max_ongoing_requests=config.router.max_ongoing_requests,
        max_queued_requests=config.router.max_queued_requests,
        ray_actor_options={"num_cpus": config.router.num_cpus, "resources": config.router.ray_resources},
        graceful_shutdown_timeout_s=drain_s(config),
    ).bind(config.model_dump(), model_apps, cache_app)


def build_app_from_config(config: AppConfig) -> Application:
    models = {model.name: model_deployment(model, config) for model in config.models}
    return router_app(config, models, _cache_deployment(config))


def build_app(args: dict) -> Application:
    """Entry point for Serve config files (``import_path: serve_app.app:build_app``)."""
    return build_app_from_config(parse_app_config(args))
