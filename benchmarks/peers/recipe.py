"""The baseline a user would copy from Ray Serve's docs: one FastAPI deployment with
``@serve.batch``, the tokenizer padding the whole batch in arrival order.

Benchmark-only. Written as the docs write it: Ray's default replica options (one CPU,
so Ray sets OMP_NUM_THREADS=1 and torch runs one thread, as ours does) and the precision
a user would pick on the machine (bf16 where the CPU has bf16 units); the scenario only
raises max_ongoing_requests above the batch size, as Ray's batching guide says to.
"""

# No `from __future__ import annotations`: FastAPI under serve.ingress must see real
# annotations, or it takes the Request parameter for a query parameter.
from typing import List

import torch
from fastapi import FastAPI
from ray import serve
from starlette.requests import Request

recipe_api = FastAPI()


@serve.deployment
@serve.ingress(recipe_api)
class RecipeEmbedder:
    def __init__(self, source: str, precision: str):
        from transformers import AutoModel, AutoTokenizer

        from serve_app.core.models import resolve_source
        from serve_app.core.models.devices import DTYPES

        path = resolve_source(source)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=DTYPES[precision]).eval()

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def embed_batch(self, texts: List[str]) -> List[List[float]]:
        encoded = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**encoded).last_hidden_state.float()
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1).tolist()

    @recipe_api.post("/v1/embeddings")
    async def embeddings(self, request: Request) -> dict:
        body = await request.json()
        vector = await self.embed_batch(body["input"])
        return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": vector}]}
