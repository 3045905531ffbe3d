"""The router's side of the response cache: one :meth:`ResponseCache.answer` per request.

In order: the hot tier (answers this router replica just computed or fetched), the
CacheServer deployment (memory or Redis, shared by the routers), the semantic index
for models that opt in, and finally the model itself, where identical requests in
flight at the same time share one call (single-flight). A fresh answer is written back
without making the client wait. Keys carry the model's revision, re-read from its
replicas every ``revision_refresh_s``, so a newly loaded revision never serves the old
one's answers. The cache can only ever miss: a slow or failing CacheServer costs a
model call, never a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Callable, Optional

import cachetools
from ray.serve.handle import DeploymentHandle

from serve_app.config import CacheConfig, ModelConfig
from serve_app.core.calls import EmbedCall, GenerateCall, ModelCall, ModelResult
from serve_app.core.cache import SingleFlight, cache_key, decode_value, encode_value, is_cacheable, semantic_namespace
from serve_app.ingress.model_client import ModelClient
from serve_app.ingress.notes import note
from serve_app.metrics import CacheMetrics

logger = logging.getLogger("ray.serve")

# Outcomes that computed the answer, as the x-cache header tells them.
_COMPUTED = ("bypass", "coalesced")


class ResponseCache:
    def __init__(self, config: CacheConfig, store: Optional[DeploymentHandle], models: dict[str, ModelConfig],
                 client: ModelClient):
        self.config = config
        self.store = store if config.enabled else None  # the CacheServer deployment
        self.models = models
        self.client = client
        # Identical requests in flight at once share one model call (per router replica).
        self.flights = SingleFlight()
        # The hot tier: encoded answers this replica just computed or fetched, for
        # router_hot_ttl_s. Repeats skip the CacheServer round trip, and a request whose
        # lookup raced a write-back is served here instead of calling the model again.
        # Entries are (encoded, result): the encoded size counts against router_hot_bytes,
        # and a hit returns the result without decoding it again.
        self._hot = cachetools.TTLCache(
            maxsize=max(1, config.router_hot_bytes), ttl=config.router_hot_ttl_s, getsizeof=lambda e: len(e[0])
        )
        self._background: set[asyncio.Task] = set()
        self._revisions: dict[str, tuple[str, float]] = {}
        self.outcomes: Counter = Counter()  # (model, outcome) -> requests
        self.metrics = CacheMetrics()
        self.errors = 0
        self._error_logged_at = 0.0

    async def answer(self, model: ModelConfig, call: ModelCall) -> tuple[ModelResult, str]:
        """The model's answer to ``call``, from the cache when possible, else from one
        (possibly shared) model call; and the ``x-cache`` header value."""
        outcome, result = await self._lookup_or_compute(model, call)
        self.outcomes[(model.name, outcome)] += 1
        self.metrics.outcome(model.name, outcome)
        note(cache=outcome)
        return result, "miss" if outcome in _COMPUTED else outcome

    async def drop(self, model: str) -> Optional[dict]:
        """Drop every cached answer of one model (all revisions); None if the store did not answer."""
        # Model names cannot hold ':' (config), so this prefix is exactly the model's keys.
        for key in [k for k in list(self._hot) if k.startswith(f"{model}:")]:
            self._hot.pop(key, None)
        return await self._store_call("drop_model", lambda store: store.drop_model.remote(model), timeout_s=60)

    async def stats(self) -> dict:
        outcomes: dict[str, dict[str, int]] = {}
        for (name, outcome), count in self.outcomes.items():
            outcomes.setdefault(name, {})[outcome] = count
        store = await self._store_call("stats", lambda store: store.stats.remote(), timeout_s=5)
        return {**(store or {}), "router_outcomes": outcomes, "router_cache_errors": self.errors,
                "coalesced": self.flights.coalesced}

    # ---- the lookup ------------------------------------------------------------------

    async def _lookup_or_compute(self, model: ModelConfig, call: ModelCall) -> tuple[str, ModelResult]:
        params = call.cache_params()
        if self.store is None or not model.cache.enabled or not is_cacheable(model.task, params):
            return "bypass", await self.client.infer(model, call)
        revision = await self._revision(model)
        key = cache_key(model=model.name, revision=revision, task=model.task, payload=call.cache_input(),
                        params=params)
        hot = self._hot_get(key)
        if hot is not None:
            return "hit", hot
        raw = await self._store_call("get", lambda store: store.get.remote(key))
        stored = self._decode(raw, call)
        if stored is not None:
            self._remember(key, raw, stored)
            return "hit", stored
        hot = self._hot_get(key)  # answered while our lookup was on its way
        if hot is not None:
            return "hit", hot
        namespace = vector = None
        semantic = model.cache.semantic
        text = call.semantic_text() if isinstance(call, GenerateCall) else None
        if semantic is not None and text:
            namespace = semantic_namespace(model=model.name, revision=revision, task=model.task, params=params)
            vector = await self._embed_for_cache(semantic.embedding_model, text)
            if vector is not None:
                found = await self._store_call(
                    "semantic_get", lambda store: store.semantic_get.remote(namespace, vector, semantic.threshold))
                similar = self._decode(found[2], call) if found is not None else None
                if similar is not None:
                    return "semantic", similar

        async def compute_and_store() -> ModelResult:
            result = await self.client.infer(model, call)
            # Inside the flight, so that from the moment the flight ends the answer is
            # already in the hot tier: no gap in which a late duplicate calls the model.
            self._write_back(key, result, model.cache.ttl_s, namespace, vector)
            return result

        result, shared = await self.flights.run(key, compute_and_store)
        return ("coalesced" if shared else "miss"), result

    async def _revision(self, model: ModelConfig) -> str:
        """The model's revision for cache keys, re-read every revision_refresh_s, so a
        newly loaded revision makes the old entries unreachable."""
        if model.cache.revision:
            return model.cache.revision
        known = self._revisions.get(model.name)
        now = time.monotonic()
        if known and now - known[1] < self.config.revision_refresh_s:
            return known[0]
        try:
            revision = (await self.client.info(model)).revision
        except Exception:
            if known:  # keep serving with the last known revision
                return known[0]
            raise
        self._revisions[model.name] = (revision, now)
        return revision

    async def _embed_for_cache(self, model_name: str, text: str) -> Optional[list[float]]:
        try:
            result = await self.client.infer(self.models[model_name], EmbedCall(texts=(text,)))
            return result.embeddings[0]
        except Exception as exc:  # the semantic cache is best effort
            logger.warning("semantic cache: embedding with %s failed: %r", model_name, exc)
            return None

    # ---- values ----------------------------------------------------------------------

    def _decode(self, encoded: Optional[bytes], call: ModelCall) -> Optional[ModelResult]:
        """A stored answer as the call's result type; None (a miss) if it is not one, for
        example an entry written by an older version in another shape."""
        if encoded is None:
            return None
        try:
            return call.result_type.from_wire(decode_value(encoded))
        except Exception as exc:
            logger.warning("cache: ignoring an entry that is not a %s: %r", call.result_type.__name__, exc)
            return None

    def _remember(self, key: str, encoded: bytes, result: ModelResult) -> None:
        try:
            self._hot[key] = (encoded, result)
        except ValueError:  # larger than the whole hot tier: the store still has it
            pass

    def _hot_get(self, key: str) -> Optional[ModelResult]:
        entry = self._hot.get(key)
        return None if entry is None else entry[1]

    def _write_back(self, key: str, result: ModelResult, ttl_s: Optional[float], namespace: Optional[str],
                    vector) -> None:
        """Store a fresh answer without making the client wait for the write."""
        encoded = encode_value(result.to_wire())
        self._remember(key, encoded, result)

        async def write() -> None:
            await self._store_call("set", lambda store: store.set.remote(key, encoded, ttl_s))
            if namespace is not None and vector is not None:
                await self._store_call("semantic_add", lambda store: store.semantic_add.remote(namespace, vector, key))

        task = asyncio.create_task(write())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _store_call(self, what: str, start: Callable[[DeploymentHandle], Any],
                          timeout_s: Optional[float] = None) -> Any:
        """A CacheServer call that can only miss: errors and slowness return None."""
        if self.store is None:
            return None
        try:
            return await asyncio.wait_for(start(self.store), timeout=timeout_s or self.config.call_timeout_s)
        except Exception as exc:  # degrade, never fail: the model still answers
            self.errors += 1
            self.metrics.errors.inc()
            now = time.monotonic()
            if now - self._error_logged_at > 30:
                logger.warning("cache %s failed (%d errors so far), serving without it: %r", what, self.errors, exc)
                self._error_logged_at = now
            return None
