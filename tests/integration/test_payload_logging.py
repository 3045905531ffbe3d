"""Prompts and answers stay out of the logs unless router.log_payloads asks for them."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx
import pytest
from ray._private.worker import global_worker
from serving_apps import SMALL, extra_app

pytestmark = pytest.mark.integration


def _router_log_text(app: str) -> str:
    logs = Path(global_worker.node.get_session_dir_path()) / "logs" / "serve"
    return "".join(path.read_text(errors="replace") for path in logs.glob(f"replica_{app}_Router_*.log"))


def _eventually_in_log(app: str, needle: str, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in _router_log_text(app):
            return True
        time.sleep(0.5)
    return False


def test_payloads_are_logged_only_when_the_config_asks(redeploy_apps, tiny_bert_embedding_dir, deployed):
    model = {"name": "tiny-embed", "source": str(tiny_bert_embedding_dir), "task": "embedding", "engine": "transformers", "resources": SMALL}
    redeploy_apps([
        extra_app("loud", model, router={"log_payloads": True}, cache={"enabled": False}),
        extra_app("quiet", model, cache={"enabled": False}),
    ])
    loud, quiet = f"secret loud {uuid.uuid4().hex}", f"secret quiet {uuid.uuid4().hex}"
    for app, text in (("loud", loud), ("quiet", quiet)):
        r = httpx.post(f"{deployed}/{app}/v1/embeddings", json={"model": "tiny-embed", "input": text}, timeout=60)
        assert r.status_code == 200
    assert _eventually_in_log("loud", loud), "log_payloads: true logs the input"
    assert quiet not in _router_log_text("quiet"), "by default the input never reaches the log"
    assert "payload model=tiny-embed" in _router_log_text("loud")
