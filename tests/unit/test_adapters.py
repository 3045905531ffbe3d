"""LoRA adapters: their config, how the router resolves an adapter's name, the cache key
it is part of, and what the vLLM replica makes of their directories (engine arguments,
revision, the LoRARequest of a call). vLLM serves a real adapter in
tests/integration/test_vllm_serving.py."""

from __future__ import annotations

import importlib.util
import json

import pytest

from serve_app.config import AppConfig, ConfigError, ModelConfig
from serve_app.core.cache.keys import cache_key
from serve_app.core.calls import ChatTurn, GenerateCall
from serve_app.core.errors import InvalidRequestError, ModelNotFoundError, ModelUnavailableError
from serve_app.ingress.serving import Serving
from serve_app.replica.engines import refuse_what_only_vllm_does
from serve_app.replica.vllm.adapters import adapters_revision, load_adapters, lora_engine_args, lora_request

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def _model(adapters, **extra) -> ModelConfig:
    return ModelConfig.model_validate({"name": "base", "source": "/x", "task": "text-generation",
                                       "adapters": adapters, **extra})


def _adapter_dir(path, rank: int = 4):
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    (path / "adapter_model.safetensors").write_bytes(b"weights")
    return path


def test_adapters_put_the_model_on_vllm_and_refuse_what_cannot_serve_them():
    assert _model([{"name": "support", "source": "/a"}]).engine == "vllm"
    for extra in ({"engine": "transformers"}, {"generation": {"engine": "continuous"}}, {"task": "embedding"}):
        with pytest.raises(ValueError, match="adapters are served by vLLM's LoRA support"):
            _model([{"name": "support", "source": "/a"}], **extra)
    with pytest.raises(ValueError, match="adapter name 'has space'"):
        _model([{"name": "has space", "source": "/a"}])


def test_adapter_names_are_unique_among_models_and_adapters():
    other = {"name": "other", "source": "/y", "task": "text-generation"}
    for adapters in ([{"name": "other", "source": "/a"}], [{"name": "a", "source": "/a"}, {"name": "a", "source": "/b"}]):
        with pytest.raises((ValueError, ConfigError), match="appears twice among models and their adapters"):
            AppConfig.model_validate({"models": [{"name": "base", "source": "/x", "task": "text-generation",
                                                  "adapters": adapters}, other]})


def test_the_router_answers_an_adapters_name_with_its_base_model():
    base = _model([{"name": "support", "source": "/a"}])
    embed = ModelConfig.model_validate({"name": "vectors", "source": "/e", "task": "embedding"})
    serving = Serving({"base": base, "vectors": embed}, client=None, cache=None, log_payloads=False)
    assert serving.generator("support", "/v1/chat/completions") == (base, "support")
    assert serving.generator("base", "/v1/chat/completions") == (base, None)
    with pytest.raises(ModelNotFoundError, match="'support' an adapter, served only on chat and completions"):
        serving.model("support", "embedding", "/v1/embeddings")
    with pytest.raises(ModelNotFoundError, match="serves: base, support, vectors"):
        serving.generator("nope", "/v1/chat/completions")


def test_an_adapters_answers_have_their_own_cache_keys():
    def key(adapter):
        call = GenerateCall(max_tokens=4, messages=(ChatTurn("user", "hi"),), adapter=adapter)
        return cache_key(model="base", revision="r", task="text-generation", payload=call.cache_input(),
                         params=call.cache_params())

    assert len({key(None), key("support"), key("sales")}) == 3


def test_the_transformers_engines_refuse_an_adapter_by_name():
    with pytest.raises(InvalidRequestError, match="the LoRA adapter 'support' needs the vLLM engine") as caught:
        refuse_what_only_vllm_does(GenerateCall(max_tokens=1, prompts=("a",), adapter="support"), "static")
    assert caught.value.param == "model"


def test_adapters_are_read_from_their_directories(tmp_path):
    config = _model([{"name": "support", "source": str(_adapter_dir(tmp_path / "s", rank=4))},
                     {"name": "sales", "source": str(_adapter_dir(tmp_path / "t", rank=12))}])
    adapters = load_adapters(config)
    assert [(a.name, a.rank, a.lora_id) for a in adapters.values()] == [("support", 4, 1), ("sales", 12, 2)]
    # vLLM's kernels are built for some ranks only: the smallest that holds the largest adapter.
    assert lora_engine_args(adapters) == {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
                                          "max_cpu_loras": 2}
    assert lora_engine_args({}) == {} and adapters_revision({}) == ""
    before = adapters_revision(adapters)
    (tmp_path / "t" / "adapter_model.safetensors").write_bytes(b"retrained")
    assert adapters_revision(load_adapters(config)) != before, "a retrained adapter gives new cache keys"
    missing = _model([{"name": "gone", "source": str(tmp_path / "gone")}])
    with pytest.raises(ValueError, match="adapter 'gone' at .* has no readable adapter_config.json"):
        load_adapters(missing)


@needs_vllm
def test_a_call_runs_with_its_adapters_lora_request(tmp_path):
    adapters = load_adapters(_model([{"name": "support", "source": str(_adapter_dir(tmp_path / "s"))}]))
    request = lora_request(adapters, "support")
    assert (request.lora_name, request.lora_int_id, request.lora_path) == ("support", 1, str(tmp_path / "s"))
    assert lora_request(adapters, None) is None
    with pytest.raises(ModelUnavailableError, match="not on this replica yet"):
        lora_request(adapters, "sales")
