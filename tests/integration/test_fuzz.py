"""Fuzz the HTTP API with schemathesis, from the live service's own /openapi.json.

Each POST route and parameterless GET of the spec gets schemathesis's coverage cases
(every declared field at its edges and just past them, a missing body, other HTTP
methods) and a bounded number of random cases, valid and invalid, in which ``model``
often names a deployed model and half the bodies are made plausible (small inputs, a
few tokens) so that they reach the models. No response may be a 5xx or any status
outside ALLOWED, every error body must have OpenAI's shape, no request may hang, and the
service must be healthy afterwards.

The schema is loaded in a fixture and its operations are driven here (``as_strategy``
under Hypothesis, ``iter_coverage_cases``, ``case.call``, ``case.validate_response``):
``schemathesis.pytest.from_fixture`` (4.32) renames the test node through
``Node._nodeid``, which pytest 9.2 no longer has.
"""

from __future__ import annotations

import base64
import io
import json
import string
from collections import Counter, defaultdict

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.errors import FailureGroup

pytestmark = pytest.mark.integration

MODELS = ["tiny-embed", "tiny-llama", "tiny-classifier", "tiny-vit"]
ALLOWED = {200, 400, 401, 403, 404, 405, 413}
# The spec's operations fuzzed here: every POST and every GET without parameters.
OPERATIONS = ["GET /healthz", "GET /v1/models", "GET /v1/stats", "POST /v1/embeddings", "POST /v1/completions",
              "POST /v1/chat/completions", "POST /v1/classify"]
# Seconds a request may take, streams included (schemathesis stops reading one then);
# the router's own deadline is 60 s.
REQUEST_TIMEOUT_S = 60
MAX_EXAMPLES = 40  # random cases per operation, beside its coverage cases
SEED = 20260101

CONFIG = SchemathesisConfig.from_dict({
    "seed": SEED,
    "request-timeout": REQUEST_TIMEOUT_S,
    "max-stream-events": 10_000,  # a stream is read to its end, or for REQUEST_TIMEOUT_S
    # Failure reports show the request as sent ("max_tokens" would read "[Filtered]").
    "output": {"sanitization": {"enabled": False}},
    # schemathesis cannot guess model names: a fuzz dictionary puts deployed ones into
    # the body's "model" field of 70% of the random cases (the rest: unknown models).
    "dictionaries": {"models": {"values": MODELS}},
    "parameters": {"body.model": {"dictionary": "models", "probability": 0.7}},
})
FUZZ_SETTINGS = settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=False,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                             HealthCheck.data_too_large, HealthCheck.large_base_example])


def _png_base64() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


PNG = _png_base64()
# Words, not any unicode: the tiny Llama's context is 128 tokens, which a few turns of
# 4-byte characters (each several byte-level tokens) would already exceed.
short_text = st.text(alphabet=string.ascii_letters + string.digits + " .,?!", min_size=1, max_size=20)
texts = st.one_of(short_text, st.lists(short_text, min_size=1, max_size=3))
few_tokens = st.integers(1, 8)


def _conversation(system: list[str], exchanges: list[tuple[str, str]], last: str) -> list[dict]:
    """Turns as chat templates take them: a system turn or none, then user and
    assistant in turn, ending with the user's."""
    turns = [{"role": "system", "content": text} for text in system]
    for asked, answered in exchanges:
        turns += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    return [*turns, {"role": "user", "content": last}]


conversations = st.builds(_conversation, st.lists(short_text, max_size=1),
                          st.lists(st.tuples(short_text, short_text), max_size=1), short_text)
# What a well-behaved client sends, per route: with these a request reaches a model.
PLAUSIBLE = {
    "/v1/embeddings": st.fixed_dictionaries({"model": st.just("tiny-embed"), "input": texts}),
    "/v1/completions": st.fixed_dictionaries({"model": st.just("tiny-llama"), "prompt": texts,
                                              "max_tokens": few_tokens}),
    "/v1/chat/completions": st.fixed_dictionaries({
        "model": st.just("tiny-llama"), "max_tokens": few_tokens,
        "messages": conversations}),
    "/v1/classify": st.one_of(
        st.fixed_dictionaries({"model": st.just("tiny-classifier"), "input": texts, "top_k": st.integers(1, 2)}),
        st.fixed_dictionaries({"model": st.just("tiny-vit"),
                               "image": st.sampled_from([PNG, f"data:image/png;base64,{PNG}", [PNG, PNG]])}),
    ),
}
# Fields of a generated body that a plausible one keeps: every value the spec allows
# for these must be served (a seed of 2**64-1, temperature 0, top_p near 0, a stream),
# so schemathesis's edge values reach the models.
KEPT = {"temperature", "top_p", "seed", "stream", "stream_options", "user", "encoding_format"}


def _route_model(path: str, body: dict) -> str:
    if path == "/v1/classify":
        return "tiny-vit" if body.get("image") is not None else "tiny-classifier"
    return {"/v1/embeddings": "tiny-embed"}.get(path, "tiny-llama")


# Each route's input field, and a small valid value for it.
MINIMAL_INPUT = {"/v1/embeddings": ("input", "hi"), "/v1/completions": ("prompt", "hi"),
                 "/v1/chat/completions": ("messages", [{"role": "user", "content": "hi"}]),
                 "/v1/classify": ("input", "hi")}


def _plausible(case, drawn: dict, keep: bool):
    kept = {key: value for key, value in case.body.items() if keep and key in KEPT}
    case.body = {**kept, **drawn}
    return case


def flatmap_case(context, case):
    """A schema hook: half the random bodies of each POST route are made plausible, half
    of those keeping the generated values of the KEPT fields."""
    plausible = PLAUSIBLE.get(case.operation.path)
    if plausible is None or not isinstance(case.body, dict):
        return st.just(case)
    made_plausible = st.tuples(plausible, st.booleans()).map(lambda drawn: _plausible(case, *drawn))
    return st.one_of(st.just(case), made_plausible)


def allowed_status(ctx, response, case):
    """Only a status a client may get for what it sent: never a 5xx, a 422, a 3xx."""
    assert response.status_code in ALLOWED, f"status {response.status_code} is not one of {sorted(ALLOWED)}"


def openai_error_body(ctx, response, case):
    """Every 4xx carries OpenAI's error object, as serve_app.ingress.http_errors builds it."""
    if not 400 <= response.status_code < 500:
        return
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"a {response.status_code} whose body is not JSON: {response.content[:300]!r}") from None
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an OpenAI error body: {body}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, \
        f"not an OpenAI error object (message, type, param, code): {body}"
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def whole_stream(ctx, response, case):
    """A 200 event stream ends, within the timeout, with [DONE] or an error event that
    is not an internal error."""
    content_type = " ".join(v for k, vs in response.headers.items() if k.lower() == "content-type" for v in vs)
    if response.status_code != 200 or "text/event-stream" not in content_type:
        return
    assert not response.stream_cut_short, f"the stream did not end within {REQUEST_TIMEOUT_S}s"
    events = [block.removeprefix("data: ") for block in response.content.decode().split("\n\n") if block.strip()]
    assert events, "an empty event stream"
    if events[-1] == "[DONE]":
        return
    last = json.loads(events[-1])
    assert "error" in last, f"the stream ended without [DONE]: {events[-3:]}"
    assert last["error"].get("code") != "internal_error", f"the model failed mid-stream: {last}"


CHECKS = [not_a_server_error, allowed_status, openai_error_body, whole_stream]
# Statuses seen, per operation and phase ("coverage", "random"; "streamed": those of both
# that answered with an event stream).
SEEN: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
# Why requests were refused, per operation: "status code param" -> count.
REFUSALS: dict[str, Counter] = defaultdict(Counter)


@pytest.fixture(scope="module")
def api_schema(deployed):
    schema = schemathesis.openapi.from_url(f"{deployed}/openapi.json", config=CONFIG, timeout=30)
    schema.hook(flatmap_case)
    return schema


def test_the_fuzzed_operations_are_the_specs(api_schema):
    live = set()
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() == "POST" or (operation.method.upper() == "GET" and not operation.path_parameters
                                                  and not list(operation.iter_parameters())):
            live.add(operation.label)
    assert live == set(OPERATIONS)


def _send(case, label: str, phase: str) -> None:
    response = case.call()
    SEEN[label][phase][response.status_code] += 1
    if any(v.startswith("text/event-stream") for k, vs in response.headers.items() if k.lower() == "content-type"
           for v in vs):
        SEEN[label]["streamed"][response.status_code] += 1
    if response.status_code >= 400:
        try:
            error = json.loads(response.content)["error"]
            REFUSALS[label][f"{response.status_code} {error['code']} {error['param']}"] += 1
        except (ValueError, KeyError, TypeError):
            pass  # openai_error_body reports it
    case.validate_response(response, checks=CHECKS)


def _coverage_cases(schema, operation):
    """The coverage phase's cases. As generated, the valid ones all name model "0" (a
    404, never more) and an empty input ("" or []): they name the route's own model
    instead, and get a small input unless the case is about the input field, so that
    each field's edge values reach the model."""
    generation = schema.config.generation_for(operation=operation, phase="coverage")
    for case in schema.iter_coverage_cases(operation, generation_modes=list(GenerationMode),
                                           generation_config=generation):
        if (case.meta.generation.mode is GenerationMode.POSITIVE and isinstance(case.body, dict)
                and "model" in case.body and case.method.upper() == operation.method.upper()):
            body = dict(case.body)
            field, minimal = MINIMAL_INPUT[operation.path]
            about = case.meta.phase.data.description
            if body.get(field) in ("", [], None) and body.get("image") is None \
                    and f"'{field}'" not in about and "'image'" not in about:
                body[field] = minimal
            body["model"] = _route_model(operation.path, body)
            case.body = body
        yield case


@pytest.mark.parametrize("label", OPERATIONS)
def test_operation_from_its_spec(api_schema, label):
    method, path = label.split(" ", 1)
    operation = api_schema[path][method]
    failures = []
    for case in _coverage_cases(api_schema, operation):
        try:
            _send(case, label, "coverage")
        except FailureGroup as exc:  # all of them, not just the first
            failures.append(str(exc))
    assert not failures, (f"{len(failures)} of {SEEN[label]['coverage'].total()} coverage cases failed:\n"
                          + "\n".join(failures[:10]))

    @seed(SEED)
    @FUZZ_SETTINGS
    @given(case=st.one_of([operation.as_strategy(mode) for mode in GenerationMode]))
    def fuzz(case):
        _send(case, label, "random")

    fuzz()
    print(" ".join(f"{label} {phase}: {seen.total()} cases {dict(sorted(seen.items()))};"
                   for phase, seen in SEEN[label].items()))


def test_fuzzing_reached_the_models_and_left_the_service_healthy(deployed):
    fuzzed = [label for label in OPERATIONS if label in SEEN]  # all of them, unless -k chose
    assert fuzzed, "runs after test_operation_from_its_spec"
    for label in fuzzed:
        print(f"{label} refusals: {dict(REFUSALS[label].most_common(16))}")
        if label.startswith("POST"):  # each route both served and refused something
            statuses = SEEN[label]["coverage"] + SEEN[label]["random"]
            assert statuses[200] > 0 and statuses[400] > 0, (label, dict(SEEN[label]))
    assert httpx.get(f"{deployed}/healthz", timeout=10).json()["status"] == "ok"


def test_nan_literals_are_refused_cleanly(client):
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"model": "tiny-llama", "prompt": "x", "top_p": {literal}}}'.encode()
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "top_p"
