"""Load one model for its task: :class:`LoadOptions` in, the task's runtime out (:func:`load_runtime`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from serve_app.core.models.base import TaskRuntime, _max_input_tokens
from serve_app.core.models.devices import _resolve_dtype, resolve_device, resolve_precision
from serve_app.core.models.encoders import (
    EmbeddingRuntime,
    ImageClassificationRuntime,
    TextClassificationRuntime,
    _read_pooling_mode,
    _sentence_transformers_max_len,
)
from serve_app.core.models.generation import GenerationRuntime
from serve_app.core.models.sources import resolve_source
from serve_app.core.models.quantization import check_quantization, from_pretrained_kwargs, quantize_weights
from serve_app.core.tasks import TASKS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadOptions:
    """Everything :func:`load_runtime` needs to load one model."""

    source: str  # "package:NAME" | "hf:Org/name" | a local directory path
    task: str  # one of TASKS
    precision: str = "fp32"  # one of serve_app.core.tasks.PRECISION_CHOICES ("auto": see resolve_precision)
    device: str = "cpu"  # "cpu", "cuda", "cuda:N", "auto"; see resolve_device()
    trust_remote_code: bool = False
    hub_revision: str | None = None  # for hf: sources
    cache_dir: str | None = None  # converted GGUF models; default $SERVE_APP_CACHE or ~/.cache/serve_app
    quantization: str = "none"  # one of serve_app.core.models.quantization.QUANTIZATIONS


def _load_tokenizer(path: Path, trust_remote_code: bool, **kw):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kw)


def _prepare(model, device: torch.device):
    model.eval()
    if getattr(model, "hf_device_map", None):  # placed while loading (bitsandbytes), cannot be moved
        return model
    return model.to(device)


def load_runtime(options: LoadOptions) -> TaskRuntime:
    """Resolve the source, load model and tokenizer/processor for the task, return its runtime."""
    if options.task not in TASKS:
        raise ValueError(f"unknown task {options.task!r}; use one of {', '.join(TASKS)}")
    device = resolve_device(options.device)
    precision, why = resolve_precision(options.precision, device)
    if options.precision == "auto":
        logger.info("precision %s (%s)", precision, why)
    dtype = _resolve_dtype(precision, device)
    # Before resolving the source: a GGUF conversion or hub download is wasted on a
    # combination that cannot run.
    check_quantization(options.quantization, precision, device.type)
    path = resolve_source(
        options.source, hub_revision=options.hub_revision, cache_dir=options.cache_dir,
        trust_remote_code=options.trust_remote_code,
    )
    trc = options.trust_remote_code
    load_kwargs = dict(dtype=dtype, trust_remote_code=trc, **from_pretrained_kwargs(options.quantization, device, dtype))
    common = dict(model_path=path, device=device, dtype=dtype)
    import transformers as tf

    if options.task == "embedding":
        tok = _load_tokenizer(path, trc)
        model = _prepare(tf.AutoModel.from_pretrained(path, **load_kwargs), device)
        mx = _max_input_tokens(model.config, tok, [_sentence_transformers_max_len(path)])
        rt: TaskRuntime = EmbeddingRuntime(
            task=options.task, model=model, tokenizer=tok, pooling=_read_pooling_mode(path),
            max_input_tokens=mx, **common,
        )
    elif options.task == "text-classification":
        tok = _load_tokenizer(path, trc)
        model = _prepare(
            tf.AutoModelForSequenceClassification.from_pretrained(path, **load_kwargs), device
        )
        rt = TextClassificationRuntime(
            task=options.task, model=model, tokenizer=tok, max_input_tokens=_max_input_tokens(model.config, tok),
            **common,
        )
    elif options.task == "image-classification":
        try:
            processor = tf.AutoImageProcessor.from_pretrained(path, trust_remote_code=trc)
        except Exception as exc:
            raise ValueError(f"model directory {str(path)!r} has no usable image processor "
                             f"(preprocessor_config.json): {exc}") from exc
        model = _prepare(
            tf.AutoModelForImageClassification.from_pretrained(path, **load_kwargs), device
        )
        rt = ImageClassificationRuntime(
            task=options.task, model=model, processor=processor, max_input_tokens=1, **common,
        )
    else:  # text-generation
        tok = _load_tokenizer(path, trc, padding_side="left")
        tok.padding_side = "left"
        if tok.pad_token is None and tok.eos_token is not None:
            tok.pad_token = tok.eos_token
        model = _prepare(tf.AutoModelForCausalLM.from_pretrained(path, **load_kwargs), device)
        rt = GenerationRuntime(
            task=options.task, model=model, tokenizer=tok, max_input_tokens=_max_input_tokens(model.config, tok),
            **common,
        )
    if isinstance(rt, (EmbeddingRuntime, TextClassificationRuntime)):
        # The replica tokenizes in worker threads, several at once. A fast tokenizer's
        # first call may reconfigure its Rust backend (truncation or padding saved in
        # tokenizer.json), which concurrent calls would collide on ("Already borrowed");
        # done once here, every later call only reads it.
        rt.tokenize("warm up")
    # After the runtime is built: torchao packs weights for the device they are on.
    quantize_weights(rt.model, options.quantization)
    rt.quantization = options.quantization
    # Cache keys carry the revision. The same files served at another precision or
    # quantization answer slightly differently, so they get their own revision.
    # (The precision run, not the one asked for: "auto" is bf16 on one node and fp32 on another.)
    if precision != "fp32" or options.quantization != "none":
        rt.revision = f"{rt.revision}-{precision}-{options.quantization}"
    logger.info("loaded %r", rt)
    return rt
