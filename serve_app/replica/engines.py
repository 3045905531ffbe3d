"""Generation engines: what runs a :class:`GenerateCall` inside a replica.

Every engine implements :class:`GenerationEngine` and takes the whole call (prompts
or chat messages): tokenizing, the chat template and the context-window check are the
engine's, since an engine such as vLLM does them its own way. The two engines here run
on our transformers :class:`~serve_app.core.models.GenerationRuntime` and share that
part (:class:`_TransformersEngine`):

- :class:`StaticEngine`: rows go through the replica's ``@serve.batch`` admission and
  executor (the ``submit`` callable it is given) and run as one padded generate() per
  sub-batch (:func:`static_generate`) until the last row ends.
- :class:`ContinuousEngine`: rows join :class:`~serve_app.core.continuous.engine.ContinuousBatcher`'s
  running batch between decode steps and leave as soon as they end; they skip the
  admission window and the executor.

:func:`make_engine` picks one for the configured ``generation.engine``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Protocol, Sequence

from serve_app.config import BatchingConfig
from serve_app.core.calls import Completion, GenerateCall, GenerateResult, StreamDelta, StreamEnd, StreamEvent
from serve_app.core.continuous.engine import ContinuousBatcher
from serve_app.core.errors import ContextLengthExceededError, DeadlineExceededError, InvalidRequestError, ServeAppError
from serve_app.core.models import GenerationRequest, GenerationResult, GenerationRuntime
from serve_app.core.batching.static import Row, new_row
from serve_app.replica.inputs import encode_each, in_tokenizer_thread
from serve_app.replica.stats import ReplicaObserver, RowTiming

logger = logging.getLogger("ray.serve")


class GenerationEngine(Protocol):
    """What the replica asks of a generation engine.

    Errors are :class:`~serve_app.core.errors.ServeAppError` subclasses (bad input,
    context length) raised before any row runs, or a row's own failure.
    """

    kind: str  # "static" | "continuous" | "vllm"; ModelInfo.engine

    async def generate(self, call: GenerateCall) -> GenerateResult:
        """Every row's completion, in order. Cancelling the awaiting task cancels the rows."""
        ...

    def stream(self, call: GenerateCall) -> AsyncIterator[StreamEvent]:
        """An async generator: :class:`StreamDelta` events as rows produce text, then one
        :class:`StreamEnd` per row in index order. Closing it or cancelling its
        consumer ends the rows that still run."""
        ...

    def retune(self, batching: BatchingConfig) -> None:
        """Take new batching knobs (the deployment's user_config changed)."""
        ...

    def stats(self) -> Optional[dict]:
        """The engine's own figures for ``get_stats()["engine"]`` (with its ``kind``), or None."""
        ...

    def close(self) -> None:
        """Stop; the replica is going away (requests have drained)."""
        ...


class RowOutput:
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
        self.deadline_passed = False  # the replica's deadline timer ended it (continuous engine)
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


def refuse_what_only_vllm_does(call: GenerateCall, engine: str) -> None:
    """A 400 naming the first field of the call that the transformers engines cannot do."""
    response_format = call.response_format.type if call.response_format is not None else None
    # A tool turn in the history is refused, not dropped: without it the answer would differ.
    tool_turn = next((i for i, turn in enumerate(call.messages or ())
                      if turn.role == "tool" or turn.tool_calls is not None), None)
    refused = (
        ("model", call.adapter is not None, f"the LoRA adapter {call.adapter!r}"),
        ("tools", call.tools is not None, "tools"),
        (f"messages.{tool_turn}", tool_turn is not None, "a conversation with tool calls"),
        ("n", call.n != 1, f"n={call.n}"),
        ("logprobs", call.logprobs is not None, "logprobs"),
        ("response_format", response_format is not None, f"response_format {response_format}"),
        # 0 and {} are the defaults, which change nothing: accepted.
        ("frequency_penalty", call.sampling.frequency_penalty != 0, "frequency_penalty"),
        ("presence_penalty", call.sampling.presence_penalty != 0, "presence_penalty"),
        ("logit_bias", bool(call.sampling.logit_bias), "logit_bias"),
    )
    for field, asked, what in refused:
        if asked:
            raise InvalidRequestError(
                f"{what} needs the vLLM engine; this model runs on the {engine} engine "
                "(set engine: vllm for it, with vLLM installed)",
                param=field,
            )


def prompt_ids(runtime: GenerationRuntime, call: GenerateCall) -> list[list[int]]:
    """One row of token ids per prompt (completions) or one for the chat, checked
    against the context window. Any runtime with encode_chat, encode_prompt and
    max_input_tokens will do (the vLLM engine's VLLMRuntime too)."""
    chat = call.chat()
    if chat is not None:  # tools: only the vLLM engine takes them (the others refuse them first)
        rows = [runtime.encode_chat(chat, call.tools.tool_list()) if call.tools else runtime.encode_chat(chat)]
    else:
        rows = encode_each(runtime.encode_prompt, call.prompts, "prompt")
    window = runtime.max_input_tokens
    for ids in rows:
        total = len(ids) + call.max_tokens
        if total <= window:
            continue
        if not call.max_tokens_defaulted:
            raise ContextLengthExceededError(
                f"prompt ({len(ids)} tokens) + max_tokens ({call.max_tokens}) = {total} tokens exceeds "
                f"the model's context of {window} tokens; shorten the prompt or lower max_tokens",
                param="max_tokens",
            )
        if len(ids) >= window:  # no room left for even one token: the prompt is what is too long
            field = "messages" if chat is not None else "prompt"
            raise ContextLengthExceededError(
                f"the {field} has {len(ids)} tokens and fills the model's context of {window} tokens; shorten it",
                param=field)
    return rows


def fit_max_tokens(call: GenerateCall, rows: list[list[int]], window: int) -> GenerateCall:
    """The call with a defaulted max_tokens lowered to the room its longest prompt leaves
    in the context (what :func:`prompt_ids` let through); an explicit one as it is."""
    room = window - max(len(ids) for ids in rows)
    if not call.max_tokens_defaulted or room >= call.max_tokens:
        return call
    return dataclasses.replace(call, max_tokens=room)


async def encode_rows(runtime: GenerationRuntime, call: GenerateCall) -> tuple[list[list[int]], GenerateCall]:
    """:func:`prompt_ids` in the replica's tokenizer thread, off the event loop, and the
    call with its max_tokens fitted to them (:func:`fit_max_tokens`)."""
    rows = await in_tokenizer_thread(prompt_ids, runtime, call)
    return rows, fit_max_tokens(call, rows, runtime.max_input_tokens)


class _TransformersEngine:
    """What both engines over a :class:`GenerationRuntime` share: encoding the call
    into rows, streaming, cancellation and the generation observations. Subclasses
    run the rows (``_run``) and say how to stop them (``_cancel``)."""

    kind = "transformers"

    def __init__(self, runtime: GenerationRuntime, batching: BatchingConfig, observer: ReplicaObserver):
        self.runtime = runtime
        self.batching = batching
        self.observer = observer

    # ---- the protocol -----------------------------------------------------------

    async def generate(self, call: GenerateCall) -> GenerateResult:
        results = await self._execute(await self._rows(call, deltas=None))
        return GenerateResult(completions=[
            Completion(text=r.text, finish_reason=r.finish_reason, prompt_tokens=r.prompt_tokens,
                       completion_tokens=r.completion_tokens)
            for r in results
        ])

    async def stream(self, call: GenerateCall) -> AsyncIterator[StreamEvent]:
        # The rows are batched like any others; a caller that goes away (Serve cancels
        # this generator) ends them at the next step.
        deltas: asyncio.Queue = asyncio.Queue()
        results = asyncio.ensure_future(self._execute(await self._rows(call, deltas=deltas)))
        delta: Optional[asyncio.Future] = None
        try:
            while not results.done():
                delta = asyncio.ensure_future(deltas.get())
                await asyncio.wait({delta, results}, return_when=asyncio.FIRST_COMPLETED)
                if delta.done():
                    index, text = delta.result()
                    yield StreamDelta(index=index, text=text)
                else:
                    delta.cancel()
            # The engine hands over every delta before the result, so what is queued now
            # is the rest of the text.
            while not deltas.empty():
                index, text = deltas.get_nowait()
                yield StreamDelta(index=index, text=text)
            for index, result in enumerate(results.result()):
                yield StreamEnd(index=index, finish_reason=result.finish_reason,
                                prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens)
        finally:
            # A consumer that goes away leaves us waiting on both tasks: cancel them and
            # wait for them to end, so no deltas.get() stays pending on a dead queue.
            pending = [task for task in (delta, results) if task is not None and not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)

    def retune(self, batching: BatchingConfig) -> None:
        self.batching = batching

    def stats(self) -> Optional[dict]:
        return None

    def close(self) -> None:
        pass

    # ---- shared machinery ----------------------------------------------------------

    async def _rows(self, call: GenerateCall, deltas: Optional[asyncio.Queue]) -> list[Row]:
        refuse_what_only_vllm_does(call, self.kind)
        encoded, call = await encode_rows(self.runtime, call)
        loop = asyncio.get_running_loop()
        return [
            # new_tokens: generate() pads prompts to the longest one and then appends the
            # largest max_tokens, which is what the static planner must charge.
            new_row(GenerationRequest(prompt_ids=ids, max_tokens=call.max_tokens, stop=tuple(call.stop)),
                    len(ids) + call.max_tokens, self.batching, group=call.sampling, deadline=call.deadline,
                    output=RowOutput(index, loop, deltas), new_tokens=call.max_tokens)
            for index, ids in enumerate(encoded)
        ]

    async def _execute(self, rows: list[Row]) -> list[GenerationResult]:
        """The rows' results; if the request is cancelled meanwhile, its rows end at the
        engine's next step."""
        try:
            results = await self._run(rows)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the caller went away
                self.observer.cancelled(len(rows))
            for row in rows:
                row.output.cancelled = True
            self._cancel(rows)
            raise
        for row, result in zip(rows, results):
            if result.finish_reason == "cancelled":
                # Its caller is still here, so the engine ended it on its own: the
                # deadline timer (wall clock, which may fire before the router's
                # monotonic one) or a failed delivery. Such a row's text is cut short;
                # it must never be answered, or cached, as a completion.
                self.observer.cancelled(len(rows))
                for other in rows:
                    other.output.cancelled = True
                self._cancel(rows)
                raise _cut_short(row)
        self.observer.generation(self._timing(row, result) for row, result in zip(rows, results))
        return results

    async def _run(self, rows: list[Row]) -> list[GenerationResult]:
        raise NotImplementedError

    def _cancel(self, rows: list[Row]) -> None:
        """Stop rows whose request ended early (``output.cancelled`` is already set)."""

    def _timing(self, row: Row, result: GenerationResult) -> RowTiming:
        return RowTiming(enqueued_at=row.enqueued_at, completion_tokens=result.completion_tokens,
                         first_token_at=row.output.first_token_at)


def _cut_short(row: Row) -> ServeAppError:
    """The error for a generation row the engine ended early while its caller waited."""
    if row.output.deadline_passed or (row.deadline is not None and time.time() >= row.deadline):
        return DeadlineExceededError("the request's deadline passed while the model generated", code="timeout")
    return ServeAppError("generation ended before the row finished: its output could not be delivered")


def static_generate(runtime: GenerationRuntime, rows: Sequence[Row]) -> list[GenerationResult]:
    """One sub-batch of the static engine (rows of one sampling group): one generate() call."""
    outputs = [row.output for row in rows]
    started = time.monotonic()
    for output in outputs:
        output.started_at = started
    streaming = any(output.deltas is not None for output in outputs)
    return runtime.generate(
        [row.payload for row in rows], rows[0].group,
        on_delta=(lambda i, text: outputs[i].on_delta(text)) if streaming else None,
        is_cancelled=lambda i: outputs[i].cancelled,
    )


class StaticEngine(_TransformersEngine):
    """Rows admitted together run as one padded generate() until the last one ends.

    ``submit(rows)`` queues rows in the replica's admission window and executor (which
    runs them with :func:`static_generate`) and returns their results, raising the
    first row error.
    """

    kind = "static"

    def __init__(self, runtime: GenerationRuntime, batching: BatchingConfig, observer: ReplicaObserver,
                 submit: Callable[[list[Row]], Awaitable[list[Any]]]):
        super().__init__(runtime, batching, observer)
        self._submit = submit

    async def _run(self, rows: list[Row]) -> list[GenerationResult]:
        # A cancelled caller cancels the executor's futures; a row already running sees
        # output.cancelled at its next step.
        return await self._submit(rows)

    def _timing(self, row: Row, result: GenerationResult) -> RowTiming:
        timing = super()._timing(row, result)
        output = row.output
        if timing.first_token_at is None and result.time_to_first_token_s is not None and output.started_at is not None:
            # Not streamed: the runtime timed the first token from its call's start.
            timing = dataclasses.replace(timing, first_token_at=output.started_at + result.time_to_first_token_s)
        return timing


class ContinuousEngine(_TransformersEngine):
    """Iteration-level batching: the batcher owns the model on its own thread, and rows
    skip the admission window and the executor (it batches at every decode step)."""

    kind = "continuous"

    def __init__(self, runtime: GenerationRuntime, batching: BatchingConfig, observer: ReplicaObserver):
        super().__init__(runtime, batching, observer)
        # ValueError for a cache layout the loop cannot merge (sliding window).
        self.batcher = ContinuousBatcher(runtime, max_rows=batching.max_batch_size,
                                         kv_token_budget=batching.max_batch_tokens)
        self.batcher.start()

    async def _run(self, rows: list[Row]) -> list[GenerationResult]:
        self.observer.request(rows_outside_batches=len(rows))
        loop = asyncio.get_running_loop()
        deadline_timers = []
        try:
            for row in rows:
                row.output.outcome = loop.create_future()
                row.output.engine_handle = self.batcher.submit(row.payload, row.group, row.output)
                if row.deadline is not None:  # ends the row, waiting or running, when its caller gives up
                    deadline_timers.append(loop.call_later(
                        max(0.0, row.deadline - time.time()), self._deadline_passed, row))
            return list(await asyncio.gather(*(row.output.outcome for row in rows)))
        finally:
            # Ended either way: drop the timers rather than hold them for the whole
            # request timeout (one per row; thousands under load).
            for timer in deadline_timers:
                timer.cancel()

    def _deadline_passed(self, row: Row) -> None:
        # Marked first: the row's "cancelled" result then surfaces as a 504 (_execute).
        row.output.deadline_passed = True
        self.batcher.cancel(row.output.engine_handle)

    def _cancel(self, rows: list[Row]) -> None:
        for row in rows:
            if row.output.engine_handle is not None:
                self.batcher.cancel(row.output.engine_handle)

    def _timing(self, row: Row, result: GenerationResult) -> RowTiming:
        timing = super()._timing(row, result)
        handle = row.output.engine_handle
        if handle is not None and handle.admitted_at is not None:
            # The batcher's queue: from arrival until the row joined the batch.
            timing = dataclasses.replace(timing, queue_wait_s=max(0.0, handle.admitted_at - row.enqueued_at))
        return timing

    def retune(self, batching: BatchingConfig) -> None:
        super().retune(batching)
        # Read by the engine thread at its next admission.
        self.batcher.max_rows = batching.max_batch_size
        self.batcher.kv_token_budget = batching.max_batch_tokens

    def stats(self) -> Optional[dict]:
        return {"kind": self.kind, **dataclasses.asdict(self.batcher.stats())}

    def close(self) -> None:
        self.batcher.shutdown(timeout=5)


def make_engine(runtime: GenerationRuntime, engine: str, batching: BatchingConfig, observer: ReplicaObserver, *,
                submit: Callable[[list[Row]], Awaitable[list[Any]]], model_name: str) -> GenerationEngine:
    """The engine for ``generation.engine``: "static", "continuous", or "auto"
    (continuous unless the model's cache layout cannot merge, then static with a warning)."""
    chosen: GenerationEngine
    if engine == "static":
        chosen = StaticEngine(runtime, batching, observer, submit)
    else:
        try:
            chosen = ContinuousEngine(runtime, batching, observer)
        except ValueError as exc:  # a cache layout the loop cannot merge (sliding window)
            if engine == "continuous":
                raise
            logger.warning("model %s: continuous batching unavailable (%s); using the static engine", model_name, exc)
            chosen = StaticEngine(runtime, batching, observer, submit)
    logger.info("model %s generates with the %s engine", model_name, chosen.kind)
    return chosen
