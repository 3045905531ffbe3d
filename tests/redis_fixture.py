"""Redis for tests: a server URL for the session and a key prefix per test.

``redis_url`` uses the server at ``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``) if
it answers; otherwise it starts ``redis-server`` from PATH on a free port (no snapshots,
no append-only file, data dir in a temporary folder) and stops it at the end of the
session. Without either it skips the test, saying how to get one.

``private_redis`` starts a redis-server of the test's own, so the test can kill it
mid-traffic; it yields ``(process, url)``.

``redis_prefix`` gives each test its own key prefix and deletes every key under it
afterwards; tests must write only under it (the server may be shared: never FLUSHDB).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid

import pytest
from benchmarks.harness.processes import free_port, stop_process

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def _answers(url: str, timeout_s: float = 0.5) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    pytest.importorskip("redis", reason="redis-py is not installed: pip install redis")
    url = os.environ.get("REDIS_URL", DEFAULT_REDIS_URL)
    if _answers(url):
        yield url
        return

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(
            f"no Redis answers at {url} and there is no redis-server on PATH: "
            "install one (apt-get install redis-server) or set REDIS_URL to a running server"
        )
    proc, own_url, problem = _start_redis_server(binary, tmp_path_factory.mktemp("redis"))
    try:
        if problem:
            pytest.skip(problem)
        yield own_url
    finally:
        stop_process(proc, timeout_s=5)


@pytest.fixture
def redis_prefix(redis_url):
    import redis

    prefix = f"serve_app_test:{uuid.uuid4().hex}:"
    yield prefix
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=1.0, socket_timeout=2.0)
    try:
        batch = []
        for key in client.scan_iter(match=prefix + "*", count=1000):
            batch.append(key)
            if len(batch) >= 500:
                client.unlink(*batch)
                batch = []
        if batch:
            client.unlink(*batch)
    finally:
        client.close()


@pytest.fixture()
def private_redis(tmp_path):
    """A redis-server of this test's own (``(process, url)``), so it can be killed mid-traffic."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not on PATH: install one (apt-get install redis-server)")
    process, url, problem = _start_redis_server(binary, tmp_path)
    try:
        if problem:
            pytest.fail(problem)
        yield process, url
    finally:
        process.kill()
        process.wait()


def _start_redis_server(binary: str, data_dir) -> tuple[subprocess.Popen, str, str | None]:
    """A redis-server on a free port that keeps nothing on disk; returns the process, its
    URL, and what went wrong if it does not answer within 10 s (None when it does)."""
    port = free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(data_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10.0
    while not _answers(url, timeout_s=0.2):
        if process.poll() is not None:
            return process, url, f"redis-server exited with code {process.returncode} on port {port}"
        if time.monotonic() > deadline:
            return process, url, f"redis-server on port {port} did not answer within 10 s"
        time.sleep(0.05)
    return process, url, None
