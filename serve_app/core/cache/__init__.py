"""Response caching: canonical keys, stores, a semantic index and single-flight.

The router asks the cache before it asks a model (see DESIGN.md):

1. :func:`cache_key` turns (model, revision, task, input, params) into a key. Inputs are
   canonicalized first (:func:`canonical_payload`), so whitespace and Unicode variants of
   one text share an entry. The model's name leads the key so one model's entries can be
   dropped by prefix; the revision follows, so entries of an old revision become
   unreachable the moment a new revision loads (they then age out by TTL).
2. A :class:`CacheStore` holds the encoded answers (:func:`encode_value`, msgpack, never
   pickle): :class:`MemoryStore` in-process, :class:`RedisStore` shared. Wrap either in
   :class:`ResilientStore` so a slow or dead store turns into cache misses, never into
   failed requests.
3. :class:`SemanticIndex` (opt-in per model) finds an earlier request whose embedding is
   close enough to reuse its answer.
4. :class:`SingleFlight` lets identical requests that are in flight at the same time
   share one model call.

Everything here is plain asyncio; nothing imports ray. Nothing here is thread-safe: each
object belongs to one event loop.
"""

from serve_app.core.cache.flight import SingleFlight
from serve_app.core.cache.keys import (
    cache_key,
    canonical_payload,
    canonical_text,
    is_cacheable,
    semantic_namespace,
)
from serve_app.core.cache.semantic import SemanticIndex
from serve_app.core.cache.stores import CacheStore, MemoryStore, RedisStore, ResilientStore
from serve_app.core.cache.values import decode_value, encode_value

__all__ = [
    "CacheStore",
    "MemoryStore",
    "RedisStore",
    "ResilientStore",
    "SemanticIndex",
    "SingleFlight",
    "cache_key",
    "canonical_payload",
    "canonical_text",
    "decode_value",
    "encode_value",
    "is_cacheable",
    "semantic_namespace",
]
