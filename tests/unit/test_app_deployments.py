"""The deployments serve_app.app builds: options Serve applies to each replica. No running Ray."""

from __future__ import annotations

from serve_app.app import build_app_from_config, model_deployment
from serve_app.config import parse_app_config


def _drain_s(application) -> float:
    return application._bound_deployment._deployment_config.graceful_shutdown_timeout_s


def test_a_stopping_router_or_model_replica_waits_as_long_as_a_request_may_last():
    # A redeploy replaces the Router; a request it holds may wait for the model's new
    # replica up to the request timeout, and Serve's default 20 s killed it (a bare 500).
    for timeout_s in (45.0, 300.0):
        config = parse_app_config({"router": {"request_timeout_s": timeout_s},
                                   "models": [{"name": "m", "source": "/x", "task": "embedding"}]})
        router = build_app_from_config(config)
        model = model_deployment(config.models[0], config)
        for application in (router, model):
            assert _drain_s(application) > timeout_s
