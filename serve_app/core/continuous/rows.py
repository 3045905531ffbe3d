"""The engine-side state of one request of the continuous batcher
(:class:`serve_app.core.continuous.engine.ContinuousBatcher`): what it holds, and how a
token it samples and the text that makes reach it.

This module must never import ray.
"""

from __future__ import annotations

import logging

import torch

from serve_app.core.calls import SamplingParams
from serve_app.core.continuous.types import GenerationSink, RowHandle
from serve_app.core.models import GenerationRequest
from serve_app.core.decoding.sampling import RowProcessors, seeded_generator
from serve_app.core.decoding.streaming import TextStream


logger = logging.getLogger(__name__)


class BatchRow:
    """One request inside the batcher: what it asked for, what it has produced, where
    it stands in the cache, and whether it has ended. Touched on the engine thread only
    (``handle`` is what other threads see)."""

    def __init__(self, handle: RowHandle, request: GenerationRequest, params: SamplingParams,
                 sink: GenerationSink, limit: int, stream: TextStream, device: torch.device):
        self.handle = handle
        self.request = request
        self.sink = sink
        self.limit = limit  # max_tokens capped by the context window
        # The most cache columns this row can come to hold: its prompt, then one per decode
        # step; the last sampled token is never fed back, so limit - 1 of its tokens.
        self.kv_cost = len(request.prompt_ids) + max(0, limit - 1)
        self.stream = stream
        temperature = params.temperature
        self.temperature = float(temperature) if temperature is not None and temperature > 0 else 0.0
        self.top_p = float(params.top_p) if params.top_p is not None else 1.0
        self.generator: torch.Generator | None = None  # None: the global RNG (no seed asked)
        if self.temperature > 0 and params.seed is not None:
            self.generator = seeded_generator(params.seed, device)
        self.tokens: list[int] = []
        self.next_token: int | None = None  # sampled but not yet fed through the model
        self.cached_len = 0  # real (non-padding) tokens of this row in the cache
        self.finish_reason: str | None = None
        self.sink_failed = False
        self.ended = False  # its sink got on_finish; nothing may end it again
        # The model's logits processors for this row; None if its generation_config asks for none.
        self.processors: RowProcessors | None = None

    def take(self, token: int, eos_token_ids) -> str:
        """Record a sampled token and decide whether the row ends; return its new text, not yet streamed."""
        self.tokens.append(token)
        self.next_token = token
        if self.processors is not None:
            self.processors.append(token)
        if token in eos_token_ids:
            self.finish_reason = "stop"
            return ""
        delta = self.stream.push(token)
        if self.stream.stopped:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.limit:
            self.finish_reason = "length"
        return delta

    def deliver(self, delta: str) -> None:
        """Stream ``delta`` to the row's sink; a sink that raises is told nothing more
        (the batcher then cancels the row)."""
        if not delta or self.sink_failed:
            return
        try:
            self.sink.on_delta(delta)
        except Exception:
            logger.exception("sink.on_delta failed for request %d; cancelling it", self.handle.request_id)
            self.sink_failed = True
