"""CacheServer: the response cache as a deployment of its own.

The router asks it before any model call and writes answers back after a miss; the
lookups and write-backs of requests that arrive together travel as one call each
(``get_many``, ``set_many``; see ``core.coalescing``). It holds the store (in-process
memory by default, Redis for a cluster) behind a ResilientStore, so a slow or dead
store answers "miss" within a short timeout instead of failing requests, and the
semantic index for models that opt in.

Several CacheServer replicas share entries only through Redis; with the memory store
each replica keeps its own entries (the router's calls spread over them, so the hit
rate drops as replicas are added: use Redis when you need more than one). The
semantic index is always per replica, and bounded as a whole by
``cache.semantic_max_bytes`` (see :class:`SemanticIndex`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Optional, Sequence

from ray import serve

from serve_app.config import CacheConfig
from serve_app.core.cache import NOT_SENT, MemoryStore, RedisStore, ResilientStore, SemanticIndex, bounded_reply
from serve_app.metrics import StoreMetrics
from serve_app.serve_logs import start_log_flusher

logger = logging.getLogger("ray.serve")


def _store_from_config(config: CacheConfig):
    if config.store == "memory":
        return MemoryStore(max_bytes=config.max_bytes)
    url = os.environ.get(config.redis_url_env) or config.redis_url
    password = os.environ.get(config.redis_password_env) or None
    return RedisStore(
        url,
        prefix=config.key_prefix,
        password=password,
        socket_timeout_s=config.store_timeout_s,
        connect_timeout_s=config.store_timeout_s,
    )


GAUGE_REFRESH_S = 5.0


@serve.deployment
class CacheServer:
    async def __init__(self, cache_config: dict):
        start_log_flusher()  # Ray buffers this replica's log lines (serve_app.serve_logs)
        self.config = CacheConfig.model_validate(cache_config)
        self.store = ResilientStore(_store_from_config(self.config), timeout_s=self.config.store_timeout_s)
        self.semantic = SemanticIndex(max_entries_per_namespace=self.config.semantic_max_entries,
                                      max_bytes=self.config.semantic_max_bytes)
        self.counts = {"gets": 0, "hits": 0, "sets": 0, "semantic_lookups": 0, "semantic_hits": 0}
        self.metrics = StoreMetrics()
        # Ray drops a gauge from the scrape when it is not set for a while; refresh the
        # store's gauges on a timer so dashboards show them while traffic is quiet too.
        self._gauge_task = asyncio.create_task(self._refresh_gauges_forever())
        logger.info("cache store: %s (ttl %ss)", self.config.store, self.config.ttl_s)

    async def _refresh_gauges(self) -> dict:
        """Read the store's figures once, set the gauges from them, and return them."""
        inner = self.store.inner
        figures = {
            "evictions": getattr(inner, "evictions", None),
            "size_bytes": await self.store.size_bytes(),
            "entries": len(inner) if isinstance(inner, MemoryStore) else None,
            "store_errors": self.store.errors,
        }
        self.metrics.update(**figures)
        return figures

    async def _refresh_gauges_forever(self, period_s: float = GAUGE_REFRESH_S) -> None:
        while True:
            try:
                await self._refresh_gauges()
            except Exception:  # a slow or absent store must not end the loop
                logger.debug("cache gauge refresh failed", exc_info=True)
            await asyncio.sleep(period_s)

    async def get_many(self, keys: Sequence[str], max_reply_bytes: Optional[int] = None) -> list:
        """One value (or None) per key, in order: the lookups of several requests in one
        call. With ``max_reply_bytes`` (the transport's message limit, less headroom),
        values past it come back as NOT_SENT, for the caller to ask for again: 64 cached
        768-d vectors are 440 KB, and ten such hits would pass gRPC's 4 MiB."""
        values = await self.store.get_many(list(keys))
        reply = bounded_reply(values, max_reply_bytes)
        self.counts["gets"] += sum(value is not NOT_SENT for value in reply)
        self.counts["hits"] += sum(value is not None and value is not NOT_SENT for value in reply)
        return reply

    async def set_many(self, entries: Sequence[tuple[str, bytes, Optional[float]]]) -> list[None]:
        """Several write-backs in one call; a ttl_s of None takes the configured TTL, 0 deletes."""
        self.counts["sets"] += len(entries)
        await self.store.set_many([(key, value, self.config.ttl_s if ttl_s is None else ttl_s)
                                   for key, value, ttl_s in entries])
        return [None] * len(entries)

    async def semantic_get(self, namespace: str, vector: Sequence[float], question: str,
                           threshold: float) -> Optional[tuple[str, float, bytes]]:
        """The stored answer of the most similar earlier question of ``namespace``, if similar
        enough and, by the index's guard, asking the same thing as ``question``."""
        self.counts["semantic_lookups"] += 1
        found = self.semantic.lookup(namespace, vector, question, threshold=threshold)
        if found is None:
            return None
        key, similarity = found
        value = await self.store.get(key)
        if value is None:  # the answer expired or was evicted: forget the vector too
            self.semantic.discard(namespace, key)
            return None
        self.counts["semantic_hits"] += 1
        return key, similarity, value

    async def semantic_add(self, namespace: str, vector: Sequence[float], key: str, question: str) -> None:
        self.semantic.add(namespace, vector, key, question)

    async def drop_model(self, model: str) -> dict:
        entries = await self.store.drop_model(model)
        vectors = self.semantic.drop_prefix(model)
        logger.info("cache: dropped %d entries and %d semantic vectors of model %s", entries, vectors, model)
        return {"model": model, "entries": entries, "vectors": vectors}

    async def stats(self) -> dict:
        figures = await self._refresh_gauges()
        return {
            "store": self.config.store,
            **self.counts,
            "store_errors": figures["store_errors"],
            "store_skipped": self.store.skipped,
            "store_healthy": self.store.healthy,
            "evictions": figures["evictions"],
            "expirations": getattr(self.store.inner, "expirations", None),
            "entries": figures["entries"],
            "bytes": figures["size_bytes"],
            "semantic_vectors": len(self.semantic),
            "semantic_namespaces": self.semantic.namespaces,
            "semantic_bytes": self.semantic.nbytes,
            "semantic_evictions": self.semantic.evictions,
            "semantic_refused": self.semantic.refused,
        }
