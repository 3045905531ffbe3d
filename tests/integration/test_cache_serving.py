"""The cache deployment through the real HTTP proxy: exact and semantic hits,
coalescing, invalidation, and a store that dies mid-traffic."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

pytestmark = pytest.mark.integration


def _embed(client, text, model="tiny-embed"):
    return client.post("/v1/embeddings", json={"model": model, "input": text})


def _rows(client, model="tiny-embed") -> int:
    return client.get("/v1/stats").json()["models"][model]["rows"]


def test_identical_requests_hit_and_other_spellings_get_their_own_entry(client):
    text = f"cache me {uuid.uuid4().hex}"
    first = _embed(client, text)
    assert first.headers["x-cache"] == "miss"
    rows = _rows(client)
    again = _embed(client, text)
    assert again.headers["x-cache"] == "hit" and again.json()["data"] == first.json()["data"]
    assert _rows(client) == rows, "a hit must not touch the model"
    # Keys hold the text as sent: a full-width spelling (NFKC: the same text) is
    # [UNK] to MiniLM's tokenizer, so it must be computed, not answered with the ASCII text's vector.
    wide = _embed(client, text.replace("cache me", "\uff43\uff41\uff43\uff48\uff45 me"))
    assert wide.headers["x-cache"] == "miss"
    assert wide.json()["data"][0]["embedding"] != first.json()["data"][0]["embedding"]


def test_sampling_without_seed_is_never_cached(client):
    body = {"model": "tiny-llama", "prompt": f"tell {uuid.uuid4().hex}", "max_tokens": 3, "temperature": 0.9}
    assert [client.post("/v1/completions", json=body).headers["x-cache"] for _ in range(2)] == ["miss", "miss"]
    seeded = {**body, "seed": 7}
    assert [client.post("/v1/completions", json=seeded).headers["x-cache"] for _ in range(2)] == ["miss", "hit"]


def test_chat_answers_are_cached_with_fresh_ids(client):
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": f"hi {uuid.uuid4().hex}"}],
            "max_tokens": 3, "temperature": 0}
    first, second = (client.post("/v1/chat/completions", json=body) for _ in range(2))
    assert (first.headers["x-cache"], second.headers["x-cache"]) == ("miss", "hit")
    assert first.json()["choices"] == second.json()["choices"]
    assert first.json()["id"] != second.json()["id"]


def test_admin_drop_makes_entries_miss(client):
    text = f"drop me {uuid.uuid4().hex}"
    _embed(client, text)
    assert _embed(client, text).headers["x-cache"] == "hit"
    dropped = client.delete("/v1/cache/tiny-embed")
    assert dropped.status_code == 200 and dropped.json()["entries"] >= 1
    assert _embed(client, text).headers["x-cache"] == "miss"
    assert client.delete("/v1/cache/no-such-model").status_code == 404


def test_fifty_identical_concurrent_requests_cost_one_inference(client, tiny_service):
    text = f"burst {uuid.uuid4().hex}"
    rows = _rows(client)

    async def burst():
        async with httpx.AsyncClient(base_url=tiny_service, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/embeddings", json={"model": "tiny-embed", "input": text})
                                          for _ in range(50)))

    answers = asyncio.run(burst())
    assert all(a.status_code == 200 for a in answers)
    assert len({str(a.json()["data"]) for a in answers}) == 1
    assert _rows(client) - rows == 1, "50 identical requests must cost exactly one model row"


def test_semantic_paraphrase_hits_and_unrelated_misses(deployed):
    question = {"role": "user", "content": "What's the capital of France?"}
    body = {"model": "smollm2", "messages": [question], "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=f"{deployed}/local", timeout=120) as http:
        http.delete("/v1/cache/smollm2")
        first = http.post("/v1/chat/completions", json=body)
        assert first.headers["x-cache"] == "miss"
        paraphrase = {**body, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        hit = http.post("/v1/chat/completions", json=paraphrase)
        assert hit.headers["x-cache"] == "semantic"
        assert hit.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
        unrelated = {**body, "messages": [{"role": "user", "content": "What is the capital of Germany?"}]}
        assert http.post("/v1/chat/completions", json=unrelated).headers["x-cache"] == "miss"
        other_params = {**paraphrase, "max_tokens": 4}
        assert http.post("/v1/chat/completions", json=other_params).headers["x-cache"] == "miss"


def test_semantic_cache_never_answers_another_question_or_endpoint(deployed):
    # Both seen on an earlier version: "unsafe" answered with "safe"'s answer at
    # cosine 0.99, and a completion "user: X" answered from the chat's entry for X.
    body = {"model": "smollm2", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=f"{deployed}/local", timeout=120) as http:
        http.delete("/v1/cache/smollm2")
        safe = {**body, "messages": [{"role": "user", "content": "Is it safe to mix bleach and ammonia?"}]}
        assert http.post("/v1/chat/completions", json=safe).headers["x-cache"] == "miss"
        unsafe = {**body, "messages": [{"role": "user", "content": "Is it unsafe to mix bleach and ammonia?"}]}
        assert http.post("/v1/chat/completions", json=unsafe).headers["x-cache"] == "miss"
        as_prompt = {**body, "prompt": "user: Is it safe to mix bleach and ammonia?"}
        assert http.post("/v1/completions", json=as_prompt).headers["x-cache"] == "miss"
        other_system = {**body, "messages": [{"role": "system", "content": "Answer in French."}, safe["messages"][0]]}
        assert http.post("/v1/chat/completions", json=other_system).headers["x-cache"] == "miss"


def test_redis_dying_mid_traffic_loses_no_request(deployed, tiny_app, private_redis, redeploy_apps):
    process, url = private_redis
    args = {**tiny_app["args"], "cache": {"store": "redis", "redis_url": url, "key_prefix": f"t-{uuid.uuid4().hex}:"}}
    redis_app = {**tiny_app, "name": "redis", "route_prefix": "/redis", "args": args}
    redeploy_apps([redis_app])
    tag = uuid.uuid4().hex
    # Ten texts repeated while Redis lives, then only new texts: those must be computed.
    texts = [f"redis {tag} {i % 10}" for i in range(30)] + [f"redis {tag} late {i}" for i in range(30)]

    async def traffic():
        async with httpx.AsyncClient(base_url=f"{deployed}/redis", timeout=60) as http:
            answers = []
            for i, text in enumerate(texts):
                if i == 30:
                    process.kill()  # the store dies mid-traffic
                answers.append(await http.post("/v1/embeddings", json={"model": "tiny-embed", "input": text}))
            return answers

    answers = asyncio.run(traffic())
    assert [a.status_code for a in answers] == [200] * len(texts)
    caches = [a.headers["x-cache"] for a in answers]
    assert "hit" in caches[:30], "repeated texts hit while Redis lived"
    assert set(caches[30:]) == {"miss"}, "with Redis gone, new texts are answered by the model"
    stats = httpx.get(f"{deployed}/redis/v1/stats", timeout=30).json()
    assert stats["cache"]["store_errors"] >= 1
