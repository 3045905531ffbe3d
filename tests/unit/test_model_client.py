"""ingress/model_client.py against scripted backends, without Ray: the deadline on the
call, replica retry, Serve's failures mapped to client errors, streams."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import ActorUnavailableError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve_app.config import ModelConfig, RouterConfig
from serve_app.core.calls import (
    EmbedCall,
    EmbedResult,
    GenerateCall,
    StreamDelta,
    StreamEnd,
)
from serve_app.core.errors import (
    DeadlineExceededError,
    ModelUnavailableError,
    OverloadedError,
)
from serve_app.ingress.model_client import ModelBackend, ModelClient, ModelServerBackend
from handle_fakes import ScriptedBackend


def _model(task: str = "text-generation", name: str = "m", **extra) -> ModelConfig:
    return ModelConfig.model_validate({"name": name, "source": "package:nothing", "task": task, **extra})


_LOST = ActorUnavailableError("replica died", None)


def _client(backend, **router) -> ModelClient:
    return ModelClient({"m": backend}, RouterConfig.model_validate(router))


def test_client_puts_the_deadline_on_the_call_and_returns_the_typed_result():
    answer = EmbedResult(embeddings=[[1.0]], prompt_tokens=1)
    backend = ScriptedBackend(answer)
    before = time.time()
    assert asyncio.run(_client(backend, request_timeout_s=30).infer(_model("embedding"), EmbedCall(("a",)))) == answer
    (sent,) = backend.calls
    assert before + 29 < sent.deadline < time.time() + 31


def test_client_retries_a_lost_replica_then_gives_up():
    answer = EmbedResult(embeddings=[[1.0]], prompt_tokens=1)
    client = _client(ScriptedBackend(_LOST, answer), replica_retries=2)
    assert asyncio.run(client.infer(_model("embedding"), EmbedCall(("a",)))) == answer
    assert client.replica_retries["m"] == 1
    with pytest.raises(ActorUnavailableError):
        asyncio.run(_client(ScriptedBackend(_LOST, _LOST), replica_retries=1).infer(_model("embedding"), EmbedCall(("a",))))


def test_client_maps_serve_failures_to_client_errors():
    full = _client(ScriptedBackend(BackPressureError(num_queued_requests=9, max_queued_requests=8)), retry_after_s=3)
    with pytest.raises(OverloadedError) as caught:
        asyncio.run(full.infer(_model("embedding"), EmbedCall(("a",))))
    assert caught.value.headers() == {"Retry-After": "3"}
    broken = _client(ScriptedBackend(DeploymentUnavailableError(None)))
    with pytest.raises(ModelUnavailableError):
        asyncio.run(broken.infer(_model("embedding"), EmbedCall(("a",))))


def test_client_cancels_a_call_past_the_deadline():
    backend = ScriptedBackend(EmbedResult(embeddings=[], prompt_tokens=0), delay_s=5)
    with pytest.raises(DeadlineExceededError):
        asyncio.run(_client(backend, request_timeout_s=0.05).infer(_model("embedding"), EmbedCall(("a",))))
    assert backend.pending[0].cancelled


def test_stream_retries_only_before_the_first_event():
    end = StreamEnd(index=0, finish_reason="stop", prompt_tokens=1, completion_tokens=1)
    call = GenerateCall(max_tokens=4, prompts=("p",))

    async def events(client):
        return [event async for event in client.stream(_model(), call)]

    client = _client(ScriptedBackend([_LOST], [StreamDelta(0, "a"), end]), replica_retries=1)
    assert asyncio.run(events(client)) == [StreamDelta(0, "a"), end]
    late = _client(ScriptedBackend([StreamDelta(0, "a"), _LOST], [end]), replica_retries=1)
    with pytest.raises(ActorUnavailableError):
        asyncio.run(events(late))


def test_every_backend_has_the_whole_model_backend_protocol():
    from test_cache_revisions_and_deadlines import _Backend
    from test_call_gathering import _DeadEngineFirst
    from test_semantic_cache import _LLM, _Embedder

    wanted = {name for name in vars(ModelBackend) if not name.startswith("_")}
    assert wanted == {"infer", "infer_stream", "info", "stats", "gathering"}
    for backend in (ModelServerBackend, ScriptedBackend, _Backend, _DeadEngineFirst, _LLM, _Embedder):
        assert wanted <= set(dir(backend)), f"{backend.__name__} lacks {sorted(wanted - set(dir(backend)))}"
