"""ModelServer: one Ray Serve deployment per configured model.

It only adapts requests to the model code: each input of a request becomes one row in
a ``@serve.batch`` queue (the admission window: wait timeout, row and token caps). The
admitted rows run when the model is free, merged with any others waiting
(``core.executor``); each model batch is cut by ``core.batching`` into length-sorted
sub-batches, each padded only to its own longest row and run by ``core.runtime``; the
results go back to their callers in arrival order. A row whose sub-batch fails gets
its exception back alone, so one bad item never fails the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Sequence

import torch
from ray import serve

from serve_app.config import BatchingConfig, ModelConfig
from serve_app.core.batching import arrival_order_plan, plan_batches, scatter
from serve_app.core.continuous import ContinuousBatcher
from serve_app.core.errors import ContextLengthExceededError, DeadlineExceededError, InvalidRequestError
from serve_app.core.executor import Budget, ModelPacedExecutor
from serve_app.core.recent import RecentEvents, mean, percentile
from serve_app.core.runtime import (
    EmbeddingRuntime,
    GenerationRequest,
    GenerationResult,
    GenerationRuntime,
    ImageClassificationRuntime,
    LoadOptions,
    SamplingParams,
    TextClassificationRuntime,
    load_runtime,
)
from serve_app.metrics import BatchMetrics

logger = logging.getLogger("ray.serve")


@dataclass
class _Row:
    """One input waiting in the batch queue."""

    payload: Any  # token ids, a pixel tensor or a GenerationRequest
    tokens: int  # what this row costs the batch's token budget
    group: Any  # rows in different groups never share a model call (sampling params)
    enqueued_at: float
    # The budgets in force when the row was queued, read by _batch_cost (which Ray
    # calls with the rows alone, not the replica).
    token_budget: int
    row_budget: int
    output: Optional["_RowOutput"] = None  # generation rows: streaming and cancellation
    deadline: Optional[float] = None  # time.time() after which its caller no longer waits


class _RowOutput:
    """One generation row's link back to its request, used from the model thread.

    ``on_delta`` hands streamed text to the request's event loop (thread-safe);
    ``cancelled`` is read by the engine between decode steps, so a request that went
    away (client disconnect, deadline) stops costing compute.
    """

    def __init__(self, index: int, loop: asyncio.AbstractEventLoop, deltas: Optional[asyncio.Queue]):
        self.index = index
        self.loop = loop
        self.deltas = deltas  # None: the request does not stream
        self.cancelled = False
        self.first_token_at: Optional[float] = None  # time.monotonic()
        self.started_at: Optional[float] = None  # its model call began (static engine)
        self.engine_handle: Any = None  # continuous engine's RowHandle
        self.outcome: Optional[asyncio.Future] = None  # continuous engine: the result

    def on_delta(self, text: str) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if self.deltas is not None:
            self.loop.call_soon_threadsafe(self.deltas.put_nowait, (self.index, text))

    def on_finish(self, outcome: Any) -> None:  # the continuous engine's GenerationSink
        self.loop.call_soon_threadsafe(self._resolve, outcome)

    def _resolve(self, outcome: Any) -> None:
        if self.outcome is None or self.outcome.done():  # its request was cancelled
            return
        if isinstance(outcome, BaseException):
            self.outcome.set_exception(outcome)
        else:
            self.outcome.set_result(outcome)


def _expired(row: _Row) -> Optional[BaseException]:
    """The error for a row whose caller's deadline passed while it waited, else None."""
    if row.deadline is not None and time.time() > row.deadline:
        return DeadlineExceededError("the request's deadline passed while it waited for the model", code="timeout")
    return None


def _batch_cost(rows: Sequence[_Row]) -> int:
    """Batch size in row units that also charges tokens.

    Ray's queue closes a batch when this reaches ``max_batch_size`` (R). Rows count 1
    each, and tokens count R/T each, so the value stays <= R exactly when the batch
    has <= R rows and <= T tokens (T = max_batch_tokens). A single row longer than T
    is charged T, so it still runs, alone.
    """
    token_budget, row_budget = rows[0].token_budget, rows[0].row_budget
    tokens = sum(min(row.tokens, token_budget) for row in rows)
    return max(len(rows), math.ceil(tokens * row_budget / token_budget))


class _BatchStats:
    """Counters behind /v1/stats (read by tests and operators)."""

    def __init__(self, window: int = 256):
        self.requests = 0
        self.rows = 0
        self.batches = 0
        self.model_calls = 0
        self.real_tokens = 0
        self.padded_tokens = 0
        self.cancelled_rows = 0  # generation rows whose caller went away before the end
        self.recent_batch_rows: deque[int] = deque(maxlen=window)
        self.recent_queue_wait_s: deque[float] = deque(maxlen=window)
        # (time, rows, real tokens, padded tokens) per model batch; (time, wait) per row.
        self.last_minute_batches = RecentEvents(60.0)
        self.last_minute_waits = RecentEvents(60.0)

    def snapshot(self) -> dict:
        recent = list(self.recent_batch_rows)
        waits = sorted(self.recent_queue_wait_s)
        return {
            "requests": self.requests,
            "rows": self.rows,
            "batches": self.batches,
            "model_calls": self.model_calls,
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "cancelled_rows": self.cancelled_rows,
            "padding_efficiency": (self.real_tokens / self.padded_tokens) if self.padded_tokens else None,
            "mean_batch_rows": (sum(recent) / len(recent)) if recent else None,
            "max_batch_rows": max(recent) if recent else None,
            "p50_queue_wait_s": waits[len(waits) // 2] if waits else None,
            "last_minute": self._last_minute(),
        }

    def _last_minute(self) -> dict:
        batches = self.last_minute_batches.recent()
        waits = [wait for _, wait in self.last_minute_waits.recent()]
        real = sum(b[2] for b in batches)
        padded = sum(b[3] for b in batches)
        return {
            "batches": len(batches),
            "rows": sum(b[1] for b in batches),
            "mean_batch_rows": mean(b[1] for b in batches),
            "padding_efficiency": real / padded if padded else None,
            "p50_queue_wait_s": percentile(waits, 50),
            "p95_queue_wait_s": percentile(waits, 95),
        }


@serve.deployment
class ModelServer:
    def __init__(self, model_config: dict):
        self.config = ModelConfig.model_validate(model_config)
        torch.set_num_threads(self.config.effective_torch_threads())
        started = time.perf_counter()
        try:
            self.runtime = load_runtime(
                LoadOptions(
                    source=self.config.source,
                    task=self.config.task,
                    precision=self.config.precision,
                    device=self.config.device,
                    trust_remote_code=self.config.trust_remote_code,
                    hub_revision=self.config.hub_revision,
                    quantization=self.config.quantization,
                )
            )
        except Exception as exc:
            # Serve retries the start a few times, then marks only this deployment
            # DEPLOY_FAILED; the router answers 503 for this model and serves the others.
            logger.error("model %s failed to load from %s (task %s): %s: %s", self.config.name, self.config.source,
                         self.config.task, type(exc).__name__, exc)
            raise
        logger.info(
            "model %s loaded from %s in %.1fs: task=%s device=%s dtype=%s revision=%s context=%d threads=%d",
            self.config.name,
            self.config.source,
            time.perf_counter() - started,
            self.runtime.task,
            self.runtime.device,
            self.runtime.dtype,
            self.runtime.revision,
            self.runtime.max_input_tokens,
            torch.get_num_threads(),
        )
        self.stats = _BatchStats()
        self.metrics = BatchMetrics(self.config.name)
        self.executor = ModelPacedExecutor(
            self._run_batch,
            budget=lambda: Budget(max_rows=self.batching.max_batch_size, max_tokens=self.batching.max_batch_tokens),
            row_tokens=lambda row: row.tokens,
            expired=_expired,
        )
        # The continuous engine owns the model on its own thread; with it, generation
        # rows skip the admission window and the executor (see _submit_continuous).
        self.engine: Optional[ContinuousBatcher] = None
        engine = self.config.generation.engine
        if isinstance(self.runtime, GenerationRuntime) and engine != "static":
            batching = self.config.batching
            try:
                self.engine = ContinuousBatcher(self.runtime, max_rows=batching.max_batch_size,
                                                kv_token_budget=batching.max_batch_tokens)
            except ValueError as exc:  # a cache layout the loop cannot merge (sliding window)
                if engine == "continuous":
                    raise
                logger.warning("model %s: continuous batching unavailable (%s); using the static engine",
                               self.config.name, exc)
            else:
                self.engine.start()
        if isinstance(self.runtime, GenerationRuntime):
            logger.info("model %s generates with the %s engine", self.config.name,
                        "continuous" if self.engine is not None else "static")
        self._apply_batching(self.config.batching)

    def __del__(self):
        # Serve calls this when it stops the replica, after in-flight requests drained.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout=5)

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
        if self.engine is not None:  # read by the engine thread at its next admission
            self.engine.max_rows = batching.max_batch_size
            self.engine.kv_token_budget = batching.max_batch_tokens
        self._admit.set_max_batch_size(batching.max_batch_size)
        self._admit.set_batch_wait_timeout_s(batching.batch_wait_timeout_s)

    # ---- the batch queue --------------------------------------------------------

    def _row(self, payload: Any, tokens: int, group: Any = None, deadline: Optional[float] = None) -> _Row:
        return _Row(
            payload=payload,
            tokens=tokens,
            group=group,
            enqueued_at=time.monotonic(),
            token_budget=self.batching.max_batch_tokens,
            row_budget=self.batching.max_batch_size,
            deadline=deadline,
        )

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01, batch_size_fn=_batch_cost)
    async def _admit(self, rows: list[_Row]) -> list[asyncio.Future]:
        # Admission only: Serve's queue gathers rows for batch_wait_timeout_s and caps
        # them by rows and tokens; the executor then runs them when the model is free,
        # merged with any other admitted rows still waiting (see core/executor.py).
        # Returning at once lets Serve admit the next batch while the model runs.
        return self.executor.submit(rows)

    def _run_batch(self, rows: list[_Row]) -> list[Any]:
        now = time.monotonic()
        stats = self.stats
        stats.batches += 1
        stats.rows += len(rows)
        stats.recent_batch_rows.append(len(rows))
        waits = [now - row.enqueued_at for row in rows]
        stats.recent_queue_wait_s.extend(waits)
        for wait in waits:
            stats.last_minute_waits.add(wait, now=now)
            self.metrics.queue_wait.observe(wait)
        self.metrics.batch_rows.observe(len(rows))
        batch_real = batch_padded = batch_calls = 0

        results: list[Any] = [None] * len(rows)
        groups: dict[Any, list[int]] = {}
        for index, row in enumerate(rows):
            groups.setdefault(row.group, []).append(index)
        for group, indices in groups.items():
            group_rows = [rows[i] for i in indices]
            plan = self._plan([row.tokens for row in group_rows])
            outputs = []
            for sub_batch in plan.sub_batches:
                payloads = [group_rows[i].payload for i in sub_batch.indices]
                row_outputs = [group_rows[i].output for i in sub_batch.indices]
                try:
                    out = self._call_model(payloads, group, row_outputs)
                    if len(out) != len(payloads):
                        raise RuntimeError(
                            f"model {self.config.name} returned {len(out)} outputs for {len(payloads)} inputs"
                        )
                except Exception as exc:  # fail only the rows of this sub-batch
                    logger.exception("model %s failed on a sub-batch of %d rows", self.config.name, len(payloads))
                    out = [exc] * len(payloads)
                outputs.append(out)
            stats.model_calls += len(plan.sub_batches)
            stats.real_tokens += plan.real_tokens
            stats.padded_tokens += plan.padded_tokens
            batch_real, batch_padded = batch_real + plan.real_tokens, batch_padded + plan.padded_tokens
            batch_calls += len(plan.sub_batches)
            for sub_batch in plan.sub_batches:
                self.metrics.call_rows.observe(sub_batch.rows)
                self.metrics.call_tokens.observe(sub_batch.real_tokens)
                if sub_batch.padded_tokens:
                    self.metrics.padding_efficiency.observe(sub_batch.real_tokens / sub_batch.padded_tokens)
            for i, output in zip(indices, scatter(plan, outputs)):
                results[i] = output
        self.metrics.sub_batches.observe(batch_calls)
        self.metrics.batches.inc()
        self.metrics.rows.inc(len(rows))
        self.metrics.model_calls.inc(batch_calls)
        if batch_padded:  # Ray's Counter refuses 0 (image rows have no tokens)
            self.metrics.real_tokens.inc(batch_real)
            self.metrics.padded_tokens.inc(batch_padded)
        stats.last_minute_batches.add(len(rows), batch_real, batch_padded, now=now)
        return results

    def _plan(self, lengths: list[int]):
        batching = self.batching
        if not batching.length_sorting:
            return arrival_order_plan(lengths, max_batch_tokens=batching.max_batch_tokens, max_rows=batching.max_batch_size)
        return plan_batches(
            lengths,
            max_batch_tokens=batching.max_batch_tokens,
            max_rows=batching.max_batch_size,
            sub_batch_overhead_tokens=batching.sub_batch_overhead_tokens,
        )

    def _call_model(self, payloads: list[Any], group: Any, outputs: list[Optional[_RowOutput]]) -> list[Any]:
        runtime = self.runtime
        if isinstance(runtime, EmbeddingRuntime):
            return runtime.embed(payloads)
        if isinstance(runtime, (TextClassificationRuntime, ImageClassificationRuntime)):
            # Rank every label once; each caller's top_k is cut from it afterwards.
            return runtime.classify(payloads, top_k=len(runtime.labels))
        if isinstance(runtime, GenerationRuntime):
            started = time.monotonic()
            for output in outputs:
                output.started_at = started
            streaming = any(output.deltas is not None for output in outputs)
            return runtime.generate(
                payloads, group,
                on_delta=(lambda i, text: outputs[i].on_delta(text)) if streaming else None,
                is_cancelled=lambda i: outputs[i].cancelled,
            )
        raise TypeError(f"no batch call for runtime {type(runtime).__name__}")

    async def _submit(self, rows: list[_Row]) -> list[Any]:
        self.stats.requests += 1
        futures = await asyncio.gather(*(self._admit(row) for row in rows))
        # A cancelled caller cancels these futures; the executor then skips its rows.
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    def _require(self, runtime_type: type, operation: str):
        if not isinstance(self.runtime, runtime_type):
            raise InvalidRequestError(
                f"model {self.config.name!r} serves {self.runtime.task}, which does not support {operation}",
                param="model",
                code="wrong_task",
            )
        return self.runtime

    # ---- the API the router calls ----------------------------------------------

    async def info(self) -> dict:
        runtime = self.runtime
        return {
            "name": self.config.name,
            "task": runtime.task,
            "revision": runtime.revision,
            "max_input_tokens": runtime.max_input_tokens,
            "device": str(runtime.device),
            "dtype": str(runtime.dtype).replace("torch.", ""),
            "quantization": self.config.quantization,
            "labels": list(getattr(runtime, "labels", []) or []),
            "engine": ("continuous" if self.engine is not None else "static")
            if isinstance(runtime, GenerationRuntime) else None,
        }

    async def get_stats(self) -> dict:
        stats = {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "batching": self.batching.model_dump(),
            **self.stats.snapshot(),
        }
        if self.engine is not None:
            stats["engine"] = {"kind": "continuous", **dataclasses.asdict(self.engine.stats())}
        return stats

    # ``deadline`` (time.time() seconds), from the router: past it, a row still waiting
    # for the model is dropped with a 504 instead of being computed for nobody.

    async def embed(self, texts: list[str], deadline: Optional[float] = None) -> dict:
        runtime = self._require(EmbeddingRuntime, "embeddings")
        token_rows = [_with_param(runtime.tokenize, text, "input", i, len(texts)) for i, text in enumerate(texts)]
        vectors = await self._submit([self._row(ids, len(ids), deadline=deadline) for ids in token_rows])
        return {"embeddings": vectors, "prompt_tokens": sum(len(ids) for ids in token_rows)}

    async def classify_texts(self, texts: list[str], top_k: int, deadline: Optional[float] = None) -> dict:
        runtime = self._require(TextClassificationRuntime, "text classification")
        token_rows = [_with_param(runtime.tokenize, text, "input", i, len(texts)) for i, text in enumerate(texts)]
        ranked = await self._submit([self._row(ids, len(ids), deadline=deadline) for ids in token_rows])
        return {"results": [r[:top_k] for r in ranked], "prompt_tokens": sum(len(ids) for ids in token_rows)}

    async def classify_images(self, images: list[bytes], top_k: int, deadline: Optional[float] = None) -> dict:
        runtime = self._require(ImageClassificationRuntime, "image classification")
        pixels = [_with_param(runtime.decode, image, "image", i, len(images)) for i, image in enumerate(images)]
        # Every image is resized to the same shape, so each row costs the same.
        ranked = await self._submit([self._row(p, 1, deadline=deadline) for p in pixels])
        return {"results": [r[:top_k] for r in ranked], "prompt_tokens": 0}

    def _generation_rows(
        self,
        *,
        prompts: Optional[list[str]],
        messages: Optional[list[dict]],
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop: Sequence[str],
        seed: Optional[int],
        deadline: Optional[float],
        deltas: Optional[asyncio.Queue] = None,
    ) -> list[_Row]:
        """One row per prompt (completions) or one for the chat (``messages``), checked
        against the context window."""
        runtime = self._require(GenerationRuntime, "text generation")
        if messages is not None:
            prompt_rows = [runtime.encode_chat(messages)]
        else:
            prompt_rows = [
                _with_param(runtime.encode_prompt, prompt, "prompt", i, len(prompts or ())) for i, prompt in enumerate(prompts or ())
            ]
        for ids in prompt_rows:
            total = len(ids) + max_tokens
            if total > runtime.max_input_tokens:
                raise ContextLengthExceededError(
                    f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds "
                    f"the model's context of {runtime.max_input_tokens} tokens; shorten the prompt or lower max_tokens",
                    param="max_tokens",
                )
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
        loop = asyncio.get_running_loop()
        rows = []
        for index, ids in enumerate(prompt_rows):
            row = self._row(GenerationRequest(prompt_ids=ids, max_tokens=max_tokens, stop=tuple(stop)),
                            len(ids) + max_tokens, params, deadline=deadline)
            row.output = _RowOutput(index, loop, deltas)
            rows.append(row)
        return rows

    async def _run_generation(self, rows: list[_Row]) -> list[GenerationResult]:
        """The rows' results from the configured engine; if the request is cancelled
        meanwhile, its rows end at the engine's next step."""
        try:
            if self.engine is None:
                results = await self._submit(rows)
            else:
                results = await self._submit_continuous(rows)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the caller went away
                self.stats.cancelled_rows += len(rows)
            for row in rows:
                row.output.cancelled = True
                if row.output.engine_handle is not None:
                    self.engine.cancel(row.output.engine_handle)
            raise
        self._observe_generation(rows, results)
        return results

    async def _submit_continuous(self, rows: list[_Row]) -> list[GenerationResult]:
        # No admission window: the engine batches at every decode step.
        self.stats.requests += 1
        self.stats.rows += len(rows)
        loop = asyncio.get_running_loop()
        deadline_timers = []
        try:
            for row in rows:
                row.output.outcome = loop.create_future()
                row.output.engine_handle = self.engine.submit(row.payload, row.group, row.output)
                if row.deadline is not None:  # ends the row, waiting or running, when its caller gives up
                    deadline_timers.append(loop.call_later(
                        max(0.0, row.deadline - time.time()), self.engine.cancel, row.output.engine_handle))
            return list(await asyncio.gather(*(row.output.outcome for row in rows)))
        finally:
            # Ended either way: drop the timers rather than hold them for the whole
            # request timeout (one per row; thousands under load).
            for timer in deadline_timers:
                timer.cancel()

    def _observe_generation(self, rows: list[_Row], results: list[GenerationResult]) -> None:
        finished = time.monotonic()
        generated = 0
        for row, result in zip(rows, results):
            generated += result.completion_tokens
            output = row.output
            handle = output.engine_handle
            if handle is not None and handle.admitted_at is not None:
                # The continuous engine's queue: from arrival until the row joined the batch
                # (the static engine's wait is observed when its batch starts).
                wait = max(0.0, handle.admitted_at - row.enqueued_at)
                self.metrics.queue_wait.observe(wait)
                self.stats.last_minute_waits.add(wait, now=finished)
                self.stats.recent_queue_wait_s.append(wait)
            first = output.first_token_at
            if first is None and result.time_to_first_token_s is not None and output.started_at is not None:
                first = output.started_at + result.time_to_first_token_s  # static engine, not streamed
            if first is None or result.completion_tokens < 1:
                continue
            self.metrics.time_to_first_token.observe(max(0.0, first - row.enqueued_at))
            if result.completion_tokens >= 2:
                self.metrics.inter_token_latency.observe((finished - first) / (result.completion_tokens - 1))
        if generated:
            self.metrics.generated_tokens.inc(generated)

    async def generate(
        self,
        *,
        prompts: Optional[list[str]] = None,
        messages: Optional[list[dict]] = None,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop: Sequence[str] = (),
        seed: Optional[int] = None,
        deadline: Optional[float] = None,
    ) -> list[dict]:
        """Generate for each prompt (completions) or for one chat (``messages``)."""
        rows = self._generation_rows(prompts=prompts, messages=messages, max_tokens=max_tokens,
                                     temperature=temperature, top_p=top_p, stop=stop, seed=seed, deadline=deadline)
        return [_finished(result) for result in await self._run_generation(rows)]

    async def generate_stream(
        self,
        *,
        prompts: Optional[list[str]] = None,
        messages: Optional[list[dict]] = None,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop: Sequence[str] = (),
        seed: Optional[int] = None,
        deadline: Optional[float] = None,
    ) -> AsyncIterator[dict]:
        """:meth:`generate`, streamed: ``{"index", "text"}`` events as rows produce
        text, then one ``{"index", "finish_reason", "prompt_tokens",
        "completion_tokens"}`` per row. The rows are batched like any others; a caller
        that goes away (Serve cancels this generator) ends them at the next step."""
        deltas: asyncio.Queue = asyncio.Queue()
        rows = self._generation_rows(prompts=prompts, messages=messages, max_tokens=max_tokens,
                                     temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                                     deadline=deadline, deltas=deltas)
        results = asyncio.ensure_future(self._run_generation(rows))
        try:
            while not results.done():
                delta = asyncio.ensure_future(deltas.get())
                await asyncio.wait({delta, results}, return_when=asyncio.FIRST_COMPLETED)
                if delta.done():
                    index, text = delta.result()
                    yield {"index": index, "text": text}
                else:
                    delta.cancel()
            # The engine hands over every delta before the result, so what is queued now
            # is the rest of the text.
            while not deltas.empty():
                index, text = deltas.get_nowait()
                yield {"index": index, "text": text}
            for index, result in enumerate(results.result()):
                yield {"index": index, **_finished(result, with_text=False)}
        finally:
            if not results.done():
                results.cancel()


def _finished(result: GenerationResult, *, with_text: bool = True) -> dict:
    """A row's result for the router; a stream's last event leaves out the text, which
    its deltas carried already."""
    finished = {
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
    }
    return {"text": result.text, **finished} if with_text else finished


def _with_param(fn, value, field: str, index: int, count: int):
    """Run a per-input check, naming the input's position in the error for lists."""
    try:
        return fn(value)
    except InvalidRequestError as exc:
        if count > 1 and (exc.param in (None, field)):
            exc.param = f"{field}[{index}]"
        raise
