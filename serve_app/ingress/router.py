"""The HTTP ingress: an OpenAI-compatible API in front of the model deployments.

This module only wires the parts together and declares the routes. Each OpenAI
endpoint's answer is ``create`` in its module of ``ingress.openai``: find the model,
turn the body into a typed call, answer it through the response cache
(``response_cache``, which calls the model through ``model_client``), shape the OpenAI
response. Errors raised anywhere become OpenAI error bodies in ``http_errors``, the one
error boundary.
"""

# No `from __future__ import annotations`: Serve's ingress re-signs these methods and
# FastAPI then cannot resolve string annotations, turning bodies into query params.
import logging
import time
from typing import Optional

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.config import AppConfig, ModelConfig
from serve_app.ingress.auth import ApiKeys
from serve_app.core.errors import InvalidRequestError, ModelNotFoundError, ServeAppError
from serve_app.ingress import http_errors
from serve_app.ingress.middleware import IngressGuard, IngressState, RequestObserver, ingress_state
from serve_app.ingress.model_client import ModelClient, ModelServerBackend
from serve_app.ingress.openai import chat, classify, completions, embeddings
from serve_app.ingress.openai.chat import ChatCompletionBody
from serve_app.ingress.openai.classify import ClassifyBody
from serve_app.ingress.openai.completions import CompletionBody
from serve_app.ingress.openai.embeddings import EmbeddingBody
from serve_app.ingress.response_cache import ResponseCache
from serve_app.ingress.serving import Serving
from serve_app.ingress.status import ServiceStatus
from serve_app.serve_logs import start_log_flusher

logger = logging.getLogger("ray.serve")

api = FastAPI(title="serve_app", description="Hugging Face models on Ray Serve, OpenAI-compatible.")
# The last added runs first: the observer records every request, refused ones included.
api.add_middleware(IngressGuard)
api.add_middleware(RequestObserver)
http_errors.install(api)


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
        self.state = IngressState(keys=keys, max_body_bytes=self.config.router.max_body_bytes,
                                  request_timeout_s=self.config.router.request_timeout_s)
        router = self.config.router
        self.client = ModelClient(
            {name: ModelServerBackend(h, self.models[name], gather=router.gather_calls, router=router)
             for name, h in model_handles.items()},
            router)
        self.cache = ResponseCache(self.config.cache, cache_handle, self.models, self.client)
        self.status = ServiceStatus(self.models, self.client, self.cache)
        self.serving = Serving(self.models, self.client, self.cache, log_payloads=self.config.router.log_payloads)
        self.created = int(time.time())

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve calls this after __init__, with the copy of ``api`` this replica serves;
        # the middleware reads the replica's state from that copy (see ingress.middleware).
        self.app.state.ingress = self.state
        return self.app

    # ---- endpoints ---------------------------------------------------------------

    @api.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """503 until every model has a ready replica (warmed up), then 200; "degraded"
        lists models that cannot serve."""
        status_code, body = await self.status.health()
        return JSONResponse(body, status_code=status_code)

    @api.get("/v1/models")
    async def list_models(self) -> dict:
        # An adapter is listed as vLLM's server lists one: its base model as its parent.
        entries = [(m.name, m.task, None) for m in self.config.models]
        entries += [(a.name, m.task, m.name) for m in self.config.models for a in m.adapters]
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": self.created, "owned_by": "serve_app", "task": task,
                      **({"parent": parent} if parent else {})} for name, task, parent in entries],
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
        return await embeddings.create(self.serving, body, response)

    @api.post("/v1/completions")
    async def completions(self, body: CompletionBody, response: Response):
        return await completions.create(self.serving, body, response)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionBody, response: Response):
        return await chat.create(self.serving, body, response)

    @api.post("/v1/classify")
    async def classify(self, body: ClassifyBody, response: Response) -> dict:
        return await classify.create(self.serving, body, response)
