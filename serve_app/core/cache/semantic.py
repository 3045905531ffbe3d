"""SemanticIndex: reuse an earlier answer whose request embedding is close enough."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from serve_app.core.cache.keys import _model_part


class _Namespace:
    """Rows of one namespace: a float32 matrix grown by doubling, used as a ring (FIFO)."""

    __slots__ = ("matrix", "keys", "slot_of", "count", "next_slot", "dim")

    def __init__(self, dim: int, capacity: int):
        self.dim = dim
        self.matrix = np.zeros((capacity, dim), dtype=np.float32)
        self.keys: list[str | None] = [None] * capacity
        self.slot_of: dict[str, int] = {}
        self.count = 0  # filled rows: 0..count-1
        self.next_slot = 0  # where the next new key goes once full (the oldest row)


def _unit(vector: Any) -> np.ndarray | None:
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(v))
    if v.size == 0 or not math.isfinite(norm) or norm == 0.0:
        return None
    return v / norm


class SemanticIndex:
    """Nearest-neighbour lookup of earlier requests by embedding, per namespace.

    Each namespace (one model + revision + task + params, from :func:`semantic_namespace`)
    holds at most ``max_entries_per_namespace`` L2-normalized float32 rows in one numpy
    matrix, so a lookup is one matrix-vector product (10,000 rows x 384: about 15 MB, and
    about 1 ms a lookup on this 2-core CPU). When full, the oldest entry is overwritten (FIFO). Adding
    a key again replaces its vector. The index stores keys, not answers: a key it returns
    may have expired from the store, in which case the caller treats it as a miss (and may
    :meth:`discard` it).
    """

    _INITIAL_CAPACITY = 64

    def __init__(self, *, max_entries_per_namespace: int = 10_000, threshold: float = 0.95):
        if max_entries_per_namespace < 1:
            raise ValueError(f"max_entries_per_namespace is {max_entries_per_namespace}; it must be at least 1")
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"threshold is {threshold}; a cosine similarity lies in [-1, 1]")
        self.max_entries_per_namespace = max_entries_per_namespace
        self.threshold = threshold
        self._spaces: dict[str, _Namespace] = {}

    def __len__(self) -> int:
        return sum(len(ns.slot_of) for ns in self._spaces.values())

    def add(self, namespace: str, vector: Sequence[float], key: str) -> None:
        unit = _unit(vector)
        if unit is None:
            return  # a zero or non-finite vector has no direction to match on
        ns = self._spaces.get(namespace)
        if ns is None:
            ns = self._spaces[namespace] = _Namespace(
                unit.size, min(self._INITIAL_CAPACITY, self.max_entries_per_namespace)
            )
        if unit.size != ns.dim:
            raise ValueError(f"vector has {unit.size} dimensions; namespace {namespace!r} holds {ns.dim}")
        slot = ns.slot_of.get(key)
        if slot is None:
            if ns.count < self.max_entries_per_namespace:
                if ns.count == ns.matrix.shape[0]:
                    self._grow(ns)
                slot = ns.count
                ns.count += 1
            else:
                slot = ns.next_slot  # the oldest entry
                ns.next_slot = (slot + 1) % self.max_entries_per_namespace
                del ns.slot_of[ns.keys[slot]]
            ns.keys[slot] = key
            ns.slot_of[key] = slot
        ns.matrix[slot] = unit

    def _grow(self, ns: _Namespace) -> None:
        capacity = min(ns.matrix.shape[0] * 2, self.max_entries_per_namespace)
        matrix = np.zeros((capacity, ns.dim), dtype=np.float32)
        matrix[: ns.count] = ns.matrix[: ns.count]
        ns.matrix = matrix
        ns.keys.extend([None] * (capacity - len(ns.keys)))

    def lookup(
        self, namespace: str, vector: Sequence[float], *, threshold: float | None = None
    ) -> tuple[str, float] | None:
        """The closest stored key with cosine >= ``threshold`` (default: the index's)."""
        ns = self._spaces.get(namespace)
        if ns is None or not ns.slot_of:
            return None
        unit = _unit(vector)
        if unit is None or unit.size != ns.dim:
            return None
        scores = ns.matrix[: ns.count] @ unit
        best = int(np.argmax(scores))
        similarity = float(scores[best])
        key = ns.keys[best]
        if key is None or similarity < (self.threshold if threshold is None else threshold):
            return None
        return key, min(similarity, 1.0)

    def discard(self, namespace: str, key: str) -> bool:
        """Forget one key (say, its entry expired from the store). True if it was there."""
        ns = self._spaces.get(namespace)
        if ns is None or key not in ns.slot_of:
            return False
        slot = ns.slot_of.pop(key)
        ns.keys[slot] = None
        ns.matrix[slot] = 0.0  # scores 0 against everything; below any useful threshold
        if not ns.slot_of:
            del self._spaces[namespace]
        return True

    def drop_prefix(self, model: str) -> int:
        """Drop every namespace of ``model`` (all revisions); return how many entries went."""
        prefix = _model_part(model) + ":"
        doomed = [name for name in self._spaces if name.startswith(prefix)]
        return sum(len(self._spaces.pop(name).slot_of) for name in doomed)
