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

from serve_app.core.models.base import TaskRuntime
from serve_app.core.models.devices import resolve_device
from serve_app.core.models.encoders import EmbeddingRuntime, ImageClassificationRuntime, TextClassificationRuntime
from serve_app.core.models.generation import GenerationRequest, GenerationResult, GenerationRuntime
from serve_app.core.models.loader import LoadOptions, load_runtime
from serve_app.core.models.sources import model_revision, resolve_source

__all__ = [
    "EmbeddingRuntime",
    "GenerationRequest",
    "GenerationResult",
    "GenerationRuntime",
    "ImageClassificationRuntime",
    "LoadOptions",
    "TaskRuntime",
    "TextClassificationRuntime",
    "load_runtime",
    "model_revision",
    "resolve_device",
    "resolve_source",
]
