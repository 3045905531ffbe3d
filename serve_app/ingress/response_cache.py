"""The router's side of the response cache: one :meth:`ResponseCache.answer` per request.

In order: the hot tier (answers this router replica just computed or fetched), the
CacheServer deployment (memory or Redis, shared by the routers), the semantic index
for models that opt in, and finally the model itself, where identical requests in
flight at the same time share one call (single-flight). A fresh answer is written back
without making the client wait, under the revision of the replica that computed it
(during a rolling update that can differ from the one read). Reads use the model's
revision as the router knows it (``ingress.revisions``: re-read from its replicas every
``revision_refresh_s``, never going back to an older one), so a newly loaded revision
never serves the old one's answers; a stored value that does not fit its request
(``core.cache.fit``) is a miss. One deadline, taken when the request
arrives, covers every call made for it. The cache can only ever miss: a slow or
failing CacheServer, or a corrupt stored value, costs a model call, never a request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from typing import Any, Callable, Optional

import cachetools
from ray.serve.handle import DeploymentHandle

from serve_app.config import CacheConfig, ModelConfig
from serve_app.core.calls import (
    EmbedCall,
    GenerateCall,
    ModelCall,
    ModelResult,
)
from serve_app.core.cache import (
    NOT_SENT,
    SingleFlight,
    cache_key,
    decode_value,
    encode_value,
    is_cacheable,
    semantic_namespace,
)
from serve_app.core.cache.fit import misfit
from serve_app.core.coalescing import Coalescer
from serve_app.core.cache.semantic import semantic_request
from serve_app.core.shared_tasks import start_shared
from serve_app.ray_env import handle_message_budget_bytes
from serve_app.ingress.model_client import ModelClient
from serve_app.ingress.request_context import current, note
from serve_app.ingress.revisions import RevisionTracker
from serve_app.metrics import CacheMetrics

logger = logging.getLogger("ray.serve")

# Outcomes that computed the answer, as the x-cache header tells them.
_COMPUTED = ("bypass", "coalesced")

# At most one warning per this many seconds per kind of trouble (a corrupt entry, a
# failing embedder): a per-request problem must not write a line per request.
_WARN_EVERY_S = 30.0
# Most lookups (or write-backs) one CacheServer call carries.
_STORE_BATCH = 256
# Most CacheServer calls one lookup makes when its value keeps being left out of full
# replies (each call sends at least one value, so a burst drains); then it is a miss.
_LOOKUP_ROUNDS = 8
# A text the embedder refused as too long makes texts at least as long skip the semantic
# lookup for this long (then one is tried again: the bound is a guess in characters).
_TOO_LONG_MEMORY_S = 600.0


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
        # Lookups and write-backs of requests that arrive together go to the CacheServer
        # as one call each: its per-call cost, not the store, is most of what a miss
        # costs (core.coalescing).
        # Both bounded in bytes too, below the transport's message limit: a batch of
        # large answers (64 vectors of 768 floats are 440 KB) would otherwise fail whole.
        self.max_bytes = handle_message_budget_bytes()
        self.too_large = 0  # answers not cached: larger than one CacheServer call may carry
        self._lookups: Coalescer[str, Optional[bytes]] = Coalescer(
            self._get_many, timeout_s=config.call_timeout_s, max_items=_STORE_BATCH)
        self._writes: Coalescer[tuple, None] = Coalescer(
            self._set_many, timeout_s=config.call_timeout_s, max_items=_STORE_BATCH,
            size_of=lambda entry: len(entry[0]) + len(entry[1]), max_bytes=self.max_bytes)
        self.revisions = RevisionTracker(client, config.revision_refresh_s)
        self._too_long: dict[str, tuple[int, float]] = {}  # embedder -> (chars, when) it refused
        self._warned_at: dict[str, float] = {}
        self._unwarned: Counter = Counter()
        self.semantic_too_long = 0  # semantic lookups skipped: the text exceeds the embedder's context
        self.corrupt_entries = 0  # stored values that were not a valid answer to their request
        self.outcomes: Counter = Counter()  # (model, outcome) -> requests
        self.metrics = CacheMetrics()
        self.errors = 0
        self._error_logged_at = 0.0

    async def answer(self, model: ModelConfig, call: ModelCall, *,
                     deadline: Optional[float] = None) -> tuple[ModelResult, str]:
        """The model's answer to ``call``, from the cache when possible, else from one
        (possibly shared) model call; and the ``x-cache`` header value. ``deadline``
        (time.monotonic(); None: the request's, which the model client reads from the
        request context) covers every call made for it: the revision read, the semantic
        cache's embedding and the model call."""
        deadline = self.client.request_deadline(deadline)  # fixed once for all of them
        outcome, result = await self._lookup_or_compute(model, call, deadline)
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
                "coalesced": self.flights.coalesced, "router_corrupt_entries": self.corrupt_entries,
                "router_semantic_too_long": self.semantic_too_long, "router_too_large_to_store": self.too_large}

    # ---- the lookup ------------------------------------------------------------------

    async def _lookup_or_compute(self, model: ModelConfig, call: ModelCall,
                                 deadline: float) -> tuple[str, ModelResult]:
        params = call.cache_params()
        if self.store is None or not model.cache.enabled or not is_cacheable(model.task, params):
            return "bypass", await self.client.infer(model, call, deadline=deadline)
        # Reads use the revision the router knows: the newest it has seen, so a hit is
        # never an older revision's answer. Writes use the revision of the replica that
        # computed the answer (compute_and_store), which during a rolling update can be
        # another one: an old replica's answer never lands under the new revision's key.
        revision = await self.revisions.read(model, deadline)

        def key_under(rev: str) -> str:
            return cache_key(model=model.name, revision=rev, task=model.task, payload=call.cache_input(),
                             params=params)

        key = key_under(revision)
        hot = self._hot_get(key)
        if hot is not None:
            return "hit", hot
        raw = await self._lookup(key)
        stored = self._decode(raw, call, key=key, revision=revision)
        if stored is not None:
            self._remember(key, raw, stored)
            return "hit", stored
        hot = self._hot_get(key)  # answered while our lookup was on its way
        if hot is not None:
            return "hit", hot
        namespace = vector = question = None
        semantic = model.cache.semantic
        # Only the last user turn (a completion: its one prompt) is compared by meaning;
        # the endpoint, system prompt, earlier turns, params, the embedder and the
        # caller's scope must match exactly and are hashed into the namespace. The
        # CacheServer's index then refuses a similar question with other numbers,
        # negations or content words (core.cache.semantic).
        asked = (semantic_request(prompts=call.prompts, messages=call.chat())
                 if semantic is not None and isinstance(call, GenerateCall) else None)
        if asked is not None:
            # The lookup only saves work: it may not spend the model call's time.
            embed_by = time.monotonic() + semantic.embed_timeout_s
            embedded = await self._embed_for_cache(semantic.embedding_model, asked.question,
                                                   min(deadline, embed_by))
            if embedded is not None:
                vector, embedder_revision = embedded
                question = asked.question
                namespace = semantic_namespace(
                    model=model.name, revision=revision, task=model.task, params=params, endpoint=asked.endpoint,
                    context=asked.context, embedder=semantic.embedding_model, embedder_revision=embedder_revision,
                    scope=self._semantic_scope())
                found = await self._store_call(
                    "semantic_get",
                    lambda store: store.semantic_get.remote(namespace, vector, question, semantic.threshold))
                similar = self._decode(found[2], call, key=found[0], revision=revision) if found is not None else None
                if similar is not None:
                    return "semantic", similar

        async def compute_and_store() -> ModelResult:
            result = await self.client.infer(model, call, deadline=deadline)
            computed_by = getattr(result, "revision", None)
            if computed_by is None and not model.cache.revision:
                # A replica of code older than results that carry a revision (the first
                # rolling update onto this version): whose answer it is cannot be told,
                # so it is not cached at all.
                return result
            computed_by = computed_by or revision
            self.revisions.saw(model, computed_by)
            if computed_by == revision:
                # Inside the flight, so that from the moment the flight ends the answer is
                # already in the hot tier: no gap in which a late duplicate calls the model.
                self._write_back(key, result, model.cache.ttl_s, namespace, vector, question)
            else:
                # Another revision's replica answered: its key, and no semantic entry (the
                # namespace is the read revision's).
                self._write_back(key_under(computed_by), result, model.cache.ttl_s, None, None)
            return result

        result, shared = await self.flights.run(key, compute_and_store)
        return ("coalesced" if shared else "miss"), result

    async def _embed_for_cache(self, model_name: str, text: str,
                               deadline: Optional[float] = None) -> Optional[tuple[list[float], str]]:
        """The semantic cache's embedding of ``text`` and the revision of the embedder
        that computed it (part of the namespace: vectors of two revisions are not
        comparable), or None (no semantic lookup).

        Within the request's deadline: the model call after it has only what is left. A
        text longer than the embedder's context is never sent (the call could only fail):
        one with more words than the context has tokens is too long for any tokenizer
        that gives each word a token at least; and once the embedder refuses a text as
        too long, texts at least as long (in characters) skip it for a while.
        """
        embedder = self.models[model_name]
        if self._too_long_to_embed(embedder, text):
            self.semantic_too_long += 1
            return None
        try:
            await self.revisions.read(embedder, deadline)  # learns its context (max_input_tokens)
        except Exception:  # noqa: BLE001 - the context check is an optimisation only
            pass
        if self._too_long_to_embed(embedder, text):
            self.semantic_too_long += 1
            return None
        try:
            result = await self.client.infer(embedder, EmbedCall(texts=(text,)), deadline=deadline)
            return result.embeddings[0], self.revisions.of_result(embedder, result)
        except Exception as exc:  # the semantic cache is best effort
            if getattr(exc, "code", None) == "context_length_exceeded":
                self.semantic_too_long += 1
                known = self._too_long.get(model_name)
                fresh = known is not None and time.monotonic() - known[1] < _TOO_LONG_MEMORY_S
                self._too_long[model_name] = (min(len(text), known[0]) if fresh else len(text), time.monotonic())
                self._warn("too_long", "semantic cache: %d text(s) longer than the context of %s were not embedded "
                           "(no semantic lookup for them; last: %d characters)", model_name, len(text),
                           level=logging.INFO)
            else:
                self._warn("embed", "semantic cache: %d embedding call(s) with %s failed (last: %r)", model_name, exc)
            return None

    def _too_long_to_embed(self, embedder: ModelConfig, text: str) -> bool:
        context = self.revisions.max_input_tokens(embedder)
        if context and len(text.split()) > context:
            return True
        refused = self._too_long.get(embedder.name)
        return (refused is not None and len(text) >= refused[0]
                and time.monotonic() - refused[1] < _TOO_LONG_MEMORY_S)

    def _warn(self, kind: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        """Log ``message`` at most once per _WARN_EVERY_S per ``kind``. Its first
        placeholder (``%d``) gets how many times it happened since the last line."""
        self._unwarned[kind] += 1
        now = time.monotonic()
        if now - self._warned_at.get(kind, -math.inf) < _WARN_EVERY_S:
            return
        count, self._unwarned[kind] = self._unwarned[kind], 0
        self._warned_at[kind] = now
        logger.log(level, message, count, *args)

    # ---- values ----------------------------------------------------------------------

    def _decode(self, encoded: Optional[bytes], call: ModelCall, *, key: Optional[str] = None,
                revision: Optional[str] = None) -> Optional[ModelResult]:
        """A stored answer as the call's result type; None (a miss) if it is not a valid
        answer to ``call`` of ``revision``: garbage, another shape (VALUE_SCHEMA in the key
        keeps other versions' layouts apart, so this is corruption), the wrong number of
        rows, a non-finite vector. Such an entry is dropped (``key``), so it costs one
        miss, not a miss or a 500 per request until its TTL ends."""
        if encoded is None:
            return None
        try:
            result = call.result_type.from_wire(decode_value(encoded))
            problem = misfit(call, result, revision)
        except Exception as exc:  # noqa: BLE001 - any failure to decode is a corrupt entry
            result, problem = None, repr(exc)
        if problem is None:
            return result
        self.corrupt_entries += 1
        self._warn("corrupt", "cache: dropped %d stored value(s) that were not a valid answer (last: not a %s: %s)",
                   call.result_type.__name__, problem)
        if key is not None:
            self._hot.pop(key, None)
            self._write_later((key, b"", 0))  # ttl 0 deletes
        return None

    def _remember(self, key: str, encoded: bytes, result: ModelResult) -> None:
        try:
            self._hot[key] = (encoded, result)
        except ValueError:  # larger than the whole hot tier: the store still has it
            pass

    def _semantic_scope(self) -> str:
        """Who may share semantic entries: under ``cache.scope: per_key`` (the default) the
        caller's API key identity, a hash set by the ingress guard; "" (everyone) when
        shared or with auth off (no keys, so one tenant)."""
        if self.config.scope == "shared":
            return ""
        context = current()
        return (context.caller if context is not None else None) or ""

    def _hot_get(self, key: str) -> Optional[ModelResult]:
        entry = self._hot.get(key)
        return None if entry is None else entry[1]

    def _write_back(self, key: str, result: ModelResult, ttl_s: Optional[float], namespace: Optional[str],
                    vector, question: Optional[str] = None) -> None:
        """Store a fresh answer without making the client wait for the write; with a
        ``namespace``, also its question's vector and text for the semantic index."""
        encoded = encode_value(result.to_wire())
        self._remember(key, encoded, result)
        if len(encoded) > self.max_bytes:  # no CacheServer call could carry it (the hot tier keeps it)
            self.too_large += 1
            return
        if namespace is None or vector is None or question is None:
            self._write_later((key, encoded, ttl_s))
            return

        async def write_then_index() -> None:  # the index may only point at a stored answer
            await self._batched("set", self._writes, (key, encoded, ttl_s))
            await self._store_call("semantic_add",
                                   lambda store: store.semantic_add.remote(namespace, vector, key, question))

        task = start_shared(write_then_index())  # outlives the request: none of its context
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _write_later(self, entry: tuple) -> None:
        """Queue one write for the next batch; nobody waits for it (no task per write)."""
        if self.store is not None:
            self._writes.submit(entry).add_done_callback(self._note_write)

    def _note_write(self, outcome: asyncio.Future) -> None:
        if not outcome.cancelled() and outcome.exception() is not None:
            self._store_failed("set", outcome.exception())

    async def _batched(self, what: str, batcher: Coalescer, item: Any) -> Any:
        """A batched CacheServer call that can only miss: errors and slowness return None.
        The batcher bounds its time (a batch's own timeout, and at most one wait for a
        batch already out)."""
        if self.store is None:
            return None
        try:
            return await batcher.call(item)
        except Exception as exc:  # degrade, never fail: the model still answers
            self._store_failed(what, exc)
            return None

    async def _get_many(self, keys: list[str]) -> list:
        """The keys' values in one CacheServer call, whose reply stays under the transport's
        limit: what did not fit comes back NOT_SENT, and its lookup asks again (_lookup)."""
        return await self.store.get_many.remote(keys, self.max_bytes)

    async def _lookup(self, key: str) -> Optional[bytes]:
        """One key's stored value (None: a miss). A value left out of a full reply is asked
        for again in the next batch, each with its own time limit, so a burst of large
        hits arrives over several calls instead of failing (or timing out) as one."""
        for _ in range(_LOOKUP_ROUNDS):
            raw = await self._batched("get", self._lookups, key)
            if raw is not NOT_SENT:
                return raw
        return None

    async def _set_many(self, entries: list[tuple]) -> list[None]:
        return await self.store.set_many.remote(entries)

    async def _store_call(self, what: str, start: Callable[[DeploymentHandle], Any],
                          timeout_s: Optional[float] = None) -> Any:
        """A CacheServer call that can only miss: errors and slowness return None."""
        if self.store is None:
            return None
        try:
            return await asyncio.wait_for(start(self.store), timeout=timeout_s or self.config.call_timeout_s)
        except Exception as exc:  # degrade, never fail: the model still answers
            self._store_failed(what, exc)
            return None

    def _store_failed(self, what: str, exc: BaseException) -> None:
        self.errors += 1
        self.metrics.errors.inc()
        now = time.monotonic()
        if now - self._error_logged_at > 30:
            logger.warning("cache %s failed (%d errors so far), serving without it: %r", what, self.errors, exc)
            self._error_logged_at = now
