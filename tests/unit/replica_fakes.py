"""Stand-ins for the replica tests: metrics that remember, a model-less encoder runtime,
and a ModelServer built around a runtime without Serve."""

from __future__ import annotations

import asyncio

import torch

from serve_app.core.errors import InvalidRequestError
from serve_app.replica.model_server import ModelServer


class Recorder:
    """A stand-in for a Ray metric: remembers every value."""

    def __init__(self):
        self.values: list[float] = []

    def observe(self, value, tags=None):
        self.values.append(value)

    def inc(self, value=1):
        self.values.append(value)

    def set(self, value):
        self.values.append(value)


class FakeMetrics:
    def __getattr__(self, name):  # any BatchMetrics attribute, created on first use
        recorder = Recorder()
        setattr(self, name, recorder)
        return recorder


class FakeEncoder:
    """Embedding / classification runtime without a model: a token per word, id = word length."""

    device, dtype, revision, max_input_tokens = "cpu", torch.float32, "rev-1", 16

    def __init__(self, task: str, labels=("negative", "positive", "neutral")):
        self.task = task
        self.labels = list(labels)
        self.calls: list[list] = []

    def tokenize(self, text: str) -> list[int]:
        if not text.strip():
            raise InvalidRequestError("input is empty; give some text", param="input")
        return [len(word) for word in text.split()]

    def decode(self, image: bytes):
        if not image:
            raise InvalidRequestError("image is empty or not bytes", param="image")
        return image

    def embed(self, rows):
        self.calls.append(rows)
        if [13] in rows:  # a 13-letter word: this sub-batch fails
            raise RuntimeError("unlucky")
        return [[float(len(r)), float(sum(r))] for r in rows]

    def classify(self, rows, top_k):
        self.calls.append(rows)
        assert top_k == len(self.labels)
        return [[("positive", 0.6), ("neutral", 0.3), ("negative", 0.1)] for _ in rows]


def server(runtime, **config) -> ModelServer:
    model = {"name": "fake", "source": "/nowhere", "task": runtime.task, **config}
    return ModelServer.func_or_class(model, runtime=runtime, metrics=FakeMetrics(), admission_window=False)


def run(coro):
    return asyncio.run(coro)
