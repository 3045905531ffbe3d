"""The revision a replica's answers are cached under (what the router's cache keys name)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

from serve_app.config import ModelConfig
from serve_app.replica.vllm.runtime import VLLMRuntime, runs_eager

# Part of every revision this replica reports. Bump it when a code change alters what an
# engine answers for the same weights, config and input (2: the continuous engine applies
# the model's generation_config), so cached answers of the old code are never
# served as the new code's.
ANSWERS_VERSION = 2


def answer_revision(config: ModelConfig, runtime: Any, engine_kind: Optional[str]) -> str:
    """The revision this replica's answers are cached under: ``models[].cache.revision``
    when the config pins one, else the weights' revision (``runtime.revision``: files,
    precision, quantization) extended with everything else that changes an answer: the
    engine (static, continuous and vLLM answer differently for the same weights), the
    device type (CPU and GPU kernels round differently), vLLM's own options that change
    numerics (its quantization, engine_args such as kv_cache_dtype, tensor parallelism,
    CUDA graphs), and :data:`ANSWERS_VERSION`. Two replicas that could answer one request
    differently never report the same revision, so they never share cache keys."""
    if config.cache.revision:
        return config.cache.revision
    answers: dict[str, Any] = {
        "answers": ANSWERS_VERSION,
        "engine": engine_kind,
        "device": str(runtime.device).split(":")[0],  # the type: cuda:0 and cuda:1 answer alike
    }
    if isinstance(runtime, VLLMRuntime):
        vllm = config.vllm
        answers["vllm"] = {"engine_args": vllm.engine_args, "tensor_parallel_size": vllm.tensor_parallel_size,
                           "enforce_eager": runs_eager(config), "quantization": config.quantization}
    digest = hashlib.sha256(json.dumps(answers, sort_keys=True, default=str).encode()).hexdigest()[:12]
    return f"{runtime.revision}-{engine_kind or 'encoder'}-{digest}"
