"""The KubeRay RayService manifest for serve_app's GPU application.

``deployments/kuberay/rayservice.yaml`` is rendered from ``deployments/gpu-cluster.yaml``
(its ``serveConfigV2``, verbatim) and the node types of ``cluster.yaml`` (a CPU head,
4x A10G and 8x A100 worker groups that Ray's autoscaler scales from zero), so the
Kubernetes and the cluster-launcher deployments serve the same application:

    python -m serve_app.kuberay --write     # after changing gpu-cluster.yaml

``tests/unit/test_kuberay.py`` checks that the committed manifest is current and that it
satisfies the RayService CRD schema (KubeRay's ``ray.io/v1``), without a cluster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from serve_app.ray_env import HIGH_THROUGHPUT_ENV

ROOT = Path(__file__).resolve().parents[1]
SERVE_CONFIG = ROOT / "deployments" / "gpu-cluster.yaml"
MANIFEST = ROOT / "deployments" / "kuberay" / "rayservice.yaml"

RAY_VERSION = "2.60.0"
# Built from deployments/kuberay/Dockerfile (rayproject/ray GPU image + vLLM + serve_app);
# push it to your registry and set it here, or pass --image.
IMAGE = "serve-app:0.1.0"
SECRET = "serve-app"  # the Secret with the keys and addresses below (see docs/deploying.md)

_HEADER = """\
# KubeRay RayService for serve_app's GPU application. Rendered by
# `python -m serve_app.kuberay --write` from deployments/gpu-cluster.yaml (serveConfigV2)
# and cluster.yaml's node types; edit those, not this file. Apply with:
#   kubectl create secret generic serve-app --from-literal=api-keys=... \\
#     --from-literal=admin-keys=... --from-literal=redis-url=redis://redis:6379/0 \\
#     --from-literal=redis-password=... [--from-literal=hf-token=...]
#   kubectl apply -f deployments/kuberay/rayservice.yaml
"""


def _secret_env(name: str, key: str, *, optional: bool = False) -> dict:
    ref: dict[str, Any] = {"name": SECRET, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


# What every Ray container needs: the replicas' settings (gpu-cluster.yaml reads them from
# the environment) and a writable Hugging Face cache.
_ENV = [
    _secret_env("SERVE_APP_API_KEYS", "api-keys"),
    _secret_env("SERVE_APP_ADMIN_KEYS", "admin-keys"),
    _secret_env("SERVE_APP_REDIS_URL", "redis-url"),
    _secret_env("SERVE_APP_REDIS_PASSWORD", "redis-password"),
    _secret_env("HF_TOKEN", "hf-token", optional=True),  # gated models only
    # Ray Serve's high-throughput mode (serve_app/ray_env.py), read by every Ray process of
    # the pod; "0" for both on every group keeps Ray's classic proxy.
    *({"name": name, "value": value} for name, value in HIGH_THROUGHPUT_ENV.items()),
]
_CACHE_VOLUME = {"name": "hf-cache", "emptyDir": {}}
_CACHE_MOUNT = {"name": "hf-cache", "mountPath": "/home/ray/.cache/huggingface"}


def _container(name: str, image: str, cpus: int, memory: str, gpus: int, ports: list[dict]) -> dict:
    limits: dict[str, Any] = {"cpu": str(cpus), "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    container = {
        "name": name,
        "image": image,
        "env": _ENV,
        # Requests equal limits: Ray schedules by what it was told the pod has.
        "resources": {"requests": dict(limits), "limits": limits},
        "volumeMounts": [_CACHE_MOUNT],
        # Let the replicas drain their requests before the pod goes (Serve's own
        # graceful shutdown waits up to 20 s by default).
        "lifecycle": {"preStop": {"exec": {"command": ["/bin/sh", "-c", "ray stop"]}}},
    }
    if ports:
        container["ports"] = ports
    return container


def _worker_group(name: str, image: str, accelerator: str, gpus: int, cpus: int, memory: str,
                  max_replicas: int) -> dict:
    return {
        "groupName": name,
        # Scaled from zero by Ray's autoscaler as the daily profile asks for replicas.
        "replicas": 0,
        "minReplicas": 0,
        "maxReplicas": max_replicas,
        # The accelerator resource lets replicas pinned with accelerator_type land here.
        "rayStartParams": {"resources": f'"{{\\"accelerator_type:{accelerator}\\": 1}}"'},
        "template": {"spec": {
            "containers": [_container("ray-worker", image, cpus, memory, gpus, [])],
            "volumes": [_CACHE_VOLUME],
            "nodeSelector": {"nvidia.com/gpu.product": _GPU_PRODUCTS[accelerator]},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }},
    }


_GPU_PRODUCTS = {"A10G": "NVIDIA-A10G", "A100": "NVIDIA-A100-SXM4-40GB"}  # NVIDIA GPU feature discovery labels


class _Literal(str):
    """A string dumped as a YAML literal block (serveConfigV2 stays readable)."""


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data):  # every pod spells its env out: kubectl users read it
        return True


_Dumper.add_representer(_Literal, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|"))


def rayservice(serve_config: str, image: str = IMAGE) -> dict:
    """The RayService object for ``serve_config`` (a Serve config file's text)."""
    head = _container("ray-head", image, 8, "32Gi", 0, [
        {"containerPort": 6379, "name": "gcs-server"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
        {"containerPort": 8000, "name": "serve"},
        {"containerPort": 8080, "name": "metrics"},
    ])
    workers = [
        _worker_group("gpu-4x-a10g", image, "A10G", gpus=4, cpus=48, memory="180Gi", max_replicas=4),
        _worker_group("gpu-8x-a100", image, "A100", gpus=8, cpus=96, memory="1000Gi", max_replicas=2),
    ]
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "serve-app"},
        "spec": {
            # A changed rayClusterConfig starts a new cluster and moves traffic once its
            # applications are RUNNING; a changed serveConfigV2 alone updates in place
            # (Serve's rolling update, replica by replica).
            "upgradeStrategy": {"type": "NewCluster"},
            "serveConfigV2": _Literal(serve_config),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                # Ride out short dips in load; remove an idle GPU pod after 10 min (as
                # cluster.yaml's idle_timeout_minutes).
                "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 600},
                # With GCS fault tolerance a restarted head pod recovers the cluster's
                # state (actors, Serve applications) from an external Redis, and the
                # worker pods and their replicas keep serving meanwhile.
                "gcsFaultToleranceOptions": {
                    "redisAddress": "redis:6379",
                    "redisPassword": {"valueFrom": {"secretKeyRef": {"name": SECRET, "key": "redis-password"}}},
                },
                "headGroupSpec": {
                    # The head runs routers and caches only (gpu-cluster.yaml pins them to
                    # it), so GPU pods hold nothing but model replicas and can go.
                    "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
                    "template": {"spec": {"containers": [head], "volumes": [_CACHE_VOLUME]}},
                },
                "workerGroupSpecs": workers,
            },
        },
    }


def render(image: str = IMAGE) -> str:
    body = yaml.dump(rayservice(SERVE_CONFIG.read_text(), image), Dumper=_Dumper, sort_keys=False, width=100)
    return _HEADER + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {MANIFEST.relative_to(ROOT)}")
    parser.add_argument("--image", default=IMAGE, help="the serve_app image every Ray pod runs")
    args = parser.parse_args(argv)
    text = render(args.image)
    if args.write:
        MANIFEST.parent.mkdir(parents=True, exist_ok=True)
        MANIFEST.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
