"""Response caching: canonical keys, stores, a semantic index and single-flight.

The router asks the cache before it asks a model (docs/cache.md tells it for users):

1. :func:`cache_key` turns (model, revision, task, input, params) into a key. Texts enter
   it exactly as sent (:func:`canonical_payload`): a Unicode or whitespace variant can
   tokenize differently, so it gets its own entry. The model's name leads the key so one model's entries can be
   dropped by prefix; the revision follows, so entries of an old revision become
   unreachable the moment a new revision loads (they then age out by TTL).
2. A :class:`CacheStore` holds the encoded answers (:func:`encode_value`, msgpack, never
   pickle): :class:`MemoryStore` in-process, :class:`RedisStore` shared. Wrap either in
   :class:`ResilientStore` so a slow or dead store turns into cache misses, never into
   failed requests.
3. :class:`SemanticIndex` (opt-in per model) finds an earlier request that asks the same
   question: its context matched exactly (:func:`semantic_namespace`), its last user
   turn close by embedding and accepted by a guard (``semantic.same_question``).
4. :class:`SingleFlight` lets identical requests that are in flight at the same time
   share one model call.
5. The store lookups (and write-backs) of requests that arrive together travel as one
   call: the router sends them through a :class:`~serve_app.core.coalescing.Coalescer`.
6. :func:`~serve_app.core.cache.fit.misfit` says why a stored value cannot be the answer
   to the request that found it (then it is a miss, and dropped).

Everything here is plain asyncio; nothing imports ray. Nothing here is thread-safe: each
object belongs to one event loop.
"""

from serve_app.core.cache.flight import SingleFlight
from serve_app.core.cache.keys import (
    cache_key,
    canonical_payload,
    is_cacheable,
    semantic_namespace,
)
from serve_app.core.cache.semantic import SemanticIndex
from serve_app.core.cache.stores import CacheStore, MemoryStore, RedisStore, ResilientStore
from serve_app.core.cache.values import NOT_SENT, bounded_reply, decode_value, encode_value

__all__ = [
    "NOT_SENT",
    "CacheStore",
    "MemoryStore",
    "RedisStore",
    "ResilientStore",
    "SemanticIndex",
    "SingleFlight",
    "bounded_reply",
    "cache_key",
    "canonical_payload",
    "decode_value",
    "encode_value",
    "is_cacheable",
    "semantic_namespace",
]
