"""One served model (``args.models[]``) and its batching, resources and generation sections."""

from __future__ import annotations

import math
import re
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import _Section
from serve_app.config.cache import ModelCacheConfig
from serve_app.config.vllm import VLLMConfig
from serve_app.core.models.checkpoint_formats import VLLM_FORMATS, VLLMFormat, check_vllm_format
from serve_app.core.models.quantization import Quantization, check_quantization
from serve_app.core.tasks import PRECISION_CHOICES, TASKS, VLLM_TASKS

Task = Literal[TASKS]
Precision = Literal[PRECISION_CHOICES]

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class BatchingConfig(_Section):
    """Dynamic batching knobs. They travel as the deployment's ``user_config``, so
    changing them in the YAML and redeploying retunes live replicas without a restart."""

    max_batch_size: int = Field(
        32, ge=1, le=4096, description="Most requests (rows) one batch may hold; 1 turns batching off."
    )
    max_batch_tokens: int = Field(
        8192,
        ge=1,
        description="Most tokens one batch may hold, padding included (for generation: rows x (longest "
        "prompt + largest max_tokens) for a static sub-batch, the KV cache's rows x width at its widest for "
        "the continuous engine); also the padded-token cap of each length-sorted sub-batch. Bounds memory.",
    )
    batch_wait_timeout_s: float = Field(
        0.01, ge=0.0, le=10.0, description="How long the first request of a batch waits for others, in seconds."
    )
    sub_batch_overhead_tokens: int = Field(
        32,
        ge=0,
        description="Fixed cost of one model call, in padded tokens, used when splitting a batch into "
        "length-sorted sub-batches: higher makes fewer, more padded calls. Larger on GPUs.",
    )
    length_sorting: bool = Field(
        True,
        description="Sort each batch by length into sub-batches padded to their own longest row. "
        "false pads rows in arrival order (the plain recipe; kept for benchmarks and comparison).",
    )


class ResourcesConfig(_Section):
    """What one replica of a model reserves from Ray."""

    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per replica; fractions allowed.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica; fractions share one GPU. 0 runs on CPU.")
    accelerator_type: Optional[str] = Field(
        None, description="Ray accelerator type to pin replicas to, e.g. 'A10G' or 'A100'; needs num_gpus > 0."
    )
    torch_threads: Optional[int] = Field(
        None, ge=1, description="Torch intra-op threads; default: num_cpus rounded up, so replicas do not oversubscribe cores."
    )

    @model_validator(mode="after")
    def _accelerator_needs_gpu(self) -> "ResourcesConfig":
        if self.accelerator_type and self.num_gpus <= 0:
            raise ValueError(
                f"accelerator_type is {self.accelerator_type!r} but num_gpus is {self.num_gpus}; "
                "set num_gpus > 0 or drop accelerator_type"
            )
        return self


class GenerationConfig(_Section):
    """Limits for text-generation models."""

    default_max_tokens: int = Field(64, ge=1, description="max_tokens when a request gives none.")
    max_tokens_limit: int = Field(512, ge=1, description="Largest max_tokens a request may ask for.")
    max_stop_sequences: int = Field(4, ge=0, description="Most stop strings per request (OpenAI allows 4).")
    max_choices: int = Field(8, ge=1, le=128, description="Largest n (choices per prompt) a request may ask for (vLLM engine).")
    max_top_logprobs: int = Field(
        20, ge=0, le=20, description="Most alternatives per token a request may ask for (top_logprobs; vLLM engine).")
    engine: Literal["auto", "vllm", "static", "continuous"] = Field(
        "auto",
        description="vllm: vLLM's engine (the same as the model's engine: vllm). On the transformers "
        "runtime: static: rows admitted together run as one padded generate() until the last one ends. "
        "continuous: iteration-level batching; requests join the running batch between decode steps and "
        "leave as soon as they end (batching.max_batch_size caps its rows, max_batch_tokens its KV cache, "
        "counted as its padded rows x width at the widest it can grow to). auto: vLLM where the model's engine resolves to it, else "
        "continuous where the model supports it (a plain KV cache and position_ids; not sliding-window "
        "models), else static; the generation-mixed benchmark measured continuous ahead at every load.",
    )

    @model_validator(mode="after")
    def _default_within_limit(self) -> "GenerationConfig":
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_limit "
                f"({self.max_tokens_limit}); lower the default or raise the limit"
            )
        return self


def _simple_name(kind: str, value: str) -> str:
    """A name clients put in a request's `model` field (a model's or an adapter's)."""
    if not _MODEL_NAME.match(value):
        raise ValueError(
            f"{kind} name {value!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return value


class RoutingConfig(_Section):
    """How the router spreads a model's calls over its replicas."""

    policy: Literal["auto", "prefix_affinity", "balanced"] = Field(
        "auto", description="prefix_affinity: calls sharing a prompt prefix (a system prompt) and adapter go to "
        "the replica whose prefix cache holds it (vLLM), unless its queue is imbalanced_requests longer than "
        "another's. balanced: Serve's power of two choices. auto: prefix_affinity for text-generation models that "
        "can run on vLLM with more than one replica (num_replicas > 1 or a load_profile), else balanced.",
    )
    imbalanced_requests: int = Field(
        8, ge=1, description="Prefix affinity yields to balance when the replica holding the prefix has this many "
        "more requests in flight than the least busy one.",
    )


class AdapterConfig(_Section):
    """A LoRA adapter of a model, served on the model's own replicas (vLLM's LoRA)."""

    name: str = Field(description="Name clients put in the request's `model` field to get the adapter's answers; "
                      "unique among models and adapters.")
    source: str = Field(description="A local directory in peft's layout (adapter_config.json and the adapter's "
                        "weights), on every node the model's replicas run on.")

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, value: str) -> str:
        return _simple_name("adapter", value)


class ModelConfig(_Section):
    """One served model: one ModelServer deployment."""

    name: str = Field(description="Name clients put in the request's `model` field; letters, digits, '.', '_', '-'.")
    source: str = Field(
        description="Where the weights come from: 'hf:Org/name' (hub or local HF cache; honours HF_HUB_OFFLINE), "
        "'package:python_package' (weights shipped inside an installed package) or a local directory."
    )
    task: Task = Field(description=" | ".join(TASKS) + ".")
    precision: Precision = Field(
        "auto", description="Weight and activation dtype: auto | fp32 | bf16 | fp16. 'auto' picks, on the node a "
        "replica lands on, bf16 where the GPU supports it or the CPU has bf16 matrix units (AVX-512 BF16 or AMX), "
        "else fp32 (emulated bf16 is slower than fp32); the replica logs which and why. fp16 needs a GPU.",
    )
    quantization: Literal[Quantization, VLLMFormat] = Field(
        "none",
        description="How the weights are quantized. On the transformers engines, applied at load: int8 (torchao "
        "weight-only, CPU or GPU) | int4 (torchao weight-only, groups of 32; needs precision: bf16) | bnb-8bit | "
        "bnb-4bit (bitsandbytes, GPU only, precision bf16 or fp16). On vLLM, the format of the checkpoint "
        "`source` names: w8a8 | w4a16 (written by python -m serve_app.optimize quantize --format; both run on "
        "CPU and GPU) | awq | gptq (CPU and GPU) | fp8 (GPU, or a CPU with AMX tiles; vLLM quantizes a "
        "full-precision source at load). A vLLM format sets engine: vllm. none: as the source holds them. "
        "See docs/optimize/ for measured quality and speed.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto': the GPU Ray assigned if CUDA sees one, else CPU. 'cuda' requires num_gpus > 0."
    )
    hub_revision: Optional[str] = Field(None, description="Branch, tag or commit for hf: sources.")
    trust_remote_code: bool = Field(
        False, description="Run Python code shipped with the model. Only for sources you trust."
    )
    num_replicas: Optional[int] = Field(
        None, ge=1, description="Fixed replica count (default 1); leave it out when load_profile is set."
    )
    load_profile: Optional[str] = Field(
        None, description="Name of an entry in load_profiles that scales this model by time of day and load."
    )
    max_ongoing_requests: int = Field(
        256,
        ge=1,
        description="Requests one replica accepts at once (Ray Serve); must cover max_batch_size so batches can fill.",
    )
    max_queued_requests: int = Field(
        512,
        ge=1,
        description="Requests each router replica may queue for this model once every replica holds "
        "max_ongoing_requests; past it the router answers 503 with Retry-After at once.",
    )
    max_inputs_per_request: int = Field(
        256, ge=1, description="Most inputs (texts, images, prompts) one HTTP request may carry."
    )
    top_k_limit: int = Field(20, ge=1, description="Largest top_k a classification request may ask for.")
    batching: BatchingConfig = Field(default_factory=BatchingConfig, description="Dynamic batching knobs.")
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Per-replica resources.")
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Generation limits (text-generation only)."
    )
    cache: ModelCacheConfig = Field(default_factory=ModelCacheConfig, description="How this model's answers are cached.")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        "auto",
        description="What runs the model. vllm: vLLM's engine inside each replica (text-generation and "
        "embedding; continuous batching, paged KV cache, prefix caching; n, logprobs, response_format). "
        "transformers: our runtime, batched with @serve.batch (generation.engine picks static or "
        "continuous). auto: vllm where vLLM is installed on the replica's node and supports the model "
        "(task, architecture, quantization: none), else transformers; the replica logs which and why.",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="vLLM engine options (models that run on vLLM).")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="How calls spread over replicas.")
    adapters: list[AdapterConfig] = Field(
        default_factory=list,
        description="LoRA adapters of this text-generation model, each served on its replicas through vLLM's LoRA "
        "support (sets engine: vllm): one base model in memory for many variants. On CPU, vLLM runs LoRA "
        "models eagerly (no torch.compile).",
    )
    warmup: bool = Field(
        True,
        description="Before a replica reports healthy (so before Serve routes to it), it answers warm-up calls "
        "of the lengths and batch widths it will serve, so its first real requests run at full speed (a "
        "generation model on vLLM, which ran its own step shapes while it started: one short prompt and one chat "
        "turn); its start-up (process start to ready) is logged, exported and read by the prewarm lead.",
    )

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, value: str) -> str:
        return _simple_name("model", value)

    @field_validator("source")
    @classmethod
    def _source_has_known_form(cls, value: str) -> str:
        if ":" in value.split("/")[0] and not value.startswith(("hf:", "package:")):
            raise ValueError(
                f"source {value!r} has an unknown scheme; use 'hf:Org/name', 'package:NAME' or a local directory path"
            )
        if value in ("hf:", "package:"):
            raise ValueError(f"source {value!r} names nothing after the scheme")
        return value

    @model_validator(mode="after")
    def _device_and_precision_agree(self) -> "ModelConfig":
        gpus = self.resources.num_gpus
        if self.device == "cuda" and gpus <= 0:
            raise ValueError(
                f"model {self.name!r}: device is 'cuda' but resources.num_gpus is {gpus}; "
                "set resources.num_gpus > 0 or device: auto"
            )
        if self.precision == "fp16" and (self.device == "cpu" or gpus <= 0):
            raise ValueError(
                f"model {self.name!r}: precision fp16 needs a GPU but resources.num_gpus is {gpus}; "
                "use precision: bf16 or fp32 on CPU, or give the model a GPU"
            )
        if self.max_ongoing_requests < self.batching.max_batch_size:
            raise ValueError(
                f"model {self.name!r}: max_ongoing_requests ({self.max_ongoing_requests}) is below "
                f"batching.max_batch_size ({self.batching.max_batch_size}), so batches could never fill; "
                "raise max_ongoing_requests"
            )
        return self

    @model_validator(mode="after")
    def _quantization_fits_device(self) -> "ModelConfig":
        if self.quantization == "none":  # precision alone is checked in _device_and_precision_agree
            return self
        # The device a replica will get: 'auto' finds a GPU only when the model asks Ray for one.
        on_gpu = self.device == "cuda" or (self.device == "auto" and self.resources.num_gpus > 0)
        where = "a GPU" if on_gpu else f"CPU (device {self.device}, resources.num_gpus {self.resources.num_gpus})"
        try:
            if self.quantization in VLLM_FORMATS:
                # On CPU, fp8 depends on the CPU: checked here with this machine's flags,
                # and again by the replica with its node's.
                check_vllm_format(self.quantization, "cuda" if on_gpu else "cpu")
            else:
                # "auto" is resolved on the replica's node; here it may still become bf16,
                # which every quantization accepts, and the loader checks again with what it
                # resolved to.
                precision = "bf16" if self.precision == "auto" else self.precision
                check_quantization(self.quantization, precision, "cuda" if on_gpu else "cpu")
        except ValueError as exc:
            raise ValueError(f"model {self.name!r} on {where}: {exc}") from None
        return self

    @model_validator(mode="after")
    def _one_engine(self) -> "ModelConfig":
        generation_engine = self.generation.engine
        if generation_engine == "vllm":  # the shorthand for the model's engine: vllm
            if self.engine == "transformers":
                raise ValueError(
                    f"model {self.name!r}: engine is 'transformers' but generation.engine is 'vllm'; pick one"
                )
            self.engine = "vllm"
        transformers_engine = self.engine == "transformers" or generation_engine in ("static", "continuous")
        if self.adapters:
            if transformers_engine or self.task != "text-generation":
                raise ValueError(f"model {self.name!r}: adapters are served by vLLM's LoRA support, for "
                                 "text-generation models with engine: vllm (or auto)")
            self.engine = "vllm"
        if self.quantization in VLLM_FORMATS:
            if transformers_engine:
                raise ValueError(
                    f"model {self.name!r}: quantization {self.quantization} is a checkpoint format vLLM serves, "
                    "but the model asks for a transformers engine; set engine: vllm (or auto), or use "
                    "quantization: int8 or int4 on the transformers engines"
                )
            self.engine = "vllm"
        if self.engine == "vllm" and generation_engine in ("static", "continuous"):
            raise ValueError(
                f"model {self.name!r}: engine is 'vllm' but generation.engine is {generation_engine!r}, a "
                "transformers engine; drop generation.engine or set engine: transformers"
            )
        if self.engine != "vllm":
            return self
        if self.task not in VLLM_TASKS:
            raise ValueError(
                f"model {self.name!r}: engine vllm serves {' and '.join(VLLM_TASKS)} models, not {self.task}; "
                "use engine: transformers (or auto)"
            )
        if self.quantization != "none" and self.quantization not in VLLM_FORMATS:
            raise ValueError(
                f"model {self.name!r}: quantization {self.quantization} is applied by the transformers runtime "
                f"(torchao, bitsandbytes); on vLLM serve a checkpoint in one of {', '.join(VLLM_FORMATS)} "
                "(python -m serve_app.optimize quantize --format w8a8 writes one), or set engine: transformers"
            )
        tp, gpus = self.vllm.tensor_parallel_size, self.resources.num_gpus
        if tp > 1 and gpus != tp:
            raise ValueError(
                f"model {self.name!r}: vllm.tensor_parallel_size is {tp} but resources.num_gpus is {gpus}; "
                f"one replica shards over {tp} GPUs, so set resources.num_gpus: {tp}"
            )
        return self

    def prefix_affinity(self) -> bool:
        """Whether the router routes this model's calls by prompt prefix (routing.policy)."""
        if self.routing.policy != "auto":
            return self.routing.policy == "prefix_affinity"
        several = (self.num_replicas or 1) > 1 or self.load_profile is not None
        return self.task == "text-generation" and self.engine != "transformers" and several

    def effective_torch_threads(self) -> int:
        if self.resources.torch_threads:
            return self.resources.torch_threads
        return max(1, math.ceil(self.resources.num_cpus))
