"""ModelServer: one Ray Serve deployment per configured model.

It only adapts calls to the model code. The router sends one typed call
(:mod:`serve_app.core.calls`) per request to :meth:`ModelServer.infer` (or
:meth:`ModelServer.infer_stream`). Each input of an embedding or classification call
becomes one row in a ``@serve.batch`` queue (the admission window: wait timeout, row
and token caps). The admitted rows run when the model is free, merged with any others
waiting (``core.executor``); each model batch is cut by ``core.batching`` into
length-sorted sub-batches, each padded only to its own longest row
(``core.static_batch``), and the results go back to their callers in arrival order. A
row whose sub-batch fails gets its exception back alone, so one bad item never fails
the others.

Generation calls go to the model's engine (``replica.engines``): the static engine
queues its rows through the same admission and executor, the continuous one batches on
its own thread. A model on vLLM (``engine: vllm``, or ``auto`` where vLLM runs it;
``replica.vllm``) has vLLM's scheduler batch its generation or embedding rows,
so they skip the admission window too. What runs each task is picked once, at load:
the runtime (vLLM or transformers), the model call of a sub-batch and the handler of
each call type the model serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

import torch
from ray import serve
from ray.serve.exceptions import RayServeException

from serve_app.config import BatchingConfig, ModelConfig
from serve_app.core.tasks import VLLM_TASKS
from serve_app.core.calls import (
    CallOutcomes,
    ClassifyCall,
    ClassifyResult,
    EmbedCall,
    EmbedResult,
    GenerateCall,
    ModelCall,
    ModelInfo,
    ModelResult,
    StreamEvent,
    answer_each,
)
from serve_app.core.errors import InvalidRequestError, ServeAppError
from serve_app.core.batching.executor import Budget, ModelPacedExecutor
from serve_app.core.models import LoadOptions, load_runtime
from serve_app.core.models.devices import resolve_device
from serve_app.core.models.sources import model_revision, resolve_source
from serve_app.core.batching.static import Row, batch_cost, expired, new_row, run_static_batch
from serve_app.metrics import BatchMetrics
from serve_app.optimize.precision_gate import replica_precision
from serve_app.replica.engines import make_engine, static_generate
from serve_app.replica.inputs import encode_each, in_image_thread, in_tokenizer_thread
from serve_app.replica.startup import StartupTimes, directory_bytes, process_started_at, warmup_calls
from serve_app.replica.revision import answer_revision
from serve_app.replica.stats import ReplicaObserver
# serve_app.replica.vllm imports vLLM itself only when a model starts on it.
from serve_app.replica.vllm.embeddings import VLLMEmbedder
from serve_app.replica.vllm.generation import VLLMEngine
from serve_app.replica.vllm.engine_process import EngineProcessServer
from serve_app.replica.vllm.runtime import (VLLMRuntime, cache_root, compile_cache_dir, runs_eager,
                                             start_engine_process_server, start_vllm, vllm_unavailable)
from serve_app.scaling import ONGOING_CALLS_METRIC, STARTUP_METRIC
from serve_app.serve_logs import start_log_flusher

logger = logging.getLogger("ray.serve")

# What each call type asks of the model, as a wrong_task error names it.
_OPERATIONS = {
    "embed": "embeddings",
    "classify_texts": "text classification",
    "classify_images": "image classification",
    "generate": "text generation",
    "generate_stream": "text generation",
}


def _operation(call: ModelCall, *, stream: bool = False) -> str:
    if isinstance(call, GenerateCall):
        return "generate_stream" if stream else "generate"
    if stream:
        raise TypeError(f"only a GenerateCall streams, not a {type(call).__name__}")
    if isinstance(call, EmbedCall):
        return "embed"
    if isinstance(call, ClassifyCall):
        return "classify_texts" if call.texts is not None else "classify_images"
    raise TypeError(f"not a model call: {type(call).__name__}")


def _payloads(rows: Sequence[Row]) -> list[Any]:
    return [row.payload for row in rows]


class _NoEngine:
    """The engine slot of a model that does not generate."""

    kind = None

    def retune(self, batching: BatchingConfig) -> None:
        pass

    def stats(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass


@serve.deployment
class ModelServer:
    def __init__(self, model_config: dict, *, runtime: Any = None, metrics: Any = None,
                 admission_window: bool = True):
        """``runtime``, ``metrics`` and ``admission_window=False`` are for tests outside
        a Serve replica: a ready runtime instead of loading one, stand-in metrics, and
        rows handed to the executor at once instead of through ``@serve.batch`` (whose
        queue needs a replica context)."""
        start_log_flusher()  # Ray buffers this replica's log lines (serve_app.serve_logs)
        self.startup = StartupTimes(process_started_at())
        self.config = ModelConfig.model_validate(model_config)
        self._metrics = metrics if metrics is not None else BatchMetrics(self.config.name)
        self.runtime = runtime if runtime is not None else self._load()
        self.batching = self.config.batching
        self.observer = ReplicaObserver(self._metrics)
        self.executor = ModelPacedExecutor(
            self._run_batch,
            budget=lambda: Budget(max_rows=self.batching.max_batch_size, max_tokens=self.batching.max_batch_tokens),
            row_tokens=lambda row: row.tokens,
            expired=expired,
        )
        self._admit_row = self._admit if admission_window else self._admit_at_once
        # Calls (not Serve requests) in progress here: one infer_many carries many calls,
        # so Serve's own count of ongoing requests undercounts the load the autoscaler
        # needs (see record_autoscaling_stats).
        self.ongoing_calls = 0
        self.engine: Any = _NoEngine()
        # Chosen once for the model's task: the model call of one sub-batch, and the
        # handler of each call type it serves (any other type is a wrong_task error).
        self._model_call: Callable[[list[Row]], list[Any]]
        self._handlers: dict[str, Callable] = {}
        if isinstance(self.runtime, VLLMRuntime):
            {"embedding": self._serve_vllm_embeddings, "text-generation": self._serve_vllm_generation}[
                self.runtime.task]()
        else:
            {
                "embedding": self._serve_embeddings,
                "text-classification": lambda: self._serve_classification("classify_texts", self._classify_texts),
                "image-classification": lambda: self._serve_classification("classify_images", self._classify_images),
                "text-generation": self._serve_generation,
            }[self.runtime.task]()
        # After the engine is chosen: the revision names the engine too (see answer_revision).
        self.revision = answer_revision(self.config, self.runtime, self.engine.kind)
        self.loaded_at = time.time()
        self._apply_batching(self.batching)

    def _wants_vllm(self) -> bool:
        """Whether the config asks for vLLM (engine: vllm) or lets auto consider it: an
        explicit transformers engine (generation.engine static or continuous) does not."""
        config = self.config
        if config.engine != "auto":
            return config.engine == "vllm"
        # A generation model that names a transformers engine has chosen it.
        return config.task in VLLM_TASKS and (config.task != "text-generation" or config.generation.engine == "auto")

    def _load(self):
        config = self.config
        torch.set_num_threads(config.effective_torch_threads())
        started = time.perf_counter()
        # First thing: the process vLLM's engine core will be forked from starts importing
        # vLLM beside the rest of this start (serve_app.replica.vllm.engine_process).
        server = start_engine_process_server(config) if self._wants_vllm() else None
        try:
            # "auto" becomes bf16 or fp32 here, on the node the replica landed on.
            # (through the quality gate: a model whose bf16 answers fall below the floor stays fp32)
            with self.startup.phase("load"):
                precision, why = replica_precision(config, resolve_device(config.device))
            logger.info("model %s: precision %s (%s)", config.name, precision, why)
            config = config.model_copy(update={"precision": precision})
            if self._wants_vllm():
                runtime = self._start_vllm(config, server)
                if runtime is not None:
                    logger.info("model %s started on vLLM in %.1fs: task=%s device=%s dtype=%s context=%d",
                                config.name, time.perf_counter() - started, runtime.task, runtime.device,
                                runtime.dtype, runtime.max_input_tokens)
                    return runtime
            with self.startup.phase("load"):
                runtime = load_runtime(LoadOptions(
                    source=config.source, task=config.task, precision=precision, device=config.device,
                    trust_remote_code=config.trust_remote_code, hub_revision=config.hub_revision,
                    quantization=config.quantization,
                ))
        except Exception as exc:
            if server is not None:
                server.stop()
            # Serve retries the start a few times, then marks only this deployment
            # DEPLOY_FAILED; the router answers 503 for this model and serves the others.
            logger.error("model %s failed to load from %s (task %s): %s: %s", config.name, config.source,
                         config.task, type(exc).__name__, exc)
            raise
        logger.info(
            "model %s loaded from %s in %.1fs: task=%s device=%s dtype=%s revision=%s context=%d threads=%d",
            config.name, config.source, time.perf_counter() - started, runtime.task, runtime.device,
            runtime.dtype, runtime.revision, runtime.max_input_tokens, torch.get_num_threads(),
        )
        return runtime

    def _start_vllm(self, config: ModelConfig, server: Optional[EngineProcessServer]):
        """vLLM's engine for the model (``config``: the replica's, its precision resolved),
        or None where ``engine: auto`` falls back to the transformers runtime (logged with
        the reason); ``engine: vllm`` raises instead. ``server``: where its engine core is
        forked from, if anywhere."""
        with self.startup.phase("load"):
            model_dir = resolve_source(config.source, hub_revision=config.hub_revision,
                                       trust_remote_code=config.trust_remote_code)
        with self.startup.phase("engine"):
            # Importing vLLM to ask it (7 s on 2 cores) is part of starting its engine.
            reason = vllm_unavailable(config, model_dir)
        if reason is not None:
            if config.engine == "vllm":
                raise ValueError(f"model {config.name!r} has engine: vllm, but {reason}; use engine: auto or transformers")
            logger.info("model %s: engine auto picked the transformers runtime: %s", config.name, reason)
            if server is not None:
                server.stop()
            return None
        logger.info("model %s: engine %s picked vLLM", config.name, config.engine)
        # The same files on vLLM answer slightly differently from the transformers
        # runtime, so its answers get their own revision in cache keys.
        revision = f"{model_revision(model_dir)}-{config.precision}-vllm"
        # The whole cache root: with AOT, vLLM keeps the artifact and inductor's kernels
        # under torch_compile_cache/; without, inductor's caches are in compile_cache_dir.
        # An eager engine compiles nothing, so its start walks no cache.
        compiles = compile_cache_dir(config) is not None and not runs_eager(config)
        cache_dir = cache_root(config) if compiles else None
        before = directory_bytes(cache_dir)
        with self.startup.phase("engine"):
            runtime = start_vllm(config, model_dir, revision, self._metrics, server)
        self.startup.engine_process = server.engine_process if server is not None else "spawned: no server"
        if cache_dir is not None:
            self.startup.compile_cache = "reused" if directory_bytes(cache_dir) == before else "filled"
        return runtime

    def _serve_vllm_generation(self) -> None:
        self.engine = VLLMEngine(self.runtime, self.observer, model_name=self.config.name,
                                 stream_interval_s=self.config.vllm.stream_interval_s)
        self._model_call = _no_static_batches
        self._handlers.update(generate=self.engine.generate, generate_stream=self.engine.stream)

    def _serve_vllm_embeddings(self) -> None:
        self.engine = VLLMEmbedder(self.runtime, self.observer)
        self._model_call = _no_static_batches
        self._handlers["embed"] = self.engine.embed

    def _serve_embeddings(self) -> None:
        runtime = self.runtime
        self._model_call = lambda rows: runtime.embed(_payloads(rows))
        self._handlers["embed"] = self._embed

    def _serve_classification(self, operation: str, handler: Callable) -> None:
        runtime = self.runtime
        # Rank every label once; each caller's top_k is cut from it afterwards.
        self._model_call = lambda rows: runtime.classify(_payloads(rows), top_k=len(runtime.labels))
        self._handlers[operation] = handler

    def _serve_generation(self) -> None:
        self.engine = make_engine(self.runtime, self.config.generation.engine, self.batching, self.observer,
                                  submit=self._submit, model_name=self.config.name)
        # Only the static engine queues rows for the executor; the continuous one never does.
        self._model_call = functools.partial(static_generate, self.runtime)
        self._handlers.update(generate=self.engine.generate, generate_stream=self.engine.stream)

    def __del__(self):
        # Serve calls this when it stops the replica, after in-flight requests drained.
        getattr(self, "engine", _NoEngine()).close()

    # ---- configuration --------------------------------------------------------

    def reconfigure(self, user_config: dict) -> None:
        """Retune batching in place (Serve calls this on a user_config change).

        ``user_config`` may name only some knobs (a ``deployments:`` override in the
        Serve config file); the rest keep the values from the model's ``batching:``.
        """
        merged = {**self.config.batching.model_dump(), **(user_config or {})}
        batching = BatchingConfig.model_validate(merged)
        self._apply_batching(batching)
        logger.info("model %s batching retuned: %s", self.config.name, batching.model_dump())

    def _apply_batching(self, batching: BatchingConfig) -> None:
        self.batching = batching
        self.engine.retune(batching)
        self._admit.set_max_batch_size(batching.max_batch_size)
        self._admit.set_batch_wait_timeout_s(batching.batch_wait_timeout_s)

    # ---- the batch queue --------------------------------------------------------

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01, batch_size_fn=batch_cost)
    async def _admit(self, rows: list[Row]) -> list[asyncio.Future]:
        # Admission only: Serve's queue gathers rows for batch_wait_timeout_s and caps
        # them by rows and tokens; the executor then runs them when the model is free,
        # merged with any other admitted rows still waiting (see core/batching/executor.py).
        # Returning at once lets Serve admit the next batch while the model runs.
        return self.executor.submit(rows)

    async def _admit_at_once(self, row: Row) -> asyncio.Future:
        return self.executor.submit([row])[0]

    def _run_batch(self, rows: list[Row]) -> list[Any]:
        results, report = run_static_batch(rows, self._model_call, self.batching, name=self.config.name)
        self.observer.batch(report)
        return results

    async def _submit(self, rows: list[Row]) -> list[Any]:
        """The rows' results through admission and the executor; raises the first row error."""
        self.observer.request()
        futures = await asyncio.gather(*(self._admit_row(row) for row in rows))
        # A cancelled caller cancels these futures; the executor then skips its rows.
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    def _handler(self, call: ModelCall, *, stream: bool = False) -> Callable:
        operation = _operation(call, stream=stream)
        handler = self._handlers.get(operation)
        if handler is None:
            raise InvalidRequestError(
                f"model {self.config.name!r} serves {self.runtime.task}, which does not support "
                f"{_OPERATIONS[operation]}",
                param="model",
                code="wrong_task",
            )
        return handler

    # ---- the API the router calls ----------------------------------------------

    async def infer(self, call: ModelCall) -> ModelResult:
        """The call's result (``call.result_type``). ``call.deadline`` (time.time()
        seconds): past it, a row still waiting for the model is dropped with a 504
        instead of being computed for nobody. The result carries this replica's revision:
        the router writes it to the cache under that revision, whatever it read under."""
        if self.startup.count_call_before_ready():  # Serve should send none (see StartupTimes)
            self._metrics.calls_before_ready.inc()
        return await self._answer(call)

    async def _answer(self, call: ModelCall) -> ModelResult:
        """:meth:`infer` without the readiness count: the warm-up's calls come here."""
        self.ongoing_calls += 1
        try:
            result = await self._handler(call)(call)
        finally:
            self.ongoing_calls -= 1
        if dataclasses.is_dataclass(result) and hasattr(result, "revision"):
            result = dataclasses.replace(result, revision=self.revision)
        return result

    async def infer_many(self, calls: Sequence[ModelCall]) -> CallOutcomes:
        """Each call's outcome, as :meth:`infer` would answer it alone: the calls run
        concurrently, so their rows batch together as if they had come one by one. One
        request through Serve instead of one per call: the router gathers concurrent
        embedding and classification calls into it, which takes 40-55% off the CPU each
        call costs the router and this replica (measured, see ingress/call_gathering.py).
        A call that fails gets its own error back; the others are unaffected."""
        return await answer_each(self.infer, calls, replica=_replica_id(), unexpected=self._unexpected)

    def _unexpected(self, outcome: BaseException) -> ServeAppError:
        # An unexpected failure travels as a plain 500 that says where to look: its type,
        # message and traceback stay in this replica's log (they may hold other requests'
        # data or internals), and only our own errors cross the handle.
        logger.error("model %s: call failed", self.config.name, exc_info=outcome)
        return ServeAppError(f"model {self.config.name!r} failed on this request; see the model replica's log",
                             code="internal_error")

    async def infer_stream(self, call: GenerateCall) -> AsyncIterator[StreamEvent]:
        """A generation, streamed: :class:`StreamDelta` events as rows produce text,
        then one :class:`StreamEnd` per row in index order. A caller that goes away
        (Serve cancels this generator) ends its rows at the next step."""
        if self.startup.count_call_before_ready():  # Serve should send none (see StartupTimes)
            self._metrics.calls_before_ready.inc()
        self.ongoing_calls += 1
        try:
            async with contextlib.aclosing(self._handler(call, stream=True)(call)) as events:
                async for event in events:
                    yield event
        finally:
            self.ongoing_calls -= 1

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (pushed with its own, only for a deployment
        that autoscales): the calls in progress here, which the daily-profile policy
        reads as this replica's load, and, once ready, how long this replica took to
        start, from which it sets its prewarm lead (serve_app.scaling)."""
        stats = {ONGOING_CALLS_METRIC: float(self.ongoing_calls)}
        if self.startup.ready_at is not None:
            stats[STARTUP_METRIC] = self.startup.total_s
        return stats

    async def check_health(self) -> None:
        """Serve's health check. The first one, which Serve awaits before it routes
        anything here, runs the warm-up (see replica/startup.py); after it, a model whose
        engine died (vLLM's engine core) fails it, and Serve replaces the replica."""
        if self.startup.ready_at is None:
            await self._warm_up()
        check = getattr(self.runtime, "check_health", None)
        if check is not None:
            await check()

    async def _warm_up(self) -> None:
        """Answer the warm-up calls through :meth:`infer`, then mark this replica ready.
        A call the model refuses (a context window shorter than the warm-up assumed) is
        logged and skipped; any other failure fails the health check, so Serve restarts
        a replica that cannot answer instead of routing to it."""
        runtime, config = self.runtime, self.config
        calls = warmup_calls(runtime.task, runtime.max_input_tokens, self.batching.max_batch_size,
                             chat=bool(getattr(getattr(runtime, "tokenizer", None), "chat_template", None)),
                             engine_ran_shapes=self.engine.kind == "vllm")
        with self.startup.phase("warmup"):
            for call in calls if config.warmup else ():
                try:
                    await self._answer(call)
                except ServeAppError as exc:
                    logger.warning("model %s: a warm-up call was refused: %s", config.name, exc.message)
        self.observer.forget_counters()  # /v1/stats counts traffic, not the warm-up
        self.startup.ready()
        self.observer.startup(self.startup)
        logger.info("model %s ready: %s", config.name, self.startup.summary())

    async def info(self) -> ModelInfo:
        runtime = self.runtime
        return ModelInfo(
            name=self.config.name,
            task=runtime.task,
            revision=self.revision,
            max_input_tokens=runtime.max_input_tokens,
            device=str(runtime.device),
            dtype=str(runtime.dtype).replace("torch.", ""),
            quantization=self.config.quantization,
            labels=tuple(getattr(runtime, "labels", None) or ()),
            engine=self.engine.kind,
            loaded_at=self.loaded_at,
        )

    async def get_stats(self) -> dict:
        stats = {"replica": _replica_id(), "batching": self.batching.model_dump(), **self.observer.snapshot(),
                 # Calls in progress here now (an infer_many counts each of its calls): 0 once
                 # the load is over, whatever its clients did (hung up, timed out).
                 "ongoing_calls": self.ongoing_calls, "startup": self.startup.snapshot()}
        engine = self.engine.stats()
        if engine is not None:
            stats["engine"] = engine
        return stats

    # ---- handlers, chosen at load --------------------------------------------------

    async def _embed(self, call: EmbedCall) -> EmbedResult:
        vectors, prompt_tokens = await self._submit_texts(call.texts, call.deadline)
        return EmbedResult(embeddings=vectors, prompt_tokens=prompt_tokens)

    async def _classify_texts(self, call: ClassifyCall) -> ClassifyResult:
        ranked, prompt_tokens = await self._submit_texts(call.texts, call.deadline)
        return ClassifyResult(rankings=[r[:call.top_k] for r in ranked], prompt_tokens=prompt_tokens)

    async def _classify_images(self, call: ClassifyCall) -> ClassifyResult:
        # Decoding and resizing take up to seconds per image: off the event loop, which
        # keeps serving the replica's other requests meanwhile.
        pixels = await in_image_thread(encode_each, self.runtime.decode, call.images, "image")
        # Every image is resized to the same shape, so each row costs the same.
        ranked = await self._submit([new_row(p, 1, self.batching, deadline=call.deadline) for p in pixels])
        return ClassifyResult(rankings=[r[:call.top_k] for r in ranked], prompt_tokens=0)

    async def _submit_texts(self, texts: Sequence[str], deadline: Optional[float]) -> tuple[list[Any], int]:
        """One row per text, tokenized; the outputs and the prompt tokens."""
        # Off the event loop: a body of megabytes of text takes long to tokenize, and
        # only then can its length be checked against the context.
        token_rows = await in_tokenizer_thread(encode_each, self.runtime.tokenize, texts, "input")
        outputs = await self._submit([new_row(ids, len(ids), self.batching, deadline=deadline) for ids in token_rows])
        return outputs, sum(len(ids) for ids in token_rows)


def _no_static_batches(rows: list[Row]) -> list[Any]:
    raise AssertionError("a model on vLLM never queues rows for the replica's executor")


def _replica_id() -> Optional[str]:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # outside a replica (tests)
        return None
