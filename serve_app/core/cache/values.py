"""Cached values: responses as msgpack bytes, never pickle."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import msgpack
import numpy as np

# The layout of a cached value (a result type's to_wire map, serve_app.core.calls). It
# is part of every cache key, so bump it whenever a result type gains, loses or changes
# a field: entries of the old layout then are never read (they age out by TTL), instead
# of failing to decode, or worse decoding into a wrong answer.
# 2: results carry the revision of the replica that computed them.
# 3: a completion carries the tool calls the model made.
VALUE_SCHEMA = 3


def _msgpack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot cache a value of type {type(obj).__name__}")


def encode_value(obj: Any) -> bytes:
    """msgpack bytes of a response (dicts, lists, str, int, float, bool, None; nested).

    Floats stay 64-bit, so they round-trip exactly; tuples come back as lists; numpy
    arrays and scalars are stored as lists and Python numbers. Never pickle: a shared
    cache must not be a way to run code.
    """
    return msgpack.packb(obj, use_bin_type=True, default=_msgpack_default)


def decode_value(data: bytes) -> Any:
    """The inverse of :func:`encode_value`; raises ValueError-like errors on garbage."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# In a reply of CacheServer.get_many, a value left out to keep the reply under the size
# the caller gave (the transport's message limit): the caller asks for it again.
NOT_SENT = False


def bounded_reply(values: Sequence[Optional[bytes]], max_bytes: Optional[int]) -> list:
    """``values`` as a reply of at most ``max_bytes`` of values: those past the budget
    become :data:`NOT_SENT` (asked again in the next call), and one that could never fit
    alone is a miss (None). The first value that fits always goes, so each call makes
    progress."""
    if max_bytes is None:
        return list(values)
    reply, used = [], 0
    for value in values:
        size = len(value) if value is not None else 0
        if size > max_bytes:
            reply.append(None)
        elif used + size > max_bytes:
            reply.append(NOT_SENT)
        else:
            reply.append(value)
            used += size
    return reply
