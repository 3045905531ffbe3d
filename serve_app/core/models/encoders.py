"""Runtimes that read a whole input in one forward pass: sentence embeddings, text
classification and image classification."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from serve_app.core.errors import InvalidRequestError
from serve_app.core.models.base import TaskRuntime, _TextRuntime

#: Largest image (width x height) that :meth:`ImageClassificationRuntime.decode` accepts.
MAX_IMAGE_PIXELS = 50_000_000
#: The formats PIL may open. Limiting them keeps every other decoder (and its bugs)
#: away from request bytes. PIL's JPEG opener also opens MPO, the JPEG variant many
#: phone cameras write (its format then reads "MPO").
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def _labels(config: Any) -> list[str]:
    id2label = getattr(config, "id2label", None) or {}
    n = getattr(config, "num_labels", None) or len(id2label)
    return [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(n)]


def _check_top_k(top_k: int, n: int) -> int:
    if not isinstance(top_k, int) or top_k < 1:
        raise InvalidRequestError(f"top_k must be a positive integer, got {top_k!r}", param="top_k")
    return min(top_k, n)


def _topk_rows(probs: torch.Tensor, labels: list[str], top_k: int) -> list[list[tuple[str, float]]]:
    k = _check_top_k(top_k, probs.shape[-1])
    values, indices = torch.topk(probs.float(), k, dim=-1)
    return [
        [(labels[i], float(v)) for v, i in zip(vs, ix)]
        for vs, ix in zip(values.cpu().tolist(), indices.cpu().tolist())
    ]


def _rank_labels(logits: torch.Tensor, labels: list[str], top_k: int, *, multi_label: bool) -> list[list[tuple[str, float]]]:
    """Per-row (label, score) pairs, best first: sigmoid scores for multi-label models, else softmax."""
    logits = logits.float()
    probs = torch.sigmoid(logits) if multi_label else torch.softmax(logits, dim=-1)
    return _topk_rows(probs, labels, top_k)


def _draft_side(processor: Any) -> int | None:
    """The largest side the processor resizes or crops to, or None when it says none:
    a JPEG decoded at 1/2, 1/4 or 1/8 scale (PIL's draft mode, done by the JPEG decoder
    itself, many times faster) still has at least this many pixels on either side."""
    sides: list[int] = []
    for attr in ("size", "crop_size"):
        value = getattr(processor, attr, None)
        if isinstance(value, int):
            sides.append(value)
            continue
        # A dict, or transformers' SizeDict (a dataclass); only sides count (min_pixels is an area).
        fields = value if isinstance(value, dict) else getattr(value, "__dict__", {})
        sides.extend(v for k, v in fields.items()
                     if k in ("height", "width", "shortest_edge", "longest_edge") and isinstance(v, int) and v > 0)
    if not sides:
        return None
    # Processors with crop_pct (ConvNeXt-style) first resize to shortest_edge / crop_pct,
    # then crop: the draft must keep that larger side, or the resize would upsample it.
    crop_pct = getattr(processor, "crop_pct", None)
    scale = 1.0 / crop_pct if isinstance(crop_pct, (int, float)) and 0 < crop_pct < 1 else 1.0
    return int(max(sides) * scale) + 1 if scale > 1 else max(sides)


def _read_pooling_mode(model_path: Path) -> str:
    """Pooling of a sentence-transformers model folder: 'mean' (default), 'cls', 'max' or 'last'."""
    pooling_cfg = None
    modules = model_path / "modules.json"
    try:
        if modules.is_file():
            for m in json.loads(modules.read_text()):
                if str(m.get("type", "")).endswith("Pooling"):
                    pooling_cfg = model_path / m.get("path", "") / "config.json"
                    break
        if pooling_cfg is None:
            pooling_cfg = model_path / "1_Pooling" / "config.json"
        if not pooling_cfg.is_file():
            return "mean"
        cfg = json.loads(pooling_cfg.read_text())
    except (OSError, ValueError, TypeError, AttributeError):
        return "mean"
    if cfg.get("pooling_mode_cls_token"):
        return "cls"
    if cfg.get("pooling_mode_lasttoken"):
        return "last"
    if cfg.get("pooling_mode_max_tokens") and not cfg.get("pooling_mode_mean_tokens"):
        return "max"
    return "mean"


def _sentence_transformers_max_len(model_path: Path) -> int | None:
    f = model_path / "sentence_bert_config.json"
    try:
        v = json.loads(f.read_text()).get("max_seq_length") if f.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, int) and v > 0 else None


class EmbeddingRuntime(_TextRuntime):
    """Sentence embeddings: pooled last hidden state, L2-normalized.

    Pooling follows a sentence-transformers ``1_Pooling/config.json`` when present
    (mean, CLS, max or last token), else mean over the attention mask.
    """

    def __init__(self, *, tokenizer: Any, pooling: str = "mean", **kw):
        super().__init__(**kw)
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.dimensions = int(getattr(self.model.config, "hidden_size", 0) or 0)

    def embed(self, rows: list[list[int]]) -> list[list[float]]:
        """One sub-batch: pad to its longest row, pool, normalize; float32 lists in row order."""
        if not rows:
            return []
        ids, mask = self._batch(rows)
        with torch.inference_mode():
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            m = mask.unsqueeze(-1).to(hidden.dtype)
            if self.pooling == "cls":
                pooled = hidden[:, 0]
            elif self.pooling == "last":
                last = mask.sum(dim=1) - 1
                pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
            elif self.pooling == "max":
                pooled = hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values
            else:
                pooled = (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return pooled.cpu().tolist()


class TextClassificationRuntime(_TextRuntime):
    """Sequence classification; scores by softmax, or sigmoid for multi-label models."""

    labels: list[str]

    def __init__(self, *, tokenizer: Any, **kw):
        super().__init__(**kw)
        self.tokenizer = tokenizer
        self.labels = _labels(self.model.config)
        self.multi_label = (
            getattr(self.model.config, "problem_type", None) == "multi_label_classification" or len(self.labels) == 1
        )

    def classify(self, rows: list[list[int]], top_k: int) -> list[list[tuple[str, float]]]:
        if not rows:
            return []
        _check_top_k(top_k, len(self.labels))
        ids, mask = self._batch(rows)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, attention_mask=mask).logits
        return _rank_labels(logits, self.labels, top_k, multi_label=self.multi_label)


class ImageClassificationRuntime(TaskRuntime):
    """Image classification through the model's saved image processor."""

    labels: list[str]

    def __init__(self, *, processor: Any, **kw):
        super().__init__(**kw)
        self.processor = processor
        self.labels = _labels(self.model.config)
        self.multi_label = getattr(self.model.config, "problem_type", None) == "multi_label_classification"
        self.draft_side = _draft_side(processor)

    def decode(self, image: bytes) -> torch.Tensor:
        """Encoded image bytes -> one preprocessed pixel tensor (C, H, W), on CPU.

        Seconds of CPU for a large image: the replica calls it off its event loop. The
        size is checked from the header, before anything is decoded (Image.open is lazy)."""
        from PIL import Image, UnidentifiedImageError

        if not isinstance(image, (bytes, bytearray, memoryview)) or len(image) == 0:
            raise InvalidRequestError("image is empty or not bytes; send an encoded PNG/JPEG/WebP image", param="image")
        try:
            img = Image.open(io.BytesIO(bytes(image)), formats=IMAGE_FORMATS)
            w, h = img.size
            if w <= 0 or h <= 0:
                raise InvalidRequestError(f"image has no pixels ({w}x{h})", param="image")
            if w * h > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(
                    f"image is {w}x{h} = {w * h} pixels, at most {MAX_IMAGE_PIXELS} are accepted; send a smaller image",
                    param="image",
                )
            if img.format in ("JPEG", "MPO") and self.draft_side:
                img.draft("RGB", (self.draft_side, self.draft_side))
            img.load()
            img = img.convert("RGB")
        except InvalidRequestError:
            raise
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError, EOFError) as exc:
            raise InvalidRequestError(
                f"image could not be decoded ({type(exc).__name__}: {exc}); send an encoded PNG/JPEG/WebP image",
                param="image",
            ) from exc
        pixels = self.processor(images=img, return_tensors="pt")["pixel_values"]
        return pixels[0]

    def classify(self, pixels: list[torch.Tensor], top_k: int) -> list[list[tuple[str, float]]]:
        if not pixels:
            return []
        _check_top_k(top_k, len(self.labels))
        batch = torch.stack([p.to(self.dtype) for p in pixels]).to(self.device)
        with torch.inference_mode():
            logits = self.model(pixel_values=batch).logits
        return _rank_labels(logits, self.labels, top_k, multi_label=self.multi_label)
