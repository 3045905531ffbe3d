"""Which quantized formats vLLM serves where, read from the checkpoint, and what config
and the replica's engine arguments make of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serve_app.config import ConfigError, ModelConfig, parse_app_config
from serve_app.core.models import checkpoint_formats
from serve_app.core.models.checkpoint_formats import (
    VLLM_FORMATS,
    check_checkpoint_matches,
    check_vllm_format,
    checkpoint_format,
)
from serve_app.replica.vllm.runtime import engine_args


def _model_dir(path: Path, quantization_config: dict | None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"]}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return path


def _compressed(weights: dict, activations: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}}


W8A8 = _compressed({"num_bits": 8, "type": "int", "strategy": "channel"},
                   {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True})
W4A16 = _compressed({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 64})


@pytest.mark.parametrize("quantization_config, expected", [
    (None, "none"),
    (W8A8, "w8a8"),
    (W4A16, "w4a16"),
    (_compressed({"num_bits": 8, "type": "float"}, {"num_bits": 8, "type": "float"}), "fp8"),
    ({"quant_method": "awq", "bits": 4}, "awq"),
    ({"quant_method": "gptq", "bits": 4}, "gptq"),
    ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
])
def test_the_format_is_read_from_the_checkpoints_config(tmp_path, quantization_config, expected):
    assert checkpoint_format(_model_dir(tmp_path / "m", quantization_config)) == expected


def test_fp8_runs_on_a_cpu_only_with_amx_tiles_and_the_refusal_names_format_and_device():
    check_vllm_format("fp8", "cuda", flags=set())
    check_vllm_format("fp8", "cpu", flags={"avx512f", "amx_tile"})
    with pytest.raises(ValueError, match="quantization fp8 does not run on this CPU.*amx_tile.*use w8a8 or w4a16"):
        check_vllm_format("fp8", "cpu", flags={"avx512f", "avx512_vnni"})
    for fmt in ("w8a8", "w4a16", "awq", "gptq"):  # vLLM's CPU build runs each on any x86 CPU it supports
        check_vllm_format(fmt, "cpu", flags=set())


def test_a_config_asking_the_cpu_for_fp8_fails_naming_format_and_device(monkeypatch):
    monkeypatch.setattr(checkpoint_formats, "cpu_flags", lambda: {"avx2", "avx512f"})
    args = {"models": [{"name": "m", "source": "/x", "task": "text-generation", "quantization": "fp8"}]}
    with pytest.raises(ConfigError, match=r"model 'm' on CPU \(device auto, resources.num_gpus 0.0\): "
                                          r"quantization fp8 does not run on this CPU"):
        parse_app_config(args)
    # With a GPU it is fine, and it names the engine it needs.
    args["models"][0]["resources"] = {"num_gpus": 1}
    assert parse_app_config(args).models[0].engine == "vllm"


def test_a_vllm_format_sets_engine_vllm_and_every_format_is_in_the_config():
    config = ModelConfig.model_validate({"name": "m", "source": "/x", "task": "embedding", "quantization": "w8a8"})
    assert config.engine == "vllm"
    field = ModelConfig.model_fields["quantization"]
    assert all(fmt in str(field.annotation) for fmt in VLLM_FORMATS)


def _config(**extra) -> ModelConfig:
    return ModelConfig.model_validate({"name": "m", "source": "/x", "task": "text-generation", "precision": "bf16",
                                       **extra})


def test_a_checkpoint_in_the_configured_format_is_served_as_it_is(tmp_path):
    model_dir = _model_dir(tmp_path / "w8a8", W8A8)
    args = engine_args(_config(quantization="w8a8"), model_dir)
    assert "quantization" not in args  # vLLM reads it from config.json
    assert check_checkpoint_matches("w8a8", model_dir) is None


def test_a_checkpoint_in_another_format_is_refused_saying_how_to_write_the_right_one(tmp_path):
    plain = _model_dir(tmp_path / "plain", None)
    with pytest.raises(ValueError, match="model 'm': quantization is w8a8 but the source holds none weights; "
                                         "write one with python -m serve_app.optimize quantize --format w8a8"):
        engine_args(_config(quantization="w8a8"), plain)
    with pytest.raises(ValueError, match="quantization is w4a16 but the source holds w8a8 weights.*"
                                         "set quantization: w8a8"):
        engine_args(_config(quantization="w4a16"), _model_dir(tmp_path / "w8a8", W8A8))


def test_fp8_on_a_full_precision_source_is_quantized_by_vllm_at_load(tmp_path):
    config = _config(quantization="fp8", resources={"num_gpus": 1})
    assert engine_args(config, _model_dir(tmp_path / "plain", None))["quantization"] == "fp8"
