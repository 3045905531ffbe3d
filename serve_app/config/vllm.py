"""The ``vllm:`` section of a model: vLLM engine options, for models that run on vLLM
(``engine: vllm``, or ``auto`` where vLLM is installed and supports the model)."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import Field, field_validator

from serve_app.config.base import _Section

# Engine arguments that config fields (these, or the model's precision, source and
# batching) already set; engine_args must not set them a second way.
_OWNED_ENGINE_ARGS = frozenset({
    "model", "tokenizer", "dtype", "revision", "trust_remote_code", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill", "gpu_memory_utilization",
    "tensor_parallel_size", "enforce_eager", "runner", "disable_log_stats", "seed", "quantization",
})


class VLLMConfig(_Section):
    """vLLM engine options. The model's ``precision`` is vLLM's dtype; its ``source``
    (resolved to a local directory) is vLLM's model."""

    max_model_len: Optional[int] = Field(
        None, ge=16, description="Context window the engine serves, in tokens (prompt + output); default: the model's.",
    )
    max_num_seqs: Optional[int] = Field(
        None, ge=1, description="Most sequences one engine step runs (vLLM's batch size); default: batching.max_batch_size.",
    )
    max_num_batched_tokens: Optional[int] = Field(
        None, ge=16, description="Most tokens one engine step schedules (prefill chunks + decodes); default: vLLM's.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV cache of a prompt prefix already seen (a shared system prompt is computed "
        "once). Generation only: encoder (embedding) models keep no KV cache.",
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts into chunks scheduled beside running decodes, so they do not stall "
        "them. Generation only.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Share of each GPU's memory the engine may take (weights + KV cache); GPU only.",
    )
    cpu_kv_cache_gib: int = Field(
        1, ge=1, description="KV cache size on CPU, in GiB (VLLM_CPU_KVCACHE_SPACE); CPU only.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="GPUs one replica shards the model over; resources.num_gpus must equal it. "
        "Ray places the shards with a placement group on one node.",
    )
    enforce_eager: Optional[bool] = Field(
        None,
        description="Skip torch.compile and CUDA graphs: a faster start, slower steps where compiling pays. Default "
        "(null): eager for embedding models on a CPU, where the compiled graph embedded no faster (python -m "
        "benchmarks.tools.compile_modes: MiniLM's engine started warm in 12 s instead of 16 s and cold in 24 s "
        "instead of 47 s on 2 AMD EPYC cores, at 58/s either way), compiled for text generation (there it decoded "
        "one stream 1.3-1.6x as fast) and on GPUs.",
    )
    aot_compile: Optional[bool] = Field(
        None,
        description="CPU only: keep vLLM's AOT compile artifact and load it on later starts (serve_app's vLLM plugin "
        "makes it load), which skips dynamo's tracing too; false: inductor's own caches, dynamo traces again. Default "
        "(null): on, except for text generation on a CPU with AMX tiles, where the AOT graph decodes about 25% "
        "slower (python -m benchmarks.tools.compile_modes: a batch of 16 at 510 instead of 690 tokens/s on 2 Xeon "
        "cores). Without AMX it decodes as fast within noise and SmolLM2's engine starts warm in 14 s instead of 23 s "
        "(2 AMD EPYC cores).",
    )
    compile_cache_dir: Optional[str] = Field(
        None,
        description="Where vLLM keeps its caches (VLLM_CACHE_ROOT), compiled kernels included "
        "(inductor's caches under <dir>/inductor on CPU). A replica whose cache is filled skips compiling: on "
        "2 CPU cores SmolLM2's engine starts in 21 s instead of 83 s (13 s with aot_compile). Default: vLLM's "
        "(~/.cache/vllm). On Kubernetes, a volume shared by the pods (or baked into the image) keeps it across pods.",
    )
    stream_interval_s: float = Field(
        0.05, ge=0.0, le=1.0,
        description="A stream's text produced within this interval travels to the router as one event (its first "
        "token at once): fewer messages per token, so more tokens/s on the same CPUs, as Ray Serve LLM batches "
        "streams every 50 ms. 0 sends every engine step's tokens as they come.",
    )
    tool_parser: Optional[str] = Field(
        None, description="vLLM's parser of the model's own tool-call format, for tool_choice auto "
        "(vllm.tool_parsers: hermes for Qwen2.5 and Hermes, llama3_json for Llama 3.1+, mistral, pythonic, ...). "
        "Without one, tool_choice auto is a 400; required and a named function work on any model (the output "
        "is constrained to the functions' schemas).",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other vLLM engine argument (AsyncEngineArgs), passed as given, e.g. "
        "{kv_cache_dtype: fp8}. Checked by vLLM when the replica starts. (Quantization is the model's "
        "`quantization`.)",
    )

    @field_validator("engine_args")
    @classmethod
    def _no_second_way(cls, value: dict[str, Any]) -> dict[str, Any]:
        doubled = sorted(set(value) & _OWNED_ENGINE_ARGS)
        if doubled:
            raise ValueError(
                f"engine_args sets {', '.join(doubled)}, which the model's own fields set "
                "(source, precision, batching, or this section's fields); set them there instead"
            )
        return value
