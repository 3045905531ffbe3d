"""ingress/response_cache.py against a scripted backend and a fake CacheServer handle,
without Ray: hot tier, store, bypass, single-flight, failures as misses, batched store
calls under the transport's limit, drop."""

from __future__ import annotations

import asyncio
import dataclasses


from serve_app.config import AppConfig
from serve_app.core.calls import (
    ClassifyResult,
    Completion,
    EmbedResult,
    GenerateCall,
    GenerateResult,
    ModelInfo,
    SamplingParams,
    TokenLogprob,
)
from serve_app.core.cache import bounded_reply, decode_value, encode_value
from serve_app.ingress.model_client import ModelClient
from serve_app.ingress.response_cache import ResponseCache
from handle_fakes import Pending, Remote
from handle_fakes import ScriptedBackend


class _StoreHandle:
    """A CacheServer handle stand-in over a dict; ``fail`` makes every call raise."""

    def __init__(self):
        self.entries: dict[str, bytes] = {}
        self.fail = False
        self.batches: list[tuple[str, int]] = []  # (method, items) per call
        for name in ("get_many", "set_many", "semantic_get", "semantic_add", "drop_model", "stats"):
            setattr(self, name, Remote(getattr(self, f"_{name}")))

    async def _check(self):
        if self.fail:
            raise ConnectionError("store down")

    async def _get_many(self, keys, max_reply_bytes=None):  # bounded as CacheServer.get_many is
        self.batches.append(("get_many", len(keys)))
        await self._check()
        return bounded_reply([self.entries.get(key) for key in keys], max_reply_bytes)

    async def _set_many(self, entries):
        self.batches.append(("set_many", len(entries)))
        await self._check()
        for key, value, ttl_s in entries:
            self.entries[key] = value
        return [None] * len(entries)

    async def _semantic_get(self, namespace, vector, threshold):
        return None

    async def _semantic_add(self, namespace, vector, key):
        return None

    async def _drop_model(self, model):
        dropped = [k for k in self.entries if k.startswith(f"{model}:")]
        for key in dropped:
            del self.entries[key]
        return {"model": model, "entries": len(dropped), "vectors": 0}

    async def _stats(self):
        return {"entries": len(self.entries)}


_INFO = ModelInfo(name="m", task="text-generation", revision="rev1", max_input_tokens=64, device="cpu",
                  dtype="float32", quantization="none")


def _answer(text: str) -> GenerateResult:
    """An answer as a replica of _INFO returns it (with its revision: ModelServer.infer)."""
    return GenerateResult([Completion(text=text, finish_reason="stop", prompt_tokens=2, completion_tokens=1)],
                          revision=_INFO.revision)


def _cache(backend, store, **cache) -> ResponseCache:
    config = AppConfig.model_validate({"models": [{"name": "m", "source": "package:x", "task": "text-generation"}],
                                       "cache": cache})
    models = {m.name: m for m in config.models}
    return ResponseCache(config.cache, store, models, ModelClient({"m": backend}, config.router))


def test_cache_miss_then_hit_from_the_hot_tier_then_from_the_store():
    async def scenario():
        store = _StoreHandle()
        backend = ScriptedBackend(_answer("first"), info=_INFO)
        cache = _cache(backend, store)
        model, call = cache.models["m"], GenerateCall(max_tokens=4, prompts=("p",), sampling=SamplingParams(0))
        assert await cache.answer(model, call) == (_answer("first"), "miss")
        await asyncio.sleep(0)  # the background write-back
        assert await cache.answer(model, call) == (_answer("first"), "hit")
        fresh = _cache(backend, store)  # another router replica: empty hot tier, same store
        assert await fresh.answer(model, call) == (_answer("first"), "hit")
        assert [c for c in backend.calls if c != "info"] == [
            GenerateCall(max_tokens=4, prompts=("p",), sampling=SamplingParams(0), deadline=backend.calls[1].deadline)]
        assert cache.outcomes[("m", "miss")] == 1 and cache.outcomes[("m", "hit")] == 1

    asyncio.run(scenario())


def test_sampled_generation_without_seed_bypasses_the_cache():
    async def scenario():
        backend = ScriptedBackend(_answer("a"), _answer("b"))
        cache = _cache(backend, _StoreHandle())
        call = GenerateCall(max_tokens=4, prompts=("p",), sampling=SamplingParams(temperature=1.0))
        assert (await cache.answer(cache.models["m"], call))[1] == "miss"
        assert (await cache.answer(cache.models["m"], call))[0] == _answer("b")
        assert cache.outcomes[("m", "bypass")] == 2

    asyncio.run(scenario())


def test_identical_requests_in_flight_share_one_model_call():
    async def scenario():
        backend = ScriptedBackend(_answer("once"), delay_s=0.05, info=_INFO)
        cache = _cache(backend, _StoreHandle())
        call = GenerateCall(max_tokens=4, prompts=("p",), sampling=SamplingParams(0))
        answers = await asyncio.gather(*(cache.answer(cache.models["m"], call) for _ in range(3)))
        assert [header for _, header in answers] .count("miss") == 3  # coalesced reads as miss
        assert len(backend.pending) == 1 and cache.flights.coalesced == 2

    asyncio.run(scenario())


def test_a_failing_store_or_a_foreign_entry_is_a_miss_never_an_error():
    async def scenario():
        store = _StoreHandle()
        backend = ScriptedBackend(_answer("a"), _answer("b"), info=_INFO)
        cache = _cache(backend, store)
        call = GenerateCall(max_tokens=4, prompts=("p",), sampling=SamplingParams(0))
        store.fail = True
        assert await cache.answer(cache.models["m"], call) == (_answer("a"), "miss")
        await asyncio.sleep(0.01)  # its write-back fails too, while the store is down
        assert cache.errors >= 2
        store.fail = False
        other = _cache(backend, store)
        key = next(iter(cache._hot))
        store.entries[key] = encode_value([{"text": "an older shape"}])
        assert await other.answer(other.models["m"], call) == (_answer("b"), "miss")

    asyncio.run(scenario())


class _EchoBackend:
    """Answers each prompt with its own text, after ``delay_s``."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.calls = delay_s, 0

    def infer(self, call):
        self.calls += 1
        return Pending(GenerateResult([Completion(text=f"answer to {call.prompts[0]}", finish_reason="stop",
                                                  prompt_tokens=2, completion_tokens=1)], revision=_INFO.revision),
                       self.delay_s)

    def info(self):
        return Pending(_INFO)


def test_concurrent_lookups_and_write_backs_share_store_calls_and_each_gets_its_own_answer():
    async def scenario():
        store, backend = _StoreHandle(), _EchoBackend(delay_s=0.01)
        calls = [GenerateCall(max_tokens=4, prompts=(f"p{i}",), sampling=SamplingParams(0)) for i in range(12)]
        cache = _cache(backend, store)
        await cache.answer(cache.models["m"], calls[0])  # learns the revision
        await asyncio.sleep(0.01)
        store.batches.clear()
        misses = await asyncio.gather(*(cache.answer(cache.models["m"], c) for c in calls[1:]))
        await asyncio.sleep(0.02)  # the write-backs
        assert [r.completions[0].text for r, _ in misses] == [f"answer to p{i}" for i in range(1, 12)]
        assert {header for _, header in misses} == {"miss"}
        assert store.batches == [("get_many", 11), ("set_many", 11)]
        fresh = _cache(backend, store)  # another router replica: its hot tier is empty
        await fresh.answer(fresh.models["m"], calls[0])
        store.batches.clear()
        hits = await asyncio.gather(*(fresh.answer(fresh.models["m"], c) for c in reversed(calls)))
        assert [r.completions[0].text for r, _ in hits] == [f"answer to p{i}" for i in reversed(range(12))]
        assert {header for _, header in hits} == {"hit"} and backend.calls == 12
        assert store.batches == [("get_many", 11)]  # p0 came from this router's hot tier

    asyncio.run(scenario())


def test_large_answers_travel_in_store_calls_under_the_transports_limit(monkeypatch):
    """Cached answers of 64 768-d vectors are 440 KB each: a batch of ten would pass gRPC's
    4 MiB and fail whole. Lookups and write-backs are bounded in bytes; every request
    still gets its own answer, from the model and then from the store."""
    import serve_app.ingress.response_cache as response_cache

    monkeypatch.setattr(response_cache, "handle_message_budget_bytes", lambda: 3000)

    class _LongEcho(_EchoBackend):
        def infer(self, call):
            self.calls += 1
            text = f"answer to {call.prompts[0]} " + "x" * 900  # about 1 KB encoded
            return Pending(GenerateResult([Completion(text=text, finish_reason="stop", prompt_tokens=2,
                                                      completion_tokens=1)], revision=_INFO.revision), self.delay_s)

    async def scenario():
        store, backend = _StoreHandle(), _LongEcho(delay_s=0.01)
        calls = [GenerateCall(max_tokens=4, prompts=(f"p{i}",), sampling=SamplingParams(0)) for i in range(10)]
        cache = _cache(backend, store)
        await cache.answer(cache.models["m"], calls[0])
        await asyncio.sleep(0.02)
        await asyncio.gather(*(cache.answer(cache.models["m"], c) for c in calls[1:]))
        await asyncio.sleep(0.05)  # the write-backs
        writes = [n for method, n in store.batches if method == "set_many"]
        assert sum(writes) == 10 and max(writes) <= 2, writes  # at most ~3000 bytes per call
        fresh = _cache(backend, store)
        await fresh.answer(fresh.models["m"], calls[0])
        store.batches.clear()
        hits = await asyncio.gather(*(fresh.answer(fresh.models["m"], c) for c in calls[1:]))
        assert [r.completions[0].text.split(" x")[0] for r, _ in hits] == [f"answer to p{i}" for i in range(1, 10)]
        assert {header for _, header in hits} == {"hit"} and backend.calls == 10
        assert len(store.batches) > 1  # the nine hits came back over several replies
        huge = _cache(backend, store)
        huge.max_bytes = 100  # an answer no store call could carry: served, kept in the hot tier, not stored
        before = len(store.entries)
        result, _ = await huge.answer(huge.models["m"], GenerateCall(max_tokens=4, prompts=("big",),
                                                                     sampling=SamplingParams(0)))
        await asyncio.sleep(0.02)
        assert result.completions[0].text.startswith("answer to big")
        assert len(store.entries) == before and huge.too_large == 1

    asyncio.run(scenario())


def test_drop_clears_the_hot_tier_and_the_store():
    async def scenario():
        store = _StoreHandle()
        backend = ScriptedBackend(_answer("a"), _answer("b"), info=_INFO)
        cache = _cache(backend, store)
        call = GenerateCall(max_tokens=4, prompts=("p",), sampling=SamplingParams(0))
        await cache.answer(cache.models["m"], call)
        await asyncio.sleep(0)
        assert (await cache.drop("m"))["entries"] == 1
        assert await cache.answer(cache.models["m"], call) == (_answer("b"), "miss")
        assert (await cache.stats())["router_outcomes"] == {"m": {"miss": 2}}

    asyncio.run(scenario())


def test_to_wire_is_asdict_without_the_copies():
    logprob = TokenLogprob(token="a", logprob=-0.5, top=(("a", -0.5), ("b", -1.0)))
    results = [
        EmbedResult(embeddings=[[0.1, 0.2], [0.3, 0.4]], prompt_tokens=3, revision="r"),
        ClassifyResult(rankings=[[("pos", 0.9), ("neg", 0.1)]], prompt_tokens=2),
        GenerateResult([Completion(text="x", finish_reason="stop", prompt_tokens=1, completion_tokens=1,
                                   logprobs=(logprob,))], revision="r"),
    ]
    for result in results:
        assert decode_value(encode_value(result.to_wire())) == decode_value(encode_value(dataclasses.asdict(result)))
        assert type(result).from_wire(decode_value(encode_value(result.to_wire()))) == result
