"""The names of what a model does (its task), what each task can do, and the
precisions a model runs in.

One place for all three, free of torch and pydantic, so that the config (which the router
reads without importing torch), the router, the replica and the command lines read them
from here rather than each deciding again. The torch dtype of each precision is
:data:`serve_app.core.models.devices.DTYPES`.

This module must never import ray or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

TASKS = ("embedding", "text-generation", "text-classification", "image-classification")


@dataclass(frozen=True)
class TaskCapabilities:
    endpoints: tuple[str, ...]  # the routes that serve the task
    # The router sends concurrent calls to one replica as one Serve request. Only for
    # tasks whose calls cost about the same: a group answers when its slowest call ends,
    # so a long generation would hold back every short one beside it, and one image may
    # hold up to 64 megapixels to decode, making every small image beside it wait.
    gathered: bool
    # Answers may be sampled: then they are cacheable only when greedy or seeded.
    sampled: bool
    engines: tuple[str, ...]  # what can run it: "transformers" (ours), "vllm"


CAPABILITIES: dict[str, TaskCapabilities] = {
    "embedding": TaskCapabilities(endpoints=("/v1/embeddings",), gathered=True, sampled=False,
                                  engines=("transformers", "vllm")),
    # vLLM embeds through its pooling runner and generates; it does not classify here.
    "text-generation": TaskCapabilities(endpoints=("/v1/completions", "/v1/chat/completions"), gathered=False,
                                        sampled=True, engines=("transformers", "vllm")),
    "text-classification": TaskCapabilities(endpoints=("/v1/classify",), gathered=True, sampled=False,
                                            engines=("transformers",)),
    "image-classification": TaskCapabilities(endpoints=("/v1/classify",), gathered=False, sampled=False,
                                             engines=("transformers",)),
}
assert set(CAPABILITIES) == set(TASKS)

#: The tasks vLLM runs for us.
VLLM_TASKS = tuple(task for task in TASKS if "vllm" in CAPABILITIES[task].engines)

#: Concrete dtypes a model runs in.
PRECISIONS = ("fp32", "bf16", "fp16")
#: What a config may ask for: a concrete precision, or "auto" (bf16 where the hardware
#: computes it natively, else fp32; see serve_app.core.models.devices.resolve_precision).
PRECISION_CHOICES = ("auto", *PRECISIONS)
