"""Cache stores: the CacheStore protocol, MemoryStore, RedisStore and ResilientStore."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from typing import Awaitable, Callable, Protocol, Sequence, TypeVar, runtime_checkable

import cachetools

from serve_app.core.cache.keys import _model_part

# The package's logger, as before the split into modules: records keep the name
# "serve_app.core.cache", so logging set up for that name still applies as it did.
logger = logging.getLogger(__package__)


# One write: (key, value, ttl_s); a ttl_s <= 0 deletes the key.
Entry = tuple[str, bytes, float]
T = TypeVar("T")


@runtime_checkable
class CacheStore(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes, ttl_s: float) -> None: ...

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """``get`` of each key, in order, in one round trip where the store has one."""
        ...

    async def set_many(self, entries: Sequence[Entry]) -> None:
        """``set`` of each (key, value, ttl_s), in order, in one round trip where the store has one."""
        ...

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

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self._cache.expire()  # once for the batch, as get() does per key
        return [None if (entry := self._cache.get(key)) is None else entry.value for key in keys]

    async def set_many(self, entries: Sequence[Entry]) -> None:
        for key, value, ttl_s in entries:
            await self.set(key, value, ttl_s)

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
        ttl_ms = _ttl_ms(ttl_s)
        if ttl_ms <= 0:
            await self._redis.delete(self.prefix + key)
            return
        await self._redis.set(self.prefix + key, value, px=ttl_ms)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return list(await self._redis.mget([self.prefix + key for key in keys]))

    async def set_many(self, entries: Sequence[Entry]) -> None:
        if not entries:
            return
        # One round trip, not a transaction: each write stands alone, as set() does.
        pipe = self._redis.pipeline(transaction=False)
        for key, value, ttl_s in entries:
            ttl_ms = _ttl_ms(ttl_s)
            if ttl_ms <= 0:
                pipe.delete(self.prefix + key)
            else:
                pipe.set(self.prefix + key, value, px=ttl_ms)
        await pipe.execute()

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


def _ttl_ms(ttl_s: float) -> int:
    """A TTL as Redis's PX takes it: whole milliseconds, rounded up; <= 0 means delete."""
    return int(math.ceil(ttl_s * 1000))


class ResilientStore:
    """Any :class:`CacheStore`, made unable to fail a request.

    Each get/set (a get_many/set_many as one) runs under ``asyncio.wait_for(timeout_s)``;
    an error or a timeout makes get return None (a miss; get_many all misses) and set a
    no-op, counted in ``errors``. One warning per ``log_interval_s`` summarizes the
    errors since the last one, never one per request.

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

    async def _guarded(self, op: str, start: Callable[[], Awaitable[T]], fallback: T, *,
                       timeout_s: float | None = None, breaker: bool = True) -> T:
        """``await start()`` within the timeout, or ``fallback`` when it fails, times out or
        the breaker is open; each failure is counted and logged by :meth:`_failed`."""
        if breaker and self._skip():
            return fallback
        try:
            result = await asyncio.wait_for(start(), self.timeout_s if timeout_s is None else timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure is the fallback; CancelledError passes
            self._failed(op, exc)
            return fallback
        self._ok()
        return result

    async def get(self, key: str) -> bytes | None:
        return await self._guarded("get", lambda: self.inner.get(key), None)

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        await self._guarded("set", lambda: self.inner.set(key, value, ttl_s), None)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """All misses when the store fails or is slower than ``timeout_s`` for the whole batch."""
        if not keys:
            return []
        return await self._guarded("get_many", lambda: self.inner.get_many(keys), [None] * len(keys))

    async def set_many(self, entries: Sequence[Entry]) -> None:
        if entries:
            await self._guarded("set_many", lambda: self.inner.set_many(entries), None)

    async def drop_model(self, model: str) -> int:
        # An admin call: past an open breaker too, and with its own, longer timeout.
        return await self._guarded("drop_model", lambda: self.inner.drop_model(model), 0,
                                   timeout_s=self.drop_timeout_s, breaker=False)

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
