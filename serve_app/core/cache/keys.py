"""Canonical inputs and cache keys: one key per (model, revision, task, input, params)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import numpy as np

from serve_app.core.cache.values import VALUE_SCHEMA
from serve_app.core.tasks import CAPABILITIES


def _canonical(value: Any) -> Any:
    """JSON-ready form of a value: strings as they are, bytes hashed, order kept."""
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return hashlib.sha256(value).hexdigest()
    if isinstance(value, np.ndarray):
        return _canonical(value.tolist())
    if isinstance(value, np.generic):
        return _canonical(value.item())
    if isinstance(value, float):
        # 1 and 1.0 are the same parameter; NaN/inf would make non-standard JSON.
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return value if math.isfinite(value) else repr(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    raise TypeError(f"cannot build a cache key from a {type(value).__name__}: {value!r:.80}")


def canonical_payload(task: str, payload: Any) -> Any:
    """The canonical form of a request's input, ready for canonical JSON.

    Texts are kept exactly as sent, for every task: the key must change whenever what
    the model sees can. No normalisation of text is provably invisible to every
    tokenizer we serve: NFKC and whitespace collapsing change BERT's tokens
    (``ＡＢＣ １２３`` is ``[UNK] [UNK]``, ``ABC 123`` is not), NFC and CRLF->LF change a
    byte-level BPE's. A variant costs one extra model call; a shared key would serve
    another input's answer. Lists and chat messages keep their order; image bytes
    become their sha256 hex digest. ``task`` is kept for callers (and a future
    tokenizer-proven normalisation).
    """
    return _canonical(payload)


def is_cacheable(task: str, params: dict) -> bool:
    """False only for sampled generation without a seed: its answer is not a function of the input.

    A missing temperature counts as 1.0 (OpenAI's default), i.e. sampled.
    """
    if not CAPABILITIES[task].sampled:
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
    """``f"{model}:{revision}:{sha256 hex}"`` of the canonical ``[schema, task, input, params]``.

    Params are hashed with sorted keys; for greedy generation (temperature 0) the seed and
    top_p are left out since they cannot change the answer. Raises TypeError for a value
    that has no canonical form (rather than risk two inputs sharing a key).
    """
    # VALUE_SCHEMA leads the hashed body: entries written in another value layout (by an
    # older or newer version of this code, sharing a Redis) are never read as this one's.
    body = [VALUE_SCHEMA, task, canonical_payload(task, payload), _canonical(_key_params(task, params or {}))]
    digest = hashlib.sha256(_canonical_json(body)).hexdigest()
    return f"{_model_part(model)}:{revision}:{digest}"


def semantic_namespace(*, model: str, revision: str, task: str, params: dict, endpoint: str, context: Any,
                       embedder: str, embedder_revision: str, scope: str) -> str:
    """The :class:`SemanticIndex` namespace: everything two requests must share *exactly*
    for one's answer to be reused for the other, whose last questions are merely similar.

    That is the model and its revision, the task, every param that enters the exact key,
    the ``endpoint`` ("chat" or "completions": a prompt "user: X" is not the chat X), the
    ``context`` (every chat message before the last user turn, system prompt included,
    hashed exactly as the exact key hashes them), the embedder's name and revision (a
    vector of another embedder, or of another revision of it, is not comparable), and
    the caller's ``scope`` (a hash of the API key under ``cache.scope: per_key``, "" when
    shared). Starts with the model, like :func:`cache_key`, so ``drop_prefix(model)`` finds it.
    """
    body = ["semantic-2", task, _canonical(_key_params(task, params or {})), endpoint,
            canonical_payload(task, context), _model_part(embedder), embedder_revision, scope]
    digest = hashlib.sha256(_canonical_json(body)).hexdigest()[:32]
    return f"{_model_part(model)}:{revision}:{digest}"
