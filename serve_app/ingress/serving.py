"""What every endpoint uses once it has parsed its body: the model it names (checked
against the task the endpoint serves), the answer through the response cache, and the
payload log that ``router.log_payloads`` turns on."""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

from fastapi import Response

from serve_app.config import ModelConfig
from serve_app.core.calls import ModelCall, ModelResult
from serve_app.core.errors import InvalidRequestError, ModelNotFoundError
from serve_app.core.tasks import CAPABILITIES
from serve_app.ingress.model_client import ModelClient
from serve_app.ingress.request_context import note, request_id
from serve_app.ingress.response_cache import ResponseCache

logger = logging.getLogger("ray.serve")


def _clip(value: Any, limit: int = 500) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class Serving:
    def __init__(self, models: dict[str, ModelConfig], client: ModelClient, cache: ResponseCache, *,
                 log_payloads: bool):
        self.models = models
        self.client = client
        self.cache = cache
        self.log_payloads = log_payloads
        # A LoRA adapter's name -> the model whose replicas serve it.
        self.adapters = {adapter.name: model for model in models.values() for adapter in model.adapters}

    def model(self, name: str, task: str, endpoint: str) -> ModelConfig:
        """The served model called ``name``; a 404 for an unknown one, a 400 for one of
        another task than ``endpoint`` serves."""
        model = self.models.get(name)
        if model is None:
            known = ", ".join(sorted([*self.models, *self.adapters]))
            kind = "an adapter, served only on chat and completions" if name in self.adapters else "does not exist"
            raise ModelNotFoundError(f"model {name!r} {kind}; this service serves: {known}")
        note(model=name)
        if model.task != task:
            serves = " and ".join(CAPABILITIES[model.task].endpoints)
            raise InvalidRequestError(
                f"model {name!r} is a {model.task} model, served on {serves}; {endpoint} needs a {task} model",
                param="model",
                code="wrong_task",
            )
        return model

    def generator(self, name: str, endpoint: str) -> tuple[ModelConfig, Optional[str]]:
        """The text-generation model that answers ``name`` and the LoRA adapter it answers
        with (None: the model itself). Requests and their metrics carry the adapter's name."""
        base = self.adapters.get(name)
        if base is None:
            return self.model(name, "text-generation", endpoint), None
        note(model=name)
        return base, name

    async def answer(self, model: ModelConfig, call: ModelCall, response: Response) -> ModelResult:
        """The answer from the cache or the model; the response's ``x-cache`` says which."""
        result, response.headers["x-cache"] = await self.cache.answer(model, call)
        return result

    def log_payload(self, model: ModelConfig, inputs: Any, outputs: Any = None) -> None:
        """Prompts and answers reach the log only when router.log_payloads asks for it."""
        if self.log_payloads:
            logger.info("payload model=%s request=%s input=%s output=%s", model.name, request_id(),
                        _clip(inputs), _clip(outputs))
