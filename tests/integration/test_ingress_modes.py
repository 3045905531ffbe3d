"""Which ingress Ray Serve runs: the suite's session runs the default (the high-throughput
HAProxy ingress, as `make serve` does), and `python -m serve_app.launch --classic-proxy`
still serves the API through Ray's classic Python proxy.

The classic proxy is checked in its own Ray instance, started by the launcher as a user
starts it, because Ray Serve picks its ingress once, when its processes start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from benchmarks.harness.processes import free_port

from serve_app.ray_env import high_throughput_active

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
USER_KEY = "classic-proxy-user-key-4d2b9c"



@pytest.mark.skipif(not high_throughput_active(), reason="SERVE_APP_HIGH_THROUGHPUT=0: the session runs the classic proxy")
def test_the_session_is_served_through_haproxy(deployed):
    # HAProxy's stats page (on the port the session gave it) lists our applications as its
    # backends, each with its router replica UP: requests go HAProxy -> router replica.
    port = os.environ["RAY_SERVE_HAPROXY_STATS_PORT"]
    rows = httpx.get(f"http://127.0.0.1:{port}/stats;csv", timeout=10).text.splitlines()
    header = rows[0].lstrip("# ").split(",")
    stats = [dict(zip(header, row.split(","))) for row in rows[1:] if row]
    replicas = {(s["pxname"], s["status"]) for s in stats if s["svname"].startswith("SERVE_REPLICA")}
    assert ("http-tiny", "UP") in replicas and ("http-local", "UP") in replicas, replicas
    assert httpx.get(f"{deployed}/healthz", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def classic(tmp_path_factory, tiny_bert_embedding_dir, tiny_llama_dir):
    """`python -m serve_app.launch CONFIG --classic-proxy` in its own local Ray; yields its URL."""
    folder = tmp_path_factory.mktemp("classic")
    (folder / "user.keys").write_text(f"{USER_KEY}\n")
    port = free_port()
    small = {"num_cpus": 0.25, "torch_threads": 1}
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{
            "name": "classic", "route_prefix": "/", "import_path": "serve_app.app:build_app",
            "args": {
                "router": {"num_cpus": 0.1, "request_timeout_s": 60, "max_body_bytes": 65536},
                "auth": {"enabled": True, "api_keys_env": None, "admin_keys_env": None,
                         "api_keys_file": str(folder / "user.keys"), "admin_keys_file": str(folder / "user.keys")},
                "models": [
                    {"name": "tiny-embed", "source": str(tiny_bert_embedding_dir), "task": "embedding",
                     "engine": "transformers", "precision": "fp32", "resources": small},
                    {"name": "tiny-llama", "source": str(tiny_llama_dir), "task": "text-generation",
                     "engine": "transformers", "precision": "fp32", "resources": small,
                     "generation": {"default_max_tokens": 4, "max_tokens_limit": 16}},
                ],
            },
        }],
    }
    config_path = folder / "classic.yaml"
    config_path.write_text(yaml.safe_dump(config))
    # RAY_ADDRESS=local: a Ray of its own, never the test session's.
    env = {**os.environ, "RAY_ADDRESS": "local", "RAY_AUTH_MODE": "disabled"}
    log = (folder / "launch.log").open("w+")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "serve_app.launch", str(config_path), "--classic-proxy",
         "--metrics-export-port", str(free_port())],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {USER_KEY}"}
    try:
        deadline = time.monotonic() + 300
        while True:
            if launcher.poll() is not None:
                pytest.fail(f"the launcher exited with {launcher.returncode}:\n{_tail(log)}")
            try:  # both models answer: the app is running
                embedded = httpx.post(f"{url}/v1/embeddings", json={"model": "tiny-embed", "input": "x"},
                                      headers=headers, timeout=10)
                generated = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "x",
                                                                      "max_tokens": 1}, headers=headers, timeout=10)
                if embedded.status_code == generated.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the classic-proxy app did not answer within 300 s:\n{_tail(log)}")
            time.sleep(1)
        yield url, headers, log
    finally:
        # As a user stops it: SIGTERM to the launcher, which shuts Serve and its Ray down.
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
        log.close()


def _tail(log, lines: int = 40) -> str:
    log.flush()
    log.seek(0)
    return "\n".join(log.read().splitlines()[-lines:])


def _error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"], error


def test_the_classic_proxy_serves_the_api(classic):
    url, headers, log = classic
    # The launcher says which ingress it started, with Ray's variables.
    assert "ingress: Ray's classic proxy (RAY_SERVE_ENABLE_HA_PROXY=0, RAY_SERVE_THROUGHPUT_OPTIMIZED=0)" in _tail(log, 400)
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        body = {"model": "tiny-embed", "input": "the classic proxy"}
        first, again = client.post("/v1/embeddings", json=body), client.post("/v1/embeddings", json=body)
        assert (first.headers["x-cache"], again.headers["x-cache"]) == ("miss", "hit")
        assert again.json()["data"] == first.json()["data"]
        # Streamed chat: server-sent events ending with [DONE].
        chat = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=chat) as stream:
            assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"
        # Errors of the framework and of the router, in OpenAI's shape.
        _error(client.post("/v1/embeddings", content=b"{" + b" " * 70000 + b"}",
                           headers={"content-type": "application/json"}), 413, "request_too_large")
        _error(client.get("/v1/nothing-here"), 404, "not_found")
        _error(client.get("/v1/embeddings"), 405, "method_not_allowed")
        refused = client.post("/v1/embeddings", json={"model": "tiny-embed", "input": []})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input", refused.text
        _error(client.post("/v1/embeddings", json={"model": "nope", "input": "x"}), 404, "model_not_found")
        # Auth comes before the body is read.
        _error(httpx.post(f"{url}/v1/embeddings", content=b"{not json", timeout=10), 401, "invalid_api_key")
        assert client.get("/healthz").status_code == 200
        assert set(client.get("/v1/stats").json()["models"]) == {"tiny-embed", "tiny-llama"}
