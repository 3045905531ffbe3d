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


@serve.deployment
class EmulatedAccelerator:
    """A GPU replica's timing without a GPU, for the `day` scaling scenario: at most
    ``slots`` requests run at once, each takes ``service_s``, the rest queue in the
    replica (where Ray Serve's autoscaler sees them). Sleeping costs no CPU, so a
    2-core machine can host several such replicas whose capacity really adds up."""

    def __init__(self, dimensions: int, slots: int, service_s: float):
        import asyncio

        self.vector = [0.0] * dimensions
        self.slots = asyncio.Semaphore(slots)
        self.service_s = service_s
        self.calls = 0

    async def embed(self, texts: list[str]) -> dict:
        import asyncio

        async with self.slots:
            await asyncio.sleep(self.service_s)
        self.calls += 1
        return {"embeddings": [self.vector] * len(texts), "prompt_tokens": sum(len(t.split()) for t in texts)}

    async def get_stats(self) -> dict:
        return {"model_calls": self.calls}
