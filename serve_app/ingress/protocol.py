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
import json
import time
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

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


class _Body(BaseModel):
    # Unknown OpenAI fields are ignored as OpenAI's own server ignores them, but the
    # ones that would change the answer and that we do not implement are refused below.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1)
    user: Optional[str] = None


class EmbeddingBody(_Body):
    input: Union[str, list[str]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingBody(_Body):
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Union[bool, int]] = None

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
    prompt: Union[str, list[str]]
    echo: bool = False


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[_TextPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict = Field(alias="schema")
    strict: Optional[bool] = None


class ResponseFormatBody(BaseModel):
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


def _as_list(value: Union[str, list[str]], field: str, limit: int) -> list[str]:
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


def embed_call(body: EmbeddingBody, model: ModelConfig) -> EmbedCall:
    if body.dimensions is not None:
        raise InvalidRequestError("'dimensions' is not supported; omit it for the model's full size", param="dimensions")
    return EmbedCall(texts=tuple(_as_list(body.input, "input", model.max_inputs_per_request)))


def classify_call(body: ClassifyBody, model: ModelConfig) -> ClassifyCall:
    if body.input is not None:
        inputs = {"texts": tuple(_as_list(body.input, "input", model.max_inputs_per_request))}
    else:
        encoded = _as_list(body.image, "image", model.max_inputs_per_request)
        inputs = {"images": tuple(_decode_image(e, "image" if len(encoded) == 1 else f"image[{i}]")
                                  for i, e in enumerate(encoded))}
    if body.top_k > model.top_k_limit:
        raise InvalidRequestError(f"top_k is {body.top_k}; at most {model.top_k_limit} allowed", param="top_k")
    return ClassifyCall(top_k=body.top_k, **inputs)


def _generate_call(body: SamplingBody, model: ModelConfig, **inputs: Any) -> GenerateCall:
    limits = model.generation
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")
    if body.n > limits.max_choices:
        raise InvalidRequestError(f"n is {body.n}; this model allows at most {limits.max_choices}", param="n")
    max_tokens = body.requested_max_tokens()
    max_tokens = limits.default_max_tokens if max_tokens is None else max_tokens
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
    sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed)
    return GenerateCall(max_tokens=max_tokens, sampling=sampling, stop=tuple(stop), n=body.n, **inputs)


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
    prompts = _as_list(body.prompt, "prompt", model.max_inputs_per_request)
    if isinstance(body.logprobs, bool):  # the legacy field is a count; true would read as 1
        raise InvalidRequestError("logprobs is a number of alternatives per token (0-5) on /v1/completions",
                                  param="logprobs")
    if body.logprobs is not None and body.logprobs < 0:
        raise InvalidRequestError("logprobs must be >= 0", param="logprobs")
    call = _generate_call(body, model, prompts=tuple(prompts))
    return dataclasses.replace(call, logprobs=_logprobs(body.logprobs, model, "logprobs"))


def chat_call(body: ChatCompletionBody, model: ModelConfig) -> GenerateCall:
    if not body.messages:
        raise InvalidRequestError("'messages' must not be empty", param="messages")
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

    def opening(self, choices: int = 1) -> list[dict]:
        return []  # completions chunks carry no role announcement

    def _choice(self, index: int, text: Optional[str]) -> dict:
        return {"index": index, "text": text or ""}

    def _logprobs(self, logprobs: Optional[tuple[TokenLogprob, ...]]) -> Optional[dict]:
        return completion_logprobs(logprobs)

    def text(self, index: int, text: str, logprobs: Optional[tuple[TokenLogprob, ...]] = None) -> dict:
        return {**self.head, "choices": [{**self._choice(index, text), "logprobs": self._logprobs(logprobs),
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

    def _logprobs(self, logprobs: Optional[tuple[TokenLogprob, ...]]) -> Optional[dict]:
        return chat_logprobs(logprobs)


def sse(payload: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
