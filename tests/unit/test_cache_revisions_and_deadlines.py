"""Cache keys on what the model sees,
answers written under the revision that computed them, one deadline per request, corrupt
cached values as misses, and the engine in the revision. No Ray is started."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from types import SimpleNamespace

import pytest

from serve_app.config import AppConfig, ModelConfig, RouterConfig
from serve_app.core import calls
from serve_app.core.cache import bounded_reply, cache_key, encode_value
from serve_app.core.cache import keys as cache_keys
from serve_app.core.calls import (
    ClassifyCall,
    ClassifyResult,
    Completion,
    EmbedCall,
    EmbedResult,
    GenerateCall,
    GenerateResult,
    ModelInfo,
    SamplingParams,
)
from serve_app.core.errors import ContextLengthExceededError, DeadlineExceededError
from serve_app.ingress.model_client import ModelClient
from serve_app.ingress.response_cache import ResponseCache
from serve_app.replica.revision import ANSWERS_VERSION, answer_revision

from replica_fakes import FakeEncoder, run, server
from handle_fakes import FakeBackend, Pending, Remote

GREEDY = {"max_tokens": 8, "temperature": 0, "top_p": 1.0, "stop": [], "seed": None}


# ---- fakes ---------------------------------------------------------------------------


def _stamped(answer, info):
    """``answer`` as a replica of ``info`` returns it: with its revision (ModelServer.infer)."""
    if info is not None and dataclasses.is_dataclass(answer) and getattr(answer, "revision", "") is None:
        return dataclasses.replace(answer, revision=info.revision)
    return answer


class _Backend(FakeBackend):
    """A model deployment: ``answers`` in order for infer, ``infos`` in order for info
    (the last one repeats), each with its own delay; answers get the current info's
    revision, as ModelServer.infer stamps them, unless ``stamp`` is off (older code)."""

    def __init__(self, *answers, infos=(), infer_delay_s=0.0, info_delay_s=0.0, stamp=True):
        self.answers, self.infos, self.stamp = list(answers), list(infos), stamp
        self.infer_delay_s, self.info_delay_s = infer_delay_s, info_delay_s
        self.calls: list = []

    def infer(self, call):
        self.calls.append(call)
        info = self.infos[0] if self.infos and self.stamp else None
        return Pending(_stamped(self.answers.pop(0), info), self.infer_delay_s)

    def info(self):
        self.calls.append("info")
        info = self.infos.pop(0) if len(self.infos) > 1 else self.infos[0]
        return Pending(info, self.info_delay_s)

    def inferred(self):
        return [c for c in self.calls if c != "info"]


class _Store:
    """The CacheServer over a dict; a TTL of 0 deletes, as CacheServer.set does."""

    def __init__(self):
        self.entries: dict[str, bytes] = {}
        for name in ("get_many", "set_many", "semantic_get", "semantic_add", "drop_model", "stats"):
            setattr(self, name, Remote(getattr(self, f"_{name}")))

    async def _get_many(self, keys, max_reply_bytes=None):
        return bounded_reply([self.entries.get(key) for key in keys], max_reply_bytes)

    async def _set_many(self, entries):
        for key, value, ttl_s in entries:
            if ttl_s is not None and ttl_s <= 0:
                self.entries.pop(key, None)
            else:
                self.entries[key] = value
        return [None] * len(entries)

    async def _semantic_get(self, *args):
        return None

    async def _semantic_add(self, *args):
        return None

    async def _drop_model(self, model):
        return {}

    async def _stats(self):
        return {}


def _info(revision: str, loaded_at=None, task="text-generation", max_input_tokens=64) -> ModelInfo:
    return ModelInfo(name="m", task=task, revision=revision, max_input_tokens=max_input_tokens, device="cpu",
                     dtype="float32", quantization="none", loaded_at=loaded_at)


def _answer(text: str, revision=None, finish_reason="stop") -> GenerateResult:
    return GenerateResult([Completion(text=text, finish_reason=finish_reason, prompt_tokens=2, completion_tokens=1)],
                          revision=revision)


def _cache(backends: dict, store, models=None, router=None, **cache) -> ResponseCache:
    models = models or [{"name": "m", "source": "package:x", "task": "text-generation"}]
    config = AppConfig.model_validate({"models": models, "cache": cache, "router": router or {}})
    return ResponseCache(config.cache, store, {m.name: m for m in config.models},
                         ModelClient(backends, config.router))


CALL = GenerateCall(max_tokens=4, prompts=("p",), sampling=SamplingParams(0))


async def _settle():
    for _ in range(3):
        await asyncio.sleep(0)  # background write-backs and drops


# ---- keys on the text the model sees -------------------------------------------


@pytest.mark.parametrize("task", ["embedding", "text-classification", "text-generation"])
@pytest.mark.parametrize("a, b", [
    ("\uff21\uff22\uff23 \uff11\uff12\uff13", "ABC 123"),  # full-width: [UNK] [UNK] to a BERT tokenizer
    ("x\u00b2", "x2"),
    ("\u2460", "1"),
    ("\ufb01le", "file"),
    ("a  b", "a b"),
    ("a\u00a0b", "a b"),
    (" a b ", "a b"),
    ("caf\u0065\u0301", "caf\u00e9"),  # NFD vs NFC: other bytes to a byte-level BPE
    ("a\r\nb", "a\nb"),
])
def test_texts_a_tokenizer_tells_apart_get_different_keys(task, a, b):
    def key(text):
        payload = [{"role": "user", "content": text}] if task == "text-generation" else [text]
        return cache_key(model="m", revision="r", task=task, payload=payload, params={})

    assert key(a) != key(b)
    assert key(a) == key(a)


@pytest.mark.parametrize("a, b", [("\uff21\uff22\uff23 \uff11\uff12\uff13", "ABC 123"), ("x\u00b2", "x2"),
                                  ("\u2460", "1"), ("\ufb01le", "file")])
def test_minilms_tokenizer_tells_the_issues_pairs_apart_and_so_do_the_keys(a, b):
    """The issue's cases: MiniLM's WordPiece gives [UNK] for full-width letters and for
    \u2460, and other pieces for \u00b2 and the \ufb01 ligature, so the embeddings differ and
    the keys must too."""
    import tiny_models

    path = tiny_models.minilm_model_dir()
    if path is None:
        pytest.skip(f"{tiny_models.MINILM_PACKAGE} is not installed")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert tokenizer.tokenize(a) != tokenizer.tokenize(b)
    keys = {cache_key(model="m", revision="r", task="embedding", payload=[t], params={}) for t in (a, b)}
    assert len(keys) == 2


# ---- the revision of the replica that computed the answer -----------------------


def test_an_old_replicas_answer_is_written_under_its_own_revision_and_never_served_as_the_new_one():
    """Rolling update: the router read rev-new, the call landed on a rev-old replica."""
    async def scenario():
        store = _Store()
        backend = _Backend(_answer("old", revision="rev-old"), _answer("new", revision="rev-new"),
                           infos=[_info("rev-new", loaded_at=200.0)])
        cache = _cache({"m": backend}, store)
        model = cache.models["m"]
        assert await cache.answer(model, CALL) == (_answer("old", revision="rev-old"), "miss")
        await _settle()
        (written,) = store.entries
        assert written == cache_key(model="m", revision="rev-old", task="text-generation",
                                    payload=CALL.cache_input(), params=CALL.cache_params())
        # The router knows rev-new: the old answer is neither a hot nor a stored hit.
        result, header = await cache.answer(model, CALL)
        assert (result.completions[0].text, header) == ("new", "miss")
        await _settle()
        other = _cache({"m": backend}, store)  # another router replica, also at rev-new
        result, header = await other.answer(other.models["m"], CALL)
        assert (result.completions[0].text, header) == ("new", "hit")
        assert len(backend.inferred()) == 2

    asyncio.run(scenario())


def test_the_known_revision_never_goes_back_to_a_replica_loaded_earlier():
    async def scenario():
        backend = _Backend(infos=[_info("rev-new", loaded_at=200.0), _info("rev-old", loaded_at=100.0),
                                  _info("rev-rollback", loaded_at=300.0)])
        cache = _cache({"m": backend}, _Store(), revision_refresh_s=0.001)
        model = cache.models["m"]
        assert await cache.revisions.read(model) == "rev-new"
        await asyncio.sleep(0.01)
        assert await cache.revisions.read(model) == "rev-new"  # an old replica answered the re-read
        await asyncio.sleep(0.01)
        assert await cache.revisions.read(model) == "rev-rollback"  # loaded later: taken

    asyncio.run(scenario())


def test_during_the_update_onto_this_code_old_replicas_neither_write_nor_pull_the_revision_back():
    async def scenario():
        store = _Store()
        # An old replica: its info has no loaded_at and its answers no revision.
        old_info = dataclasses.replace(_info("rev-old"), loaded_at=None)
        backend = _Backend(GenerateResult([calls.Completion("old", "stop", 2, 1)]),
                           infos=[_info("rev-new", loaded_at=200.0), old_info], stamp=False)
        cache = _cache({"m": backend}, store, revision_refresh_s=0.001)
        model = cache.models["m"]
        assert await cache.revisions.read(model) == "rev-new"
        result, header = await cache.answer(model, CALL)
        await _settle()
        assert (result.completions[0].text, header) == ("old", "miss")
        assert store.entries == {}, "whose answer it is cannot be told: it is not cached"
        await asyncio.sleep(0.01)
        assert await cache.revisions.read(model) == "rev-new"  # the old replica does not pull it back

    asyncio.run(scenario())


def test_an_answer_of_an_unseen_revision_makes_the_router_reread_soon():
    async def scenario():
        backend = _Backend(_answer("new", revision="rev-new"),
                           infos=[_info("rev-old", loaded_at=100.0), _info("rev-new", loaded_at=200.0)])
        cache = _cache({"m": backend}, _Store(), revision_refresh_s=3600)
        model = cache.models["m"]
        assert await cache.revisions.read(model) == "rev-old"
        cache.revisions.known["m"].read_at -= 5  # read a while ago, far within the refresh period
        await cache.answer(model, CALL)  # read under rev-old, computed by a rev-new replica
        assert await cache.revisions.read(model) == "rev-new"

    asyncio.run(scenario())


def test_a_stored_answer_of_another_revision_is_not_a_hit():
    async def scenario():
        store = _Store()
        backend = _Backend(_answer("fresh", revision="rev-2"), infos=[_info("rev-2")])
        cache = _cache({"m": backend}, store)
        key = cache_key(model="m", revision="rev-2", task="text-generation", payload=CALL.cache_input(),
                        params=CALL.cache_params())
        store.entries[key] = encode_value(_answer("stale", revision="rev-1").to_wire())
        result, header = await cache.answer(cache.models["m"], CALL)
        assert (result.completions[0].text, header) == ("fresh", "miss")

    asyncio.run(scenario())


def test_the_replica_puts_its_revision_on_every_result():
    ms = server(FakeEncoder("embedding"))
    result = run(ms.infer(EmbedCall(texts=("a b",))))
    assert result.revision == run(ms.info()).revision == ms.revision
    assert EmbedResult.from_wire(result.to_wire()) == result
    classify = server(FakeEncoder("text-classification"))
    assert run(classify.infer(ClassifyCall(texts=("a",)))).revision == classify.revision


# ---- the engine (and whatever else changes the answer) is in the revision ----


def _gen_config(**extra) -> ModelConfig:
    return ModelConfig.model_validate({"name": "g", "source": "/x", "task": "text-generation", **extra})


def test_engines_devices_and_vllm_options_get_their_own_revisions():
    runtime = SimpleNamespace(revision="w1-fp32-none", device="cpu")
    config = _gen_config()
    revisions = {answer_revision(config, runtime, kind) for kind in ("static", "continuous", "vllm", None)}
    assert len(revisions) == 4
    assert answer_revision(config, runtime, "static") == answer_revision(config, runtime, "static")
    cuda0, cuda1 = (SimpleNamespace(revision="w1-fp32-none", device=d) for d in ("cuda:0", "cuda:1"))
    assert answer_revision(config, cuda0, "static") != answer_revision(config, runtime, "static")
    assert answer_revision(config, cuda0, "static") == answer_revision(config, cuda1, "static")
    assert answer_revision(config, runtime, "static").startswith("w1-fp32-none-static-")
    assert ANSWERS_VERSION >= 2  # the continuous engine now honours generation_config

    from serve_app.replica.vllm.runtime import VLLMRuntime

    def vllm_runtime():
        fields = {f.name: None for f in dataclasses.fields(VLLMRuntime)}
        return VLLMRuntime(**{**fields, "revision": "w1-fp32-vllm", "device": "cuda", "task": "text-generation"})

    base = answer_revision(_gen_config(engine="vllm"), vllm_runtime(), "vllm")
    fp8 = answer_revision(_gen_config(engine="vllm", vllm={"engine_args": {"kv_cache_dtype": "fp8"}}),
                          vllm_runtime(), "vllm")
    assert base != fp8
    # vLLM's fp8 quantization at load: the same files, other answers.
    assert answer_revision(_gen_config(engine="vllm", quantization="fp8", resources={"num_gpus": 1}),
                           vllm_runtime(), "vllm") != base
    # A pinned revision is the operator's: it is used as given.
    assert answer_revision(_gen_config(cache={"revision": "pinned"}), runtime, "static") == "pinned"


def test_the_replica_reports_the_answer_revision_not_only_the_weights():
    ms = server(FakeEncoder("embedding"))
    assert run(ms.info()).revision == answer_revision(ms.config, ms.runtime, None) != ms.runtime.revision


# ---- one deadline for the whole request ---------------------------------------


def test_the_revision_read_and_the_model_call_share_one_deadline():
    async def scenario():
        backend = _Backend(_answer("late"), infos=[_info("r")], info_delay_s=0.3, infer_delay_s=0.6)
        cache = _cache({"m": backend}, _Store(), router={"request_timeout_s": 0.5})
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await cache.answer(cache.models["m"], CALL)
        # Before: 0.3 s for the revision, then a fresh 0.5 s for the model: a 504 at 0.8 s.
        assert time.monotonic() - started < 0.7
        (sent,) = backend.inferred()
        assert sent.deadline < time.time() + 0.05  # the replica got what was left, not a fresh timeout

    asyncio.run(scenario())


def test_a_spent_deadline_starts_no_call():
    async def scenario():
        backend = _Backend(_answer("never"), infos=[_info("r")])
        client = ModelClient({"m": backend}, RouterConfig())
        with pytest.raises(DeadlineExceededError):
            await client.infer(ModelConfig.model_validate({"name": "m", "source": "/x", "task": "text-generation"}),
                               CALL, deadline=time.monotonic() - 0.01)
        assert backend.calls == []

    asyncio.run(scenario())


SEMANTIC_MODELS = [
    {"name": "m", "source": "package:x", "task": "text-generation",
     "cache": {"semantic": {"embedding_model": "e"}}},
    {"name": "e", "source": "package:x", "task": "embedding"},
]


def _chat(text: str) -> GenerateCall:
    return GenerateCall(max_tokens=4, messages=(calls.ChatTurn("user", text),), sampling=SamplingParams(0))


def test_the_semantic_embedding_and_the_model_call_share_one_deadline():
    async def scenario():
        model = _Backend(_answer("late"), infos=[_info("r")], infer_delay_s=0.6)
        embedder = _Backend(EmbedResult([[1.0, 0.0]], 1), infos=[_info("e", task="embedding")], infer_delay_s=0.3)
        cache = _cache({"m": model, "e": embedder}, _Store(), models=SEMANTIC_MODELS,
                       router={"request_timeout_s": 0.5})
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await cache.answer(cache.models["m"], _chat("what is the capital of France?"))
        assert time.monotonic() - started < 0.7  # before: 0.3 s embedding + a fresh 0.5 s for the model

    asyncio.run(scenario())


def test_a_slow_embedder_costs_the_lookup_not_the_request():
    async def scenario():
        model = _Backend(_answer("answered"), infos=[_info("r")], infer_delay_s=0.2)
        embedder = _Backend(EmbedResult([[1.0, 0.0]], 1), infos=[_info("e", task="embedding")], infer_delay_s=5)
        models = [dict(SEMANTIC_MODELS[0], cache={"semantic": {"embedding_model": "e", "embed_timeout_s": 0.1}}),
                  SEMANTIC_MODELS[1]]
        cache = _cache({"m": model, "e": embedder}, _Store(), models=models, router={"request_timeout_s": 1.0})
        started = time.monotonic()
        result, header = await cache.answer(cache.models["m"], _chat("what is the capital of France?"))
        # Before: the embedding took the whole deadline and the request was a 504.
        assert (result.completions[0].text, header) == ("answered", "miss")
        assert time.monotonic() - started < 0.6

    asyncio.run(scenario())


def test_text_longer_than_the_embedders_context_is_never_sent_to_it(caplog):
    async def scenario():
        model = _Backend(*[_answer(f"a{i}") for i in range(6)], infos=[_info("r")])
        embedder = _Backend(ContextLengthExceededError("too long"), EmbedResult([[1.0, 0.0]], 1),
                            infos=[_info("e", task="embedding", max_input_tokens=12)])
        cache = _cache({"m": model, "e": embedder}, _Store(), models=SEMANTIC_MODELS)
        m = cache.models["m"]
        # More words than the context has tokens: surely too long, never sent.
        for i in range(3):
            await cache.answer(m, _chat(" ".join(["word"] * 20) + f" {i}"))
        assert embedder.inferred() == []
        # Few words but refused as too long: longer texts skip the embedder after that.
        await cache.answer(m, _chat("x" * 400))
        await cache.answer(m, _chat("y" * 500))
        await cache.answer(m, _chat("z" * 600))
        assert len(embedder.inferred()) == 1
        assert cache.semantic_too_long == 6

    with caplog.at_level(logging.INFO, logger="ray.serve"):
        asyncio.run(scenario())
    assert len([r for r in caplog.records if "embed" in r.getMessage()]) <= 1


def test_embedding_failures_warn_at_most_once_per_interval(caplog):
    async def scenario():
        model = _Backend(*[_answer(f"a{i}") for i in range(5)], infos=[_info("r")])
        embedder = _Backend(*[RuntimeError("embedder down")] * 5, infos=[_info("e", task="embedding")])
        cache = _cache({"m": model, "e": embedder}, _Store(), models=SEMANTIC_MODELS)
        for i in range(5):
            await cache.answer(cache.models["m"], _chat(f"question number {i}?"))
        assert len(embedder.inferred()) == 5

    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        asyncio.run(scenario())
    assert len([r for r in caplog.records if "embedding" in r.getMessage()]) == 1


# ---- a corrupt cached value is a miss, and it is dropped -----------------------


EMBED_MODELS = [{"name": "m", "source": "package:x", "task": "embedding"}]
EMBED_CALL = EmbedCall(texts=("a", "b"))
GOOD_EMBEDDING = EmbedResult([[1.0, 2.0], [3.0, 4.0]], 2)


@pytest.mark.parametrize("corrupt", [
    b"\xc1 not msgpack",
    encode_value({"embeddings": "ab", "prompt_tokens": 2}),  # list("ab"): two "vectors" of one letter
    encode_value({"embeddings": [["x", "y"], ["z", "w"]], "prompt_tokens": 2}),
    encode_value({"embeddings": [[1.0, 2.0]], "prompt_tokens": 1}),  # one vector for two inputs
    encode_value({"embeddings": [[1.0, 2.0], [3.0]], "prompt_tokens": 2}),  # ragged
    encode_value({"embeddings": [[1.0, math.nan], [3.0, 4.0]], "prompt_tokens": 2}),
    encode_value({"embeddings": [[True, False], [True, True]], "prompt_tokens": 2}),
    encode_value([1, 2, 3]),
])
def test_a_corrupt_embedding_entry_is_a_miss_and_is_replaced(corrupt):
    async def scenario():
        store = _Store()
        backend = _Backend(GOOD_EMBEDDING, GOOD_EMBEDDING, infos=[_info("r", task="embedding")])
        first = _cache({"m": backend}, store, models=EMBED_MODELS)
        await first.answer(first.models["m"], EMBED_CALL)
        await _settle()
        (key,) = store.entries
        store.entries[key] = corrupt
        cache = _cache({"m": backend}, store, models=EMBED_MODELS)  # empty hot tier
        result, header = await cache.answer(cache.models["m"], EMBED_CALL)
        assert (result.embeddings, header) == (GOOD_EMBEDDING.embeddings, "miss")
        await _settle()
        assert store.entries.get(key) != corrupt  # dropped or overwritten: one miss, not one per request
        assert cache.corrupt_entries == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("corrupt", [
    _answer("x", finish_reason="cancelled").to_wire(),  # never an answer (the read side's guard)
    {"completions": [], "revision": None},  # no choice for a one-choice call
    {"completions": [_answer("a").completions[0].to_wire()] * 2},
])
def test_a_wrong_shaped_generation_entry_is_a_miss(corrupt):
    async def scenario():
        store = _Store()
        backend = _Backend(_answer("good"), _answer("good"), infos=[_info("r")])
        first = _cache({"m": backend}, store)
        await first.answer(first.models["m"], CALL)
        await _settle()
        (key,) = store.entries
        store.entries[key] = encode_value(corrupt)
        cache = _cache({"m": backend}, store)
        result, header = await cache.answer(cache.models["m"], CALL)
        assert (result.completions[0].text, header) == ("good", "miss")

    asyncio.run(scenario())


def test_a_corrupt_classification_entry_is_a_miss():
    async def scenario():
        models = [{"name": "m", "source": "package:x", "task": "text-classification"}]
        good = ClassifyResult([[("pos", 0.9)]], 1)
        store = _Store()
        backend = _Backend(good, good, infos=[_info("r", task="text-classification")])
        call = ClassifyCall(texts=("t",), top_k=1)
        first = _cache({"m": backend}, store, models=models)
        await first.answer(first.models["m"], call)
        await _settle()
        (key,) = store.entries
        store.entries[key] = encode_value({"rankings": [["12"]], "prompt_tokens": 1})  # ("1", 2.0) before
        cache = _cache({"m": backend}, store, models=models)
        assert (await cache.answer(cache.models["m"], call))[1] == "miss"

    asyncio.run(scenario())


def test_the_value_schema_is_part_of_the_key(monkeypatch):
    before = cache_key(model="m", revision="r", task="embedding", payload=["a"], params={})
    monkeypatch.setattr(cache_keys, "VALUE_SCHEMA", cache_keys.VALUE_SCHEMA + 1)
    assert cache_key(model="m", revision="r", task="embedding", payload=["a"], params={}) != before


# What each result type stores, as of VALUE_SCHEMA 3. A change here without a bump of
# VALUE_SCHEMA would let this code read another layout's entries: bump it, then this.
_SCHEMA_3_FIELDS = {
    "EmbedResult": ["embeddings", "prompt_tokens", "revision"],
    "ClassifyResult": ["rankings", "prompt_tokens", "revision"],
    "GenerateResult": ["completions", "revision"],
    "Completion": ["text", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs", "tool_calls"],
    "TokenLogprob": ["token", "logprob", "top"],
    "ToolCall": ["name", "arguments"],
}


def test_the_value_layout_matches_its_schema_version():
    assert cache_keys.VALUE_SCHEMA == 3
    for name, fields in _SCHEMA_3_FIELDS.items():
        assert [f.name for f in dataclasses.fields(getattr(calls, name))] == fields, name
