"""Session-wide fixtures: tiny offline models, built once per test session.

Nothing in the tests may reach a model hub, so HF_HUB_OFFLINE is set before anything
imports huggingface_hub or transformers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# tiny_models lives next to this file; make it importable whatever the import mode.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from benchmarks.harness.processes import free_ports  # noqa: E402
from serve_app.ray_env import apply_ray_env, shorten_ingress_drain  # noqa: E402

# Ray Serve as `make serve` runs it: the high-throughput ingress (HAProxy) unless
# SERVE_APP_HIGH_THROUGHPUT=0. Ray reads the variables when ray.serve is first imported
# and hands them to the processes ray.init starts, so they go in before any test module.
apply_ray_env()
# An app deleted (every extra app a test deploys, every benchmark scenario) or a Router
# replaced kept its Router reachable for Ray's 30 s drain window, meant for load balancers
# outside the cluster; the session has none but its own HAProxy, which reloads within it.
shorten_ingress_drain()
# HAProxy's exporter, its stats page and Serve's fallback proxy bind fixed ports on all
# interfaces (9101, 8404, 8500, 9500): a second Ray on this machine (a `make serve`, another
# test session) would make HAProxy exit at start. The session takes free ones instead,
# from outside the ports the kernel and Ray hand out, which Ray's own processes could take
# before HAProxy binds them.
_PORT_VARIABLES = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                   "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")
for _port_variable, _port in zip(_PORT_VARIABLES, free_ports(len(_PORT_VARIABLES))):
    os.environ.setdefault(_port_variable, str(_port))

import pytest  # noqa: E402

import tiny_models  # noqa: E402

pytest_plugins = ["redis_fixture"]


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: loads a real packaged model (tens of seconds)")


@pytest.fixture(scope="session")
def tiny_bert_embedding_dir(tmp_path_factory) -> Path:
    """A tiny random BERT for the embedding task (max 64 tokens, MiniLM vocabulary)."""
    if tiny_models.minilm_model_dir() is None:
        pytest.skip(f"{tiny_models.MINILM_PACKAGE} is not installed (its tokenizer files are needed)")
    return tiny_models.build_tiny_bert(tmp_path_factory.mktemp("tiny_bert_embedding"), task="embedding")


@pytest.fixture(scope="session")
def tiny_bert_classifier_dir(tmp_path_factory) -> Path:
    """A tiny random BERT sequence classifier with labels ("negative", "positive")."""
    if tiny_models.minilm_model_dir() is None:
        pytest.skip(f"{tiny_models.MINILM_PACKAGE} is not installed (its tokenizer files are needed)")
    return tiny_models.build_tiny_bert(tmp_path_factory.mktemp("tiny_bert_classifier"), task="text-classification")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama causal LM (max 128 positions) with a ChatML chat template."""
    return tiny_models.build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_llama_vllm_dir(tmp_path_factory) -> Path:
    """The tiny llama with heads wide enough for vLLM's CPU attention kernels (head_dim 64)."""
    return tiny_models.build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_vllm"), head_dim=64)


@pytest.fixture(scope="session")
def tiny_lora_dir(tiny_llama_vllm_dir, tmp_path_factory) -> Path:
    """A LoRA adapter of the vLLM tiny llama, trained to answer tiny_models.LORA_ANSWER."""
    pytest.importorskip("peft")
    return tiny_models.build_tiny_lora(tiny_llama_vllm_dir, tmp_path_factory.mktemp("tiny_lora"))


@pytest.fixture(scope="session")
def tiny_llama_no_chat_dir(tmp_path_factory) -> Path:
    """The tiny Llama without a chat template."""
    return tiny_models.build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_no_chat"), chat_template=False)


@pytest.fixture(scope="session")
def tiny_vit_dir(tmp_path_factory) -> Path:
    """A tiny random ViT image classifier (32x32 images) with labels ("cat", "dog", "bird")."""
    return tiny_models.build_tiny_vit(tmp_path_factory.mktemp("tiny_vit"))


@pytest.fixture(scope="session")
def minilm_package_available() -> bool:
    return tiny_models.minilm_model_dir() is not None


@pytest.fixture(scope="session")
def smollm_package_available() -> bool:
    return tiny_models.smollm_gguf_file() is not None
