"""``precision: auto`` through the quality gate: bf16 only where the model's bf16 answers
keep the floor that every cheaper variant must keep (:class:`QualityFloor`).

:func:`resolve_precision` picks bf16 from the hardware alone (bf16 matrix units, a GPU
that supports it). Some models answer differently enough in bf16 that the saving is not
worth it, so before a replica starts a model whose ``auto`` became bf16, the model is
measured once in fp32 and in bf16 (the transformers runtime, on the replica's device,
on the package's held-out texts and evaluation set, as ``python -m serve_app.optimize``
measures), and stays fp32 if bf16 falls below the floor. The verdict is kept in
``$SERVE_APP_CACHE/precision-gate/``, keyed by the model's files, the task, the device
type and CPU flags, and the floor, so the measurement is paid once per model and
machine type, not once per replica start.

The measurement runs on torch's kernels, not vLLM's: both round to bf16 the same way
at every matmul, which is what moves the answers; the engines' figures agree to a few
thousandths (``python -m benchmarks run --scenario cheaper-vllm``).

This module must never import ray.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from serve_app.core.models.checkpoint_formats import checkpoint_format
from serve_app.core.models.devices import resolve_precision
from serve_app.core.models.sources import _default_cache_dir, model_revision, resolve_source

logger = logging.getLogger(__name__)

#: Bump when what the gate measures changes (its texts or figures): old verdicts expire.
GATE_VERSION = 2  # 2: the chat evaluation generates its prompts in left-padded batches


def _verdict_path(model_dir: Path, task: str, device_type: str, floor: Any) -> Path:
    from serve_app.core.models.hardware import cpu_flags
    from serve_app.optimize.evaluation import ANSWER_TOKENS

    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx2"))) if device_type == "cpu" else []
    key = json.dumps({"v": GATE_VERSION, "model": model_revision(model_dir), "task": task, "device": device_type,
                      "flags": flags, "floor": dataclasses.asdict(floor), "answer_tokens": ANSWER_TOKENS},
                     sort_keys=True)
    return _default_cache_dir() / "precision-gate" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def measure(model_dir: Path, task: str, device: str, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """bf16's figures against fp32 for one model (held-out and evaluation set)."""
    from serve_app.core.models import LoadOptions, load_runtime
    from serve_app.optimize import heldout_texts
    from serve_app.optimize import quality as q
    from serve_app.optimize.evaluation import task_evaluation

    options = dict(source=str(model_dir), task=task, device=device, trust_remote_code=trust_remote_code)
    try:
        reference = load_runtime(LoadOptions(**options, precision="fp32"))
        candidate = load_runtime(LoadOptions(**options, precision="bf16"))
        return {**q.quality(reference, candidate, heldout_texts()), **task_evaluation(reference, candidate)}
    finally:
        reference = candidate = None
        # The engine that starts next (vLLM sizes itself by the GPU's free memory) gets it all back.
        gc.collect()
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


def gated_precision(model_dir: Path, task: str, device_type: str, device: str, *,
                    trust_remote_code: bool = False) -> tuple[str, str]:
    """``("bf16", why)`` when bf16 keeps the quality floor for this model, else
    ``("fp32", why)``; measured once, then read from the verdict cache."""
    from serve_app.optimize.evaluation import QualityFloor

    floor = QualityFloor()
    path = _verdict_path(model_dir, task, device_type, floor)
    try:
        verdict = json.loads(path.read_text())
        measured = "measured before"
    except (OSError, ValueError):
        started = time.perf_counter()
        figures = measure(model_dir, task, device, trust_remote_code=trust_remote_code)
        verdict = {"figures": figures, "shortfalls": floor.shortfalls(figures),
                   "seconds": round(time.perf_counter() - started, 1)}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # replicas of one model may measure at once
        tmp.write_text(json.dumps(verdict, indent=2))
        tmp.replace(path)  # atomic: a reader sees a whole verdict or none
        measured = f"measured in {verdict['seconds']} s"
    shown = {k: v for k, v in verdict["figures"].items()
             if k in ("greedy_agreement", "perplexity_reference", "perplexity_candidate", "embedding_cosine_mean",
                      "retrieval_accuracy_candidate", "label_agreement")}
    if verdict["shortfalls"]:
        return "fp32", (f"bf16 falls below the quality floor ({'; '.join(verdict['shortfalls'])}; {measured}, "
                        f"{path}), so fp32")
    return "bf16", f"bf16 keeps the quality floor ({shown}; {measured})"


def replica_precision(config: Any, device: Any) -> tuple[str, str]:
    """The precision a replica runs ``config``'s model (a ModelConfig) in on ``device``
    (a torch.device), and why: :func:`resolve_precision`'s pick for the hardware, and,
    for ``auto``, through the gate when that pick is 16-bit and the model's weights are
    full precision (a quantized checkpoint was gated when it was written; images have no
    text to measure on)."""
    precision, why = resolve_precision(config.precision, device)
    if (config.precision != "auto" or precision == "fp32" or config.quantization != "none"
            or config.task == "image-classification"):
        return precision, why
    model_dir = resolve_source(config.source, hub_revision=config.hub_revision,
                               trust_remote_code=config.trust_remote_code)
    if checkpoint_format(model_dir) != "none":
        return precision, why
    try:
        gated, reason = gated_precision(model_dir, config.task, device.type, str(device),
                                        trust_remote_code=config.trust_remote_code)
    except Exception as exc:  # e.g. an architecture only vLLM loads: the gate must not stop the start
        logger.warning("model %s: the precision gate could not measure bf16 (%s: %s); keeping %s",
                       config.name, type(exc).__name__, exc, precision)
        return precision, f"{why}; not gated: {type(exc).__name__}"
    return gated, f"{why}; {reason}"
