"""The one error boundary (ingress/http_errors.py) and the middleware (ingress/middleware.py)
on a bare FastAPI app, without Ray: OpenAI error bodies, what the observer records, the
guard's body limit and API keys."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from serve_app.ingress.auth import ApiKeys
from serve_app.core.errors import (
    InvalidRequestError,
)
from serve_app.ingress import http_errors
from serve_app.ingress.middleware import IngressGuard, IngressState, RequestObserver, ingress_state
from serve_app.ingress.request_context import note


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
