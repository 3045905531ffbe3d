"""The benchmark load generator against a local aiohttp server (no Ray)."""

import asyncio
import json

import pytest

aiohttp_web = pytest.importorskip("aiohttp.web")

from benchmarks.harness.loadgen import closed_loop, open_loop  # noqa: E402


async def _serve():
    async def echo(request):
        body = await request.json()
        if body.get("fail"):
            return aiohttp_web.json_response({"error": "no"}, status=400)
        return aiohttp_web.json_response({"tokens": body["n"]})

    async def health(request):
        return aiohttp_web.Response(text=json.dumps({"ok": True}))

    app = aiohttp_web.Application()
    app.router.add_post("/echo", echo)
    app.router.add_get("/health", health)
    runner = aiohttp_web.AppRunner(app)
    await runner.setup()
    site = aiohttp_web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_closed_and_open_loop_count_requests_errors_and_units():
    async def main():
        runner, url = await _serve()
        try:
            make = lambda i: ("/echo", {"n": 2, "fail": i % 10 == 0})  # noqa: E731
            closed = await closed_loop(url, make, concurrency=4, requests=40, label="t",
                                       extract=lambda answer: answer["tokens"], progress=False)
            health = await closed_loop(url, lambda i: ("/health", None), concurrency=2, requests=10, label="h",
                                       progress=False)
            opened = await open_loop(url, make, rate_per_s=200, requests=20, label="o", progress=False)
            return closed, health, opened
        finally:
            await runner.cleanup()

    closed, health, opened = asyncio.run(main())
    assert closed.requests == 40 and closed.errors == 4 and closed.units == 72
    assert len(closed.latencies_s) == 36 and closed.percentile_ms(50) <= closed.percentile_ms(99)
    assert "HTTP 400" in closed.error_samples[0]
    assert health.errors == 0 and health.throughput_rps > 0
    assert opened.requests == 20 and opened.errors == 2
    summary = closed.summary()
    assert summary["p50_ms"] is not None and summary["throughput_rps"] > 0


def test_process_cpu_counts_a_replicas_cpu_by_role_and_its_children():
    import subprocess
    import sys
    import time

    from benchmarks.harness.process_cpu import ProcessCPU, per_request_ms

    # A stand-in replica titled as Serve titles one, spinning for 1.5 s of CPU, with a
    # child (an engine core) that spins as long.
    spin = "import time; t = time.process_time(); exec('while time.process_time() - t < 1.5: pass')"
    code = f"import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', {spin!r}]); {spin}; c.wait()"
    replica = subprocess.Popen([sys.executable, "-c", code, "ray::ServeReplica:bench-app:Router"])
    try:
        time.sleep(0.3)  # both started
        with ProcessCPU("bench-app") as cpu:
            time.sleep(0.5)
        with ProcessCPU("other-app") as other:
            pass
    finally:
        replica.kill()
        replica.wait()
    assert set(cpu.seconds) == {"Router", "Router/child"}
    for seconds in cpu.seconds.values():  # each spun through the 0.5 s window
        assert 0.15 <= seconds <= 0.7, cpu.seconds
    assert other.seconds == {}
    assert per_request_ms({"Router": 0.5, "Router/child": 1.5}, 1000) == {"Router": 0.5, "Router/child": 1.5, "all": 2.0}
