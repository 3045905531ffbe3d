"""The serving path end to end, through the real HTTP proxy, on tiny fixture models."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.integration


def _png(color=(255, 0, 0), size=(40, 40)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_health_and_models(client):
    assert client.get("/healthz").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert {m["id"] for m in models["data"]} == {"tiny-embed", "tiny-classifier", "tiny-llama", "tiny-vit"}


def test_embeddings_float_and_base64_agree(client):
    body = {"model": "tiny-embed", "input": ["hello world", "a much longer sentence about batching"]}
    floats = client.post("/v1/embeddings", json=body).json()
    assert [d["index"] for d in floats["data"]] == [0, 1]
    assert floats["usage"]["prompt_tokens"] > 0
    first = np.array(floats["data"][0]["embedding"])
    assert abs(np.linalg.norm(first) - 1.0) < 1e-4
    encoded = client.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, first, atol=1e-6)


def test_concurrent_requests_are_batched_and_match_alone(client, tiny_service):
    texts = [" ".join(["word"] * (1 + (i * 7) % 40)) + f" number {i}" for i in range(32)]
    alone = [client.post("/v1/embeddings", json={"model": "tiny-embed", "input": t}).json() for t in texts]
    # The answers alone are cached now; drop them so the burst reaches the model.
    assert client.delete("/v1/cache/tiny-embed").status_code == 200
    before = client.get("/v1/stats").json()["models"]["tiny-embed"]

    async def burst():
        async with httpx.AsyncClient(base_url=tiny_service, timeout=60) as http:
            return await asyncio.gather(
                *(http.post("/v1/embeddings", json={"model": "tiny-embed", "input": t}) for t in texts)
            )

    together = [r.json() for r in asyncio.run(burst())]
    after = client.get("/v1/stats").json()["models"]["tiny-embed"]
    calls = after["model_calls"] - before["model_calls"]
    batches = after["batches"] - before["batches"]
    assert after["rows"] - before["rows"] == 32
    assert batches < 32 and calls < 32, f"32 requests took {batches} batches and {calls} model calls"
    for one, many in zip(alone, together):
        np.testing.assert_allclose(one["data"][0]["embedding"], many["data"][0]["embedding"], atol=1e-5)


def test_chat_and_completion(client):
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5, "temperature": 0},
    ).json()
    choice = chat["choices"][0]
    assert chat["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert 0 < chat["usage"]["completion_tokens"] <= 5
    assert chat["usage"]["total_tokens"] == chat["usage"]["prompt_tokens"] + chat["usage"]["completion_tokens"]

    completion = client.post(
        "/v1/completions", json={"model": "tiny-llama", "prompt": ["one two", "three"], "max_tokens": 4, "temperature": 0}
    ).json()
    assert completion["object"] == "text_completion" and len(completion["choices"]) == 2
    again = client.post(
        "/v1/completions", json={"model": "tiny-llama", "prompt": "one two", "max_tokens": 4, "temperature": 0}
    ).json()
    assert again["choices"][0]["text"] == completion["choices"][0]["text"], "greedy must not depend on batching"


def test_classify_text_and_image(client):
    text = client.post("/v1/classify", json={"model": "tiny-classifier", "input": ["good", "bad"], "top_k": 2}).json()
    labels = text["data"][0]["labels"]
    assert {l["label"] for l in labels} == {"negative", "positive"}
    assert abs(sum(l["score"] for l in labels) - 1.0) < 1e-4
    image = client.post("/v1/classify", json={"model": "tiny-vit", "image": _png(), "top_k": 2}).json()
    assert len(image["data"][0]["labels"]) == 2
    data_url = client.post("/v1/classify", json={"model": "tiny-vit", "image": "data:image/png;base64," + _png()})
    assert data_url.status_code == 200


@pytest.mark.parametrize(
    "path, body, status, param, fragment",
    [
        ("/v1/embeddings", {"model": "nope", "input": "x"}, 404, "model", "does not exist"),
        ("/v1/embeddings", {"model": "tiny-llama", "input": "x"}, 400, "model", "text-generation model"),
        ("/v1/embeddings", {"model": "tiny-embed", "input": []}, 400, "input", "must not be empty"),
        ("/v1/embeddings", {"model": "tiny-embed", "input": "   "}, 400, "input", "empty"),
        ("/v1/embeddings", {"model": "tiny-embed", "input": ["a"] * 9}, 400, "input", "at most 8"),
        ("/v1/embeddings", {"model": "tiny-embed", "input": "word " * 200}, 400, "input", "64"),
        ("/v1/embeddings", {"model": "tiny-embed"}, 400, "input", "Field required"),
        ("/v1/embeddings", {"model": "tiny-embed", "input": 5}, 400, "input", "input"),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": []}, 400, "messages", "must not be empty"),
        ("/v1/chat/completions", {"model": "tiny-llama", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "role"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "max_tokens": 65}, 400, "max_tokens", "at most 64"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "temperature": 3}, 400, "temperature", "less than or equal"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "x", "n": 2}, 400, "n", "needs the vLLM engine"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "word " * 100}, 400, "prompt", "at most 127"),
        ("/v1/completions", {"model": "tiny-llama", "prompt": "word " * 40, "max_tokens": 60}, 400, "max_tokens", "context of 128"),
        ("/v1/classify", {"model": "tiny-vit", "image": "%%%not-base64"}, 400, "image", "base64"),
        ("/v1/classify", {"model": "tiny-vit", "image": base64.b64encode(b"not an image").decode()}, 400, "image", "image"),
        ("/v1/classify", {"model": "tiny-vit", "image": "https://example.com/cat.png"}, 400, "image", "URL"),
        ("/v1/classify", {"model": "tiny-classifier", "input": "x", "top_k": 3}, 400, "top_k", "at most 2"),
        ("/v1/classify", {"model": "tiny-classifier"}, 400, "input", "exactly one"),
    ],
)
def test_bad_requests_get_openai_errors(client, path, body, status, param, fragment):
    error = _error(client.post(path, json=body), status)
    assert error["param"] == param, error
    assert fragment in error["message"], error


def test_invalid_json_and_nan(client):
    error = _error(client.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "not valid JSON" in error["message"]
    nan_body = b'{"model": "tiny-llama", "prompt": "x", "temperature": NaN}'
    error = _error(client.post("/v1/completions", content=nan_body, headers={"content-type": "application/json"}), 400)
    assert error["param"] == "temperature"
    assert client.get("/healthz").status_code == 200


def _raw_error(response: httpx.Response, status: int, code: str) -> dict:
    error = _error(response, status)
    assert error["code"] == code, error
    return error


def test_framework_level_errors_have_the_same_shape(client):
    """Bodies and paths refused before any endpoint runs still answer in OpenAI's shape."""
    json_header = {"content-type": "application/json"}
    # Over router.max_body_bytes (16 MiB by default): refused from its Content-Length, unread.
    big = b'{"model": "tiny-embed", "input": "' + b"a" * (16 * 2**20) + b'"}'
    _raw_error(client.post("/v1/embeddings", content=big, headers=json_header), 413, "request_too_large")

    # The same body sent chunked (no Content-Length) is cut off once the limit passes.
    def chunks():
        yield b'{"model": "tiny-embed", "input": "'
        for _ in range(17):
            yield b"a" * 2**20
        yield b'"}'

    _raw_error(client.post("/v1/embeddings", content=chunks(), headers=json_header), 413, "request_too_large")
    _raw_error(client.get("/v1/nothing-here"), 404, "not_found")
    _raw_error(client.get("/v1/embeddings"), 405, "method_not_allowed")
    deep = b'{"model": "tiny-embed", "input": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert client.post("/v1/embeddings", content=deep, headers=json_header).status_code == 400
    bad_utf8 = b'{"model": "tiny-embed", "input": "' + bytes([0xFF, 0xFE]) + b'"}'
    assert client.post("/v1/embeddings", content=bad_utf8, headers=json_header).status_code == 400
    assert client.get("/healthz").status_code == 200


def test_openai_client_works_unchanged(tiny_service):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url=f"{tiny_service}/v1", api_key="unused")
    embedding = api.embeddings.create(model="tiny-embed", input=["hello", "world"])  # base64 by default
    assert len(embedding.data) == 2 and len(embedding.data[0].embedding) > 0
    chat = api.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 4
    assert {m.id for m in api.models.list()} >= {"tiny-embed", "tiny-llama"}
    with pytest.raises(openai.NotFoundError):
        api.embeddings.create(model="missing", input="x")


def test_batching_retunes_without_restarting_replicas(client, redeploy):
    """A user_config override in the deployments file retunes live replicas in place."""
    before = client.get("/v1/stats").json()["models"]["tiny-embed"]
    redeploy([{"name": "ModelServer-tiny-embed", "user_config": {"max_batch_size": 4, "batch_wait_timeout_s": 0.002}}])
    after = client.get("/v1/stats").json()["models"]["tiny-embed"]
    assert after["batching"]["max_batch_size"] == 4
    assert after["batching"]["batch_wait_timeout_s"] == 0.002
    # Keys left out of the override keep the deployments file's values.
    assert after["batching"]["max_batch_tokens"] == before["batching"]["max_batch_tokens"] == 4096
    assert after["replica"] == before["replica"], "a batching change must not restart the replica"
    assert after["rows"] >= before["rows"], "counters survive: same process"
    response = client.post("/v1/embeddings", json={"model": "tiny-embed", "input": ["still", "serving"]})
    assert response.status_code == 200
