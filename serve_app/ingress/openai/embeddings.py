"""``/v1/embeddings``: the body, its EmbedCall, and OpenAI's embeddings list."""

# No `from __future__ import annotations`: FastAPI resolves these bodies' annotations
# at run time, and Serve's ingress re-signs the endpoints that take them.
import base64
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import Response
from pydantic import Field

from serve_app.config import ModelConfig
from serve_app.core.calls import EmbedCall, EmbedResult
from serve_app.core.errors import InvalidRequestError
from serve_app.ingress.openai.common import ModelBody, TokenIds, inputs_list, usage
from serve_app.ingress.serving import Serving


class EmbeddingBody(ModelBody):
    input: Union[str, list[str], TokenIds, list[TokenIds]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)


def embed_call(body: EmbeddingBody, model: ModelConfig) -> EmbedCall:
    if body.dimensions is not None:
        raise InvalidRequestError("'dimensions' is not supported; omit it for the model's full size", param="dimensions")
    return EmbedCall(texts=tuple(inputs_list(body.input, "input", model.max_inputs_per_request)))


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


async def create(serving: Serving, body: EmbeddingBody, response: Response) -> dict:
    model = serving.model(body.model, "embedding", "/v1/embeddings")
    call = embed_call(body, model)
    result = await serving.answer(model, call, response)
    serving.log_payload(model, call.cache_input())
    return embeddings_response(result, model.name, body.encoding_format)
