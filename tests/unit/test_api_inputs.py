"""What a request may carry and what it costs the replica: explicit nulls, fields that
change the answer (honoured on vLLM, refused by name elsewhere), seeds out of range,
image and text inputs kept off the replica's event loop, the model revision that leads
cache keys, and what the public /healthz says."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import io
import json
import logging
import os
import shutil
import struct
import threading
import zlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from serve_app.config import ModelConfig, model_deployment_name
from serve_app.core.calls import ChatTurn, ClassifyCall, EmbedCall, GenerateCall, SamplingParams
from serve_app.core.errors import InvalidRequestError
from serve_app.core.models import sources
from serve_app.core.models.sources import model_revision
from serve_app.ingress import http_errors
from serve_app.ingress.openai import chat as chat_api, classify as classify_api, completions as completions_api, embeddings as embeddings_api
from serve_app.ingress import status as status_module
from serve_app.ingress.status import ServiceStatus
from serve_app.replica.engines import refuse_what_only_vllm_does

from replica_fakes import FakeEncoder, run, server

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
HI = [{"role": "user", "content": "hi"}]


def _model(task: str = "text-generation", **extra) -> ModelConfig:
    return ModelConfig.model_validate({"name": "m", "source": "package:nothing", "task": task, **extra})


def _chat(**fields) -> GenerateCall:
    return chat_api.chat_call(chat_api.ChatCompletionBody.model_validate({"model": "m", "messages": HI, **fields}),
                              _model())


def _completion(**fields) -> GenerateCall:
    return completions_api.completion_call(completions_api.CompletionBody.model_validate({"model": "m", "prompt": "p", **fields}),
                                    _model())


def _refused(make, **fields) -> str:
    """The param a refused request names (a body-validation error or the call's own)."""
    try:
        make(**fields)
    except InvalidRequestError as exc:
        return exc.param
    except ValidationError as exc:
        return ".".join(str(part) for part in exc.errors()[0]["loc"])
    raise AssertionError(f"{fields} was accepted")


# ---- 12: explicit null is "not given" -------------------------------------------------

_OPTIONAL = ("temperature", "top_p", "n", "stream", "stop", "seed", "max_tokens", "stream_options", "logprobs",
             "frequency_penalty", "presence_penalty", "logit_bias", "user")


def test_explicit_nulls_are_absent_fields():
    nulls = dict.fromkeys(_OPTIONAL, None)
    chat_nulls = {**nulls, **dict.fromkeys(("max_completion_tokens", "top_logprobs", "response_format", "tools",
                                            "tool_choice", "functions", "function_call"), None)}
    assert _chat(**chat_nulls) == _chat()
    assert _completion(**nulls, echo=None, suffix=None, best_of=None) == _completion()
    body = chat_api.ChatCompletionBody.model_validate({"model": "m", "messages": HI, **chat_nulls})
    assert (body.stream, body.include_usage, body.temperature, body.n) == (False, False, 1.0, 1)
    # Nested objects too.
    assert chat_api.ChatCompletionBody.model_validate(
        {"model": "m", "messages": HI, "stream": True, "stream_options": {"include_usage": None}}).include_usage is False
    assert _chat(response_format={"type": "json_schema", "json_schema": {"name": None, "schema": {}, "strict": None}}
                 ).response_format.schema == "{}"
    embed = embeddings_api.EmbeddingBody.model_validate({"model": "m", "input": "x", "encoding_format": None,
                                                   "dimensions": None})
    assert embed.encoding_format == "float"
    classify = classify_api.ClassifyBody.model_validate({"model": "m", "input": "x", "image": None, "top_k": None})
    assert classify.top_k == 1 and classify.task == "text-classification"


def test_an_assistant_turn_without_content_is_valid_but_a_user_turn_needs_it():
    call = _chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                           {"role": "user", "content": "again"}])
    assert call.messages == (ChatTurn("user", "hi"), ChatTurn("assistant", ""), ChatTurn("user", "again"))
    assert _refused(_chat, messages=[{"role": "user", "content": None}]) == "messages.0.content"
    # A required field sent as null is missing, still a 400 naming it.
    assert _refused(_chat, model=None) == "model"


# ---- 13: fields that change the answer --------------------------------------------------


def test_penalties_and_logit_bias_travel_in_the_call_and_change_its_cache_key():
    plain = _chat()
    asked = _chat(frequency_penalty=0.5, presence_penalty=-1.5, logit_bias={"50": 5, "7": -100, "007": -100})
    assert asked.sampling == SamplingParams(frequency_penalty=0.5, presence_penalty=-1.5,
                                            logit_bias=((7, -100.0), (50, 5.0)))
    assert asked.sampling.penalised and not plain.sampling.penalised
    for field, value in (("frequency_penalty", 0.5), ("presence_penalty", 0.5), ("logit_bias", ((1, 1.0),))):
        varied = dataclasses.replace(plain, sampling=dataclasses.replace(plain.sampling, **{field: value}))
        assert varied.cache_params() != plain.cache_params(), field
    # The defaults are the defaults, however sent.
    assert _chat(frequency_penalty=0, presence_penalty=0.0, logit_bias={}) == plain
    assert _completion(frequency_penalty=1).sampling.frequency_penalty == 1.0


@pytest.mark.parametrize("fields, param", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"１": 1}}, "logit_bias"),  # a full-width digit is no token id
    ({"logit_bias": {"5": 101}}, "logit_bias"),
])
def test_penalty_and_logit_bias_ranges_are_openais(fields, param):
    assert _refused(_chat, **fields) == param


@pytest.mark.parametrize("field, value", [
    ("frequency_penalty", 0.5), ("presence_penalty", -0.5), ("logit_bias", ((3, 10.0),)),
])
def test_the_transformers_engines_refuse_penalties_by_name_and_accept_the_defaults(field, value):
    call = GenerateCall(max_tokens=4, prompts=("p",))
    refuse_what_only_vllm_does(call, "static")  # defaults: accepted
    asked = dataclasses.replace(call, sampling=dataclasses.replace(call.sampling, **{field: value}))
    with pytest.raises(InvalidRequestError) as caught:
        refuse_what_only_vllm_does(asked, "continuous")
    assert caught.value.param == field and "vLLM" in caught.value.message


@pytest.mark.parametrize("make, fields, param", [
    (_chat, {"top_k": 5}, "top_k"),
    (_chat, {"repetition_penalty": 1.2}, "repetition_penalty"),
    (_chat, {"repetition_penalty": True}, "repetition_penalty"),
    (_chat, {"min_tokens": 3}, "min_tokens"),
    (_chat, {"guided_json": {"type": "object"}}, "guided_json"),
    (_chat, {"chat_template": "{{ messages }}"}, "chat_template"),
    (_chat, {"echo": True}, "echo"),
    (_chat, {"reasoning_effort": "high"}, "reasoning_effort"),
    (_chat, {"modalities": ["text", "audio"]}, "modalities"),
    (_chat, {"functions": [{"name": "f"}]}, "functions"),
    (_chat, {"function_call": {"name": "f"}}, "function_call"),
    (_chat, {"tool_choice": "required"}, "tool_choice"),
    (_chat, {"messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id"),
    (_chat, {"messages": [*HI, {"role": "assistant", "content": None,
                                "tool_calls": [{"id": "c", "type": "function"}]}]}, "messages.1.tool_calls.0.function"),
    (_completion, {"suffix": "the end"}, "suffix"),
    (_completion, {"best_of": 3}, "best_of"),
    (_completion, {"top_k": 5}, "top_k"),
])
def test_fields_that_would_change_the_answer_are_refused_by_name(make, fields, param):
    assert _refused(make, **fields) == param


def test_fields_that_cannot_change_the_answer_are_accepted():
    plain = _chat()
    assert _chat(user="u", service_tier="auto", store=False, metadata={"a": "b"}, parallel_tool_calls=True,
                 prediction={"type": "content", "content": "x"}, tool_choice="auto", function_call="none",
                 top_k=-1, repetition_penalty=1.0, min_p=0, ignore_eos=False, add_generation_prompt=True,
                 modalities=["text"], echo=False, some_future_field=1) == plain
    assert _completion(best_of=1) == _completion()
    assert _completion(best_of=2, n=2).n == 2


@needs_vllm
def test_vllm_gets_the_penalties_and_logit_bias():
    from test_vllm_engine import FakeAsyncLLM, FakeTokenizer, _server

    ms = _server(FakeAsyncLLM())
    sampling = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=-1.0,
                              logit_bias=((3, 100.0), (9, -5.0)))
    run(ms.infer(GenerateCall(max_tokens=1, prompts=("a",), sampling=sampling)))
    ((_, sent),) = ms.runtime.engine.requests
    assert (sent.frequency_penalty, sent.presence_penalty) == (0.5, -1.0)
    assert sent.logit_bias == {3: 100.0, 9: -5.0}

    class SizedTokenizer(FakeTokenizer):
        def __len__(self):
            return 8

    ms.runtime.tokenizer = SizedTokenizer()
    with pytest.raises(InvalidRequestError) as caught:  # id 9 is outside the vocabulary of 8
        run(ms.infer(GenerateCall(max_tokens=1, prompts=("a",), sampling=sampling)))
    assert caught.value.param == "logit_bias"


# ---- 15: a seed out of range is a 400 ---------------------------------------------------


def test_a_seed_beyond_what_the_generators_take_is_a_400_naming_seed():
    app = FastAPI()
    http_errors.install(app)

    @app.post("/v1/chat/completions")
    async def chat(body: chat_api.ChatCompletionBody) -> dict:
        return {"seed": chat_api.chat_call(body, _model()).sampling.seed}

    client = TestClient(app, raise_server_exceptions=False)
    for seed in (2**64, -(2**63) - 1, 10**30):
        answer = client.post("/v1/chat/completions", json={"model": "m", "messages": HI, "seed": seed})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "seed", seed
    for seed in (2**64 - 1, -(2**63), 0):
        assert client.post("/v1/chat/completions", json={"model": "m", "messages": HI, "seed": seed}).json() == {
            "seed": seed}
        torch.Generator().manual_seed(seed)  # what the engines do with it: accepted there too
    with pytest.raises((RuntimeError, ValueError)):  # what the replica did with the seeds refused above: a 500
        torch.Generator().manual_seed(2**64)


# ---- 10: images and long texts ----------------------------------------------------------


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares width x height in its header (its pixel data is a stub): a
    few bytes that claim a huge image, as the issue's 160 KB 7000x7000 PNGs do."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def _image(fmt: str, size=(48, 32)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, format=fmt)
    return buf.getvalue()


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode()


def test_the_router_caps_the_declared_pixels_of_a_request_before_any_decoding():
    model = _model("image-classification")
    side = 6000  # 36 Mpx each: one fits, two exceed the request's budget
    one = classify_api.classify_call(classify_api.ClassifyBody(model="m", image=_b64(_png_header(side, side))), model)
    assert one.images == (_png_header(side, side),)
    with pytest.raises(InvalidRequestError) as caught:
        classify_api.classify_call(classify_api.ClassifyBody(model="m", image=[_b64(_image("PNG"))] + [
            _b64(_png_header(side, side))] * 2), model)
    assert caught.value.param == "image[2]" and str(classify_api.MAX_REQUEST_IMAGE_PIXELS) in caught.value.message


@pytest.fixture(scope="module")
def vit(tiny_vit_dir):
    from serve_app.core.models import LoadOptions, load_runtime

    torch.set_num_threads(1)
    return load_runtime(LoadOptions(source=str(tiny_vit_dir), task="image-classification"))


@pytest.mark.parametrize("fmt", ["GIF", "BMP", "TIFF"])
def test_only_png_jpeg_and_webp_are_decoded(vit, fmt):
    with pytest.raises(InvalidRequestError) as caught:
        vit.decode(_image(fmt))
    assert caught.value.param == "image"
    for accepted in ("PNG", "JPEG", "WEBP"):
        assert vit.decode(_image(accepted)).shape == (3, 32, 32)


def test_a_large_jpeg_is_decoded_at_reduced_size(vit, monkeypatch):
    from PIL import JpegImagePlugin

    drafts = []
    draft = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        result = draft(self, mode, size)
        drafts.append((size, self.size))
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    pixels = vit.decode(_image("JPEG", size=(800, 600)))
    assert pixels.shape == (3, 32, 32)
    # The processor wants 32x32: the decoder ran at 1/8 scale (100x75), still >= 32 a side.
    assert drafts == [((32, 32), (100, 75))]


class _ThreadRecorder(FakeEncoder):
    def __init__(self, task: str):
        super().__init__(task)
        self.threads: list[threading.Thread] = []

    def tokenize(self, text):
        self.threads.append(threading.current_thread())
        return super().tokenize(text)

    def decode(self, image):
        self.threads.append(threading.current_thread())
        return super().decode(image)


@pytest.mark.parametrize("task, call", [
    ("image-classification", ClassifyCall(images=(b"a", b"b"))),
    ("text-classification", ClassifyCall(texts=("a b", "c"))),
    ("embedding", EmbedCall(texts=("a b", "c"))),
])
def test_decoding_and_tokenizing_run_off_the_replicas_event_loop(task, call):
    runtime = _ThreadRecorder(task)
    ms = server(runtime)

    async def infer():
        return threading.current_thread(), await ms.infer(call)

    loop_thread, _ = run(infer())
    assert len(runtime.threads) == 2 and loop_thread not in runtime.threads
    # Their errors still name the input.
    with pytest.raises(InvalidRequestError) as caught:
        bad = ClassifyCall(images=(b"a", b"")) if task == "image-classification" else dataclasses.replace(
            call, texts=("a", " "))
        run(ms.infer(bad))
    assert caught.value.param in ("image[1]", "input[1]")


# ---- 6: the revision covers every byte of the model folder ---------------------------------


@pytest.fixture()
def model_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SERVE_APP_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model"
    (path / "1_Pooling").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (path / "model.safetensors").write_bytes(os.urandom(5 << 20))  # 5 MiB: a middle beyond first/last MiB
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return path


def _rewrite_keeping_times(f: Path, data: bytes) -> None:
    """An in-place change that keeps size and mtime (what a careless copy tool does)."""
    st = f.stat()
    f.write_bytes(data)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_revision_changes_with_a_tensor_in_the_middle_of_a_weight_file(model_dir):
    before = model_revision(model_dir)
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    _rewrite_keeping_times(weights, bytes(data))
    assert model_revision(model_dir) != before


def test_revision_changes_with_a_file_in_a_subfolder(model_dir):
    before = model_revision(model_dir)
    pooling = model_dir / "1_Pooling" / "config.json"
    _rewrite_keeping_times(pooling, pooling.read_bytes().replace(b"mean", b"cls_"))  # same size
    assert model_revision(model_dir) != before
    new_file = model_dir / "2_Normalize" / "config.json"
    new_file.parent.mkdir()
    new_file.write_text("{}")
    assert model_revision(model_dir) != before


def test_revision_is_of_content_and_names_not_of_location_or_hidden_files(model_dir, tmp_path):
    before = model_revision(model_dir)
    copy = tmp_path / "elsewhere"
    shutil.copytree(model_dir, copy)
    assert model_revision(copy) == before
    (copy / ".cache" / "huggingface").mkdir(parents=True)  # a hub download's metadata
    (copy / ".cache" / "huggingface" / "model.safetensors.metadata").write_text("etag")
    assert model_revision(copy) == before
    (copy / "model.safetensors").rename(copy / "other.safetensors")  # same bytes, another name
    assert model_revision(copy) != before


def test_a_restart_hashes_only_files_that_changed(model_dir, monkeypatch):
    hashed = []
    digest = sources._file_digest
    monkeypatch.setattr(sources, "_file_digest", lambda f: hashed.append(f.name) or digest(f))
    # Files written just now are "racy" (git's word) and always re-hashed; pretend they are old.
    monkeypatch.setattr(sources, "_RACY_NS", -10**15)
    first = model_revision(model_dir)
    assert sorted(hashed) == ["config.json", "config.json", "model.safetensors"]
    hashed.clear()
    assert model_revision(model_dir) == first and hashed == []
    (model_dir / "config.json").write_text(json.dumps({"model_type": "bert", "x": 1}))
    assert model_revision(model_dir) != first and hashed == ["config.json"]


# ---- 20: the public /healthz says no more than a status ---------------------------------


def _fake_serve(monkeypatch, message: str):
    deployment = SimpleNamespace(status="DEPLOY_FAILED", replica_states={}, message=message)
    healthy = SimpleNamespace(status="HEALTHY", replica_states={"RUNNING": 1}, message="")
    applications = {"app": SimpleNamespace(deployments={model_deployment_name("broken"): deployment,
                                                        model_deployment_name("fine"): healthy})}
    monkeypatch.setattr(status_module, "serve", SimpleNamespace(
        get_replica_context=lambda: SimpleNamespace(app_name="app"),
        status=lambda: SimpleNamespace(applications=applications)))


def test_healthz_lists_failed_models_without_serves_messages(monkeypatch, caplog):
    message = ('The deployment failed to start: Traceback (most recent call last):\n  File '
               '"/home/ops/secret-models/broken/modeling.py", line 3\nValueError: bad weights')
    _fake_serve(monkeypatch, message)
    models = {name: _model(name=name) for name in ("broken", "fine")}
    service = ServiceStatus(models, client=None, cache=None)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        code, health = run(service.health())
    assert code == 200 and health == {"status": "degraded", "models": ["broken", "fine"],
                      "unavailable": {"broken": {"status": "DEPLOY_FAILED", "running": 0}}}
    assert "/home/ops" not in json.dumps(health)
    # The details go to the log (once per change), and to the admin-only /v1/stats.
    assert [r.getMessage() for r in caplog.records if "secret-models" in r.getMessage()] != []
    caplog.clear()
    service._states = (service._states[0], float("-inf"))  # read the controller again
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        run(service.health())
    assert not [r for r in caplog.records if "secret-models" in r.getMessage()]
    assert run(service.deployment_states())["broken"]["message"] == message


def test_healthz_is_503_while_a_model_has_no_ready_replica(monkeypatch):
    """Serve counts a replica RUNNING only after its warm-up (the first health check), so
    a model without a RUNNING replica is still loading or compiling."""
    starting = SimpleNamespace(status="UPDATING", replica_states={"STARTING": 1}, message="")
    ready = SimpleNamespace(status="HEALTHY", replica_states={"RUNNING": 1}, message="")
    deployments = {model_deployment_name("chat"): starting, model_deployment_name("embed"): ready}
    monkeypatch.setattr(status_module, "serve", SimpleNamespace(
        get_replica_context=lambda: SimpleNamespace(app_name="app"),
        status=lambda: SimpleNamespace(applications={"app": SimpleNamespace(deployments=deployments)})))
    models = {name: _model(name=name) for name in ("chat", "embed", "later")}
    service = ServiceStatus(models, client=None, cache=None)
    assert run(service.health()) == (503, {"status": "starting", "models": ["chat", "embed", "later"],
                                           "starting": ["chat", "later"]})  # "later": no deployment yet
    deployments[model_deployment_name("chat")] = ready
    deployments[model_deployment_name("later")] = ready
    service._states = (service._states[0], float("-inf"))  # read the controller again
    assert run(service.health()) == (200, {"status": "ok", "models": ["chat", "embed", "later"]})


def test_probes_of_a_slow_controller_share_one_read_instead_of_a_thread_each(monkeypatch):
    """serve.status blocks its thread until the controller answers; each probe that timed
    out used to leave one behind. Now every probe waits on the one read in progress."""
    import threading

    answered = threading.Event()
    reads = []
    ready = SimpleNamespace(status="HEALTHY", replica_states={"RUNNING": 1}, message="")

    def slow_status():
        reads.append(1)
        answered.wait(10)
        return SimpleNamespace(applications={"app": SimpleNamespace(deployments={model_deployment_name("m"): ready})})

    monkeypatch.setattr(status_module, "serve", SimpleNamespace(
        get_replica_context=lambda: SimpleNamespace(app_name="app"), status=slow_status))
    monkeypatch.setattr(status_module, "_READ_TIMEOUT_S", 0.05)
    service = ServiceStatus({"m": _model(name="m")}, client=None, cache=None)

    async def probes():
        for _ in range(5):  # each gives up on the slow controller and answers from what it knew
            await service.health()
        answered.set()
        await asyncio.sleep(0.1)
        return await service.health()

    assert run(probes()) == (200, {"status": "ok", "models": ["m"]})
    assert len(reads) == 1


def test_the_draft_keeps_the_side_a_crop_pct_processor_resizes_to_first():
    from types import SimpleNamespace

    from serve_app.core.models.encoders import _draft_side

    # ConvNeXt-style: resize the short side to 224 / 0.875 = 256, then crop 224.
    convnext = SimpleNamespace(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}, crop_pct=0.875)
    assert _draft_side(convnext) >= 256
    assert _draft_side(SimpleNamespace(size={"height": 224, "width": 224}, crop_size=None)) == 224


# ---- token-id inputs (OpenAI's list-of-ints form) ---------------------------------------


def _embed(value) -> EmbedCall:
    return embeddings_api.embed_call(embeddings_api.EmbeddingBody.model_validate({"model": "m", "input": value}),
                               _model("embedding"))


def test_token_id_inputs_become_one_input_per_list():
    assert _embed([1996, 4937]).texts == ((1996, 4937),)
    assert _embed([[1996, 4937], [3899]]).texts == ((1996, 4937), (3899,))
    assert _completion(prompt=[[5, 6], [7]]).prompts == ((5, 6), (7,))
    assert _completion(prompt=[5, 6]).prompts == ((5, 6),)
    assert _embed(["a", "b"]).texts == ("a", "b")  # texts stay texts


def test_empty_or_mixed_token_id_inputs_are_refused():
    assert _refused(_embed, value=[[1, 2], []]) == "input"
    assert _refused(_embed, value=[]) == "input"
    with pytest.raises(ValidationError):
        _embed([1, "two"])


def test_token_ids_and_text_that_spells_them_have_different_cache_keys():
    from serve_app.core.cache import cache_key

    def key(call):
        return cache_key(model="m", revision="r", task="embedding", payload=call.cache_input(), params={})

    assert key(_embed([1, 2])) == key(_embed([[1, 2]]))
    assert key(_embed([1, 2])) != key(_embed("[1, 2]"))
    assert key(_embed([1, 2])) != key(_embed([2, 1]))


def test_token_ids_are_checked_against_the_vocabulary_and_used_as_given(llm, tiny_bert_embedding_dir):
    from serve_app.core.models import LoadOptions, load_runtime

    vocabulary = len(llm.tokenizer)
    assert llm.encode_prompt((1, 2, 3)) == [1, 2, 3]  # no BOS added: the ids as the client sent them
    with pytest.raises(InvalidRequestError) as caught:
        llm.encode_prompt((1, vocabulary))
    assert caught.value.param == "prompt" and str(vocabulary) in caught.value.message
    with pytest.raises(InvalidRequestError):
        llm.encode_prompt((-1,))
    embedder = load_runtime(LoadOptions(source=str(tiny_bert_embedding_dir), task="embedding"))
    assert embedder.tokenize((5, 6)) == [5, 6]
    with pytest.raises(InvalidRequestError) as caught:
        embedder.tokenize((len(embedder.tokenizer) + 3,))
    assert caught.value.param == "input"
    with pytest.raises(InvalidRequestError):  # longer than the context, as text would be
        embedder.tokenize(tuple([5] * (embedder.max_input_tokens + 1)))


def test_streamed_completion_logprob_offsets_continue_across_chunks():
    from serve_app.core.calls import TokenLogprob

    chunks = completions_api.CompletionChunks("m")

    def offsets(index, *tokens):
        logprobs = tuple(TokenLogprob(token=t, logprob=-0.1, top=()) for t in tokens)
        return chunks.text(index, "".join(tokens), logprobs)["choices"][0]["logprobs"]["text_offset"]

    assert offsets(0, "Once", " upon") == [0, 4]
    assert offsets(1, "A") == [0]  # each choice has its own text
    assert offsets(0, " a", " time") == [9, 11]


def test_an_omitted_max_tokens_is_marked_defaulted_and_a_given_one_is_not():
    assert _completion().max_tokens_defaulted and _chat().max_tokens_defaulted
    assert not _completion(max_tokens=8).max_tokens_defaulted
    assert not _chat(max_completion_tokens=8).max_tokens_defaulted
