"""The engine-side state of one request of the continuous batcher
(:class:`serve_app.core.continuous.ContinuousBatcher`).

This module must never import ray.
"""

from __future__ import annotations

import torch

from serve_app.core.calls import SamplingParams
from serve_app.core.continuous_types import GenerationSink, RowHandle
from serve_app.core.models import GenerationRequest
from serve_app.core.sampling import RowProcessors, seeded_generator
from serve_app.core.streaming import TextStream


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
