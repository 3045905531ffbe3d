"""Where a model runs: the torch device (:func:`resolve_device`) and the dtype of its precision."""

from __future__ import annotations

import logging

import torch

from serve_app.core.tasks import PRECISIONS

logger = logging.getLogger(__name__)

#: The torch dtype of each name in :data:`serve_app.core.tasks.PRECISIONS`.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(requested: str = "auto") -> torch.device:
    """Turn a device request into a usable :class:`torch.device`.

    ``"auto"`` picks CUDA when available, else CPU. A CUDA request on a machine without
    CUDA falls back to CPU with a warning (so one config file runs on a laptop too); a
    CUDA index beyond the visible devices is an error.
    """
    req = (requested or "auto").strip().lower()
    if req == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(req)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"unknown device {requested!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            logger.warning("device %r requested but CUDA is not available; using cpu", requested)
            return torch.device("cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ValueError(
                f"device {requested!r} requested but only {count} CUDA device(s) are visible; "
                f"use 'cuda' or an index below {count}"
            )
    return dev


def _resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision == "fp16" and device.type == "cpu":
        raise ValueError("fp16 needs a GPU; use bf16 or fp32 on CPU")
    return DTYPES[precision]
