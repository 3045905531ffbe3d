"""core.cache: keys, stores (memory and Redis), resilience, semantic index, single-flight.

No Ray. Async code runs through asyncio.run inside plain tests. The Redis tests use the
server from tests/redis_fixture.py and write only under their own key prefix.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from redis_fixture import free_port, redis_prefix, redis_url  # noqa: F401 - fixtures
from serve_app.core.cache import (
    CacheStore,
    MemoryStore,
    RedisStore,
    ResilientStore,
    SemanticIndex,
    SingleFlight,
    cache_key,
    canonical_payload,
    decode_value,
    encode_value,
    is_cacheable,
    semantic_namespace,
)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


GREEDY = {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "stop": [], "seed": None}


def key(payload, *, model="m", revision="r1", task="embedding", params=None):
    return cache_key(model=model, revision=revision, task=task, payload=payload, params=params or {})


# ---- response shapes the router caches ----------------------------------------------

EMBEDDING_RESPONSE = {
    "object": "list",
    "data": [
        {"object": "embedding", "index": 0, "embedding": [0.1, -0.25, 3.0e-8, 1.0, -0.0]},
        {"object": "embedding", "index": 1, "embedding": [float(x) for x in np.float32([0.3, 0.7, -1.5])]},
    ],
    "model": "minilm",
    "usage": {"prompt_tokens": 7, "total_tokens": 7},
}
CHAT_RESPONSE = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "smollm",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Héllo — 世界 \n\t ok"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17},
}
COMPLETION_RESPONSE = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1700000000,
    "model": "smollm",
    "choices": [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"},
        {"index": 1, "text": "two", "logprobs": None, "finish_reason": "stop"},
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
}
CLASSIFY_RESPONSE = {
    "object": "list",
    "model": "clf",
    "data": [{"index": 0, "labels": [{"label": "positive", "score": 0.9876543210123}, {"label": "negative", "score": 0.0123}]}],
    "usage": {"prompt_tokens": 4, "total_tokens": 4},
}
MODEL_OUTPUTS = [
    {"embeddings": [[0.5, 0.25]], "prompt_tokens": 3},  # ModelServer.embed
    [{"text": "hi", "finish_reason": "stop", "prompt_tokens": 2, "completion_tokens": 1}],  # generate
    {"results": [[["cat", 0.75], ["dog", 0.25]]], "prompt_tokens": 0},  # classify
    None,
    True,
    0,
    -(2**63),
    2**64 - 1,
    1.5,
    "",
    [],
    {},
]
RESPONSES = [EMBEDDING_RESPONSE, CHAT_RESPONSE, COMPLETION_RESPONSE, CLASSIFY_RESPONSE, *MODEL_OUTPUTS]


# ---- canonicalization and keys ---------------------------------------------------------


def test_variants_of_one_text_get_their_own_keys():
    # A tokenizer sees these differently (full-width letters are [UNK] to BERT),
    # so they must not share an answer; keys use the text exactly as sent.
    variants = ["Hello world", "  Hello   world\n", "Hello\u3000world", "\uff28ello world"]
    assert len({key(v) for v in variants}) == len(variants)
    assert len({key([v, "second  text"]) for v in variants}) == len(variants)
    assert key("Hello world") != key("hello world")


def test_key_changes_with_model_revision_task_params_and_input():
    base = key("text", params={"top_k": 3})
    assert base.startswith("m:r1:")
    assert len(base.split(":")[2]) == 64
    assert key("text", model="other", params={"top_k": 3}) != base
    assert key("text", revision="r2", params={"top_k": 3}) != base
    assert key("text", task="text-classification", params={"top_k": 3}) != base
    assert key("text", params={"top_k": 4}) != base
    assert key("other text", params={"top_k": 3}) != base
    assert key(["text", "b"]) != key(["b", "text"])  # input order matters


def test_params_are_order_insensitive_and_numbers_normalized():
    a = key("x", task="text-generation", params={"temperature": 0.5, "seed": 1, "max_tokens": 8})
    b = key("x", task="text-generation", params={"max_tokens": 8, "seed": 1, "temperature": 0.5})
    assert a == b
    assert key("x", params={"top_k": 1}) == key("x", params={"top_k": 1.0})


def test_greedy_generation_ignores_seed_and_top_p():
    a = key("x", task="text-generation", params=GREEDY)
    b = key("x", task="text-generation", params={**GREEDY, "seed": 7, "top_p": 0.5})
    assert a == b
    assert key("x", task="text-generation", params={**GREEDY, "max_tokens": 17}) != a
    sampled = {**GREEDY, "temperature": 0.7, "seed": 1}
    assert key("x", task="text-generation", params=sampled) != key(
        "x", task="text-generation", params={**sampled, "seed": 2}
    )


def test_chat_message_order_matters_and_text_is_kept_exactly():
    m1 = {"role": "user", "content": "Caf\u0065\u0301  there\r\nok"}  # decomposed é, CRLF
    m2 = {"role": "assistant", "content": "Hello"}
    a = key([m1, m2], task="text-generation", params=GREEDY)
    assert key([m2, m1], task="text-generation", params=GREEDY) != a
    # NFC and CRLF->LF change a byte-level BPE's tokens, so they change the key.
    composed = [{"content": "Caf\u00e9  there\nok", "role": "user"}, m2]
    assert key(composed, task="text-generation", params=GREEDY) != a
    assert key([{"content": "Caf\u0065\u0301  there\r\nok", "role": "user"}, m2],
               task="text-generation", params=GREEDY) == a  # dict order is not the input
    # An LLM tokenizes whitespace: "a  b" and "a b" are different prompts.
    collapsed = [{"content": "Caf\u00e9 there\nok", "role": "user"}, m2]
    assert key(collapsed, task="text-generation", params=GREEDY) != a
    assert canonical_payload("text-generation", [m1]) == [m1]


def test_whitespace_in_params_is_kept():
    newline = key("x", task="text-generation", params={**GREEDY, "stop": ["\n"]})
    space = key("x", task="text-generation", params={**GREEDY, "stop": [" "]})
    assert newline != space


def test_image_bytes_are_hashed():
    img = bytes(range(256)) * 10
    canon = canonical_payload("image-classification", [img, bytearray(img)])
    assert canon[0] == canon[1] and len(canon[0]) == 64
    assert key([img], task="image-classification") != key([img + b"\0"], task="image-classification")


def test_key_rejects_values_without_a_canonical_form():
    with pytest.raises(TypeError):
        key(object())


def test_is_cacheable():
    assert is_cacheable("text-generation", GREEDY)
    assert not is_cacheable("text-generation", {**GREEDY, "temperature": 0.8})
    assert is_cacheable("text-generation", {**GREEDY, "temperature": 0.8, "seed": 3})
    assert not is_cacheable("text-generation", {"max_tokens": 5})  # OpenAI's default: temperature 1
    for task in ("embedding", "text-classification", "image-classification"):
        assert is_cacheable(task, {"temperature": 1.0})


_NS = dict(model="m", revision="r1", task="text-generation", params=GREEDY, endpoint="chat",
           context=[{"role": "system", "content": "be brief"}], embedder="e", embedder_revision="er1", scope="")


def test_semantic_namespace():
    ns = semantic_namespace(**_NS)
    assert ns.startswith("m:r1:")
    # Everything but the last question is matched exactly: each part changes the namespace.
    for change in (dict(revision="r2"), dict(params={**GREEDY, "max_tokens": 2}), dict(endpoint="completions"),
                   dict(context=[{"role": "system", "content": "be long"}]), dict(context=[]),
                   dict(embedder="e2"), dict(embedder_revision="er2"), dict(scope="key-hash")):
        assert ns != semantic_namespace(**{**_NS, **change}), change


# ---- values ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", RESPONSES, ids=lambda v: type(v).__name__)
def test_encode_decode_round_trip(value):
    data = encode_value(value)
    assert isinstance(data, bytes)
    back = decode_value(data)
    assert back == value
    assert type(back) is type(value)


def test_encode_floats_bit_exact_and_numpy_accepted():
    floats = [0.1, 1 / 3, -0.0, 1e-300, 5e-324, float(np.float32(0.1))]
    back = decode_value(encode_value(floats))
    assert [x.hex() for x in back] == [x.hex() for x in floats]
    assert decode_value(encode_value({"v": np.arange(3, dtype=np.float32), "n": np.int64(4)})) == {"v": [0.0, 1.0, 2.0], "n": 4}


def test_encode_refuses_arbitrary_objects():
    with pytest.raises(TypeError):
        encode_value({"x": object()})


# ---- stores: memory and Redis, same contract ------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def make_store(request):
    """A factory (call it inside the event loop) for the store under test."""
    if request.param == "memory":
        return lambda clock=time.monotonic: MemoryStore(10_000_000, clock=clock)
    url = request.getfixturevalue("redis_url")
    prefix = request.getfixturevalue("redis_prefix")
    # Generous timeouts: the machine may be busy; the short defaults are for production.
    return lambda clock=None: RedisStore(url, prefix=prefix, socket_timeout_s=2.0, connect_timeout_s=2.0)


def test_store_set_get_round_trip(make_store):
    async def main():
        store = make_store()
        assert isinstance(store, CacheStore)
        try:
            assert await store.get("m:r:missing") is None
            for i, value in enumerate(RESPONSES):
                await store.set(f"m:r:{i}", encode_value(value), 60)
            for i, value in enumerate(RESPONSES):
                assert decode_value(await store.get(f"m:r:{i}")) == value
            await store.set("m:r:0", b"replaced", 60)
            assert await store.get("m:r:0") == b"replaced"
            await store.set("m:r:empty", b"", 60)
            assert await store.get("m:r:empty") == b""
        finally:
            await store.close()

    asyncio.run(main())


def test_store_get_many_and_set_many_match_one_at_a_time(make_store):
    async def main():
        store = make_store()
        try:
            assert await store.get_many([]) == [] and await store.set_many([]) is None
            await store.set_many([("m:r:a", b"1", 60), ("m:r:b", b"2", 60), ("m:r:a", b"3", 60)])
            assert await store.get_many(["m:r:b", "m:r:missing", "m:r:a"]) == [b"2", None, b"3"]  # last write wins
            assert await store.get("m:r:a") == b"3"
            await store.set_many([("m:r:b", b"", 0)])  # ttl 0 deletes, as set() does
            assert await store.get_many(["m:r:a", "m:r:b"]) == [b"3", None]
        finally:
            await store.close()

    asyncio.run(main())


def test_store_ttl_expiry(make_store, request):
    is_memory = "memory" in request.node.callspec.id
    clock = FakeClock()

    async def main():
        store = make_store(clock) if is_memory else make_store()
        try:
            await store.set("m:r:short", b"a", 0.2)
            await store.set("m:r:long", b"b", 60)
            assert await store.get("m:r:short") == b"a"
            if is_memory:
                clock.advance(0.19)
                assert await store.get("m:r:short") == b"a"
                clock.advance(0.02)
            else:
                await asyncio.sleep(0.3)
            assert await store.get("m:r:short") is None
            assert await store.get("m:r:long") == b"b"
            if is_memory:
                assert store.expirations == 1 and store.evictions == 0
        finally:
            await store.close()

    asyncio.run(main())


def test_store_drop_model_removes_only_that_model(make_store):
    async def main():
        store = make_store()
        try:
            keys = {
                name: [key(f"text {i}", model=name, revision=rev) for i in range(7) for rev in ("r1", "r2")]
                for name in ("m1", "m1:x", "m10", "m*", "m2")
            }
            for name, ks in keys.items():
                for k in ks:
                    await store.set(k, name.encode(), 60)
            assert await store.drop_model("m1") == 14
            assert await store.drop_model("m*") == 14  # glob characters match only themselves
            for name, ks in keys.items():
                gone = name in ("m1", "m*")
                for k in ks:
                    assert (await store.get(k) is None) == gone, (name, k)
            assert await store.drop_model("m1") == 0
        finally:
            await store.close()

    asyncio.run(main())


def test_redis_store_every_key_has_prefix_and_ttl(redis_url, redis_prefix):  # noqa: F811
    import redis

    async def main():
        store = RedisStore(redis_url, prefix=redis_prefix, socket_timeout_s=2.0, connect_timeout_s=2.0)
        try:
            await store.set("m:r:k", b"v", 30)
            assert await store.size_bytes() is None
        finally:
            await store.close()

    asyncio.run(main())
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.get(redis_prefix + "m:r:k") == b"v"
        assert 0 < client.pttl(redis_prefix + "m:r:k") <= 30_000
    finally:
        client.close()


# ---- memory store: byte budget ---------------------------------------------------------


def test_memory_store_evicts_least_recently_used_within_budget():
    async def main():
        store = MemoryStore(max_bytes=1000)
        value = b"x" * 196  # 4-byte key + 196 = 200 bytes an entry: five fit
        for i in range(5):
            await store.set(f"k:{i:02d}", value[:-1], 60)  # "k:00" is 4 bytes; 4 + 195 = 199
        assert await store.size_bytes() <= 1000 and store.evictions == 0
        assert await store.get("k:00") is not None  # k:00 is now the most recently used
        await store.set("k:05", value[:-1], 60)
        assert store.evictions == 1
        assert await store.get("k:01") is None  # least recently used went first
        assert await store.get("k:00") is not None
        for i in range(6, 30):
            await store.set(f"k:{i:02d}", value[:-1], 60)
            assert await store.size_bytes() <= 1000
        assert store.evictions == 25 and len(store) == 5
        assert store.expirations == 0

    asyncio.run(main())


def test_memory_store_refuses_oversized_entry_and_keeps_the_rest():
    async def main():
        store = MemoryStore(max_bytes=100)
        await store.set("a", b"1" * 50, 60)
        await store.set("b", b"2" * 100, 60)  # 1 + 100 > 100
        assert await store.get("b") is None
        assert await store.get("a") == b"1" * 50
        assert store.too_large == 1 and store.evictions == 0
        await store.set("a", b"3" * 200, 60)  # an oversized update must not leave the old value
        assert await store.get("a") is None
        await store.set("c", b"4" * 99, 60)  # exactly the budget
        assert await store.get("c") == b"4" * 99

    asyncio.run(main())


def test_memory_store_zero_ttl_is_not_stored():
    async def main():
        store = MemoryStore(max_bytes=100)
        await store.set("a", b"1", 0)
        assert await store.get("a") is None

    asyncio.run(main())


# ---- resilient store -------------------------------------------------------------------


class BrokenStore:
    def __init__(self, delay_s: float = 0.0, fail: bool = True):
        self.delay_s = delay_s
        self.fail = fail
        self.calls = 0

    async def _maybe_fail(self):
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("down")

    async def get(self, key):
        await self._maybe_fail()
        return b"value"

    async def set(self, key, value, ttl_s):
        await self._maybe_fail()

    async def get_many(self, keys):
        await self._maybe_fail()
        return [b"value"] * len(keys)

    async def set_many(self, entries):
        await self._maybe_fail()

    async def drop_model(self, model):
        await self._maybe_fail()
        return 3

    async def size_bytes(self):
        await self._maybe_fail()
        return 1

    async def close(self):
        await self._maybe_fail()


def test_resilient_store_over_dead_redis_is_a_fast_miss_and_logs_once(caplog):
    port = free_port()  # nothing listens there

    async def main():
        store = ResilientStore(RedisStore(f"redis://127.0.0.1:{port}/0"), timeout_s=0.05, log_interval_s=60)
        started = time.perf_counter()
        assert await store.get("m:r:k") is None
        assert time.perf_counter() - started < 0.5
        await store.set("m:r:k", b"v", 10)  # must not raise
        for _ in range(40):
            assert await store.get("m:r:k") is None
            await store.set("m:r:k", b"v", 10)
        assert await store.drop_model("m") == 0
        assert await store.size_bytes() is None
        await store.close()
        return store, time.perf_counter() - started

    with caplog.at_level(logging.WARNING, logger="serve_app.core.cache"):
        store, elapsed = asyncio.run(main())
    assert elapsed < 5.0
    assert store.errors >= 1
    assert store.errors + store.skipped == 83
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "serving without the cache" in warnings[0].getMessage()


def test_resilient_store_batches_fail_as_all_misses_in_one_timeout():
    async def main():
        slow = ResilientStore(BrokenStore(delay_s=1.0, fail=False), timeout_s=0.05)
        started = time.perf_counter()
        assert await slow.get_many(["a", "b", "c"]) == [None, None, None]
        await slow.set_many([("a", b"v", 1), ("b", b"v", 1)])
        assert time.perf_counter() - started < 0.5  # one timeout per batch, not per key
        dead = ResilientStore(BrokenStore(), timeout_s=0.05)
        assert await dead.get_many(["a", "b"]) == [None, None]
        await dead.set_many([("a", b"v", 1)])  # must not raise
        working = ResilientStore(BrokenStore(fail=False), timeout_s=0.05)
        assert await working.get_many(["a", "b"]) == [b"value", b"value"]
        return slow, dead, working

    slow, dead, working = asyncio.run(main())
    assert (slow.errors, dead.errors, working.errors) == (2, 2, 0)  # a batch is one call, one error


def test_resilient_store_times_out_a_slow_store():
    async def main():
        store = ResilientStore(BrokenStore(delay_s=1.0, fail=False), timeout_s=0.05)
        started = time.perf_counter()
        assert await store.get("k") is None
        await store.set("k", b"v", 1)
        assert time.perf_counter() - started < 0.5
        return store

    store = asyncio.run(main())
    assert store.errors == 2


def test_resilient_store_summarizes_errors_once_per_interval(caplog):
    clock = FakeClock()

    async def main():
        # Breaker effectively off so every call reaches the inner store.
        store = ResilientStore(BrokenStore(), log_interval_s=30, clock=clock, open_after_errors=10**9)
        for _ in range(10):
            await store.get("k")
        clock.advance(29)
        for _ in range(10):
            await store.set("k", b"v", 1)
        clock.advance(2)
        await store.get("k")  # 31 s after the first warning: the second one
        return store

    with caplog.at_level(logging.WARNING, logger="serve_app.core.cache"):
        store = asyncio.run(main())
    assert store.errors == 21
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(messages) == 2, messages
    assert "failed 1 time(s)" in messages[0]
    assert "failed 20 time(s)" in messages[1]


def test_resilient_store_breaker_skips_then_retries():
    clock = FakeClock()
    inner = BrokenStore()

    async def main():
        store = ResilientStore(inner, clock=clock, open_after_errors=3, retry_after_s=1.0)
        for _ in range(10):
            assert await store.get("k") is None
        assert inner.calls == 3 and store.errors == 3 and store.skipped == 7
        clock.advance(1.5)
        inner.fail = False
        assert await store.get("k") == b"value"
        assert store.healthy
        assert await store.drop_model("m") == 3

    asyncio.run(main())


def test_resilient_store_passes_values_through():
    async def main():
        store = ResilientStore(MemoryStore(1000))
        await store.set("m:r:k", b"v", 10)
        assert await store.get("m:r:k") == b"v"
        assert await store.size_bytes() == len("m:r:k") + 1
        assert await store.drop_model("m") == 1
        assert store.errors == 0

    asyncio.run(main())


# ---- semantic index --------------------------------------------------------------------


def _rng_unit(rng, dim=64):
    v = rng.standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


def test_semantic_index_finds_near_duplicates_only():
    rng = np.random.default_rng(0)
    index = SemanticIndex(threshold=0.95)
    base = _rng_unit(rng)
    index.add("ns", (base * 3.0).tolist(), "k-base", "q")  # scale does not matter
    for i in range(20):
        index.add("ns", _rng_unit(rng).tolist(), f"k{i}", "q")
    near = base + 0.05 * _rng_unit(rng)
    found = index.lookup("ns", near, "q")
    assert found is not None and found[0] == "k-base" and found[1] >= 0.95
    orthogonal = _rng_unit(rng)
    orthogonal -= orthogonal.dot(base) * base
    assert index.lookup("ns", orthogonal, "q") is None
    assert index.lookup("ns", np.zeros(64), "q") is None
    assert index.lookup("ns", np.ones(3), "q") is None  # another dimension: no match
    with pytest.raises(ValueError):
        index.add("ns", np.ones(3), "bad", "q")


def test_semantic_index_namespaces_are_isolated_and_droppable():
    index = SemanticIndex(threshold=0.9)
    v = [1.0, 0.0, 0.0]
    ns_a = semantic_namespace(**{**_NS, "model": "a"})
    ns_a2 = semantic_namespace(**{**_NS, "model": "a", "revision": "r2"})
    ns_ab = semantic_namespace(**{**_NS, "model": "a:b"})
    ns_b = semantic_namespace(**{**_NS, "model": "b"})
    index.add(ns_a, v, "ka", "q")
    index.add(ns_a2, v, "ka2", "q")
    index.add(ns_ab, v, "kab", "q")
    assert index.lookup(ns_a, v, "q") == ("ka", 1.0)
    assert index.lookup(ns_b, v, "q") is None
    assert index.drop_prefix("a") == 2
    assert index.lookup(ns_a, v, "q") is None and index.lookup(ns_a2, v, "q") is None
    assert index.lookup(ns_ab, v, "q") == ("kab", 1.0)


def test_semantic_index_capacity_evicts_oldest():
    index = SemanticIndex(max_entries_per_namespace=150, threshold=0.999)
    eye = np.eye(200, dtype=np.float32)
    for i in range(200):  # grows past its first allocation, then wraps
        index.add("ns", eye[i], f"k{i}", "q")
    assert len(index) == 150
    for i in range(50):
        assert index.lookup("ns", eye[i], "q") is None
    for i in range(50, 200):
        assert index.lookup("ns", eye[i], "q") == (f"k{i}", 1.0)
    index.add("ns", eye[0], "k0", "q")  # evicts k50, the oldest left
    assert index.lookup("ns", eye[50], "q") is None and index.lookup("ns", eye[0], "q") == ("k0", 1.0)
    index.add("ns", eye[1], "k0", "q")  # same key again: its vector is replaced, nothing evicted
    assert index.lookup("ns", eye[0], "q") is None and index.lookup("ns", eye[1], "q") == ("k0", 1.0)
    assert index.lookup("ns", eye[51], "q") == ("k51", 1.0)
    assert index.discard("ns", "k0") and index.lookup("ns", eye[1], "q") is None


# ---- single-flight ---------------------------------------------------------------------


def test_single_flight_coalesces_identical_calls():
    async def main():
        flight = SingleFlight()
        calls = 0

        async def fn():
            nonlocal calls
            calls += 1
            await asyncio.sleep(0.05)
            return {"answer": 42}

        results = await asyncio.gather(*(flight.run("k", fn) for _ in range(50)))
        assert calls == 1 and flight.coalesced == 49
        assert all(r == {"answer": 42} for r, _ in results)
        assert sum(shared for _, shared in results) == 49
        assert len(flight) == 0
        (result, shared) = await flight.run("k", fn)  # finished calls are not reused
        assert calls == 2 and not shared
        other = await asyncio.gather(flight.run("a", fn), flight.run("b", fn))
        assert calls == 4 and not any(s for _, s in other)

    asyncio.run(main())


def test_single_flight_exception_reaches_every_caller():
    async def main():
        flight = SingleFlight()
        calls = 0

        async def fn():
            nonlocal calls
            calls += 1
            await asyncio.sleep(0.01)
            raise ValueError("model failed")

        results = await asyncio.gather(*(flight.run("k", fn) for _ in range(10)), return_exceptions=True)
        assert calls == 1
        assert all(isinstance(r, ValueError) and str(r) == "model failed" for r in results)
        assert len(flight) == 0

    asyncio.run(main())


def test_single_flight_first_caller_cancelled_others_still_served():
    async def main():
        flight = SingleFlight()
        release = asyncio.Event()
        calls = 0

        async def fn():
            nonlocal calls
            calls += 1
            await release.wait()
            return "done"

        first = asyncio.ensure_future(flight.run("k", fn))
        await asyncio.sleep(0)
        others = [asyncio.ensure_future(flight.run("k", fn)) for _ in range(3)]
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(*others)
        assert first.cancelled()
        assert results == [("done", True)] * 3 and calls == 1

        # Every caller gone: the call finishes on its own and frees its key.
        release.clear()
        lone = asyncio.ensure_future(flight.run("j", fn))
        await asyncio.sleep(0)
        lone.cancel()
        await asyncio.sleep(0)
        assert len(flight) == 1
        release.set()
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(flight) == 0 and calls == 2

    asyncio.run(main())
