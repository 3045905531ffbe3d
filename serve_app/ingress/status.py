"""The operator's view from the ingress: /healthz and /v1/stats.

Deployment states come from the Serve controller, read at most every few seconds
(load balancers call /healthz often); per-model figures come from this router's own
traffic, the model replica that answers the stats call, and the response cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from ray import serve

from serve_app.config import ModelConfig, model_deployment_name
from serve_app.core.errors import ServeAppError
from serve_app.core.shared_tasks import start_shared
from serve_app.ingress.middleware import Traffic
from serve_app.ingress.model_client import ModelClient
from serve_app.ingress.response_cache import ResponseCache

logger = logging.getLogger("ray.serve")

# How stale the controller's view of the model deployments may be in /healthz and stats.
_STATES_MAX_AGE_S = 5.0
# How long a probe waits for the controller's answer before it answers from the last one.
_READ_TIMEOUT_S = 5.0
# Deployment statuses in which a model may not serve.
_FAILING = ("DEPLOY_FAILED", "UNHEALTHY")


class ServiceStatus:
    def __init__(self, models: dict[str, ModelConfig], client: ModelClient, cache: ResponseCache):
        self.models = models
        self.client = client
        self.cache = cache
        self._states: tuple[dict[str, dict], float] = ({}, float("-inf"))
        self._states_read = False  # whether the controller has answered once
        # The one read of the controller in progress. serve.status blocks a thread until
        # the controller answers; a probe that times out leaves it running, so later
        # probes wait on the same read instead of starting a thread each.
        self._reading: Optional[asyncio.Future] = None

    async def health(self) -> tuple[int, dict]:
        """The status code and body of /healthz: readiness that means ready.

        - 503 "starting" while a model has no replica ready yet, listing those models
          under "starting". A replica is ready once it answered its warm-up calls (Serve
          runs them in the replica's first health check, before it counts the replica
          RUNNING), so a load balancer or a Kubernetes readiness probe sends nothing here
          while a model is still loading or compiling.
        - 200 "ok" once every model has a ready replica.
        - 200 "degraded" when a model's deployment cannot serve (it failed to load, or
          has no healthy replica), listed with its status; the other models keep
          serving, so a load balancer should not pull this ingress for it.

        /healthz is public (no API key), so it says no more than that: Serve's message
        (a load error's text, with file paths and tracebacks) is logged when it changes
        and shown on the admin-only /v1/stats."""
        states = await self.deployment_states()
        unavailable = {
            name: {"status": state["status"], "running": state["running"]}
            for name, state in states.items()
            if state["status"] in _FAILING and not state["running"]
        }
        # A model missing from a read of the controller has no deployment yet: starting too.
        starting = sorted(name for name in self.models if name not in unavailable and self._states_read
                          and not (states.get(name) or {}).get("running"))
        status = "starting" if starting else "degraded" if unavailable else "ok"
        body: dict[str, Any] = {"status": status, "models": sorted(self.models)}
        if starting:
            body["starting"] = starting
        if unavailable:
            body["unavailable"] = unavailable
        return (503 if starting else 200), body

    async def stats(self, traffic: Traffic) -> dict:
        """Per model: the last minute at a glance (requests, latency, batching, cache,
        replicas), then the cumulative batching counters of the replica that answered."""
        names = list(self.models)
        # A model that cannot answer (it failed to load) gets its error, not a failed page.
        snapshots, states, cache = await asyncio.gather(
            asyncio.gather(*(self.client.stats(self.models[n]) for n in names), return_exceptions=True),
            self.deployment_states(),
            self.cache.stats(),
        )
        models = {}
        for name, snapshot in zip(names, snapshots):
            if isinstance(snapshot, BaseException):
                error = snapshot if isinstance(snapshot, ServeAppError) else None
                snapshot = {"error": error.message if error else f"stats unavailable: {type(snapshot).__name__}"}
            batching = snapshot.pop("last_minute", None) or {}
            state: Optional[dict] = states.get(name)
            models[name] = {
                "last_minute": {
                    **traffic.summary(name),
                    "mean_batch_rows": batching.get("mean_batch_rows"),
                    "padding_efficiency": batching.get("padding_efficiency"),
                    "p95_queue_wait_s": batching.get("p95_queue_wait_s"),
                    "replicas": state["running"] if state else None,
                },
                # Serve's own words (why a deployment failed): for operators only, as
                # /v1/stats needs an admin key when auth is on; /healthz never shows them.
                "deployment": {"status": state["status"], "message": state["message"]} if state else None,
                # This router replica's gathering of the model's calls (None: each call alone).
                "gathering": self.client.gathering(name),
                **snapshot,
            }
        return {
            "scope": "last_minute: this router replica's requests and one model replica's batches",
            "models": models,
            "replica_retries": dict(self.client.replica_retries),
            "cache": cache,
        }

    async def deployment_states(self) -> dict[str, dict]:
        """Per model: its deployment's status, RUNNING replicas and Serve's message,
        read from the controller at most every few seconds (health checks call this)."""
        now = time.monotonic()
        cached, read_at = self._states
        if now - read_at < _STATES_MAX_AGE_S:
            return cached
        try:
            app = serve.get_replica_context().app_name
            if self._reading is None:
                self._reading = start_shared(asyncio.to_thread(serve.status))
            reading = self._reading
            try:
                status = await asyncio.wait_for(asyncio.shield(reading), timeout=_READ_TIMEOUT_S)
            finally:
                if reading.done() and self._reading is reading:  # taken (or failed): the next probe reads anew
                    self._reading = None
            deployments = status.applications[app].deployments
        except Exception:  # health and stats must answer even when the controller is slow
            logger.debug("could not read deployment states", exc_info=True)
            return cached
        states = {}
        for name in self.models:
            deployment = deployments.get(model_deployment_name(name))
            if deployment is not None:
                states[name] = {
                    "status": str(getattr(deployment.status, "value", deployment.status)),
                    "running": deployment.replica_states.get("RUNNING", 0),
                    "message": deployment.message,
                }
                previous = cached.get(name)
                if deployment.message and (previous is None or previous["message"] != deployment.message):
                    # Once per change, not per health check: the details /healthz leaves out.
                    failing = states[name]["status"] in _FAILING
                    logger.log(logging.WARNING if failing else logging.INFO, "model %s deployment is %s: %s",
                               name, states[name]["status"], deployment.message)
        self._states = (states, now)
        self._states_read = True
        return states
