"""The ingress without Ray: bodies to typed calls, OpenAI shapes, the error boundary and
the guard on a bare FastAPI app, the model client's deadline/retry/error mapping and the
response cache's protocol against fake handles."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel
from ray.exceptions import ActorUnavailableError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from serve_app.config import AppConfig, ModelConfig, RouterConfig
from serve_app.ingress.auth import ApiKeys
from serve_app.core.calls import (
    ChatTurn,
    ClassifyCall,
    ClassifyResult,
    Completion,
    EmbedCall,
    EmbedResult,
    GenerateCall,
    GenerateResult,
    ModelInfo,
    ResponseFormat,
    SamplingParams,
    StreamDelta,
    StreamEnd,
    TokenLogprob,
)
from serve_app.core.cache import bounded_reply, decode_value, encode_value
from serve_app.core.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ModelUnavailableError,
    OverloadedError,
)
from serve_app.ingress import http_errors
from serve_app.ingress.openai import chat as chat_api, classify as classify_api, completions as completions_api, embeddings as embeddings_api, streaming
from serve_app.ingress.middleware import IngressGuard, IngressState, RequestObserver, ingress_state
from serve_app.ingress.model_client import ModelClient
from serve_app.ingress.request_context import note
from serve_app.ingress.response_cache import ResponseCache
from handle_fakes import Pending, Remote


def _model(task: str = "text-generation", name: str = "m", **extra) -> ModelConfig:
    return ModelConfig.model_validate({"name": name, "source": "package:nothing", "task": task, **extra})


# ---- protocol: bodies -> calls -------------------------------------------------------


def test_chat_body_becomes_one_typed_call_with_the_model_defaults():
    model = _model(generation={"default_max_tokens": 7})
    body = chat_api.ChatCompletionBody(model="m", messages=[{"role": "developer", "content": "be brief"},
                                                            {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                       temperature=0, stop="END", seed=3)
    call = chat_api.chat_call(body, model)
    assert call == GenerateCall(max_tokens=7, sampling=SamplingParams(temperature=0, top_p=1.0, seed=3),
                                messages=(ChatTurn("system", "be brief"), ChatTurn("user", "hi")), stop=("END",),
                                max_tokens_defaulted=True)  # the model's default: fitted to the room the prompt leaves
    assert chat_api.chat_call(body.model_copy(update={"max_completion_tokens": 5, "max_tokens": 9}), model).max_tokens == 5


@pytest.mark.parametrize("update, param", [
    ({"max_tokens": 513}, "max_tokens"),
    ({"n": 9}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"echo": True}, "echo"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["p"] * 257}, "prompt"),
])
def test_completion_limits_are_checked_at_the_router_naming_the_field(update, param):
    body = completions_api.CompletionBody.model_validate({"model": "m", "prompt": "hello", **update})
    with pytest.raises(InvalidRequestError) as caught:
        completions_api.completion_call(body, _model())
    assert caught.value.param == param


def test_what_only_vllm_does_travels_in_the_call_and_changes_its_cache_key():
    model = _model()
    plain = chat_api.chat_call(chat_api.ChatCompletionBody.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}), model)
    asked = chat_api.chat_call(chat_api.ChatCompletionBody.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 3, "logprobs": True, "top_logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
    }), model)
    assert (asked.n, asked.logprobs) == (3, 2)
    assert asked.response_format == ResponseFormat(type="json_schema", schema='{"type":"object"}')
    # Each field changes the answer, so each must change the cache key.
    for field, value in (("n", 3), ("logprobs", 2), ("response_format", asked.response_format),
                         ("tools", '[{"type":"function"}]')):
        varied = dataclasses.replace(plain, **{field: value})
        assert varied.cache_params() != plain.cache_params(), field
    completion = completions_api.completion_call(completions_api.CompletionBody.model_validate(
        {"model": "m", "prompt": ["a", "b"], "n": 2, "logprobs": 0}), model)
    assert (completion.n, completion.logprobs, completion.rows) == (2, 0, 2)
    text_format = chat_api.chat_call(chat_api.ChatCompletionBody.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "text"}}), model)
    assert text_format.response_format is None


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_chat_logprob_and_format_mistakes_name_the_field(body, param):
    with pytest.raises((InvalidRequestError, ValueError)) as caught:
        chat_api.chat_call(chat_api.ChatCompletionBody.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}), _model())
    if isinstance(caught.value, InvalidRequestError):
        assert caught.value.param == param


def test_choices_and_logprobs_in_openai_shapes():
    lp = (TokenLogprob("He", -0.5, (("He", -0.5), ("Hi", -1.0))), TokenLogprob("y", -0.25, (("y", -0.25),)))
    result = GenerateResult(completions=[
        Completion("Hey", "stop", prompt_tokens=4, completion_tokens=2, logprobs=lp),
        Completion("Yo", "length", prompt_tokens=0, completion_tokens=2, logprobs=lp),
    ])
    chat = chat_api.chat_response(result, "m")
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    first = chat["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == "He" and first["bytes"] == list(b"He")
    assert [t["token"] for t in first["top_logprobs"]] == ["He", "Hi"]
    legacy = completions_api.completion_response(result, "m")["choices"][0]["logprobs"]
    assert legacy == {"tokens": ["He", "y"], "token_logprobs": [-0.5, -0.25],
                      "top_logprobs": [{"He": -0.5, "Hi": -1.0}, {"y": -0.25}], "text_offset": [0, 2]}
    assert GenerateResult.from_wire(result.to_wire()) == result


def test_classify_call_decodes_images_and_names_the_bad_one():
    model = _model("image-classification", top_k_limit=3)
    png = base64.b64encode(b"\x89PNG fake").decode()
    call = classify_api.classify_call(classify_api.ClassifyBody(model="m", image=[f"data:image/png;base64,{png}"], top_k=2),
                                  model)
    assert call == ClassifyCall(images=(b"\x89PNG fake",), top_k=2)
    with pytest.raises(InvalidRequestError) as caught:
        classify_api.classify_call(classify_api.ClassifyBody(model="m", image=[png, "%%%"]), model)
    assert caught.value.param == "image[1]"
    with pytest.raises(InvalidRequestError) as caught:
        classify_api.classify_call(classify_api.ClassifyBody(model="m", image=png, top_k=4), model)
    assert caught.value.param == "top_k"
    with pytest.raises(InvalidRequestError):
        classify_api.ClassifyBody(model="m").task  # neither input nor image


def test_embedding_response_base64_is_little_endian_float32():
    result = EmbedResult(embeddings=[[0.5, -1.0]], prompt_tokens=3)
    body = embeddings_api.embeddings_response(result, "e", "base64")
    assert np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4").tolist() == [0.5, -1.0]
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}


def test_stream_chunks_follow_openai_shapes():
    chat = chat_api.ChatChunks("m")
    assert chat.opening()[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chat.text(0, "hi")["choices"][0]["delta"] == {"content": "hi"}
    assert chat.finish(0, "stop")["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    completion = completions_api.CompletionChunks("m")
    assert completion.opening() == []
    assert completion.finish(1, "length")["choices"][0]["text"] == ""
    assert completion.usage(2, 3)["usage"] == {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3}
    assert streaming.sse({"a": 1}) == b'data: {"a":1}\n\n'


# ---- the error boundary and the guard on a bare app ------------------------------------


class _Echo(BaseModel):
    value: int


def _app(state: IngressState) -> TestClient:
    app = FastAPI()
    app.add_middleware(IngressGuard)
    app.add_middleware(RequestObserver)
    http_errors.install(app)
    app.state.ingress = state

    @app.post("/v1/echo")
    async def echo(body: _Echo) -> dict:
        note(model="m")
        if body.value < 0:
            raise InvalidRequestError("value must not be negative", param="value")
        if body.value == 0:
            raise RuntimeError("a bug")
        return {"value": body.value}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return TestClient(app, raise_server_exceptions=False)


def test_every_error_has_the_openai_shape_and_is_observed():
    state = IngressState()
    client = _app(state)
    assert client.post("/v1/echo", json={"value": 2}).json() == {"value": 2}
    bad = client.post("/v1/echo", json={"value": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "value"
    assert client.post("/v1/echo", content=b"{", headers={"content-type": "application/json"}).json()["error"][
        "code"] == "invalid_json"
    assert client.post("/v1/echo", json={"value": -1}).json()["error"]["message"] == "value must not be negative"
    crash = client.post("/v1/echo", json={"value": 0})
    assert crash.status_code == 500 and crash.json()["error"]["code"] == "internal_error"
    assert client.get("/nowhere").json()["error"]["code"] == "not_found"
    assert client.get("/v1/echo").json()["error"]["code"] == "method_not_allowed"
    summary = state.traffic.summary("m")
    assert summary["requests"] == 3 and summary["errors"] == 2  # bodies that fail validation name no model yet


def test_guard_refuses_large_bodies_unread_and_checks_keys_before_validation():
    keys = ApiKeys(user_keys=(b"user-key",), admin_keys=())
    client = _app(IngressState(keys=keys, max_body_bytes=64))
    assert client.post("/v1/echo", content=b"x" * 65).status_code == 413
    missing = client.post("/v1/echo", json={"value": "not even valid"})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert client.get("/healthz").status_code == 200  # public
    ok = client.post("/v1/echo", json={"value": 1}, headers={"Authorization": "Bearer user-key"})
    assert ok.json() == {"value": 1}


def test_ingress_state_defaults_to_open_until_the_router_sets_it():
    app = FastAPI()
    assert ingress_state(app).keys is None and ingress_state(app) is ingress_state(app)


# ---- the model client ---------------------------------------------------------------


class _Stream:
    def __init__(self, events):
        self.events, self.cancelled = list(events), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.events:
            raise StopAsyncIteration
        event = self.events.pop(0)
        if isinstance(event, BaseException):
            raise event
        return event

    def cancel(self):
        self.cancelled = True


class _Backend:
    """Answers from a script: one outcome per call, in order."""

    def __init__(self, *outcomes, delay_s: float = 0.0, info: ModelInfo | None = None):
        self.outcomes, self.delay_s, self.calls, self.pending = list(outcomes), delay_s, [], []
        self.model_info = info

    def infer(self, call):
        self.calls.append(call)
        outcome = self.outcomes.pop(0)
        if self.model_info is not None and dataclasses.is_dataclass(outcome) and outcome.revision is None:
            outcome = dataclasses.replace(outcome, revision=self.model_info.revision)  # as ModelServer.infer
        self.pending.append(Pending(outcome, self.delay_s))
        return self.pending[-1]

    def infer_stream(self, call):
        self.calls.append(call)
        return _Stream(self.outcomes.pop(0))

    def info(self):
        self.calls.append("info")
        return Pending(self.model_info)

    def stats(self):
        return Pending({"rows": 0})


_LOST = ActorUnavailableError("replica died", None)


def _client(backend, **router) -> ModelClient:
    return ModelClient({"m": backend}, RouterConfig.model_validate(router))


def test_client_puts_the_deadline_on_the_call_and_returns_the_typed_result():
    answer = EmbedResult(embeddings=[[1.0]], prompt_tokens=1)
    backend = _Backend(answer)
    before = time.time()
    assert asyncio.run(_client(backend, request_timeout_s=30).infer(_model("embedding"), EmbedCall(("a",)))) == answer
    (sent,) = backend.calls
    assert before + 29 < sent.deadline < time.time() + 31


def test_client_retries_a_lost_replica_then_gives_up():
    answer = EmbedResult(embeddings=[[1.0]], prompt_tokens=1)
    client = _client(_Backend(_LOST, answer), replica_retries=2)
    assert asyncio.run(client.infer(_model("embedding"), EmbedCall(("a",)))) == answer
    assert client.replica_retries["m"] == 1
    with pytest.raises(ActorUnavailableError):
        asyncio.run(_client(_Backend(_LOST, _LOST), replica_retries=1).infer(_model("embedding"), EmbedCall(("a",))))


def test_client_maps_serve_failures_to_client_errors():
    full = _client(_Backend(BackPressureError(num_queued_requests=9, max_queued_requests=8)), retry_after_s=3)
    with pytest.raises(OverloadedError) as caught:
        asyncio.run(full.infer(_model("embedding"), EmbedCall(("a",))))
    assert caught.value.headers() == {"Retry-After": "3"}
    broken = _client(_Backend(DeploymentUnavailableError(None)))
    with pytest.raises(ModelUnavailableError):
        asyncio.run(broken.infer(_model("embedding"), EmbedCall(("a",))))


def test_client_cancels_a_call_past_the_deadline():
    backend = _Backend(EmbedResult(embeddings=[], prompt_tokens=0), delay_s=5)
    with pytest.raises(DeadlineExceededError):
        asyncio.run(_client(backend, request_timeout_s=0.05).infer(_model("embedding"), EmbedCall(("a",))))
    assert backend.pending[0].cancelled


def test_stream_retries_only_before_the_first_event():
    end = StreamEnd(index=0, finish_reason="stop", prompt_tokens=1, completion_tokens=1)
    call = GenerateCall(max_tokens=4, prompts=("p",))

    async def events(client):
        return [event async for event in client.stream(_model(), call)]

    client = _client(_Backend([_LOST], [StreamDelta(0, "a"), end]), replica_retries=1)
    assert asyncio.run(events(client)) == [StreamDelta(0, "a"), end]
    late = _client(_Backend([StreamDelta(0, "a"), _LOST], [end]), replica_retries=1)
    with pytest.raises(ActorUnavailableError):
        asyncio.run(events(late))


# ---- the response cache ---------------------------------------------------------------


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
        backend = _Backend(_answer("first"), info=_INFO)
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
        backend = _Backend(_answer("a"), _answer("b"))
        cache = _cache(backend, _StoreHandle())
        call = GenerateCall(max_tokens=4, prompts=("p",), sampling=SamplingParams(temperature=1.0))
        assert (await cache.answer(cache.models["m"], call))[1] == "miss"
        assert (await cache.answer(cache.models["m"], call))[0] == _answer("b")
        assert cache.outcomes[("m", "bypass")] == 2

    asyncio.run(scenario())


def test_identical_requests_in_flight_share_one_model_call():
    async def scenario():
        backend = _Backend(_answer("once"), delay_s=0.05, info=_INFO)
        cache = _cache(backend, _StoreHandle())
        call = GenerateCall(max_tokens=4, prompts=("p",), sampling=SamplingParams(0))
        answers = await asyncio.gather(*(cache.answer(cache.models["m"], call) for _ in range(3)))
        assert [header for _, header in answers] .count("miss") == 3  # coalesced reads as miss
        assert len(backend.pending) == 1 and cache.flights.coalesced == 2

    asyncio.run(scenario())


def test_a_failing_store_or_a_foreign_entry_is_a_miss_never_an_error():
    async def scenario():
        store = _StoreHandle()
        backend = _Backend(_answer("a"), _answer("b"), info=_INFO)
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
        backend = _Backend(_answer("a"), _answer("b"), info=_INFO)
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
