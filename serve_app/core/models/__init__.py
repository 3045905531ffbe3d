"""Model runtimes: load a Hugging Face model for one task and run it on batches.

Nothing here knows about serving. A deployment turns requests into the plain inputs
these classes take (token id lists, pixel tensors, :class:`GenerationRequest`) and
calls one method per sub-batch. Input checks that depend on the model (empty text,
context length, undecodable images, missing chat template) raise the errors of
:mod:`serve_app.core.errors`, so the router can answer 4xx.

Modules: ``sources`` (where the weights come from), ``devices`` (device and dtype),
``base`` (what every runtime shares), ``encoders`` (embedding and classification),
``generation`` (text generation), ``loader`` (:func:`load_runtime`).

No module of this package may import ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each name from the module that defines it, imported when first used: the router and
# cache processes import this package's light modules (checkpoint_formats, quantization,
# sources, through the config) and would otherwise load torch at start,
# about 1.4 s of CPU in every such process.
_SOURCES = {
    "TaskRuntime": "base",
    "resolve_device": "devices",
    "EmbeddingRuntime": "encoders",
    "ImageClassificationRuntime": "encoders",
    "TextClassificationRuntime": "encoders",
    "GenerationRequest": "generation",
    "GenerationResult": "generation",
    "GenerationRuntime": "generation",
    "LoadOptions": "loader",
    "load_runtime": "loader",
    "model_revision": "sources",
    "resolve_source": "sources",
}

if TYPE_CHECKING:
    from serve_app.core.models.base import TaskRuntime
    from serve_app.core.models.devices import resolve_device
    from serve_app.core.models.encoders import EmbeddingRuntime, ImageClassificationRuntime, TextClassificationRuntime
    from serve_app.core.models.generation import GenerationRequest, GenerationResult, GenerationRuntime
    from serve_app.core.models.loader import LoadOptions, load_runtime
    from serve_app.core.models.sources import model_revision, resolve_source


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = sorted(_SOURCES)
