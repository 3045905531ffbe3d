"""How long `make serve` takes, from the command to `/healthz` 200 and to the first chat
and embedding answers, as a new user sees it.

    python -m benchmarks.tools.first_answer            # vLLM's caches as they are (~/.cache/vllm)
    python -m benchmarks.tools.first_answer --cold     # an empty cache directory: a first start

Runs ``make serve`` in a process group of its own, polls the ingress every half second,
prints one JSON line, then stops the server with SIGTERM (serve_app.launch shuts Serve
and its Ray down) and waits for it to exit. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness.processes import process_group_gone

ROOT = Path(__file__).resolve().parents[2]
CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0}
EMBED = {"model": "minilm", "input": "a first request"}
PROBES = (("healthz_s", "/healthz", None), ("first_chat_s", "/v1/chat/completions", CHAT),
          ("first_embedding_s", "/v1/embeddings", EMBED))


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/healthz", timeout=2)
    except httpx.HTTPError:
        return False
    return True


def _running(server: subprocess.Popen, began: float, timeout_s: float) -> bool:
    return time.perf_counter() - began < timeout_s and server.poll() is None


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.first_answer")
    parser.add_argument("--cold", action="store_true", help="start with an empty vLLM cache directory")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--log", default="/tmp/first_answer.log")
    args = parser.parse_args(argv)
    flags = open("/proc/cpuinfo").read().split("flags", 2)[1].split("\n")[0] if os.path.exists("/proc/cpuinfo") else ""
    print("cpu flags:", " ".join(f for f in flags.split() if f.startswith(("avx512_bf16", "amx", "avx512_vnni"))),
          "| cores:", os.cpu_count(), flush=True)
    if _answers(args.url):
        sys.exit(f"something already answers at {args.url}: stop it first")
    with tempfile.TemporaryDirectory() as empty:
        env = dict(os.environ)
        if args.cold:
            env["VLLM_CACHE_ROOT"] = empty
        log = open(args.log, "w")
        began = time.perf_counter()
        server = subprocess.Popen(["make", "--no-print-directory", "serve"], cwd=ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
        out: dict = {"vllm_cache": "empty" if args.cold else "as found"}
        try:
            with httpx.Client(timeout=60) as client:
                while len(out) < 1 + len(PROBES) and _running(server, began, args.timeout_s):
                    for key, path, body in PROBES:
                        if key in out:
                            continue
                        try:
                            url = args.url + path
                            answer = client.get(url) if body is None else client.post(url, json=body)
                        except httpx.HTTPError:
                            continue
                        if answer.status_code == 200:
                            out[key] = round(time.perf_counter() - began, 1)
                    time.sleep(0.5)
        finally:
            os.killpg(server.pid, signal.SIGTERM)  # make and serve_app.launch under it
            server.wait()
            # make exits at once; serve_app.launch, in the same group, takes seconds to shut
            # Serve and Ray down. A next start that finds it still there measures nothing.
            if not process_group_gone(server.pid, timeout_s=120):
                os.killpg(server.pid, signal.SIGKILL)
                process_group_gone(server.pid, timeout_s=30)
            log.close()
        # Serve and Ray shut down after the launcher exits; the next start must not find them.
        deadline = time.perf_counter() + 120
        while _answers(args.url) and time.perf_counter() < deadline:
            time.sleep(1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
