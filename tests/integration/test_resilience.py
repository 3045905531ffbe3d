"""Overload and replica failure: every accepted request is answered, refusals are
quick 503s with Retry-After, and a replica killed mid-traffic costs no request."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import ray
import tiny_models
from ray import serve
from ray._private.worker import global_worker
from serving_apps import SMALL, extra_app

pytestmark = pytest.mark.integration


def test_overload_answers_503_with_retry_after_and_nothing_hangs(redeploy_apps, tiny_llama_dir, deployed):
    # One replica that runs 2 requests at once and lets each router queue 2 more.
    redeploy_apps([extra_app("overload", {
        "name": "tiny-llama", "source": str(tiny_llama_dir), "task": "text-generation", "engine": "transformers",
        "max_ongoing_requests": 2, "max_queued_requests": 2,
        "batching": {"max_batch_size": 2, "batch_wait_timeout_s": 0.05},
        "generation": {"default_max_tokens": 32, "max_tokens_limit": 64},
        "resources": SMALL,
    }, router={"retry_after_s": 2}, cache={"enabled": False})])

    async def burst() -> list[tuple[int, dict, float]]:
        async with httpx.AsyncClient(base_url=f"{deployed}/overload", timeout=120) as client:
            async def one(i: int):
                t0 = time.monotonic()
                r = await client.post("/v1/completions", json={"model": "tiny-llama", "prompt": f"story {i}",
                                                               "max_tokens": 32, "temperature": 0})
                return r.status_code, dict(r.headers), time.monotonic() - t0
            return await asyncio.gather(*(one(i) for i in range(40)))  # 10x the 4 it can hold

    started = time.monotonic()
    results = asyncio.run(burst())
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 503}, statuses
    refused = [(h, t) for s, h, t in results if s == 503]
    assert statuses.count(200) >= 4 and refused, statuses
    assert all(h.get("retry-after") == "2" for h, _ in refused)
    assert max(t for _, t in refused) < 5.0, "a refusal must come at once, not after queueing"
    assert time.monotonic() - started < 120
    assert httpx.get(f"{deployed}/overload/healthz", timeout=10).status_code == 200


def _replica_actors(app: str, deployment: str) -> list:
    names = ray.util.list_named_actors(all_namespaces=True)
    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in names
            if a["name"].startswith("SERVE_REPLICA::") and f"{app}#{deployment}#" in a["name"]]


def _traffic(base_url: str, make_body, done: threading.Event, failures: list[str], answers: list,
             minimum: int = 50) -> None:
    """Send requests one after another until ``done`` (and at least ``minimum``),
    recording every non-200 and every answer."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        i = 0
        while not done.is_set() or i < minimum:
            r = client.post("/v1/embeddings", json=make_body(i))
            if r.status_code != 200:
                failures.append(f"{r.status_code}: {r.text[:200]}")
            else:
                answers.append((i, r.headers.get("x-cache"), r.json()["data"][0]["embedding"][:4]))
            i += 1


def test_replica_killed_and_redis_stopped_mid_traffic_lose_no_request(
    redeploy_apps, tiny_bert_embedding_dir, private_redis, deployed
):
    """The fault test: during steady traffic a model replica's actor is killed, then the
    cache's Redis dies. Every request is still answered 200."""
    redis_process, redis_url = private_redis
    redeploy_apps([extra_app("resilient", {
        "name": "tiny-embed", "source": str(tiny_bert_embedding_dir), "task": "embedding", "engine": "transformers", "num_replicas": 2,
        # Requests wait in the replica a little, so the kill finds some in flight.
        "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.05},
        "resources": SMALL,
    }, cache={"store": "redis", "redis_url": redis_url, "key_prefix": f"t-{uuid.uuid4().hex}:"})])
    replicas = _replica_actors("resilient", "ModelServer-tiny-embed")
    assert len(replicas) == 2

    failures: list[str] = []
    answers: list = []
    done = threading.Event()
    tag = uuid.uuid4().hex
    # Half the clients repeat a few texts (cache hits while Redis lives), half send new
    # ones (model calls throughout).
    repeat = lambda i: {"model": "tiny-embed", "input": f"{tag} repeated {i % 5}"}  # noqa: E731
    fresh = lambda i: {"model": "tiny-embed", "input": [f"{tag} fresh {i} {uuid.uuid4().hex}", "more"]}  # noqa: E731
    workers = [threading.Thread(target=_traffic, args=(f"{deployed}/resilient", body, done, failures, answers))
               for body in (repeat, repeat, repeat, fresh, fresh, fresh)]
    for w in workers:
        w.start()
    time.sleep(2)
    ray.kill(replicas[0], no_restart=False)  # Serve notices and starts a replacement
    time.sleep(2)
    redis_process.kill()  # the cache store dies too
    redis_process.wait()
    time.sleep(4)
    done.set()
    for w in workers:
        w.join(timeout=120)
    assert not failures, failures[:5]
    assert len(answers) >= 300
    stats = httpx.get(f"{deployed}/resilient/v1/stats", timeout=30).json()
    retries = stats["replica_retries"].get("tiny-embed", 0)
    cache = stats["cache"]
    print(f"{len(answers)} requests, 0 failed; replica retries {retries}; "
          f"router cache errors {cache['router_cache_errors']}, store errors {cache.get('store_errors')}; "
          f"outcomes {cache['router_outcomes']}")
    assert cache["router_outcomes"]["tiny-embed"].get("hit", 0) > 0, "repeats hit the cache while Redis lived"
    assert cache.get("store_errors", 0) + cache["router_cache_errors"] >= 1, "Redis's death was noticed"
    assert httpx.get(f"{deployed}/resilient/healthz", timeout=10).json()["status"] == "ok"


def test_a_model_that_fails_to_load_is_reported_and_the_others_keep_serving(redeploy_apps, tiny_bert_embedding_dir,
                                                                             deployed, tmp_path):
    missing = tmp_path / "no-such-model"
    app = extra_app("halfbroken", {
        "name": "tiny-embed", "source": str(tiny_bert_embedding_dir), "task": "embedding", "engine": "transformers", "resources": SMALL,
    }, cache={"enabled": False})
    app["args"]["models"].append({"name": "broken", "source": str(missing), "task": "embedding", "engine": "transformers", "resources": SMALL})
    # Serve tries the broken model's start a few times, then gives up on that
    # deployment alone (DEPLOY_FAILED); the app as a whole reports the failure.
    with pytest.raises(RuntimeError, match="deploy failed"):
        redeploy_apps([app])
    deployments = serve.status().applications["halfbroken"].deployments
    print({name: (d.status, d.replica_states) for name, d in deployments.items()})
    deadline = time.monotonic() + 120  # the healthy deployments may still be starting
    while not all(deployments[name].status == "HEALTHY" for name in ("Router", "ModelServer-tiny-embed")):
        assert time.monotonic() < deadline, {name: d.status for name, d in deployments.items()}
        time.sleep(1)
        deployments = serve.status().applications["halfbroken"].deployments
    base = f"{deployed}/halfbroken"
    good = httpx.post(f"{base}/v1/embeddings", json={"model": "tiny-embed", "input": "still here"}, timeout=30)
    assert good.status_code == 200
    broken = httpx.post(f"{base}/v1/embeddings", json={"model": "broken", "input": "anyone?"}, timeout=30)
    assert broken.status_code == 503
    error = broken.json()["error"]
    assert error["code"] == "model_unavailable" and error["param"] == "model" and "broken" in error["message"]
    health = httpx.get(f"{base}/healthz", timeout=30)
    deadline = time.monotonic() + 15  # the router re-reads deployment states every few seconds
    while health.json()["status"] != "degraded" and time.monotonic() < deadline:
        time.sleep(1)
        health = httpx.get(f"{base}/healthz", timeout=30)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded" and list(body["unavailable"]) == ["broken"]
    assert body["unavailable"]["broken"]["status"] == "DEPLOY_FAILED"
    stats = httpx.get(f"{base}/v1/stats", timeout=30).json()
    assert "unavailable" in stats["models"]["broken"]["error"] and stats["models"]["tiny-embed"]["rows"] >= 1
    logs = Path(global_worker.node.get_session_dir_path()) / "logs" / "serve"
    lines = [line for path in logs.glob("replica_halfbroken_ModelServer-broken_*.log")
             for line in path.read_text(errors="replace").splitlines()]
    assert any(f"model broken failed to load from {missing}" in line for line in lines), lines[-5:]


def test_retuning_and_a_new_model_revision_drop_no_request(redeploy_apps, tiny_bert_embedding_dir, deployed, tmp_path):
    """In-flight and arriving requests survive a user_config retune (in place) and the
    deploy of a new model revision (new replicas replace the old ones)."""
    second_revision = tiny_models.build_tiny_bert(tmp_path / "revision-2", task="embedding", seed=1)

    def app(source, batching_override=None) -> dict:
        application = extra_app("rolling", {
            "name": "tiny-embed", "source": str(source), "task": "embedding", "engine": "transformers", "resources": SMALL,
            "batching": {"max_batch_size": 8, "batch_wait_timeout_s": 0.05},
        }, cache={"enabled": False})
        if batching_override:
            application["deployments"] = [{"name": "ModelServer-tiny-embed", "user_config": batching_override}]
        return application

    redeploy_apps([app(tiny_bert_embedding_dir)])
    failures: list[str] = []
    answers: list = []
    done = threading.Event()
    body = lambda i: {"model": "tiny-embed", "input": "the same text every time"}  # noqa: E731
    workers = [threading.Thread(target=_traffic, args=(f"{deployed}/rolling", body, done, failures, answers))
               for _ in range(4)]
    for w in workers:
        w.start()
    time.sleep(1)
    redeploy_apps([app(tiny_bert_embedding_dir, {"max_batch_size": 2, "batch_wait_timeout_s": 0.01})])
    retuned_at = len(answers)
    redeploy_apps([app(second_revision)])
    time.sleep(2)
    done.set()
    for w in workers:
        w.join(timeout=120)
    assert not failures, failures[:5]
    first, last = answers[0][2], answers[-1][2]
    assert first != last, "the new revision answers after its deploy"
    print(f"{len(answers)} requests across a retune (at #{retuned_at}) and a new revision: 0 failed")


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_requests_past_their_deadline_get_504_and_leave_the_queue(redeploy_apps, tiny_llama_dir, deployed, engine):
    # One row at a time and a 1 s deadline: of a burst of long generations, the later
    # ones cannot start in time. Each gets a 504 at its deadline, and its row leaves the
    # queue (the static engine's batch queue, the continuous engine's waiting rows)
    # without being computed.
    redeploy_apps([extra_app("deadline", {
        "name": "tiny-llama", "source": str(tiny_llama_dir), "task": "text-generation", "engine": "transformers",
        "batching": {"max_batch_size": 1, "batch_wait_timeout_s": 0.0},
        "generation": {"default_max_tokens": 64, "max_tokens_limit": 64, "engine": engine},
        "resources": SMALL,
    }, router={"request_timeout_s": 1.0}, cache={"enabled": False})])
    base = f"{deployed}/deadline"
    body = {"model": "tiny-llama", "prompt": "once upon a time", "max_tokens": 64, "temperature": 0}

    async def burst() -> list[tuple[int, str, float]]:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            async def one():
                t0 = time.monotonic()
                r = await client.post("/v1/completions", json=body)
                return r.status_code, r.json()["error"]["type"] if r.status_code != 200 else "", time.monotonic() - t0
            return await asyncio.gather(*(one() for _ in range(32)))

    results = asyncio.run(burst())
    statuses = sorted(s for s, _, _ in results)
    assert set(statuses) <= {200, 504} and 504 in statuses, statuses
    assert all(kind == "timeout_error" for s, kind, _ in results if s == 504)
    assert max(t for _, _, t in results) < 4.0, "every request ends by its deadline"
    time.sleep(1.5)  # let the replica finish the row it was running
    stats = httpx.get(f"{base}/v1/stats", timeout=30).json()["models"]["tiny-llama"]
    if engine == "static":
        computed = stats["rows"]  # rows that reached a model call
    else:
        computed = stats["engine"]["rows_admitted"]  # rows that joined the running batch
    print(f"{engine}: burst of 32 with a 1 s deadline: {statuses.count(200)} answered, {statuses.count(504)} got 504; "
          f"model computed {computed} rows")
    assert computed < len(results), "timed-out requests left the queue instead of being computed"
    after = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
    assert after.status_code == 200
