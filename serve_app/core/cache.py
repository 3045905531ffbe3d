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

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
import unicodedata
from typing import Any, Awaitable, Callable, Protocol, Sequence, TypeVar, runtime_checkable

import cachetools
import msgpack
import numpy as np

logger = logging.getLogger(__name__)

T = TypeVar("T")

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

# ---- canonical inputs and keys ----------------------------------------------------

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
        # Greedy decoding ignores the seed and top_p (core.runtime sets do_sample=False).
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


# ---- values -------------------------------------------------------------------------


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


# ---- stores -------------------------------------------------------------------------


@runtime_checkable
class CacheStore(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, ttl_s: float) -> None: ...

    async def drop_model(self, model: str) -> int:
        """Delete every entry whose key starts with ``f"{model}:"``; return how many."""
        ...

    async def size_bytes(self) -> int | None:
        """Approximate bytes held, or None when unknown."""
        ...

    async def close(self) -> None: ...


class _Entry:
    __slots__ = ("value", "ttl_s", "size")

    def __init__(self, value: bytes, ttl_s: float, size: int):
        self.value = value
        self.ttl_s = ttl_s
        self.size = size


class _CountingTLRU(cachetools.TLRUCache):
    """TLRUCache that counts budget evictions and TTL expiries apart."""

    def __init__(self, maxsize, ttu, timer, getsizeof):
        super().__init__(maxsize, ttu, timer=timer, getsizeof=getsizeof)
        self.evictions = 0
        self.expirations = 0

    def expire(self, time=None):
        expired = super().expire(time)
        self.expirations += len(expired)
        return expired

    def popitem(self):
        item = super().popitem()  # expires first, then takes the least recently used
        self.evictions += 1
        return item


class MemoryStore:
    """In-process LRU with a byte budget and a TTL per entry (cachetools.TLRUCache).

    An entry costs ``len(key) + len(value)`` bytes against ``max_bytes`` (Python object
    overhead, roughly 150 bytes an entry, is not counted). When a new entry does not fit,
    the least recently used entries go first (``evictions``); entries past their TTL are
    removed lazily on get/set (``expirations``). An entry larger than ``max_bytes`` is not
    stored. ``clock`` is injectable so tests can expire entries without sleeping.
    """

    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        if max_bytes <= 0:
            raise ValueError(f"max_bytes is {max_bytes}; it must be positive")
        self.max_bytes = max_bytes
        self._cache = _CountingTLRU(
            maxsize=max_bytes,
            ttu=lambda _key, entry, now: now + entry.ttl_s,
            timer=clock,
            getsizeof=lambda entry: entry.size,
        )
        self.too_large = 0  # entries refused because they alone exceed max_bytes

    @property
    def evictions(self) -> int:
        return self._cache.evictions

    @property
    def expirations(self) -> int:
        return self._cache.expirations

    def __len__(self) -> int:
        self._cache.expire()
        return len(self._cache)

    async def get(self, key: str) -> bytes | None:
        self._cache.expire()  # O(1) when nothing is due
        entry = self._cache.get(key)
        return None if entry is None else entry.value

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        value = bytes(value)
        size = len(key) + len(value)
        if ttl_s <= 0 or size > self.max_bytes:
            if size > self.max_bytes:
                self.too_large += 1
            self._cache.pop(key, None)  # never leave an older value behind
            return
        self._cache[key] = _Entry(value, float(ttl_s), size)

    async def drop_model(self, model: str) -> int:
        prefix = _model_part(model) + ":"
        doomed = [k for k in list(self._cache.keys()) if k.startswith(prefix)]
        for k in doomed:
            self._cache.pop(k, None)
        return len(doomed)

    async def size_bytes(self) -> int | None:
        self._cache.expire()
        return int(self._cache.currsize)

    async def close(self) -> None:
        self._cache.clear()


def _glob_escape(text: str) -> str:
    """Escape Redis glob metacharacters so text matches only itself in SCAN MATCH."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class RedisStore:
    """A cache shared by every replica, in Redis (redis.asyncio, one connection pool).

    Every key is ``prefix + key`` and is written with a TTL (``SET ... PX``), always, so
    the recommended server setup is a cache-only Redis with a memory cap:

        maxmemory 4gb                    # whatever the machine affords
        maxmemory-policy allkeys-lru     # or volatile-ttl; every key here has a TTL
        save ""                          # no snapshots: a cache need not survive a restart
        appendonly no

    Timeouts are short (a cache that answers slower than the model is worse than none)
    and a failed command is retried once, at once (for a stale pooled connection), not
    with backoff. When all ``max_connections`` are busy a command waits up to
    ``socket_timeout_s`` for one. Wrap this store in :class:`ResilientStore` so errors
    become misses.

    ``drop_model`` walks the key space with SCAN (never KEYS) and deletes with UNLINK in
    batches; it is O(keys in the database), meant for admin use. ``size_bytes`` returns
    None: the server may be shared, and counting our own keys' memory would need a full
    scan.
    """

    _DROP_BATCH = 500

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "serve_app:",
        password: str | None = None,
        socket_timeout_s: float = 0.05,
        connect_timeout_s: float = 0.05,
        max_connections: int = 64,
    ):
        import redis.asyncio as redis_asyncio  # imported here: MemoryStore users need no redis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.prefix = prefix
        extra = {} if password is None else {"password": password}
        self._pool = redis_asyncio.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=socket_timeout_s,  # wait this long for a free pooled connection
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1),
            **extra,
        )
        self._redis = redis_asyncio.Redis(connection_pool=self._pool)

    async def get(self, key: str) -> bytes | None:
        return await self._redis.get(self.prefix + key)

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        ttl_ms = int(math.ceil(ttl_s * 1000))
        if ttl_ms <= 0:
            await self._redis.delete(self.prefix + key)
            return
        await self._redis.set(self.prefix + key, value, px=ttl_ms)

    async def drop_model(self, model: str) -> int:
        match = _glob_escape(self.prefix + _model_part(model) + ":") + "*"
        dropped = 0
        batch: list[bytes] = []
        async for k in self._redis.scan_iter(match=match, count=1000):
            batch.append(k)
            if len(batch) >= self._DROP_BATCH:
                dropped += await self._redis.unlink(*batch)
                batch = []
        if batch:
            dropped += await self._redis.unlink(*batch)
        return int(dropped)

    async def size_bytes(self) -> int | None:
        return None

    async def ping(self) -> bool:
        return bool(await self._redis.ping())

    async def close(self) -> None:
        await self._redis.aclose()
        await self._pool.disconnect()


class ResilientStore:
    """Any :class:`CacheStore`, made unable to fail a request.

    Each get/set runs under ``asyncio.wait_for(timeout_s)``; an error or a timeout makes
    get return None (a miss) and set a no-op, counted in ``errors``. One warning per
    ``log_interval_s`` summarizes the errors since the last one, never one per request.

    A circuit breaker keeps a dead store from costing every request a timeout: after
    ``open_after_errors`` failures in a row, calls are skipped (counted in ``skipped``)
    for ``retry_after_s``, then tried again. ``drop_model`` is an admin call that may scan
    a large key space, so it has its own, longer ``drop_timeout_s``; on failure it
    returns 0.
    """

    def __init__(
        self,
        inner: CacheStore,
        *,
        timeout_s: float = 0.05,
        log_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        open_after_errors: int = 5,
        retry_after_s: float = 1.0,
        drop_timeout_s: float = 30.0,
    ):
        self.inner = inner
        self.timeout_s = timeout_s
        self.log_interval_s = log_interval_s
        self.open_after_errors = open_after_errors
        self.retry_after_s = retry_after_s
        self.drop_timeout_s = drop_timeout_s
        self._clock = clock
        self.errors = 0
        self.skipped = 0
        self._consecutive = 0
        self._open_until = -math.inf
        self._unlogged = 0
        self._last_log: float | None = None
        self._last_error: BaseException | None = None

    @property
    def healthy(self) -> bool:
        return self._consecutive == 0

    def _skip(self) -> bool:
        if self._consecutive >= self.open_after_errors and self._clock() < self._open_until:
            self.skipped += 1
            return True
        return False

    def _ok(self) -> None:
        if self._consecutive:
            logger.info("cache store %s answers again after %d failed calls", type(self.inner).__name__, self._consecutive)
        self._consecutive = 0

    def _failed(self, op: str, exc: BaseException) -> None:
        now = self._clock()
        self.errors += 1
        self._unlogged += 1
        self._consecutive += 1
        self._last_error = exc
        if self._consecutive >= self.open_after_errors:
            self._open_until = now + self.retry_after_s
        if self._last_log is None or now - self._last_log >= self.log_interval_s:
            since = "" if self._last_log is None else f" in the last {now - self._last_log:.0f} s"
            logger.warning(
                "cache store %s failed %d time(s)%s (last: %s %s); serving without the cache",
                type(self.inner).__name__,
                self._unlogged,
                since,
                op,
                "timeout" if isinstance(exc, asyncio.TimeoutError) else repr(exc),
            )
            self._last_log = now
            self._unlogged = 0

    async def get(self, key: str) -> bytes | None:
        if self._skip():
            return None
        try:
            value = await asyncio.wait_for(self.inner.get(key), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure is a miss; CancelledError passes
            self._failed("get", exc)
            return None
        self._ok()
        return value

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        if self._skip():
            return
        try:
            await asyncio.wait_for(self.inner.set(key, value, ttl_s), self.timeout_s)
        except Exception as exc:  # noqa: BLE001
            self._failed("set", exc)
            return
        self._ok()

    async def drop_model(self, model: str) -> int:
        try:
            dropped = await asyncio.wait_for(self.inner.drop_model(model), self.drop_timeout_s)
        except Exception as exc:  # noqa: BLE001
            self._failed("drop_model", exc)
            return 0
        self._ok()
        return dropped

    async def size_bytes(self) -> int | None:
        try:
            return await asyncio.wait_for(self.inner.size_bytes(), self.timeout_s)
        except Exception:  # noqa: BLE001 - a statistic, not worth a warning
            return None

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.inner.close(), max(self.timeout_s, 1.0))
        except Exception as exc:  # noqa: BLE001
            logger.debug("closing cache store %s failed: %r", type(self.inner).__name__, exc)


# ---- semantic index -------------------------------------------------------------------


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


# ---- single-flight ----------------------------------------------------------------------


def _retrieve(task: asyncio.Future) -> None:
    # Mark the exception as seen: if every caller left, nobody else will read it.
    if not task.cancelled():
        task.exception()


class SingleFlight:
    """Identical requests in flight at once share one call.

    The first caller for a key starts ``fn()`` in its own task; callers that arrive while
    it runs await the same task (``shared=True``) and get the same result object (do not
    mutate it) or the same exception. Every caller awaits through ``asyncio.shield``, so a
    caller that is cancelled (its client went away) leaves the call running for the
    others; if all callers leave, the call still finishes on its own. The key is freed
    when the call finishes, so a later request runs again (cache it to reuse it).
    Per process: replicas do not coalesce with each other.
    """

    def __init__(self) -> None:
        self._calls: dict[str, asyncio.Future] = {}
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._calls)

    async def run(self, key: str, fn: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
        task = self._calls.get(key)
        shared = task is not None
        if shared:
            self.coalesced += 1
        else:

            async def call() -> T:
                return await fn()

            task = asyncio.ensure_future(call())
            self._calls[key] = task
            task.add_done_callback(lambda t: self._done(key, t))
        return await asyncio.shield(task), shared

    def _done(self, key: str, task: asyncio.Future) -> None:
        if self._calls.get(key) is task:
            del self._calls[key]
        _retrieve(task)
