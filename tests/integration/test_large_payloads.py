"""Large answers on the shipped high-throughput path, whose handle calls travel over gRPC
with a 4 MiB message limit: 32 concurrent requests of 64 inputs each to a model with
768-d vectors (one answer is about 440 KB) are answered by the model, then all again
from the cache. Before the cache's calls were bounded in bytes, a batch of such
write-backs or lookups failed whole: every answer was computed again (a miss)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import tiny_models
from serving_apps import SMALL, extra_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def wide(redeploy_apps_module, deployed, tmp_path_factory) -> str:
    if tiny_models.minilm_model_dir() is None:
        pytest.skip(f"{tiny_models.MINILM_PACKAGE} is not installed (its tokenizer files are needed)")
    model_dir = tiny_models.build_tiny_bert(tmp_path_factory.mktemp("bert-768"), hidden_size=768,
                                            num_attention_heads=12, num_hidden_layers=1, intermediate_size=128)
    redeploy_apps_module([extra_app("wide-embed", {
        "name": "wide", "source": str(model_dir), "task": "embedding", "engine": "transformers",
        "resources": SMALL, "batching": {"max_batch_size": 64},
    }, cache={"router_hot_bytes": 0})])  # no hot tier: every hit comes from the CacheServer
    return f"{deployed}/wide-embed"


def _all_at_once(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async def send():
        async with httpx.AsyncClient(timeout=180) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/embeddings", json=body) for body in bodies))

    return asyncio.run(send())


def test_32_requests_of_64_wide_vectors_from_the_model_then_from_the_cache(wide):
    bodies = [{"model": "wide", "input": [f"request {i}, input {j}" for j in range(64)]} for i in range(32)]
    first = _all_at_once(wide, bodies)
    assert [r.status_code for r in first] == [200] * 32, [r.text[:200] for r in first if r.status_code != 200]
    assert {len(r.json()["data"]) for r in first} == {64}
    assert {len(r.json()["data"][0]["embedding"]) for r in first} == {768}
    # The write-backs, which no client waits for: 14 MB, in calls of at most 3 MiB each.
    deadline = time.monotonic() + 60
    while (cache := httpx.get(f"{wide}/v1/stats", timeout=60).json()["cache"])["entries"] < 32:
        assert time.monotonic() < deadline, cache
        time.sleep(0.5)
    assert cache["router_cache_errors"] == 0 and cache["store_errors"] == 0, cache
    again = _all_at_once(wide, bodies)
    assert [r.status_code for r in again] == [200] * 32
    assert [r.headers["x-cache"] for r in again] == ["hit"] * 32
    assert [r.json()["data"] for r in again] == [r.json()["data"] for r in first]
