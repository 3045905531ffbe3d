"""The HTTP ingress: an OpenAI-compatible API in front of the model deployments.

This module only wires the parts together and declares the endpoints; each endpoint
reads as: find the model, turn the body into a typed call (``protocol``), answer it
through the response cache (``response_cache``, which calls the model through
``model_client``), shape the OpenAI response (``protocol``). Errors raised anywhere
become OpenAI error bodies in ``http_errors``, the one error boundary.
"""

# No `from __future__ import annotations`: Serve's ingress re-signs these methods and
# FastAPI then cannot resolve string annotations, turning bodies into query params.
import json
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig, ModelConfig
from serve_app.core.auth import ApiKeys
from serve_app.core.calls import GenerateCall, GenerateResult, StreamDelta
from serve_app.core.errors import InvalidRequestError, ModelNotFoundError, ServeAppError
from serve_app.ingress import http_errors, protocol
from serve_app.ingress.middleware import IngressGuard, IngressState, RequestObserver, ingress_state
from serve_app.ingress.model_client import ModelClient, ModelServerBackend
from serve_app.ingress.notes import note
from serve_app.ingress.protocol import ChatCompletionBody, ClassifyBody, CompletionBody, EmbeddingBody
from serve_app.ingress.response_cache import ResponseCache
from serve_app.ingress.status import ServiceStatus
from serve_app.serve_logs import start_log_flusher

logger = logging.getLogger("ray.serve")

api = FastAPI(title="serve_app", description="Hugging Face models on Ray Serve, OpenAI-compatible.")
# The last added runs first: the observer records every request, refused ones included.
api.add_middleware(IngressGuard)
api.add_middleware(RequestObserver)
http_errors.install(api)


def _clip(value: Any, limit: int = 500) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


@serve.deployment
@serve.ingress(api)
class Router:
    def __init__(
        self,
        app_config: dict,
        model_handles: dict[str, DeploymentHandle],
        cache_handle: Optional[DeploymentHandle] = None,
    ):
        start_log_flusher()  # Ray buffers this replica's log lines (serve_app.serve_logs)
        self.config = AppConfig.model_validate(app_config)
        self.models: dict[str, ModelConfig] = {m.name: m for m in self.config.models}
        auth = self.config.auth
        keys = None
        if auth.enabled:  # no keys found fails the replica's start, naming where it looked
            keys = ApiKeys.load(user_env=auth.api_keys_env, user_file=auth.api_keys_file,
                                admin_env=auth.admin_keys_env, admin_file=auth.admin_keys_file)
        logger.info("API keys: %s", "required" if keys else "off")
        self.state = IngressState(keys=keys, max_body_bytes=self.config.router.max_body_bytes)
        router = self.config.router
        self.client = ModelClient(
            {name: ModelServerBackend(h, self.models[name], gather=router.gather_calls, router=router)
             for name, h in model_handles.items()},
            router)
        self.cache = ResponseCache(self.config.cache, cache_handle, self.models, self.client)
        self.status = ServiceStatus(self.models, self.client, self.cache)
        self.created = int(time.time())

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve calls this after __init__, with the copy of ``api`` this replica serves;
        # the middleware reads the replica's state from that copy (see ingress.middleware).
        self.app.state.ingress = self.state
        return self.app

    def _model(self, name: str, task: str, endpoint: str) -> ModelConfig:
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted(self.models))
            raise ModelNotFoundError(f"model {name!r} does not exist; this service serves: {known}")
        note(model=name)
        if model.task != task:
            raise InvalidRequestError(
                f"model {name!r} is a {model.task} model; {endpoint} needs a {task} model",
                param="model",
                code="wrong_task",
            )
        return model

    def _log_payload(self, model: ModelConfig, inputs: Any, outputs: Any = None) -> None:
        """Prompts and answers reach the log only when router.log_payloads asks for it."""
        if self.config.router.log_payloads:
            logger.info("payload model=%s input=%s output=%s", model.name, _clip(inputs), _clip(outputs))

    async def _event_stream(self, model: ModelConfig, call: GenerateCall, chunks: protocol.ChunkFormat,
                            include_usage: bool, deadline: float) -> StreamingResponse:
        """Server-sent events in OpenAI's chunk format for a streamed generation.

        The first model event is awaited here, so anything that fails before the model
        produced a token (a bad prompt, a full queue, an unavailable model) is still a
        plain HTTP error; a failure after it can only be reported in the stream.
        """
        events = self.client.stream(model, call, deadline=deadline)
        first = await events.__anext__()

        async def sse() -> AsyncIterator[bytes]:
            prompt_tokens = completion_tokens = 0
            texts: dict[int, list[str]] = {}
            try:
                for opening in chunks.opening(call.n):
                    yield protocol.sse(opening)
                event = first
                while event is not None:
                    if isinstance(event, StreamDelta):
                        texts.setdefault(event.index, []).append(event.text)
                        yield protocol.sse(chunks.text(event.index, event.text, event.logprobs))
                    else:  # a row finished
                        prompt_tokens += event.prompt_tokens
                        completion_tokens += event.completion_tokens
                        yield protocol.sse(chunks.finish(event.index, event.finish_reason))
                    event = await anext(events, None)
                if include_usage:
                    yield protocol.sse(chunks.usage(prompt_tokens, completion_tokens))
                yield protocol.SSE_DONE
                self._log_payload(model, call.cache_input(), ["".join(texts.get(i, ())) for i in sorted(texts)])
            except Exception as exc:  # headers are gone: the error travels as the last event
                yield protocol.sse(http_errors.stream_error(exc, model.name).to_body())
            finally:
                await events.aclose()

        # Streams skip the response cache: x-cache says "miss" as for any computed answer.
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "x-cache": "miss"})

    # ---- endpoints ---------------------------------------------------------------

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """503 until every model has a ready replica (warmed up), then 200; "degraded"
        lists models that cannot serve."""
        status_code, body = await self.status.health()
        return JSONResponse(body, status_code=status_code)

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
    async def stats(self, request: Request) -> dict:
        """Per model: the last minute at a glance (requests, latency, batching, cache,
        replicas), then the cumulative batching counters of the replica that answered."""
        return await self.status.stats(ingress_state(request.app).traffic)

    @api.delete("/v1/cache/{model_name}")
    async def drop_cache(self, model_name: str) -> dict:
        """Drop every cached answer of one model (all revisions)."""
        if model_name not in self.models:
            raise ModelNotFoundError(f"model {model_name!r} does not exist", param="model_name")
        if self.cache.store is None:
            raise InvalidRequestError("the cache is disabled in this deployment", code="cache_disabled")
        dropped = await self.cache.drop(model_name)
        if dropped is None:
            raise ServeAppError("the cache store did not answer; try again", code="cache_unavailable")
        return dropped

    @api.post("/v1/embeddings")
    async def embeddings(self, body: EmbeddingBody, response: Response) -> dict:
        # Each endpoint takes its deadline first: every call the request makes shares it.
        deadline = self.client.deadline()
        model = self._model(body.model, "embedding", "/v1/embeddings")
        call = protocol.embed_call(body, model)
        result, response.headers["x-cache"] = await self.cache.answer(model, call, deadline=deadline)
        self._log_payload(model, call.cache_input())
        return protocol.embeddings_response(result, model.name, body.encoding_format)

    @api.post("/v1/completions")
    async def completions(self, body: CompletionBody, response: Response):
        deadline = self.client.deadline()
        model = self._model(body.model, "text-generation", "/v1/completions")
        call = protocol.completion_call(body, model)
        return await self._generation(model, call, body, response, protocol.ChunkFormat, protocol.completion_response,
                                      deadline)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionBody, response: Response):
        deadline = self.client.deadline()
        model = self._model(body.model, "text-generation", "/v1/chat/completions")
        call = protocol.chat_call(body, model)
        return await self._generation(model, call, body, response, protocol.ChatChunkFormat, protocol.chat_response,
                                      deadline)

    async def _generation(self, model: ModelConfig, call: GenerateCall, body: protocol.SamplingBody,
                          response: Response, chunks: type, respond: Callable[[GenerateResult, str], dict],
                          deadline: float):
        """A completion or chat answer, streamed as events or whole (through the cache)."""
        if body.stream:
            return await self._event_stream(model, call, chunks(model.name), body.include_usage, deadline)
        result, response.headers["x-cache"] = await self.cache.answer(model, call, deadline=deadline)
        self._log_payload(model, call.cache_input(), [c.text for c in result.completions])
        return respond(result, model.name)

    @api.post("/v1/classify")
    async def classify(self, body: ClassifyBody, response: Response) -> dict:
        deadline = self.client.deadline()
        task = body.task
        endpoint = "/v1/classify with 'input'" if task == "text-classification" else "/v1/classify with 'image'"
        model = self._model(body.model, task, endpoint)
        call = protocol.classify_call(body, model)
        result, response.headers["x-cache"] = await self.cache.answer(model, call, deadline=deadline)
        logged = list(call.texts) if call.texts is not None else f"{len(call.images)} image(s)"
        self._log_payload(model, logged, result.rankings)
        return protocol.classify_response(result, model.name)
