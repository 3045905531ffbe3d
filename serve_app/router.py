"""The HTTP ingress: an OpenAI-compatible API in front of the model deployments.

It validates requests, routes each to its model's deployment and shapes the answer as
the OpenAI API does, so the official ``openai`` client works with ``base_url`` pointed
here. It is the single error boundary: every error, wherever raised, becomes an
OpenAI-style body ``{"error": {"message", "type", "param", "code"}}`` here, and nowhere
else.
"""

# No `from __future__ import annotations`: Serve's ingress re-signs these methods and
# FastAPI then cannot resolve string annotations, turning bodies into query params.
import asyncio
import base64
import binascii
import logging
import time
import uuid
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig, ModelConfig
from serve_app.core.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    ServeAppError,
)

logger = logging.getLogger("ray.serve")

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


class _SamplingBody(_Body):
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    logprobs: Optional[Union[bool, int]] = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionBody(_SamplingBody):
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


class ChatCompletionBody(_SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1)


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


# ---- helpers ----------------------------------------------------------------------


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


def _usage(prompt_tokens: int, completion_tokens: Optional[int] = None) -> dict:
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + (completion_tokens or 0)}
    if completion_tokens is not None:
        usage["completion_tokens"] = completion_tokens
    return usage


def _unwrap(exc: BaseException) -> BaseException:
    """The original exception behind Ray's wrappers (RayTaskError keeps it as .cause)."""
    for _ in range(5):  # bounded: a cause chain is never legitimately deep
        cause = getattr(exc, "cause", None)
        if not isinstance(cause, BaseException):
            break
        exc = cause
    return exc


def error_response(exc: ServeAppError, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(status_code=exc.status_code, content=exc.to_body(), headers=headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc) -> str:
    """'messages.0.role' from pydantic's loc, without 'body' and union-branch tags."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif part != "body" and part.isidentifier() and part not in _TYPE_TAGS:
            parts.append(part)
    return ".".join(parts)


def _validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors() or [{"loc": (), "msg": "invalid request", "type": "value_error"}]
    if errors[0].get("type") == "json_invalid":
        return error_response(InvalidRequestError("request body is not valid JSON", code="invalid_json"))
    param = _field_path(errors[0].get("loc", ()))
    # A union field (str | list[str]) reports one error per branch: say them together.
    same_field = [e for e in errors if _field_path(e.get("loc", ())) == param]
    reasons = " or ".join(dict.fromkeys(e["msg"] for e in same_field))
    message = f"{param}: {reasons}" if param else reasons
    others = len(errors) - len(same_field)
    if others:
        message += f" (and {others} more problem{'s' if others > 1 else ''})"
    return error_response(InvalidRequestError(message, param=param or None, code="invalid_value"))


# ---- the ingress ----------------------------------------------------------------------

api = FastAPI(title="serve_app", description="Hugging Face models on Ray Serve, OpenAI-compatible.")


@api.exception_handler(RequestValidationError)
async def _on_validation_error(request: Request, exc: RequestValidationError):
    return _validation_error_response(exc)


@api.exception_handler(ServeAppError)
async def _on_serve_app_error(request: Request, exc: ServeAppError):
    return error_response(exc)


@api.exception_handler(Exception)
async def _on_unexpected_error(request: Request, exc: Exception):
    original = _unwrap(exc)
    if isinstance(original, ServeAppError):
        return error_response(original)
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(ServeAppError("internal server error; see the server log", code="internal_error"))


@serve.deployment
@serve.ingress(api)
class Router:
    def __init__(self, app_config: dict, model_handles: dict[str, DeploymentHandle]):
        self.config = AppConfig.model_validate(app_config)
        self.models: dict[str, ModelConfig] = {m.name: m for m in self.config.models}
        self.handles = model_handles
        self.created = int(time.time())

    def _model(self, name: str, task: str, endpoint: str) -> ModelConfig:
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models))
            raise ModelNotFoundError(f"model {name!r} does not exist; this service serves: {known}")
        if model.task != task:
            raise InvalidRequestError(
                f"model {name!r} is a {model.task} model; {endpoint} needs a {task} model",
                param="model",
                code="wrong_task",
            )
        return model

    async def _call(self, model: ModelConfig, method: str, *args, **kwargs) -> Any:
        response = getattr(self.handles[model.name], method).remote(*args, **kwargs)
        try:
            return await asyncio.wait_for(response, timeout=self.config.router.request_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise DeadlineExceededError(
                f"model {model.name!r} did not answer within {self.config.router.request_timeout_s}s", code="timeout"
            ) from None
        except Exception as exc:
            original = _unwrap(exc)
            if isinstance(original, ServeAppError):
                raise original from None
            raise

    # ---- endpoints ---------------------------------------------------------------

    @api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok", "models": sorted(self.models)}

    @api.get("/v1/models")
    async def list_models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {"id": m.name, "object": "model", "created": self.created, "owned_by": "serve_app", "task": m.task}
                for m in self.config.models
            ],
        }

    @api.get("/v1/stats")
    async def stats(self) -> dict:
        """Batching counters per model, as seen by the replica that answers."""
        names = list(self.models)
        snapshots = await asyncio.gather(*(self._call(self.models[n], "get_stats") for n in names))
        return {"models": dict(zip(names, snapshots))}

    @api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingBody) -> dict:
        model = self._model(body.model, "embedding", "/v1/embeddings")
        if body.dimensions is not None:
            raise InvalidRequestError("'dimensions' is not supported; omit it for the model's full size", param="dimensions")
        texts = _as_list(body.input, "input", model.max_inputs_per_request)
        out = await self._call(model, "embed", texts)
        data = []
        for index, vector in enumerate(out["embeddings"]):
            if body.encoding_format == "base64":
                # OpenAI's base64 format: little-endian float32 bytes (the openai client's default).
                encoded: Any = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
            else:
                encoded = vector
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        return {"object": "list", "data": data, "model": model.name, "usage": _usage(out["prompt_tokens"])}

    def _sampling_args(self, body: _SamplingBody, model: ModelConfig, max_tokens: Optional[int]) -> dict:
        limits = model.generation
        if body.stream:
            raise InvalidRequestError("stream=true is not supported yet; send stream=false", param="stream")
        if body.n != 1:
            raise InvalidRequestError("only n=1 is supported", param="n")
        if body.logprobs:
            raise InvalidRequestError("logprobs are not supported", param="logprobs")
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
        return {
            "max_tokens": max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stop": stop,
            "seed": body.seed,
        }

    @api.post("/v1/completions")
    async def completions(self, body: CompletionBody) -> dict:
        model = self._model(body.model, "text-generation", "/v1/completions")
        if body.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        prompts = _as_list(body.prompt, "prompt", model.max_inputs_per_request)
        sampling = self._sampling_args(body, model, body.max_tokens)
        results = await self._call(model, "generate", prompts=prompts, **sampling)
        choices = [
            {"index": i, "text": r["text"], "logprobs": None, "finish_reason": r["finish_reason"]}
            for i, r in enumerate(results)
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model.name,
            "choices": choices,
            "usage": _usage(sum(r["prompt_tokens"] for r in results), sum(r["completion_tokens"] for r in results)),
        }

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionBody) -> dict:
        model = self._model(body.model, "text-generation", "/v1/chat/completions")
        if not body.messages:
            raise InvalidRequestError("'messages' must not be empty", param="messages")
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
        ]
        sampling = self._sampling_args(body, model, body.max_completion_tokens or body.max_tokens)
        (result,) = await self._call(model, "generate", messages=messages, **sampling)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model.name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result["text"]},
                    "logprobs": None,
                    "finish_reason": result["finish_reason"],
                }
            ],
            "usage": _usage(result["prompt_tokens"], result["completion_tokens"]),
        }

    @api.post("/v1/classify")
    async def classify(self, body: ClassifyBody) -> dict:
        if (body.input is None) == (body.image is None):
            raise InvalidRequestError("send exactly one of 'input' (text) or 'image' (base64)", param="input")
        if body.input is not None:
            model = self._model(body.model, "text-classification", "/v1/classify with 'input'")
            texts = _as_list(body.input, "input", model.max_inputs_per_request)
            call = ("classify_texts", texts)
        else:
            model = self._model(body.model, "image-classification", "/v1/classify with 'image'")
            encoded = _as_list(body.image, "image", model.max_inputs_per_request)
            param = lambda i: "image" if len(encoded) == 1 else f"image[{i}]"  # noqa: E731
            call = ("classify_images", [_decode_image(e, param(i)) for i, e in enumerate(encoded)])
        if body.top_k > model.top_k_limit:
            raise InvalidRequestError(f"top_k is {body.top_k}; at most {model.top_k_limit} allowed", param="top_k")
        out = await self._call(model, call[0], call[1], body.top_k)
        data = [
            {"index": i, "labels": [{"label": label, "score": score} for label, score in ranked]}
            for i, ranked in enumerate(out["results"])
        ]
        return {"object": "list", "model": model.name, "data": data, "usage": _usage(out["prompt_tokens"])}
