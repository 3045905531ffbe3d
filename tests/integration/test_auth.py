"""API keys through the real HTTP proxy: no key, wrong key, user key, admin key."""

from __future__ import annotations

import httpx
import pytest
from serving_apps import SMALL, extra_app

pytestmark = pytest.mark.integration

USER, ADMIN = "test-user-key-6f1c2a9e0b7d", "test-admin-key-93e8d1c47a05"


@pytest.fixture(scope="module")
def secured(deployed, redeploy_apps_module, tiny_bert_embedding_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    (folder / "user.keys").write_text(f"{USER}\n")
    (folder / "admin.keys").write_text(f"# admins\n{ADMIN}\n")
    redeploy_apps_module([extra_app(
        "secured",
        {"name": "tiny-embed", "source": str(tiny_bert_embedding_dir), "task": "embedding", "engine": "transformers", "resources": SMALL},
        auth={"enabled": True, "api_keys_env": None, "admin_keys_env": None,
              "api_keys_file": str(folder / "user.keys"), "admin_keys_file": str(folder / "admin.keys")},
    )])
    with httpx.Client(base_url=f"{deployed}/secured", timeout=60) as client:
        yield client


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


EMBED = {"model": "tiny-embed", "input": "hello"}


def _error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_no_key_and_wrong_key_get_401(secured):
    missing = secured.post("/v1/embeddings", json=EMBED)
    _error(missing, 401, "invalid_api_key")
    assert missing.headers["www-authenticate"] == "Bearer"
    _error(secured.post("/v1/embeddings", json=EMBED, headers=_auth("not-a-key-at-all-000")), 401, "invalid_api_key")
    # Checked before the body: a caller without a key learns nothing from validation.
    _error(secured.post("/v1/embeddings", content=b"{not json"), 401, "invalid_api_key")


def test_user_key_serves_but_is_not_admin(secured):
    assert secured.post("/v1/embeddings", json=EMBED, headers=_auth(USER)).status_code == 200
    assert secured.get("/v1/models", headers=_auth(USER)).status_code == 200
    _error(secured.get("/v1/stats", headers=_auth(USER)), 403, "admin_key_required")
    _error(secured.delete("/v1/cache/tiny-embed", headers=_auth(USER)), 403, "admin_key_required")


def test_admin_key_reaches_everything_and_health_is_public(secured):
    assert secured.get("/v1/stats", headers=_auth(ADMIN)).status_code == 200
    assert secured.delete("/v1/cache/tiny-embed", headers=_auth(ADMIN)).status_code == 200
    assert secured.post("/v1/embeddings", json=EMBED, headers=_auth(ADMIN)).status_code == 200
    assert secured.get("/healthz").json()["status"] == "ok"


def test_openai_client_sends_its_key(secured):
    from openai import AuthenticationError, OpenAI

    base = str(secured.base_url).rstrip("/") + "/v1"
    vectors = OpenAI(base_url=base, api_key=USER).embeddings.create(model="tiny-embed", input=["a", "b"])
    assert len(vectors.data) == 2
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=base, api_key="wrong-key-0000000000", max_retries=0).embeddings.create(
            model="tiny-embed", input="a")


def test_other_apps_stay_open(client):
    # Auth is per application: the session's tiny app has it off.
    assert client.post("/v1/embeddings", json={"model": "tiny-embed", "input": "x"}).status_code == 200
