"""Causal LM text generation: one left-padded generate() call for many rows
(:class:`GenerationRuntime`), each row stopping, streaming and cancelled on its own."""

from __future__ import annotations

import copy
import json
import logging
import secrets
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from serve_app.core.calls import SamplingParams
from serve_app.core.errors import ContextLengthExceededError, InvalidRequestError
from serve_app.core.models.base import TaskRuntime, token_id_input, vocabulary_size
from serve_app.core.decoding.sampling import seeded_generator, top_p_filter
from serve_app.core.decoding.streaming import TextStream

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


def row_generators(n: int, seed: int | None, device: torch.device) -> list[torch.Generator] | torch.Generator:
    """The random generators for ``n`` sampled rows.

    With a seed, one generator per row, each seeded with it: a row draws from its own
    stream, so its tokens are the same alone or beside any other rows (and the global
    RNG, which other threads use, is left alone). Without a seed, one freshly seeded
    generator for the whole call: nothing is promised about those rows, so they share
    it and sample in one batched draw.
    """
    if seed is None:
        return seeded_generator(None, device)
    return [seeded_generator(seed, device) for _ in range(n)]


class _RowSampler:
    """A logits processor that samples each row's next token (temperature, then top_p)
    with the row's own generator and returns scores where only that token is finite.

    It must run last, with greedy decoding: the model's other processors (repetition
    penalty from its generation_config) have already shaped the scores it samples from.
    """

    def __init__(self, temperature: float, top_p: float, generators: list[torch.Generator] | torch.Generator):
        self.temperature = temperature
        self.top_p = top_p
        self.generators = generators

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.float() / self.temperature
        if self.top_p < 1.0:
            scores = top_p_filter(scores, self.top_p)
        probs = scores.softmax(dim=-1)
        if isinstance(self.generators, torch.Generator):  # unseeded rows: one batched draw
            chosen = torch.multinomial(probs, 1, generator=self.generators)
        else:
            chosen = torch.cat([torch.multinomial(probs[i], 1, generator=g)
                                for i, g in enumerate(self.generators)]).unsqueeze(1)
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, chosen, 0.0)


# ---------------------------------------------------------------- chat prompts

# Per tokenizer: the ids and strings of its control tokens (special added tokens).
_CONTROL_TOKENS: "weakref.WeakKeyDictionary[Any, tuple[frozenset[int], tuple[str, ...]]]" = weakref.WeakKeyDictionary()


def control_tokens(tokenizer: Any) -> tuple[frozenset[int], tuple[str, ...]]:
    """The ids and strings of the tokens a chat template uses as markup: the
    tokenizer's special tokens and every added token flagged special
    (``<|im_start|>``, ``<|eot_id|>``, reserved ids). Non-special added tokens are left
    out: some tokenizers add ordinary text (runs of spaces) that way."""
    try:
        return _CONTROL_TOKENS[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or ())}
    strings = {str(t) for t in (getattr(tokenizer, "all_special_tokens", None) or ())}
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
            strings.add(str(getattr(token, "content", token)))
    found = (frozenset(ids), tuple(sorted(s for s in strings if s)))
    try:
        _CONTROL_TOKENS[tokenizer] = found
    except TypeError:  # not weak-referenceable: computed each time
        pass
    return found


def _render(tokenizer: Any, messages: list[dict], **template: Any) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template)
    except Exception as exc:  # templates raise on orders they do not support (jinja raise_exception)
        raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}",
                                  param="messages") from exc


def _content_spans(tokenizer: Any, messages: list[dict], text: str, **template: Any) -> list[tuple[int, int]] | None:
    """Where each message's content lies in ``text`` (the rendered chat), or None if
    that cannot be told for sure.

    The template is rendered again with a unique marker for each content; the text
    between the markers is the template's own. If the template's pieces with the real
    contents put back (as they are, or trimmed, as Llama 3's template does) give
    ``text`` exactly, the contents' spans are known.
    """
    tag = secrets.token_hex(8)
    texts = [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]  # not a tool turn's None
    marks = {i: f"CONTENT{tag}X{i}X" for i in texts}
    try:
        marked = tokenizer.apply_chat_template(
            [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)],
            tokenize=False, add_generation_prompt=True, **template)
    except Exception:
        return None
    pieces, rest = [], marked
    for i in texts:
        if rest.count(marks[i]) != 1:
            return None  # the template dropped or repeated a content (e.g. a system prompt moved)
        before, rest = rest.split(marks[i])
        pieces.append(before)
    for shape in (lambda c: c, str.strip):
        spans, built = [], ""
        for piece, i in zip(pieces, texts):
            built += piece
            content = shape(messages[i]["content"])
            spans.append((len(built), len(built) + len(content)))
            built += content
        if built + rest == text:
            return spans
    return None


_PLAIN_COPIES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()  # tokenizer -> its copy


def _plain_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with any special-token strings in it split as ordinary text.

    On a copy of the tokenizer: split_special_tokens switches a flag of the Rust backend,
    which must not change under the engine thread decoding with the same tokenizer
    ("Already borrowed")."""
    try:
        plain = _PLAIN_COPIES[tokenizer]
    except (KeyError, TypeError):
        plain = copy.deepcopy(tokenizer)
        try:
            _PLAIN_COPIES[tokenizer] = plain
        except TypeError:  # not weak-referenceable: copied each time
            pass
    return list(plain(text, add_special_tokens=False, split_special_tokens=True, truncation=False,
                      verbose=False)["input_ids"])


def encode_chat_template(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of a chat through the tokenizer's chat template plus the assistant prompt,
    where the template's markup is control tokens and the messages' contents are text.

    Tokenizing the rendered chat as one string would turn a ``<|im_start|>system`` or
    ``<|eot_id|>`` that a user typed into the real control token, letting them forge a
    system or assistant turn. Here each control token that falls inside a message's
    content is replaced by the ordinary tokens of its spelling, so the model reads it
    as text; a chat without such strings gets exactly the ids it always got. Where the
    contents cannot be located in the rendered text (a template that rewrites them) or
    the tokenizer gives no offsets (a slow tokenizer), a content that spells a control
    token is refused instead (400 naming the message).

    ``messages`` are ``{"role", "content"}`` dicts, content strings. Shared by every
    engine (the transformers runtime and vLLM's), so all treat such content alike.
    ``tools`` (OpenAI's definitions) go to templates that render them; they are the
    client's text too, so one that spells a control token is refused.
    """
    control_ids, control_strings = control_tokens(tokenizer)
    template = {"tools": tools} if tools else {}
    if tools and any(s in json.dumps(tools, ensure_ascii=False) for s in control_strings):
        raise InvalidRequestError("tools spell a control token of this model's chat format; remove it", param="tools")
    contents = [m.get("content") if isinstance(m.get("content"), str) else "" for m in messages]
    if not any(s in content for content in contents for s in control_strings):
        # Nothing spelled a control token (the usual case): the template's text
        # tokenized as a whole, as transformers does it (the template holds the special
        # tokens it wants: bos, role markers).
        try:
            return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                      return_dict=False, **template))
        except Exception as exc:  # templates raise on orders they do not support (jinja raise_exception)
            raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}",
                                      param="messages") from exc
    text = _render(tokenizer, messages, **template)
    spans = _content_spans(tokenizer, messages, text, **template)
    encoded = None
    if spans is not None:
        try:
            encoded = tokenizer(text, add_special_tokens=False, truncation=False, verbose=False,
                                return_offsets_mapping=True)
        except (NotImplementedError, TypeError, ValueError):  # slow tokenizers have no offsets
            encoded = None
    if encoded is None:  # some content spells a control token (the check above), so this raises
        for i, content in enumerate(contents):
            found = next((s for s in control_strings if s in content), None)
            if found is not None:
                raise InvalidRequestError(
                    f"messages[{i}].content contains {found!r}, a control token of this model's chat format; "
                    "remove it", param="messages")
    ids: list[int] = []
    for token_id, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        if token_id in control_ids and end > start and any(start < b and a < end for a, b in spans):
            # Spelled by the user, not the template: its characters as plain text. Added
            # tokens are split out before the rest is tokenized, so the tokens around it
            # are the same either way.
            ids.extend(_plain_ids(tokenizer, text[start:end]))
        else:
            ids.append(int(token_id))
    return ids


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

    def encode_prompt(self, prompt: str | tuple[int, ...]) -> list[int]:
        """Token ids of a raw completion prompt (or the ids given, as they are)."""
        if isinstance(prompt, (tuple, list)):
            return self._check_length(token_id_input(prompt, vocabulary_size(self.tokenizer), "prompt"), "prompt")
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
        return self._check_length(encode_chat_template(self.tokenizer, clean), "messages")

    def decoding_kwargs(self) -> dict:
        """What :meth:`generate` passes transformers' generate() besides the inputs and
        limits; the continuous engine builds its logits processors from the same.

        Greedy decoding either way: when sampling, _RowSampler (the last logits
        processor) draws each row's token and leaves only that token finite, so the
        argmax picks it. transformers' own sampling draws the whole batch from one RNG,
        which makes a seeded row's tokens depend on the rows beside it."""
        return dict(min_new_tokens=0, num_beams=1, num_return_sequences=1, pad_token_id=self.pad_token_id,
                    eos_token_id=sorted(self.eos_token_ids) or None,
                    do_sample=False, temperature=None, top_p=None, top_k=None)

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
        result's ``text`` (see :class:`~serve_app.core.decoding.streaming.TextStream` for what is
        held back until the row ends). It must be quick; if it raises, the error is
        logged and that row is cancelled. ``is_cancelled(row_index)`` is asked once per
        step for each running row: True ends that row at this step with finish_reason
        "cancelled", holding only the tokens generated before, while the others go on.

        Sampling (temperature > 0): with ``params.seed`` every row draws from its own
        generator seeded with it, so a row's tokens are the same whatever rows share
        the call; the global torch RNG is never touched.
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
            stopping_criteria=StoppingCriteriaList([stopper]),
            **self.decoding_kwargs(),
        )
        if params.temperature is not None and params.temperature > 0:
            from transformers import LogitsProcessorList

            kwargs["logits_processor"] = LogitsProcessorList([_RowSampler(
                float(params.temperature), float(params.top_p) if params.top_p is not None else 1.0,
                row_generators(n, params.seed, self.device),
            )])
        with torch.inference_mode():
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
