"""Embeddings on vLLM: :class:`VLLMEmbedder`, over the same runtime as generation."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Optional

from serve_app.config import BatchingConfig
from serve_app.core.calls import (
    EmbedCall,
    EmbedResult,
)
from serve_app.core.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
)
from serve_app.replica.inputs import encode_each, in_tokenizer_thread
from serve_app.replica.stats import ReplicaObserver
from serve_app.replica.vllm.runtime import VLLMRuntime

logger = logging.getLogger("ray.serve")


class VLLMEmbedder:
    """Embeddings on vLLM's pooling runner: one vLLM request per text, batched by its
    scheduler; vectors come back pooled and normalized as the model's sentence-transformers
    config says. It fills the replica's engine slot (kind, retune, stats, close)."""

    kind = "vllm"

    def __init__(self, runtime: VLLMRuntime, observer: ReplicaObserver):
        self.runtime = runtime
        self.observer = observer

    def retune(self, batching: BatchingConfig) -> None:
        pass  # vLLM's batch limits are fixed at start (see VLLMEngine.retune)

    def stats(self) -> Optional[dict]:
        return self.runtime.stats_logger.snapshot()

    async def embed(self, call: EmbedCall) -> EmbedResult:
        from vllm import PoolingParams

        # Off the event loop, as the other engines do: a large body takes seconds to
        # tokenize, and meanwhile vLLM's output handler and the health check would wait.
        token_rows = await in_tokenizer_thread(encode_each, self.runtime.tokenize, call.texts, "input")
        window = self.runtime.max_input_tokens
        for i, ids in enumerate(token_rows):
            if len(ids) > window:
                raise ContextLengthExceededError(
                    f"input {i} has {len(ids)} tokens; the model reads at most {window}", param="input")
        self.observer.request(rows_outside_batches=len(token_rows))
        engine = self.runtime.engine
        params = PoolingParams(task="embed")
        request_ids = [uuid.uuid4().hex for _ in token_rows]

        async def one(ids: list[int], request_id: str) -> list[float]:
            final = None
            async for output in engine.encode({"prompt_token_ids": ids}, params, request_id):
                final = output
            return final.outputs.data.float().tolist()

        tasks = [asyncio.ensure_future(one(ids, rid)) for ids, rid in zip(token_rows, request_ids)]
        timeout = None if call.deadline is None else max(0.0, call.deadline - time.time())
        try:
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                raise DeadlineExceededError("the request's deadline passed while the model ran", code="timeout")
            failed = next((task.exception() for task in tasks if task.exception() is not None), None)
            if failed is not None:
                raise self.runtime.request_error(failed, "input") from failed
            vectors = [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
        return EmbedResult(embeddings=vectors, prompt_tokens=sum(len(ids) for ids in token_rows))

    def close(self) -> None:
        self.runtime.close()
