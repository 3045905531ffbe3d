"""The OpenAI wire format: request bodies, their translation into typed model calls,
response and stream-chunk builders, and server-sent-event framing.

Request-shape checks live here and only here: OpenAI's field names and ranges
(pydantic) and the limits the model's config sets (inputs per request, max_tokens,
stop sequences, top_k). What needs the model itself (token counts against the context
window) is the replica's to check.
"""

# No `from __future__ import annotations`: FastAPI resolves these bodies' annotations
# at run time, and Serve's ingress re-signs the endpoints that take them.
import base64
import binascii
import dataclasses
import io
import json
import time
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.config import ModelConfig
from serve_app.core.calls import (
    ChatTurn,
    ClassifyCall,
    ClassifyResult,
    EmbedCall,
    EmbedResult,
    GenerateCall,
    GenerateResult,
    ResponseFormat,
    SamplingParams,
    TokenLogprob,
)
from serve_app.core.errors import InvalidRequestError

# ---- request bodies (OpenAI's field names and ranges) ----------------------------

# What torch's generators (ours and vLLM's) accept as a seed; a larger one overflowed
# there, a 500 after the request was queued.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# Declared pixels (width x height, read from the headers before anything is decoded)
# of all the images of one classify request together. Each image is also capped on
# its own at the replica (core.models.encoders.MAX_IMAGE_PIXELS).
MAX_REQUEST_IMAGE_PIXELS = 64_000_000
# What PIL may open: anything else is refused before a decoder for it ever runs.
# (Its JPEG opener also opens MPO, the JPEG variant many phone cameras write.)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


class _Request(BaseModel):
    """A request object in which an explicit ``null`` means "not given": OpenAI accepts
    it for every optional field and clients send it (``"temperature": null``), so null
    fields are dropped before validation and take their defaults. A required field
    sent as null is reported as missing."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class _Body(_Request):
    # Unknown OpenAI fields are ignored as OpenAI's own server ignores them, but the
    # ones that would change the answer and that we do not implement are refused below.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1)
    user: Optional[str] = None


# OpenAI's inputs as token ids: one input as a list of ids, or several as a list of lists
# (LangChain's OpenAIEmbeddings sends these by default). Ids are checked against the
# model's vocabulary in the replica, and cached by the ids.
TokenIds = list[int]


class EmbeddingBody(_Body):
    input: Union[str, list[str], TokenIds, list[TokenIds]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)


class StreamOptions(_Request):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# Fields of other OpenAI-compatible servers (vLLM's sampling extensions) that change
# the answer and that we do not implement, with the values that change nothing (and
# are accepted). Any other value is a 400 naming the field rather than an answer that
# silently ignores it.
_UNSUPPORTED_EXTENSIONS: dict[str, tuple] = {
    "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,), "length_penalty": (1,),
    "min_tokens": (0,), "ignore_eos": (False,), "stop_token_ids": ([],), "bad_words": ([],),
    "allowed_token_ids": (), "use_beam_search": (False,), "prompt_logprobs": (),
    "include_stop_str_in_output": (False,), "truncate_prompt_tokens": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "logits_processors": (), "vllm_xargs": (),
    "chat_template": (), "chat_template_kwargs": ({},), "add_generation_prompt": (True,),
    "continue_final_message": (False,), "echo": (False,),  # chat's echo (completions declare theirs)
    # OpenAI fields for what these models cannot do at all.
    "audio": (), "modalities": (["text"],), "reasoning_effort": (), "verbosity": (), "web_search_options": (),
}
# Ignored because they cannot change the answer: user, metadata, store, service_tier,
# prediction (a latency hint), parallel_tool_calls (tools are refused), safety_identifier,
# prompt_cache_key, and any field not named anywhere here.


def _token_id(key: str) -> int:
    if not (key.isascii() and key.isdigit()):  # isdigit alone also takes "１" and "²"
        raise ValueError(f"logit_bias keys are token ids (non-negative integers as strings), got {key!r}")
    return int(key)


class SamplingBody(_Body):
    # Extra fields are kept (not ignored) only so that the ones that would change the
    # answer (_UNSUPPORTED_EXTENSIONS) can be refused by name; the rest are never read.
    model_config = ConfigDict(extra="allow")

    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Union[bool, int]] = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Token id (as a string, JSON keys are strings) -> bias added to its logit.
    logit_bias: Optional[dict[str, float]] = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_in_range(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key, bias in (value or {}).items():
            _token_id(key)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias} for token {key}")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """The bias as sorted (token id, bias) pairs: hashable, and one order for the cache key."""
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            pairs[_token_id(key)] = float(bias)  # "007" and "7" are one token
        return tuple(sorted(pairs.items()))

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionBody(SamplingBody):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1)


class _TextPart(_Request):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    model_config = ConfigDict(extra="ignore")
    # "tool" and "function" (tool results) parse so that chat_call can refuse them by name.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # None: an assistant turn without text (OpenAI's tool-call turns send content: null).
    content: Optional[Union[str, list[_TextPart]]] = None
    tool_calls: Optional[list[dict]] = None
    function_call: Optional[dict] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JSONSchemaFormat(_Request):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict = Field(alias="schema")
    strict: Optional[bool] = None


class ResponseFormatBody(_Request):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class ChatCompletionBody(SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormatBody] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[Union[str, dict]] = None
    # OpenAI's deprecated form of tools; refused like them.
    functions: Optional[list[dict]] = None
    function_call: Optional[Union[str, dict]] = None

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class ClassifyBody(_Body):
    input: Optional[Union[str, list[str]]] = None
    image: Optional[Union[str, list[str]]] = Field(
        None, description="Base64-encoded image bytes (optionally a data: URL); never fetched from a URL."
    )
    top_k: int = Field(1, ge=1)

    @field_validator("image")
    @classmethod
    def _no_urls(cls, value):
        images = [value] if isinstance(value, str) else (value or [])
        if any(item.startswith(("http://", "https://")) for item in images):
            raise ValueError("images must be sent as base64, not fetched from a URL")
        return value

    @property
    def task(self) -> str:
        """The task this body asks for; exactly one of input or image must be given."""
        if (self.input is None) == (self.image is None):
            raise InvalidRequestError("send exactly one of 'input' (text) or 'image' (base64)", param="input")
        return "text-classification" if self.input is not None else "image-classification"


# ---- bodies -> typed calls ------------------------------------------------------------


def _inputs(value: Union[str, list[str], TokenIds, list[TokenIds]], field: str,
            limit: int) -> list[Union[str, tuple[int, ...]]]:
    """Texts, or token-id inputs as tuples: ``[1, 2]`` is one input, ``[[1, 2], [3]]`` two."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return _as_list([tuple(value)], field, limit)
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        empty = next((i for i, v in enumerate(value) if not v), None)
        if empty is not None:
            raise InvalidRequestError(f"{field}[{empty}] is an empty list of token ids", param=field)
        return _as_list([tuple(v) for v in value], field, limit)
    return _as_list(value, field, limit)


def _as_list(value, field: str, limit: int) -> list:
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise InvalidRequestError(f"'{field}' must not be empty", param=field)
    if len(items) > limit:
        raise InvalidRequestError(
            f"'{field}' has {len(items)} items; this model accepts at most {limit} per request", param=field
        )
    return items


def _decode_image(data: str, param: str) -> bytes:
    if data.startswith("data:"):
        _, _, data = data.partition(",")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image is not valid base64", param=param) from None
    if not raw:
        raise InvalidRequestError("image is empty", param=param)
    return raw


def _declared_pixels(raw: bytes, param: str) -> int:
    """Width x height from the image's header; nothing is decoded (PIL opens lazily).
    0 for bytes that are no PNG, JPEG or WebP header: the replica, which opens images
    with the same formats only, refuses those with the reason."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS) as img:
            width, height = img.size
    except Image.DecompressionBombError:  # PIL's own limit, far above ours
        raise InvalidRequestError("image is too large; send a smaller image", param=param) from None
    except Exception:  # PIL raises many types for bytes that are not an image it may open
        return 0
    return width * height


def _check_image_pixels(images: list[bytes]) -> None:
    """Every image of a request decodes on the replica; their declared sizes together
    bound that work before any of it is done (a 160 KB PNG can declare 7000x7000)."""
    params = ["image"] if len(images) == 1 else [f"image[{i}]" for i in range(len(images))]
    total = 0
    for raw, param in zip(images, params):
        total += _declared_pixels(raw, param)
        if total > MAX_REQUEST_IMAGE_PIXELS:
            raise InvalidRequestError(
                f"the images of this request have more than {MAX_REQUEST_IMAGE_PIXELS} pixels together "
                f"(width x height, summed; exceeded at {param}); send fewer or smaller images",
                param=param,
            )


def embed_call(body: EmbeddingBody, model: ModelConfig) -> EmbedCall:
    if body.dimensions is not None:
        raise InvalidRequestError("'dimensions' is not supported; omit it for the model's full size", param="dimensions")
    return EmbedCall(texts=tuple(_inputs(body.input, "input", model.max_inputs_per_request)))


def classify_call(body: ClassifyBody, model: ModelConfig) -> ClassifyCall:
    if body.input is not None:
        inputs = {"texts": tuple(_as_list(body.input, "input", model.max_inputs_per_request))}
    else:
        encoded = _as_list(body.image, "image", model.max_inputs_per_request)
        images = [_decode_image(e, "image" if len(encoded) == 1 else f"image[{i}]") for i, e in enumerate(encoded)]
        _check_image_pixels(images)
        inputs = {"images": tuple(images)}
    if body.top_k > model.top_k_limit:
        raise InvalidRequestError(f"top_k is {body.top_k}; at most {model.top_k_limit} allowed", param="top_k")
    return ClassifyCall(top_k=body.top_k, **inputs)


def _refuse_unsupported(body: SamplingBody) -> None:
    """A 400 naming the first extension field that would change the answer (see
    _UNSUPPORTED_EXTENSIONS); nulls were already dropped as absent."""
    for field, value in (body.model_extra or {}).items():
        harmless = _UNSUPPORTED_EXTENSIONS.get(field)
        # isinstance(.., bool) apart: True == 1, but "repetition_penalty": true is no default.
        if harmless is not None and not any(
                value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in harmless):
            raise InvalidRequestError(f"'{field}' is not supported by this server; send the request without it",
                                      param=field)


def _generate_call(body: SamplingBody, model: ModelConfig, **inputs: Any) -> GenerateCall:
    _refuse_unsupported(body)
    limits = model.generation
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")
    if body.n > limits.max_choices:
        raise InvalidRequestError(f"n is {body.n}; this model allows at most {limits.max_choices}", param="n")
    asked = body.requested_max_tokens()
    max_tokens = limits.default_max_tokens if asked is None else asked
    if max_tokens > limits.max_tokens_limit:
        raise InvalidRequestError(
            f"max_tokens is {max_tokens}; this model allows at most {limits.max_tokens_limit}", param="max_tokens"
        )
    stop = body.stop_list()
    if len(stop) > limits.max_stop_sequences:
        raise InvalidRequestError(
            f"{len(stop)} stop sequences given; at most {limits.max_stop_sequences} allowed", param="stop"
        )
    if any(not s for s in stop):
        raise InvalidRequestError("stop sequences must not be empty strings", param="stop")
    sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                              logit_bias=body.logit_bias_pairs())
    return GenerateCall(max_tokens=max_tokens, sampling=sampling, stop=tuple(stop), n=body.n,
                        max_tokens_defaulted=asked is None, **inputs)


def _logprobs(top: Optional[int], model: ModelConfig, param: str) -> Optional[int]:
    """The call's logprobs: None (not asked) or how many alternatives per token."""
    if top is None:
        return None
    limit = model.generation.max_top_logprobs
    if top > limit:
        raise InvalidRequestError(f"{param} is {top}; this model allows at most {limit}", param=param)
    return top


def completion_call(body: CompletionBody, model: ModelConfig) -> GenerateCall:
    if body.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
    if body.suffix:  # insertion: text after the completion changes what it says
        raise InvalidRequestError("suffix is not supported; send the request without it", param="suffix")
    if body.best_of is not None and body.best_of != body.n:  # best_of == n: every sample is returned
        raise InvalidRequestError("best_of is not supported; use n for several completions", param="best_of")
    prompts = _inputs(body.prompt, "prompt", model.max_inputs_per_request)
    if isinstance(body.logprobs, bool):  # the legacy field is a count; true would read as 1
        raise InvalidRequestError("logprobs is a number of alternatives per token (0-5) on /v1/completions",
                                  param="logprobs")
    if body.logprobs is not None and body.logprobs < 0:
        raise InvalidRequestError("logprobs must be >= 0", param="logprobs")
    call = _generate_call(body, model, prompts=tuple(prompts))
    return dataclasses.replace(call, logprobs=_logprobs(body.logprobs, model, "logprobs"))


def _check_message(message: ChatMessage, index: int) -> None:
    """Turns that only a tool-calling conversation has are refused by name (tools are),
    rather than dropped from the prompt, which would change the answer."""
    if message.role in ("tool", "function"):
        raise InvalidRequestError(f"'{message.role}' messages (tool results) are not supported yet",
                                  param=f"messages.{index}.role")
    for field in ("tool_calls", "function_call"):
        if getattr(message, field):
            raise InvalidRequestError(f"assistant {field} in the conversation are not supported yet",
                                      param=f"messages.{index}.{field}")
    if message.content is None and message.role != "assistant":
        raise InvalidRequestError(f"a {message.role} message needs content", param=f"messages.{index}.content")


def chat_call(body: ChatCompletionBody, model: ModelConfig) -> GenerateCall:
    if not body.messages:
        raise InvalidRequestError("'messages' must not be empty", param="messages")
    for index, message in enumerate(body.messages):
        _check_message(message, index)
    if body.functions:
        raise InvalidRequestError("function calls are not supported yet; send the request without 'functions'",
                                  param="functions")
    # Without tools "none" and "auto" ask nothing; anything else asks for a call we cannot make.
    if not body.tools and body.tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError("tool_choice needs tools, which are not supported yet", param="tool_choice")
    if body.function_call not in (None, "none", "auto"):
        raise InvalidRequestError("function_call is not supported yet", param="function_call")
    turns = tuple(ChatTurn("system" if m.role == "developer" else m.role, m.text()) for m in body.messages)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = _logprobs(body.top_logprobs or 0, model, "top_logprobs") if body.logprobs else None
    response_format = None
    if body.response_format is not None and body.response_format.type != "text":
        if body.response_format.type == "json_schema":
            if body.response_format.json_schema is None:
                raise InvalidRequestError("response_format json_schema needs a 'json_schema' object with a 'schema'",
                                          param="response_format")
            schema = json.dumps(body.response_format.json_schema.json_schema, sort_keys=True, separators=(",", ":"))
            response_format = ResponseFormat(type="json_schema", schema=schema)
        else:
            response_format = ResponseFormat(type="json_object")
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = json.dumps(body.tools, sort_keys=True, separators=(",", ":"))
    call = _generate_call(body, model, messages=turns)
    return dataclasses.replace(call, logprobs=logprobs, response_format=response_format, tools=tools)


# ---- responses ------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: Optional[int] = None) -> dict:
    counts = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + (completion_tokens or 0)}
    if completion_tokens is not None:
        counts["completion_tokens"] = completion_tokens
    return counts


def embeddings_response(result: EmbedResult, model: str, encoding_format: str) -> dict:
    data = []
    for index, vector in enumerate(result.embeddings):
        if encoding_format == "base64":
            # OpenAI's base64 format: little-endian float32 bytes (the openai client's default).
            encoded: Any = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        else:
            encoded = vector
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    return {"object": "list", "data": data, "model": model, "usage": usage(result.prompt_tokens)}


def classify_response(result: ClassifyResult, model: str) -> dict:
    data = [
        {"index": i, "labels": [{"label": label, "score": score} for label, score in ranked]}
        for i, ranked in enumerate(result.rankings)
    ]
    return {"object": "list", "model": model, "data": data, "usage": usage(result.prompt_tokens)}


def completion_logprobs(logprobs: Optional[tuple[TokenLogprob, ...]], text_offset: int = 0) -> Optional[dict]:
    """OpenAI's legacy completions ``logprobs`` object."""
    if logprobs is None:
        return None
    offsets, position = [], text_offset
    for token in logprobs:
        offsets.append(position)
        position += len(token.token)
    return {
        "tokens": [t.token for t in logprobs],
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [dict(t.top) for t in logprobs],
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: Optional[tuple[TokenLogprob, ...]]) -> Optional[dict]:
    """OpenAI's chat ``logprobs`` object (``content``: one entry per token)."""
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(tok, lp) for tok, lp in t.top]}
                        for t in logprobs]}


def completion_response(result: GenerateResult, model: str) -> dict:
    choices = [
        {"index": i, "text": c.text, "logprobs": completion_logprobs(c.logprobs), "finish_reason": c.finish_reason}
        for i, c in enumerate(result.completions)
    ]
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result.prompt_tokens, result.completion_tokens),
    }


def chat_response(result: GenerateResult, model: str) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(result.completions)
        ],
        "usage": usage(result.prompt_tokens, result.completion_tokens),
    }


# ---- streamed responses ---------------------------------------------------------------


class ChunkFormat:
    """OpenAI's chunks of one streamed completion (``text_completion``)."""

    object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str):
        self.head = {"id": f"{self.id_prefix}-{uuid.uuid4().hex}", "object": self.object_name,
                     "created": int(time.time()), "model": model}
        # Per choice: how much text its earlier chunks carried, where the next chunk's
        # logprob text_offset starts (OpenAI's offsets run over the whole completion).
        self._sent_chars: dict[int, int] = {}

    def opening(self, choices: int = 1) -> list[dict]:
        return []  # completions chunks carry no role announcement

    def _choice(self, index: int, text: Optional[str]) -> dict:
        return {"index": index, "text": text or ""}

    def _logprobs(self, logprobs: Optional[tuple[TokenLogprob, ...]], text_offset: int) -> Optional[dict]:
        return completion_logprobs(logprobs, text_offset)

    def text(self, index: int, text: str, logprobs: Optional[tuple[TokenLogprob, ...]] = None) -> dict:
        offset = self._sent_chars.get(index, 0)
        self._sent_chars[index] = offset + len(text)
        return {**self.head, "choices": [{**self._choice(index, text), "logprobs": self._logprobs(logprobs, offset),
                                          "finish_reason": None}]}

    def finish(self, index: int, finish_reason: str) -> dict:
        return {**self.head, "choices": [{**self._choice(index, None), "logprobs": None,
                                          "finish_reason": finish_reason}]}

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self.head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


class ChatChunkFormat(ChunkFormat):
    """OpenAI's ``chat.completion.chunk`` events."""

    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def opening(self, choices: int = 1) -> list[dict]:  # OpenAI's first chunk of each choice announces the role
        return [{**self.head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]} for i in range(choices)]

    def _choice(self, index: int, text: Optional[str]) -> dict:
        return {"index": index, "delta": {} if text is None else {"content": text}}

    def _logprobs(self, logprobs: Optional[tuple[TokenLogprob, ...]], text_offset: int) -> Optional[dict]:
        return chat_logprobs(logprobs)  # chat logprobs carry no offsets


def sse(payload: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
