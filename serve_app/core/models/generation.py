"""Causal LM text generation: one left-padded generate() call for many rows
(:class:`GenerationRuntime`), each row stopping, streaming and cancelled on its own."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from serve_app.core.calls import SamplingParams
from serve_app.core.errors import ContextLengthExceededError, InvalidRequestError
from serve_app.core.models.base import TaskRuntime
from serve_app.core.streaming import TextStream

logger = logging.getLogger(__name__)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or stop string) | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    # Seconds until this row's first token: from the generate() call (static engine) or
    # from submit() (continuous engine, so queueing counts). None if no token came.
    time_to_first_token_s: float | None = None


#: ``on_delta(row_index, text_delta)``: called from the generating thread as a row's text grows.
DeltaCallback = Callable[[int, str], None]
#: ``is_cancelled(row_index)``: asked once per step for each running row; True ends it as "cancelled".
CancelCheck = Callable[[int], bool]


class _RowStopper:
    """Per-row stopping, streaming and cancellation for one generate() call.

    transformers ORs every criterion's per-row BoolTensor into its ``unfinished`` mask,
    so a row that this returns True for gets only padding afterwards. The stopper
    records, per row, how many tokens it generated and why it ended. A row that streams
    (``on_delta``) or has stop strings gets a :class:`TextStream`, which detects the stop
    strings and hands out the text deltas; other rows are decoded once at the end.
    """

    def __init__(self, runtime: "GenerationRuntime", prompt_width: int, limits: list[int],
                 stops: list[tuple[str, ...]], eos_ids: set[int], *,
                 on_delta: DeltaCallback | None = None, is_cancelled: CancelCheck | None = None):
        self.prompt_width = prompt_width
        self.limits = limits
        self.eos_ids = eos_ids
        self.on_delta = on_delta
        self.is_cancelled = is_cancelled
        n = len(limits)
        self.streams: list[TextStream | None] = [
            TextStream(runtime._decode, row_stops) if (on_delta is not None or row_stops) else None
            for row_stops in stops
        ]
        self.ended_at: list[int | None] = [None] * n
        self.reason: list[str | None] = [None] * n
        self.first_token_at: float | None = None  # time.monotonic() of the first step
        self._sink_failed = [False] * n
        self._done = torch.zeros(n, dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs) -> torch.Tensor:
        gen_len = input_ids.shape[1] - self.prompt_width
        if gen_len <= 0:
            return self._done.to(input_ids.device)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        last = input_ids[:, -1].tolist()
        for i, tok in enumerate(last):
            if self.ended_at[i] is not None:
                continue
            if self._sink_failed[i] or (self.is_cancelled is not None and self.is_cancelled(i)):
                # The token generated in this step was never streamed: the row ends before it.
                self._end(i, gen_len - 1, "cancelled")
                continue
            if tok in self.eos_ids:
                self._end(i, gen_len, "stop")
                continue
            stream = self.streams[i]
            if stream is not None:
                self.emit(i, stream.push(tok))
                if stream.stopped:
                    self._end(i, gen_len, "stop")
                    continue
            if gen_len >= self.limits[i]:
                self._end(i, gen_len, "length")
        return self._done.to(input_ids.device)

    def _end(self, i: int, gen_len: int, reason: str) -> None:
        self.ended_at[i] = gen_len
        self.reason[i] = reason
        self._done[i] = True
        stream = self.streams[i]
        if stream is not None:
            self.emit(i, stream.finish())

    def emit(self, i: int, delta: str) -> None:
        if not delta or self.on_delta is None or self._sink_failed[i]:
            return
        try:
            self.on_delta(i, delta)
        except Exception:
            # A broken consumer must not abort the other rows of the batch: drop its
            # further deltas and end its row at the next step.
            logger.exception("on_delta failed for row %d; cancelling that row", i)
            self._sink_failed[i] = True


class GenerationRuntime(TaskRuntime):
    """Causal LM text generation, many rows per generate() call with per-row stopping."""

    def __init__(self, *, tokenizer: Any, **kw):
        super().__init__(**kw)
        self.tokenizer = tokenizer
        eos: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for v in ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])):
            eos.add(int(v))
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = eos
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = min(eos) if eos else 0
        self.pad_token_id = int(pad)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _check_length(self, ids: list[int], param: str) -> list[int]:
        # At least one position of the context window must stay free for the completion.
        limit = self.max_input_tokens - 1
        if len(ids) > limit:
            raise ContextLengthExceededError(
                f"{param} has {len(ids)} tokens, model accepts at most {limit} "
                f"(context window {self.max_input_tokens} tokens, at least 1 kept for the completion); "
                f"shorten the {param}",
                param=param,
            )
        return ids

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt."""
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
        if not prompt:
            raise InvalidRequestError("prompt is empty; give some text", param="prompt")
        ids = list(self.tokenizer(prompt, add_special_tokens=True, truncation=False, verbose=False)["input_ids"])
        if not ids:
            raise InvalidRequestError("prompt encodes to no tokens; give some text", param="prompt")
        return self._check_length(ids, "prompt")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat, through the tokenizer's chat template plus the assistant prompt."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages is empty; give at least one message", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidRequestError(f"messages[{i}] is not an object", param="messages")
            role, content = m.get("role"), m.get("content")
            if role not in ("system", "user", "assistant"):
                raise InvalidRequestError(
                    f"messages[{i}].role is {role!r}; use 'system', 'user' or 'assistant'", param="messages"
                )
            if not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content must be a string", param="messages")
            clean.append({"role": role, "content": content})
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template, so it cannot take chat messages; use the completions "
                "endpoint with a raw prompt",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # templates raise on orders they do not support (jinja raise_exception)
            raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}",
                                      param="messages") from exc
        # The template already holds the special tokens it wants (bos, role markers).
        ids = list(self.tokenizer(text, add_special_tokens=False, truncation=False, verbose=False)["input_ids"])
        return self._check_length(ids, "messages")

    def generate(self, requests: list[GenerationRequest], params: SamplingParams, *,
                 on_delta: DeltaCallback | None = None,
                 is_cancelled: CancelCheck | None = None) -> list[GenerationResult]:
        """One model.generate() call for all rows; each row stops on its own.

        Rows are left-padded to the longest prompt here; max_new_tokens is the largest
        row limit, and a stopping criterion ends each row at its own max_tokens (capped
        by the context window), at EOS, or at the first of its stop strings, whose text
        and everything after it is cut off.

        Streaming: ``on_delta(row_index, text)`` is called from this (the generating)
        thread as each row's text grows; a row's deltas concatenate exactly to its
        result's ``text`` (see :class:`~serve_app.core.streaming.TextStream` for what is
        held back until the row ends). It must be quick; if it raises, the error is
        logged and that row is cancelled. ``is_cancelled(row_index)`` is asked once per
        step for each running row: True ends that row at this step with finish_reason
        "cancelled", holding only the tokens generated before, while the others go on.
        """
        if not requests:
            return []
        started = time.monotonic()
        n = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        limits = []
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i} has an empty prompt")
            if r.max_tokens < 1:
                raise ValueError(f"request {i} has max_tokens={r.max_tokens}; it must be at least 1")
            room = self.max_input_tokens - len(r.prompt_ids)
            limits.append(max(1, min(r.max_tokens, room)))
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids):] = 1
        stopper = _RowStopper(self, width, limits, [tuple(r.stop) for r in requests], self.eos_token_ids,
                              on_delta=on_delta, is_cancelled=is_cancelled)

        from transformers import StoppingCriteriaList

        kwargs: dict[str, Any] = dict(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=max(limits),
            min_new_tokens=0,
            num_beams=1,
            num_return_sequences=1,
            pad_token_id=self.pad_token_id,
            eos_token_id=sorted(self.eos_token_ids) or None,
            stopping_criteria=StoppingCriteriaList([stopper]),
        )
        if params.temperature is None or params.temperature <= 0:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=float(params.temperature),
                          top_p=float(params.top_p) if params.top_p is not None else 1.0, top_k=0)

        rng = contextlib.nullcontext()
        if params.seed is not None:
            devices = []
            if self.device.type == "cuda":
                devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()]
            rng = torch.random.fork_rng(devices=devices)
        with rng, torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(int(params.seed))
            out = self.model.generate(**kwargs)
        generated = out[:, width:].cpu().tolist()

        results = []
        for i, r in enumerate(requests):
            end = stopper.ended_at[i]
            reason = stopper.reason[i]
            stream = stopper.streams[i]
            if end is None:  # generate stopped on its own (max length reached)
                end, reason = min(len(generated[i]), limits[i]), "length"
                if stream is not None:  # feed the stream whatever the stopper did not see
                    for tok in generated[i][len(stream.token_ids):end]:
                        stopper.emit(i, stream.push(tok))
                    if stream.stopped:
                        end, reason = len(stream.token_ids), "stop"
                    stopper.emit(i, stream.finish())
            toks = generated[i][:end]
            text = stream.text if stream is not None else self._decode(toks)
            ttft = stopper.first_token_at - started if toks and stopper.first_token_at is not None else None
            results.append(GenerationResult(
                text=text, token_ids=toks, finish_reason=reason,
                prompt_tokens=len(r.prompt_ids), completion_tokens=len(toks), time_to_first_token_s=ttft,
            ))
        return results
