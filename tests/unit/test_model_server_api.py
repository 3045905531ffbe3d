"""One declared replica API (serve_app.core.calls.ModelServerAPI): the real ModelServer and
the benchmark stubs implement all of it, so the router never meets a replica without a
method it relies on (the day scenario's stubs once lacked infer_many)."""

from __future__ import annotations

import asyncio

from benchmarks.harness.stubs import ConstantEmbedder, EmulatedAccelerator
from serve_app.core.calls import (
    MODEL_SERVER_METHODS,
    CallOutcomes,
    EmbedCall,
    EmbedResult,
    GenerateCall,
    missing_model_server_methods,
)
from serve_app.core.errors import InvalidRequestError
from serve_app.replica.model_server import ModelServer


def test_the_api_lists_what_the_router_calls():
    assert set(MODEL_SERVER_METHODS) == {"infer", "infer_many", "infer_stream", "info", "get_stats", "check_health"}


def test_model_server_and_stubs_implement_the_whole_api():
    for deployment in (ModelServer, ConstantEmbedder, EmulatedAccelerator):
        assert missing_model_server_methods(deployment.func_or_class) == []


def test_the_check_names_what_a_class_lacks():
    class Partial:
        def infer(self, call):  # sync where the API is async
            return None

    problems = missing_model_server_methods(Partial)
    assert "Partial.infer must be async" in problems and "Partial.infer_many is missing" in problems


def test_stub_infer_many_answers_each_call_alone():
    stub = ConstantEmbedder.func_or_class(4)
    reply = asyncio.run(stub.infer_many([EmbedCall(texts=("a",)), GenerateCall(max_tokens=1, prompts=("x",))]))
    assert isinstance(reply, CallOutcomes) and reply.replica is None  # outside a replica
    assert isinstance(reply.outcomes[0], EmbedResult) and isinstance(reply.outcomes[1], InvalidRequestError)
