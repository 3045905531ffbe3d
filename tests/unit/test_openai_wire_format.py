"""The OpenAI wire format without Ray (ingress/openai/): bodies to typed calls with the
model's limits, and responses and stream chunks in OpenAI's shapes."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest

from serve_app.config import ModelConfig
from serve_app.core.calls import (
    ChatTurn,
    ClassifyCall,
    Completion,
    EmbedResult,
    GenerateCall,
    GenerateResult,
    ResponseFormat,
    SamplingParams,
    TokenLogprob,
    ToolsSpec,
)
from serve_app.core.errors import (
    InvalidRequestError,
)
from serve_app.ingress.openai import chat as chat_api, classify as classify_api, completions as completions_api, embeddings as embeddings_api, streaming


def _model(task: str = "text-generation", name: str = "m", **extra) -> ModelConfig:
    return ModelConfig.model_validate({"name": name, "source": "package:nothing", "task": task, **extra})


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
                         ("tools", ToolsSpec('[{"type":"function"}]'))):
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
