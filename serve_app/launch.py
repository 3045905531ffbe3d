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
import time

from serve_app.ray_env import apply_ray_env, high_throughput_active


def haproxy_config_dir() -> str:
    """Where Ray Serve keeps its HAProxy configs (one subdirectory per Ray cluster):
    the directory of RAY_SERVE_HAPROXY_CONFIG_FILE_LOC."""
    from ray.serve._private.constants import RAY_SERVE_HAPROXY_CONFIG_FILE_LOC

    return os.path.dirname(RAY_SERVE_HAPROXY_CONFIG_FILE_LOC)


def stale_haproxies(processes: list[tuple[int, int, list[str]]], config_dir: str) -> list[int]:
    """Pids of Ray Serve HAProxies that outlived their Ray: started with a config under
    ``config_dir`` (``haproxy ... -f <config_dir>/.../haproxy.cfg``) and no longer the child
    of Ray Serve's manager actor (``ray::HAProxyManager``), which a killed Ray (SIGKILL,
    an OOM kill, a closed terminal) leaves them without. Such a HAProxy keeps the HTTP
    and stats ports, and the next start cannot bind them.
    ``processes``: (pid, parent pid, command line) of every process."""
    commands = {pid: cmdline for pid, _, cmdline in processes}
    prefix = os.path.join(config_dir, "")
    stale = []
    for pid, ppid, cmdline in processes:
        if not cmdline or not os.path.basename(cmdline[0]).startswith("haproxy"):
            continue
        if not any(flag == "-f" and path.startswith(prefix) for flag, path in zip(cmdline, cmdline[1:])):
            continue
        parent = commands.get(ppid) or []
        if not (parent and parent[0].startswith("ray::")):
            stale.append(pid)
    return stale


def _processes() -> list[tuple[int, int, list[str]]]:
    """(pid, parent pid, command line) from /proc (Linux); empty elsewhere."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
        found.append((int(entry), ppid, cmdline))
    return found


def node_haproxies(processes: list[tuple[int, int, list[str]]], config_dir: str, node_id: str) -> list[int]:
    """Pids of the HAProxies Ray Serve runs for the Ray node ``node_id``: their config is
    ``<config_dir>/<node_id>/haproxy.cfg`` whoever their parent is now."""
    prefix = os.path.join(config_dir, node_id, "")
    return [pid for pid, _, cmdline in processes
            if cmdline and os.path.basename(cmdline[0]).startswith("haproxy")
            and any(flag == "-f" and path.startswith(prefix) for flag, path in zip(cmdline, cmdline[1:]))]


def stop_stale_haproxies() -> list[int]:
    """Stop (SIGTERM, then SIGKILL) the HAProxies an earlier, killed run left behind,
    saying which, instead of failing later on "cannot bind socket (Address in use)"."""
    stale = stale_haproxies(_processes(), haproxy_config_dir())
    for pid in stale:
        print(f"stopping a Ray Serve HAProxy that outlived its Ray (pid {pid}, config under {haproxy_config_dir()}); "
              "it would hold the HTTP and stats ports", flush=True)
        _terminate(pid)
    return stale


def stop_node_haproxies(node_id: str, *, wait_s: float = 5.0) -> list[int]:
    """After Serve's shutdown: stop this run's node's HAProxy if Serve did not. A signal to
    the whole process group (Ctrl-C, `kill -- -<pgid>`) kills the raylet at once, Serve's
    shutdown then times out, and HAProxy's manager actor lives on for tens of seconds,
    past this process, before it dies and orphans a HAProxy that holds the ports (seen here)."""
    deadline = time.monotonic() + wait_s
    while True:
        left = node_haproxies(_processes(), haproxy_config_dir(), node_id)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.2)  # Serve's own shutdown may still be stopping it
    for pid in left:
        print(f"stopping this run's HAProxy (pid {pid}), which Serve's shutdown left running", flush=True)
        _terminate(pid)
    return left


def _terminate(pid: int) -> None:
    """SIGTERM, then SIGKILL if the process is still there after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.1)
        if not os.path.exists(f"/proc/{pid}"):
            return


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

    def clear_haproxies() -> None:
        # A signal sent to the whole process group (Ctrl-C in a terminal, `kill -- -<pgid>`)
        # reaches Ray's processes too, and HAProxy's manager actor can die before Serve's
        # shutdown stops HAProxy; what it left would hold the ports until the next start.
        if high_throughput_active():
            stop_stale_haproxies()

    clear_haproxies()
    ray.init(namespace=SERVE_NAMESPACE, _metrics_export_port=args.metrics_export_port)
    node_id = ray.get_runtime_context().get_node_id()

    def shut_down_ray() -> None:
        # Serve is shut down (or its controller is gone) by now: its HAProxy has no more
        # use, so stop it before Ray, whose shutdown may not return if its raylet was killed.
        if high_throughput_active():
            stop_node_haproxies(node_id)
        ray.shutdown()
        clear_haproxies()

    def stop(signum, frame) -> None:
        # `kill <pid>`: shut Serve and the local Ray down here, as Ctrl-C does through
        # `serve run`; otherwise Ray's own handler exits and leaves its processes behind.
        print(f"signal {signum}: shutting down Serve and the local Ray", flush=True)
        try:
            serve.shutdown()
        finally:
            shut_down_ray()
            os._exit(0)

    # SIGTERM (`kill <pid>`) and SIGHUP (its terminal closed) stop everything it started,
    # HAProxy included; only SIGKILL cannot be seen, and the next start clears what it left.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    ingress = "HAProxy (high-throughput mode)" if high_throughput_active() else "Ray's classic proxy"
    print(f"Prometheus metrics: http://127.0.0.1:{args.metrics_export_port}/metrics; ingress: {ingress} "
          f"({', '.join(f'{k}={v}' for k, v in ray_env.items())})", flush=True)
    try:
        cli.main(["run", args.config, *serve_run_args], prog_name="serve", standalone_mode=False)
    except KeyboardInterrupt:
        pass
    finally:
        shut_down_ray()
    return 0


if __name__ == "__main__":
    sys.exit(main())
