"""deployments/gpu-cluster.yaml parses with the project's config, and its models run on
vLLM the way the cluster can hold them: LLMs and embeddings on vLLM in bf16, tensor
parallelism where a model needs it with num_gpus equal, memory shares that fit a shared
GPU. Also: benchmarks/tools/gpu_check.sh is valid bash. No Ray, no GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from serve_app.config import parse_app_config

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_DEPLOYMENT = REPO_ROOT / "deployments" / "gpu-cluster.yaml"
CLUSTER_YAML = REPO_ROOT / "cluster.yaml"
GPU_CHECK = REPO_ROOT / "benchmarks" / "tools" / "gpu_check.sh"


@pytest.fixture(scope="module")
def config():
    (application,) = yaml.safe_load(GPU_DEPLOYMENT.read_text())["applications"]
    return parse_app_config(application["args"])


# Accelerator types whose GPUs compute bf16 (Ampere and later), where precision auto is bf16.
BF16_GPUS = {"A10G", "A100", "L4", "L40S", "H100", "H200"}


def test_precision_auto_is_bf16_on_every_gpu_node_type_of_the_cluster():
    nodes = yaml.safe_load(CLUSTER_YAML.read_text())["available_node_types"]
    accelerators = {key.split(":", 1)[1] for node in nodes.values() for key in node["resources"]
                    if key.startswith("accelerator_type:")}
    assert accelerators and accelerators <= BF16_GPUS, accelerators


def test_llms_and_embeddings_run_on_vllm_in_bf16(config):
    generation = [m for m in config.models if m.task == "text-generation"]
    embedding = [m for m in config.models if m.task == "embedding"]
    assert generation and embedding
    for model in generation + embedding:
        assert model.engine == "vllm", f"{model.name}: engine {model.engine}"
        assert model.precision == "auto", model.name  # bf16 on the GPUs below
        assert model.device == "cuda" and model.resources.num_gpus > 0, model.name
        assert model.vllm.max_model_len, f"{model.name}: set vllm.max_model_len (the default is the model's, often 32k+)"
    for model in generation:
        assert model.vllm.enable_prefix_caching, f"{model.name}: chat prompts share prefixes"
    for model in config.models:
        if model.task not in ("text-generation", "embedding"):
            assert model.engine != "vllm", model.name


def test_tensor_parallelism_where_a_model_needs_it(config):
    sharded = [m for m in config.models if m.vllm.tensor_parallel_size > 1]
    assert sharded, "some LLM should shard over several GPUs (vllm.tensor_parallel_size > 1)"
    cluster = yaml.safe_load(CLUSTER_YAML.read_text())
    nodes = cluster["available_node_types"]
    for model in sharded:
        tp = model.vllm.tensor_parallel_size
        assert model.resources.num_gpus == tp, model.name
        # The shards of one replica sit on one node (a placement group): some node type
        # of the pinned accelerator must have that many GPUs.
        fits = [name for name, node in nodes.items() if node["resources"].get("GPU", 0) >= tp
                and (model.resources.accelerator_type is None
                     or f"accelerator_type:{model.resources.accelerator_type}" in node["resources"])]
        assert fits, f"{model.name}: no node type has {tp} {model.resources.accelerator_type} GPUs"


def test_vllm_memory_share_fits_a_shared_gpu(config):
    """vLLM takes gpu_memory_utilization of each GPU it sees; a replica holding a fraction
    of a GPU must ask for no more than that fraction, or it starves its neighbours."""
    for model in config.models:
        if model.engine == "vllm" and model.resources.num_gpus < 1:
            assert model.vllm.gpu_memory_utilization <= model.resources.num_gpus, (
                f"{model.name}: gpu_memory_utilization {model.vllm.gpu_memory_utilization} on "
                f"num_gpus {model.resources.num_gpus}")


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_script_is_valid_bash():
    text = GPU_CHECK.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)
