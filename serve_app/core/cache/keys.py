"""Canonical inputs and cache keys: one key per (model, revision, task, input, params)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import unicodedata
from typing import Any, Callable

import numpy as np

_WHITESPACE = re.compile(r"\s+")


def canonical_text(text: str) -> str:
    """NFKC-normalize, collapse every whitespace run to one space, strip the ends.

    Case is kept: it can change a model's answer.
    """
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text)).strip()


def exact_text(text: str) -> str:
    """NFC-normalize and unify line endings only: for prompts whose whitespace matters."""
    return unicodedata.normalize("NFC", text).replace("\r\n", "\n")


def _same(text: str) -> str:
    return text


def _canonical(value: Any, text: Callable[[str], str] = _same) -> Any:
    """JSON-ready form of a value: strings through ``text``, bytes hashed, order kept."""
    if isinstance(value, str):
        return text(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return hashlib.sha256(value).hexdigest()
    if isinstance(value, np.ndarray):
        return _canonical(value.tolist(), text)
    if isinstance(value, np.generic):
        return _canonical(value.item(), text)
    if isinstance(value, float):
        # 1 and 1.0 are the same parameter; NaN/inf would make non-standard JSON.
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return value if math.isfinite(value) else repr(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, dict):
        return {str(k): _canonical(v, text) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, text) for v in value]
    raise TypeError(f"cannot build a cache key from a {type(value).__name__}: {value!r:.80}")


def canonical_payload(task: str, payload: Any) -> Any:
    """The canonical form of a request's input, ready for canonical JSON.

    Texts for encoders (embedding, classification) go through :func:`canonical_text`:
    their tokenizers split on whitespace, so runs of it cannot change the answer. Prompts
    for text generation only get :func:`exact_text`: an LLM tokenizes "a\nb" and "a b"
    differently, and a code or poem prompt must not get another prompt's answer. Lists
    and chat messages keep their order; image bytes become their sha256 hex digest.
    """
    return _canonical(payload, exact_text if task == "text-generation" else canonical_text)


def is_cacheable(task: str, params: dict) -> bool:
    """False only for sampled generation without a seed: its answer is not a function of the input.

    A missing temperature counts as 1.0 (OpenAI's default), i.e. sampled.
    """
    if task != "text-generation":
        return True
    temperature = params.get("temperature", 1.0)
    sampled = temperature is None or temperature > 0
    return not (sampled and params.get("seed") is None)


def _key_params(task: str, params: dict) -> dict:
    """Params as they enter a key: those that cannot change the answer are left out."""
    params = dict(params)
    temperature = params.get("temperature", 1.0)
    if task == "text-generation" and temperature is not None and temperature <= 0:
        # Greedy decoding ignores the seed and top_p (core.models.generation sets do_sample=False).
        params.pop("seed", None)
        params.pop("top_p", None)
        params["temperature"] = 0
    return params


def _canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _model_part(model: str) -> str:
    """The model name as it leads a key: ':' and '%' escaped, so that dropping model "a"
    can never touch model "a:b". Names without those characters are unchanged."""
    return model.replace("%", "%25").replace(":", "%3A")


def cache_key(*, model: str, revision: str, task: str, payload: Any, params: dict) -> str:
    """``f"{model}:{revision}:{sha256 hex}"`` of the canonical ``[task, input, params]``.

    Params are hashed with sorted keys; for greedy generation (temperature 0) the seed and
    top_p are left out since they cannot change the answer. Raises TypeError for a value
    that has no canonical form (rather than risk two inputs sharing a key).
    """
    body = [task, canonical_payload(task, payload), _canonical(_key_params(task, params or {}))]
    digest = hashlib.sha256(_canonical_json(body)).hexdigest()
    return f"{_model_part(model)}:{revision}:{digest}"


def semantic_namespace(*, model: str, revision: str, task: str, params: dict) -> str:
    """The :class:`SemanticIndex` namespace for one model, revision, task and params.

    Starts with the model, like :func:`cache_key`, so ``drop_prefix(model)`` finds it.
    """
    body = [task, _canonical(_key_params(task, params or {}))]
    digest = hashlib.sha256(_canonical_json(body)).hexdigest()[:32]
    return f"{_model_part(model)}:{revision}:{digest}"
