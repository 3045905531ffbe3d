"""The startup scenario's pure parts: vLLM's server gets the engine arguments our replica
gives vLLM (checked against vLLM's own argument parser where vLLM is installed), and
the config each start deploys is the shipped model on vLLM with its own compile cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from benchmarks.harness.registry import load_all
from benchmarks.harness.service import load_models, pick_model
from benchmarks.peers.engines import vllm_cli_flags
from benchmarks.scenarios.startup import _our_config
from serve_app.config import ModelConfig
from serve_app.replica.vllm.runtime import engine_args

LOCAL_YAML = Path(__file__).resolve().parents[2] / "deployments" / "local.yaml"


def test_startup_is_registered():
    assert "startup" in load_all()


def test_flags_spell_each_kind_of_value(monkeypatch):
    monkeypatch.setattr("benchmarks.peers.engines._vllm_parser", lambda: None)  # the spelling, whether vLLM is here or not
    flags = vllm_cli_flags({"model": "/m", "dtype": "bfloat16", "max_model_len": 2048, "max_num_batched_tokens": None,
                            "enforce_eager": False, "enable_prefix_caching": True, "hf_overrides": {"a": 1}})
    assert flags == ["--dtype", "bfloat16", "--max-model-len", "2048", "--no-enforce-eager",
                     "--enable-prefix-caching", "--hf-overrides", '{"a": 1}']


@pytest.mark.parametrize("task", ["text-generation", "embedding"])
def test_our_config_is_the_shipped_model_on_vllm_with_its_own_cache(task, tmp_path):
    base = pick_model(load_models(LOCAL_YAML), task)
    config = ModelConfig.model_validate(_our_config(base, str(tmp_path)))
    assert config.engine == "vllm"
    assert config.vllm.compile_cache_dir == str(tmp_path)
    assert (config.name, config.source, config.batching.max_batch_size) == (
        base["name"], base["source"], base["batching"]["max_batch_size"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("task", ["text-generation", "embedding"])
def test_vllm_parses_the_flags_back_to_our_engine_arguments(task, tmp_path):
    from benchmarks.peers.engines import _vllm_parser

    base = pick_model(load_models(LOCAL_YAML), task)
    config = ModelConfig.model_validate({**_our_config(base, str(tmp_path)), "precision": "bf16"})
    ours = engine_args(config, tmp_path)
    parsed = vars(_vllm_parser().parse_args(["--model", str(tmp_path), *vllm_cli_flags(ours)]))
    assert {name: parsed[name] for name in ours} == ours
