"""The KubeRay RayService manifest: current with gpu-cluster.yaml, valid against the
RayService CRD schema (ray.io/v1), and serving an application our config accepts. No
cluster needed."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from serve_app import kuberay
from serve_app.config import AppConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "kuberay"
SHARED_CRD = kuberay.ROOT.parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads((DATA / "rayservice-v1.schema.json").read_text())


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load(kuberay.MANIFEST.read_text())


def _errors(schema: dict, document: dict) -> list[str]:
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_committed_manifest_is_rendered_from_gpu_cluster_yaml():
    assert kuberay.MANIFEST.read_text() == kuberay.render(), (
        "deployments/kuberay/rayservice.yaml is stale: run `python -m serve_app.kuberay --write`")


def test_the_manifest_satisfies_the_rayservice_crd_schema(schema, manifest):
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    assert _errors(schema, manifest) == []


@pytest.mark.parametrize("break_it, where", [
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(maxReplicas="four"), "maxReplicas"),
    (lambda m: m["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
    (lambda m: m["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("name"),
     "name"),
    (lambda m: m["spec"].update(serveConfigV2={"applications": []}), "serveConfigV2"),
])
def test_the_schema_check_catches_a_broken_manifest(schema, manifest, break_it, where):
    broken = copy.deepcopy(manifest)
    break_it(broken)
    errors = _errors(schema, broken)
    assert errors and any(where in e for e in errors), errors


def test_serve_config_v2_is_gpu_cluster_yaml_and_our_config_accepts_it(manifest):
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert served == yaml.safe_load(kuberay.SERVE_CONFIG.read_text())
    for app in served["applications"]:
        assert app["import_path"] == "serve_app.app:build_app"
        AppConfig.model_validate(app["args"])


def test_gpu_pods_are_autoscaled_from_zero_and_pinned_like_cluster_yaml(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    launcher = yaml.safe_load((kuberay.ROOT / "cluster.yaml").read_text())["available_node_types"]
    for name, node_type in (("gpu-4x-a10g", "gpu_4x_a10g"), ("gpu-8x-a100", "gpu_8x_a100")):
        group, resources = groups[name], launcher[node_type]["resources"]
        assert group["minReplicas"] == 0 and group["maxReplicas"] == launcher[node_type]["max_workers"]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == resources["GPU"] and int(limits["cpu"]) == resources["CPU"]
        accelerator = next(k.split(":")[1] for k in resources if k.startswith("accelerator_type:"))
        assert accelerator in group["rayStartParams"]["resources"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"  # routers and caches only: GPU pods can go
    # Every pod gets the settings gpu-cluster.yaml reads from the environment.
    for spec in [head["template"]["spec"]] + [g["template"]["spec"] for g in groups.values()]:
        names = {e["name"] for e in spec["containers"][0]["env"]}
        assert {"SERVE_APP_API_KEYS", "SERVE_APP_ADMIN_KEYS", "SERVE_APP_REDIS_URL"} <= names
        # Ray Serve's high-throughput mode on every Ray process, as make serve runs it.
        values = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert values["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and values["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


@pytest.mark.skipif(not SHARED_CRD.is_file(), reason=f"the full CRD is not beside the repository ({SHARED_CRD})")
def test_the_kept_schema_is_the_crds_v1_schema(schema):
    crd = yaml.safe_load(SHARED_CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["schema"]["openAPIV3Schema"] == schema


def test_the_image_installs_the_versions_cluster_yaml_installs():
    import re

    dockerfile = (kuberay.MANIFEST.parent / "Dockerfile").read_text()
    cluster = (kuberay.ROOT / "cluster.yaml").read_text()
    for package in ("torch", "vllm"):
        pins = {re.search(rf'"{package}==([^"]+)"', text).group(1) for text in (dockerfile, cluster)}
        assert len(pins) == 1, f"{package}: Dockerfile and cluster.yaml pin {pins}"
    assert f"rayproject/ray:{kuberay.RAY_VERSION}-" in dockerfile
