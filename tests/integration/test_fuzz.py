"""Fuzz the HTTP API from its own OpenAPI spec: random bodies built from each POST
route's declared fields (right names, wrong and right types, extremes) must never get a
5xx or hang, and the service must stay healthy."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration

MODELS = ["tiny-embed", "tiny-llama", "tiny-classifier", "tiny-vit", "no-such-model"]
ALLOWED = {200, 400, 401, 403, 404, 405, 413}

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["", " ", "\u0000", "\ud7ff", "data:image/png;base64,AAAA", "user", "system", "robot"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                           "content": st.one_of(st.text(max_size=30), values)}),
    max_size=3,
)
short_text = st.text(min_size=1, max_size=20)
# Values a well-behaved client would send, so some requests get all the way to a model.
PLAUSIBLE = {
    "input": st.one_of(short_text, st.lists(short_text, min_size=1, max_size=3)),
    "prompt": short_text,
    "messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": short_text}), min_size=1, max_size=2),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(1, 2),
    "seed": st.integers(0, 100),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
}
VALID_BASE = {
    "/v1/embeddings": {"model": st.just("tiny-embed"), "input": PLAUSIBLE["input"]},
    "/v1/completions": {"model": st.just("tiny-llama"), "prompt": PLAUSIBLE["prompt"], "max_tokens": st.integers(1, 8)},
    "/v1/chat/completions": {"model": st.just("tiny-llama"), "messages": PLAUSIBLE["messages"],
                             "max_tokens": st.integers(1, 8)},
    "/v1/classify": {"model": st.just("tiny-classifier"), "input": PLAUSIBLE["input"]},
}


@pytest.fixture(scope="module")
def routes(deployed) -> dict[str, list[str]]:
    """POST path -> the body fields its OpenAPI schema declares."""
    spec = httpx.get(f"{deployed}/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    out = {}
    for path, operations in spec["paths"].items():
        body = operations.get("post", {}).get("requestBody")
        if not body:
            continue
        ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        out[path] = sorted(schemas[ref]["properties"])
    assert {"/v1/embeddings", "/v1/completions", "/v1/chat/completions", "/v1/classify"} <= set(out), out
    return out


@st.composite
def requests(draw, routes: dict[str, list[str]]):
    path = draw(st.sampled_from(sorted(routes)))
    fields = routes[path]
    chosen = draw(st.lists(st.sampled_from(fields), unique=True, max_size=len(fields)))
    wild = draw(st.booleans())  # half the bodies start well-formed, half anything goes
    body = {} if wild else {key: draw(strategy) for key, strategy in VALID_BASE.get(path, {}).items()}
    for name in chosen:
        if name == "model":
            if wild:
                body[name] = draw(st.one_of(st.sampled_from(MODELS), values))
        elif not wild and name in PLAUSIBLE:
            body[name] = draw(PLAUSIBLE[name])
        elif name == "messages":
            body[name] = draw(st.one_of(messages, values))
        elif name in ("max_tokens", "max_completion_tokens", "top_k"):
            body[name] = draw(st.one_of(st.integers(-5, 80), values))
        else:
            body[name] = draw(values)
    if wild and draw(st.booleans()):
        body["model"] = draw(st.sampled_from(MODELS))
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(min_size=1, max_size=8))] = draw(values)  # an unknown field
    return path, body


def test_random_bodies_never_get_a_5xx(deployed, routes):
    seen: dict[int, int] = {}

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(request=requests(routes))
    def check(request):
        path, body = request
        # allow_nan: Python's json writes NaN/Infinity, which strict JSON parsers reject.
        content = json.dumps(body, allow_nan=True).encode()
        response = httpx.post(f"{deployed}{path}", content=content,
                              headers={"content-type": "application/json"}, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code in ALLOWED, (path, body, response.status_code, response.text[:300])
        if response.status_code != 200:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error

    check()
    print("status counts:", dict(sorted(seen.items())))
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen
    assert httpx.get(f"{deployed}/healthz", timeout=10).json()["status"] == "ok"


def test_nan_literals_are_refused_cleanly(client):
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"model": "tiny-llama", "prompt": "x", "top_p": {literal}}}'.encode()
        response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "top_p"
