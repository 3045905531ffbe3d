"""``serve run`` on a local Ray whose Prometheus endpoint is on a known port.

    python -m serve_app.launch deployments/local.yaml --metrics-export-port 8080

Plain ``serve run`` starts a local Ray with a random metrics port and Ray Serve's classic
Python proxy. This starts the same local Ray with the port pinned and Ray Serve's
high-throughput mode on (HAProxy as the ingress; see :mod:`serve_app.ray_env`), then hands
over to ``serve run`` itself, which reuses a Ray that is already running; other
``serve run`` options pass through. ``--classic-proxy`` (or SERVE_APP_HIGH_THROUGHPUT=0)
keeps the classic proxy. On a cluster, cluster.yaml's ``ray start`` commands do the same.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from serve_app.ray_env import apply_ray_env, high_throughput_active


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a Serve config file, e.g. deployments/local.yaml")
    parser.add_argument("--metrics-export-port", type=int, default=8080, help="Prometheus endpoint port (default 8080)")
    parser.add_argument("--classic-proxy", action="store_true",
                        help="Ray Serve's classic Python proxy instead of its high-throughput HAProxy ingress")
    args, serve_run_args = parser.parse_known_args(argv)

    # Ray 2.60 turns on token auth for local clusters; the local demo runs without it.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Before ray is imported: Ray Serve reads these once, and ray.init hands them on.
    ray_env = apply_ray_env(enabled=False if args.classic_proxy else None)
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.scripts import cli

    ray.init(namespace=SERVE_NAMESPACE, _metrics_export_port=args.metrics_export_port)

    def stop(signum, frame) -> None:
        # `kill <pid>`: shut Serve and the local Ray down here, as Ctrl-C does through
        # `serve run`; otherwise Ray's own handler exits and leaves its processes behind.
        print(f"signal {signum}: shutting down Serve and the local Ray", flush=True)
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    ingress = "HAProxy (high-throughput mode)" if high_throughput_active() else "Ray's classic proxy"
    print(f"Prometheus metrics: http://127.0.0.1:{args.metrics_export_port}/metrics; ingress: {ingress} "
          f"({', '.join(f'{k}={v}' for k, v in ray_env.items())})", flush=True)
    try:
        cli.main(["run", args.config, *serve_run_args], prog_name="serve", standalone_mode=False)
    except KeyboardInterrupt:
        pass
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
