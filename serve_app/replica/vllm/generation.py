"""Generation on vLLM: :class:`VLLMEngine`, the replica's generation engine over a
started :class:`~serve_app.replica.vllm.runtime.VLLMRuntime`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional

from serve_app.config import BatchingConfig
from serve_app.core.calls import (
    Completion,
    GenerateCall,
    GenerateResult,
    StreamDelta,
    StreamEnd,
    StreamEvent,
    TokenLogprob,
)
from serve_app.core.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ModelUnavailableError,
)
from serve_app.replica.engines import encode_rows
from serve_app.replica.stats import ReplicaObserver, RowTiming
from serve_app.replica.vllm.adapters import lora_request
from serve_app.replica.vllm.runtime import VLLMRuntime
from serve_app.replica.vllm.tools import ToolCalling

logger = logging.getLogger("ray.serve")


@dataclasses.dataclass
class _CallState:
    """One call's progress: per prompt, its token count and its choices."""

    prompt_tokens: list[int] = dataclasses.field(default_factory=list)
    choices: list[list["_Choice"]] = dataclasses.field(default_factory=list)
    tools: Optional[ToolCalling] = None  # a chat with tools: its calls are read from each choice's text


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
        # With tools the text is held to the end: until then it cannot be told whether it
        # is a call (auto) or whole enough to parse (required); each choice then comes as
        # one delta with its calls, as OpenAI's clients accumulate them either way.
        interval = self.stream_interval_s
        held: dict[int, list[StreamDelta]] = {}
        last_sent = -float("inf")
        async with contextlib.aclosing(self._events(call, state)) as events:
            async for delta in events:
                held.setdefault(delta.index, []).append(delta)
                now = time.monotonic()
                if call.tools is None and now - last_sent >= interval:
                    for merged in _merge_deltas(held):
                        yield merged
                    held.clear()
                    last_sent = now
        completions = _completions(call, state)
        if call.tools is None:
            for merged in _merge_deltas(held):
                yield merged
        else:
            for index, completion in enumerate(completions):
                if completion.text or completion.tool_calls or completion.logprobs:
                    yield StreamDelta(index=index, text=completion.text, logprobs=completion.logprobs,
                                      tool_calls=completion.tool_calls)
        for index, completion in enumerate(completions):
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

    def _sampling(self, call: GenerateCall, tools: Optional[ToolCalling]) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        structured = None
        constraint = tools.constraint() if tools is not None else None
        if constraint is not None:  # required or a named function: the output is the call
            structured = StructuredOutputsParams(json=constraint)
        elif call.response_format is not None:
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
            skip_special_tokens=tools.skip_special_tokens if tools is not None else True,
            output_kind=RequestOutputKind.DELTA,  # each output holds only the new tokens
        )

    async def _events(self, call: GenerateCall, state: _CallState) -> AsyncIterator[StreamDelta]:
        """Run every prompt of the call, filling ``state`` and yielding each new piece of
        text. The choice index is OpenAI's: prompt-major, ``n`` per prompt."""
        if call.tools is not None:
            state.tools = ToolCalling(call.tools, parser_class=self.runtime.tool_parser,
                                      tokenizer=self.runtime.tokenizer, model_name=self.model_name)
        lora = lora_request(self.runtime.adapters, call.adapter)
        rows, call = await encode_rows(self.runtime, call)
        sampling = self._sampling(call, state.tools)
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
                async for output in engine.generate({"prompt_token_ids": rows[row]}, sampling, request_ids[row],
                                                    lora_request=lora):
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


def _completions(call: GenerateCall, state: _CallState) -> list[Completion]:
    completions = []
    for row, row_choices in enumerate(state.choices):
        for j, choice in enumerate(row_choices):
            if choice.finish_reason is None:  # vLLM's stream ended without saying why: not a whole answer
                raise ModelUnavailableError("the model's engine ended the generation without a finish reason; retry",
                                            param=None, code="generation_unfinished")
            text, tool_calls, finish_reason = "".join(choice.text), None, choice.finish_reason
            if state.tools is not None:
                text, tool_calls, finish_reason = state.tools.read(text, finish_reason)
            completions.append(Completion(
                text=text, finish_reason=finish_reason,
                # A prompt's tokens count once, on its first choice.
                prompt_tokens=state.prompt_tokens[row] if j == 0 else 0, completion_tokens=choice.tokens,
                logprobs=tuple(choice.logprobs) if call.logprobs is not None else None, tool_calls=tool_calls,
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
