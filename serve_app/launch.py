"""``serve run`` on a local Ray whose Prometheus endpoint is on a known port.

    python -m serve_app.launch deployments/local.yaml --metrics-export-port 8080

Plain ``serve run`` starts a local Ray with a random metrics port. This starts the same
local Ray with the port pinned and then hands over to ``serve run`` itself, which reuses
a Ray that is already running; other ``serve run`` options pass through. On a cluster,
give ``ray start --head --metrics-export-port=8080`` instead (see cluster.yaml).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a Serve config file, e.g. deployments/local.yaml")
    parser.add_argument("--metrics-export-port", type=int, default=8080, help="Prometheus endpoint port (default 8080)")
    args, serve_run_args = parser.parse_known_args(argv)

    # Ray 2.60 turns on token auth for local clusters; the local demo runs without it.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.serve.scripts import cli

    ray.init(namespace=SERVE_NAMESPACE, _metrics_export_port=args.metrics_export_port)
    # `kill <pid>` stops it as Ctrl-C does: Serve shuts down, then the local Ray.
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"Prometheus metrics: http://127.0.0.1:{args.metrics_export_port}/metrics", flush=True)
    try:
        cli.main(["run", args.config, *serve_run_args], prog_name="serve", standalone_mode=False)
    except KeyboardInterrupt:
        pass
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
