"""The names of what a model does (its task) and of the precisions it runs in.

One place for both, free of torch and pydantic, so that the config (which the router
reads without importing torch) and the command lines can use them. The torch dtype of
each precision is :data:`serve_app.core.models.devices.DTYPES`.

This module must never import ray or torch.
"""

TASKS = ("embedding", "text-generation", "text-classification", "image-classification")

#: Concrete dtypes a model runs in.
PRECISIONS = ("fp32", "bf16", "fp16")
#: What a config may ask for: a concrete precision, or "auto" (bf16 where the hardware
#: computes it natively, else fp32; see serve_app.core.models.devices.resolve_precision).
PRECISION_CHOICES = ("auto", *PRECISIONS)
