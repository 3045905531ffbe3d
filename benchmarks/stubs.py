"""A benchmark-only stand-in for ModelServer that answers at once with a constant of
the right shape, so the HTTP proxy + router path can be measured alone (the stack
ceiling S). Never used by the service itself."""

from __future__ import annotations

from ray import serve


@serve.deployment
class ConstantEmbedder:
    def __init__(self, dimensions: int):
        self.vector = [0.0] * dimensions
        self.calls = 0

    async def embed(self, texts: list[str]) -> dict:
        self.calls += 1
        return {"embeddings": [self.vector] * len(texts), "prompt_tokens": sum(len(t.split()) for t in texts)}

    async def get_stats(self) -> dict:
        return {"model_calls": self.calls}
