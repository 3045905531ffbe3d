"""The day scenario's stub replicas behind the real router: they answer infer_many like
the real replica, so the router gathers calls and counts every replica it reaches (with
no infer_many, every group failed first and the gatherer saw one replica while the day
scaled to five)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_the_gatherer_sees_every_stub_replica(serve_instance):
    from ray import serve

    from benchmarks.harness.stubs import EmulatedAccelerator
    from serve_app.app import router_app
    from serve_app.config import model_deployment_name, parse_app_config

    config = parse_app_config({"models": [{"name": "embed", "source": "emulated", "task": "embedding"}],
                               "router": {"num_cpus": 0.05}, "cache": {"enabled": False}})
    model = EmulatedAccelerator.options(name=model_deployment_name("embed"), num_replicas=3, max_ongoing_requests=8,
                                        ray_actor_options={"num_cpus": 0.05}).bind(8, 2, 0.2, name="embed")
    serve.run(router_app(config, {"embed": model}), name="stub-replicas", route_prefix="/stub-replicas")
    base = f"{serve_instance}/stub-replicas"
    try:
        async def load() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as client:
                limit = asyncio.Semaphore(24)

                async def one(i: int) -> int:
                    async with limit:
                        reply = await client.post(f"{base}/v1/embeddings", json={"model": "embed", "input": f"t {i}"})
                        return reply.status_code

                return await asyncio.gather(*(one(i) for i in range(150)))

        assert set(asyncio.run(load())) == {200}
        gathering = httpx.get(f"{base}/v1/stats", timeout=30).json()["models"]["embed"]["gathering"]
        assert gathering["replicas_seen"] == 3, gathering
        assert gathering["calls"] > gathering["groups"], "calls travelled together"
    finally:
        serve.delete("stub-replicas")
