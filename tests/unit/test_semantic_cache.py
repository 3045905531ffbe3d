"""The semantic cache answers only the same question: exact context, guarded last turn,
endpoint and embedder in the namespace, scoped per API key, bounded memory (and an index
that loses no entry to a KeyError in SemanticIndex.add)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import tiny_models
from serve_app.cache_server import CacheServer
from serve_app.config import AppConfig
from serve_app.ingress.auth import ApiKeys
from serve_app.core.cache.semantic import (
    MAX_QUESTION_CHARS,
    SemanticIndex,
    question_difference,
    same_question,
    semantic_request,
)
from serve_app.core.calls import (
    ChatTurn,
    Completion,
    EmbedResult,
    GenerateCall,
    GenerateResult,
    ModelInfo,
    SamplingParams,
)
from serve_app.ingress import request_context
from serve_app.ingress.middleware import IngressGuard, IngressState
from serve_app.ingress.model_client import ModelClient
from serve_app.ingress.response_cache import ResponseCache
from handle_fakes import FakeBackend, Remote

PAIRS = json.loads((Path(__file__).resolve().parent.parent / "data" / "semantic_pairs.json").read_text())
BLEACH, UNSAFE = "Is it safe to mix bleach and ammonia?", "Is it unsafe to mix bleach and ammonia?"


# ---- the guard ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind,a,b", PAIRS["near_miss"], ids=lambda v: v[:40] if isinstance(v, str) else v)
def test_the_guard_refuses_every_written_near_miss(kind, a, b):
    assert question_difference(a, b) is not None and question_difference(b, a) is not None


def test_the_guard_names_why():
    assert question_difference(BLEACH, UNSAFE) == "negation"
    assert question_difference("Do vaccines cause autism?", "Don't vaccines cause autism?") == "negation"
    assert question_difference("What is 17 times 23?", "What is 17 times 24?") == "number"
    assert question_difference("Give me two examples", "Give me 3 examples") == "number"
    assert question_difference("What is the capital of France?", "What is the capital of Germany?") == "content"
    assert question_difference("Is a dog bigger than a cat?", "Is a cat bigger than a dog?") == "order"
    assert question_difference("Should I buy milk chocolate?", "Should I buy chocolate milk?") == "order"


@pytest.mark.parametrize("a,b", [
    ("What's the capital of France?", "what is the capital of france"),
    ("Tell me the capital of France.", "What is the capital of France?"),
    ("Give me two examples of mammals.", "Give me 2 examples of mammals."),
    ("How do I reverse a list in Python?", "In Python, how can I reverse a list?"),
    ("How many moons does Jupiter have?", "How many moons does Jupiter have  ?"),
    ("Why is the sky blue?", "Why's the sky blue"),
])
def test_the_guard_lets_plain_rephrasings_through(a, b):
    assert same_question(a, b)


def test_semantic_request_splits_context_from_the_question():
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "X?"}]
    asked = semantic_request(prompts=None, messages=chat)
    assert (asked.endpoint, asked.context, asked.question) == ("chat", chat[:-1], "X?")
    # A raw prompt is text to continue: "return x *" and "return x **" continue differently.
    assert semantic_request(prompts=["def f(x):\n    return x *"], messages=None) is None
    assert semantic_request(prompts=None, messages=chat[:-1]) is None  # ends with an assistant turn
    long = [{"role": "user", "content": "x" * (MAX_QUESTION_CHARS + 1)}]
    assert semantic_request(prompts=None, messages=long) is None
    assert semantic_request(prompts=None, messages=[{"role": "user", "content": "  "}]) is None


# ---- the router against a real CacheServer -------------------------------------------------


class _Pending:
    def __init__(self, value):
        self.value = value

    def __await__(self):
        async def get():
            return self.value
        return get().__await__()

    def cancel(self):
        pass


class _LLM(FakeBackend):
    """A generation backend whose every answer is new ("answer 1", "answer 2", ...)."""

    def __init__(self):
        self.calls = 0

    def infer(self, call):
        self.calls += 1
        done = Completion(text=f"answer {self.calls}", finish_reason="stop", prompt_tokens=2, completion_tokens=1)
        return _Pending(GenerateResult([done], revision="rev1"))

    def info(self):
        return _Pending(ModelInfo(name="m", task="text-generation", revision="rev1", max_input_tokens=512,
                                  device="cpu", dtype="float32", quantization="none"))


class _Embedder(FakeBackend):
    """An embedding backend: ``embed`` maps a text to its vector; by default every text
    gets the same one, the worst embedder there is (everything is "similar")."""

    def __init__(self, embed=lambda text: [1.0, 0.0, 0.0], revision="e1"):
        self.embed, self.revision, self.texts = embed, revision, []

    def infer(self, call):
        self.texts += list(call.texts)
        return _Pending(EmbedResult(embeddings=[self.embed(t) for t in call.texts], prompt_tokens=1,
                                    revision=self.revision))

    def info(self):
        return _Pending(ModelInfo(name="e", task="embedding", revision=self.revision, max_input_tokens=256,
                                  device="cpu", dtype="float32", quantization="none"))


class _ServerHandle:
    """A CacheServer handle over the real CacheServer class (its index and memory store)."""

    def __init__(self, server):
        for name in ("get_many", "set_many", "semantic_get", "semantic_add", "drop_model", "stats"):
            setattr(self, name, Remote(getattr(server, name)))


async def _cache_server(**cache):
    cls = CacheServer.func_or_class
    server = cls.__new__(cls)
    await server.__init__(cache)
    server._gauge_task.cancel()
    return server


async def _router_cache(embedder, **cache):
    config = AppConfig.model_validate({
        "models": [
            {"name": "m", "source": "package:x", "task": "text-generation",
             "cache": {"semantic": {"embedding_model": "e", "threshold": 0.95}}},
            {"name": "e", "source": "package:x", "task": "embedding"},
        ],
        "cache": cache,
    })
    llm = _LLM()
    server = await _cache_server(**config.cache.model_dump())
    models = {m.name: m for m in config.models}
    cache = ResponseCache(config.cache, _ServerHandle(server), models,
                          ModelClient({"m": llm, "e": embedder}, config.router))
    return cache, llm, server


def _chat(*turns: tuple[str, str]) -> GenerateCall:
    return GenerateCall(max_tokens=8, sampling=SamplingParams(0), messages=tuple(ChatTurn(r, c) for r, c in turns))


async def _ask(cache, call) -> tuple[str, str]:
    result, outcome = await cache.answer(cache.models["m"], call)
    await asyncio.gather(*list(cache._background))  # the write-back, with its semantic_add
    return result.completions[0].text, outcome


def test_unsafe_is_not_answered_with_safe_even_when_the_embedder_says_they_are_one():
    """The issue's case: before, "unsafe" was an x-cache: semantic hit with "safe"'s answer."""
    async def scenario():
        cache, llm, server = await _router_cache(_Embedder())
        assert await _ask(cache, _chat(("user", BLEACH))) == ("answer 1", "miss")
        assert await _ask(cache, _chat(("user", UNSAFE))) == ("answer 2", "miss")
        # A mere rephrasing is still a hit: the guard is not a second exact cache.
        assert await _ask(cache, _chat(("user", "is it safe to mix bleach and ammonia"))) == ("answer 1", "semantic")
        assert server.semantic.refused >= 1

    asyncio.run(scenario())


@pytest.mark.slow
@pytest.mark.skipif(tiny_models.minilm_model_dir() is None, reason=f"{tiny_models.MINILM_PACKAGE} is not installed")
def test_unsafe_is_not_a_hit_with_the_real_minilm():
    from serve_app.core.models import LoadOptions, load_runtime

    runtime = load_runtime(LoadOptions(source=f"package:{tiny_models.MINILM_PACKAGE}", task="embedding"))

    def embed(text):
        return runtime.embed([runtime.tokenize(text)])[0]

    vectors = np.asarray([embed(BLEACH), embed(UNSAFE)])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    assert float(vectors[0] @ vectors[1]) >= 0.95  # the embedding alone would serve it

    async def scenario():
        cache, llm, _ = await _router_cache(_Embedder(embed))
        assert await _ask(cache, _chat(("user", BLEACH))) == ("answer 1", "miss")
        assert await _ask(cache, _chat(("user", UNSAFE))) == ("answer 2", "miss")
        assert await _ask(cache, _chat(("user", "Is it safe to mix bleach and ammonia"))) == ("answer 1", "semantic")

    asyncio.run(scenario())


def test_everything_but_the_last_user_turn_is_matched_exactly():
    async def scenario():
        embedder = _Embedder()
        cache, llm, _ = await _router_cache(embedder)
        history = [("system", "You are a chemist."), ("user", "I clean my bathroom a lot. " * 20),
                   ("assistant", "Good to know.")]
        assert (await _ask(cache, _chat(*history, ("user", "Which cleaners can I mix?"))))[1] == "miss"
        # Only the last turn is embedded, never the shared history.
        assert embedder.texts == ["Which cleaners can I mix?"]
        # Another system prompt, another earlier turn: other namespaces, whatever the embedding.
        other_system = [("system", "You are a pirate."), *history[1:]]
        assert (await _ask(cache, _chat(*other_system, ("user", "Which cleaners can I mix?"))))[1] == "miss"
        other_turn = [*history[:2], ("assistant", "Noted.")]
        assert (await _ask(cache, _chat(*other_turn, ("user", "Which cleaners can I mix?"))))[1] == "miss"
        # The same long history with another last instruction is another question.
        assert (await _ask(cache, _chat(*history, ("user", "Which cleaners must I never mix?"))))[1] == "miss"
        # The same history, the question rephrased: reused.
        assert (await _ask(cache, _chat(*history, ("user", "which cleaners can I mix"))))[1] == "semantic"
        assert llm.calls == 4

    asyncio.run(scenario())


def test_completions_and_chat_never_share_semantic_entries():
    async def scenario():
        cache, llm, _ = await _router_cache(_Embedder())
        assert (await _ask(cache, _chat(("user", "What is the capital of France?"))))[1] == "miss"
        completion = GenerateCall(max_tokens=8, sampling=SamplingParams(0),
                                  prompts=("user: What is the capital of France?",))
        assert (await _ask(cache, completion))[1] == "miss"
        plain = GenerateCall(max_tokens=8, sampling=SamplingParams(0), prompts=("What is the capital of France",))
        assert (await _ask(cache, plain))[1] == "miss"  # completions are answered exactly or not at all
        # Within one endpoint a rephrasing hits: the endpoint is the only difference above.
        assert (await _ask(cache, _chat(("user", "what is the capital of france"))))[1] == "semantic"

    asyncio.run(scenario())


def test_another_embedder_revision_is_another_namespace():
    async def scenario():
        embedder = _Embedder(revision="e1")
        cache, llm, _ = await _router_cache(embedder)
        assert (await _ask(cache, _chat(("user", "What is the capital of France?"))))[1] == "miss"
        embedder.revision = "e2"  # a re-trained embedder: its vectors are not comparable to e1's
        assert (await _ask(cache, _chat(("user", "what is the capital of France"))))[1] == "miss"
        assert (await _ask(cache, _chat(("user", "What's the capital of France?"))))[1] == "semantic"

    asyncio.run(scenario())


def _as(identity, call):
    async def run(cache):
        context, token = request_context.begin(60.0)
        context.caller = identity
        try:
            return await _ask(cache, call)
        finally:
            request_context.end(token)
    return run


def test_semantic_entries_are_scoped_to_the_api_key_by_default():
    async def scenario():
        cache, llm, _ = await _router_cache(_Embedder())
        mine = _chat(("user", "What is the balance of my account 12345?"))
        similar = _chat(("user", "what is the balance of my account 12345"))
        assert await _as("key-a", mine)(cache) == ("answer 1", "miss")
        assert await _as("key-b", similar)(cache) == ("answer 2", "miss")  # B never gets A's answer
        again = _chat(("user", "What's the balance of my account 12345?"))
        assert await _as("key-a", again)(cache) == ("answer 1", "semantic")
        # The exact cache is shared: an identical request has the identical answer.
        assert await _as("key-b", mine)(cache) == ("answer 1", "hit")

    asyncio.run(scenario())


def test_scope_shared_lets_every_caller_reuse_semantic_entries():
    async def scenario():
        cache, llm, _ = await _router_cache(_Embedder(), scope="shared")
        assert await _as("key-a", _chat(("user", "What is the capital of France?")))(cache) == ("answer 1", "miss")
        assert await _as("key-b", _chat(("user", "what is the capital of france")))(cache) == ("answer 1", "semantic")

    asyncio.run(scenario())


def test_the_ingress_guard_hands_on_a_hash_of_the_key_never_the_key():
    key_a, key_b = "a" * 24, "b" * 24
    seen = []

    async def app(scope, receive, send):
        seen.append(request_context.current().caller)

    async def call(keys, key):
        state = IngressState(keys=keys)
        scope = {"type": "http", "path": "/v1/chat/completions",
                 "headers": [(b"authorization", f"Bearer {key}".encode())],
                 "app": SimpleNamespace(state=SimpleNamespace(ingress=state))}
        _, token = request_context.begin(60.0)  # as the observer, outside the guard, opens it
        try:
            await IngressGuard(app)(scope, None, None)
        finally:
            request_context.end(token)

    keys = ApiKeys((key_a.encode(), key_b.encode()), ())
    for keys_, key in ((keys, key_a), (keys, key_a), (keys, key_b), (None, key_a)):
        asyncio.run(call(keys_, key))
    assert seen[0] == seen[1] and seen[0] != seen[2] and seen[3] is None
    assert key_a not in seen[0] and seen[0] != hashlib.sha256(key_a.encode()).hexdigest()[:32]
    assert request_context.current() is None  # reset after the request


# ---- the index: bounded memory, holes ------------------------------------------------------


def test_the_whole_index_is_bounded_across_namespaces():
    """Before, every namespace allocated ~100 KB and nothing bounded their number."""
    budget = 2**20
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((16, 384)).astype(np.float32)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = SemanticIndex(max_bytes=budget)
        index.add("m:r:keep", vectors[0], "keep", "q")
        for i in range(3000):  # one namespace per conversation context or caller: many small ones
            index.add(f"m:r:{i}", vectors[i % 16], f"m:r:key{i}", "What is the balance of my account?")
            if i % 100 == 0:
                assert index.lookup("m:r:keep", vectors[0], "q") is not None  # used: stays
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.nbytes <= budget and traced <= budget
    assert index.evictions > 0 and index.namespaces < 3000
    assert index.lookup("m:r:2999", vectors[2999 % 16], "What is the balance of my account?") is not None
    assert index.lookup("m:r:0", vectors[0], "What is the balance of my account?") is None  # least recently used
    assert index.lookup("m:r:keep", vectors[0], "q") is not None


def test_one_namespace_takes_at_most_half_the_budget():
    index = SemanticIndex(max_bytes=2**20, max_entries_per_namespace=10_000)
    eye = np.eye(384, dtype=np.float32)
    index.add("m:r:other", eye[0], "other", "q")
    for i in range(2000):
        index.add("m:r:busy", eye[i % 384] + eye[(i * 7) % 384], f"k{i}", "q")
    assert index.nbytes <= 2**20
    assert index.lookup("m:r:other", eye[0], "q") == ("other", 1.0)
    assert 0 < len(index) < 2000


def test_the_cache_server_bounds_its_index_from_config():
    async def scenario():
        server = await _cache_server(semantic_max_bytes=2**20)
        for i in range(2000):
            await server.semantic_add(f"m:r:{i}", np.ones(384).tolist(), f"m:r:k{i}", "q")
        stats = await server.stats()
        assert stats["semantic_bytes"] <= 2**20 and stats["semantic_evictions"] > 0
        assert stats["semantic_namespaces"] < 2000

    asyncio.run(scenario())


def test_add_wraps_onto_a_discarded_row():
    """Before: KeyError(None), the ring's oldest row had been freed by discard."""
    index = SemanticIndex(max_entries_per_namespace=2, threshold=0.999)
    eye = np.eye(4, dtype=np.float32)
    index.add("ns", eye[0], "a", "q")
    index.add("ns", eye[1], "b", "q")
    assert index.discard("ns", "a")
    index.add("ns", eye[2], "c", "q")  # the ring's next row is a's, freed
    assert [index.lookup("ns", eye[i], "q") for i in range(3)] == [None, ("b", 1.0), ("c", 1.0)]
    index.add("ns", eye[3], "d", "q")  # b is the oldest now
    assert index.lookup("ns", eye[1], "q") is None and index.lookup("ns", eye[2], "q") == ("c", 1.0)
    assert len(index) == 2


def test_a_hyphen_joins_words_but_is_a_minus_elsewhere():
    assert question_difference("What are the side-effects of aspirin?", "What are the side effects of aspirin?") is None
    for a, b in [("What is x-y?", "What is x y?"), ("Is 1e-3 big?", "Is 1e3 big?"), ("Is -5 big?", "Is 5 big?")]:
        assert question_difference(a, b) == "symbol", (a, b)
