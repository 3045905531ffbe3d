"""Ports and processes for what benchmarks and tests start beside Ray (Redis,
Prometheus, vLLM's server, the launcher, HAProxy's extra ports).

Why ports come from 20000-32767: a port the kernel hands out for ``bind(0)`` lies in its
ephemeral range (32768-60999 on Linux), which is also where Ray's own ``bind(0)`` ports
and every outgoing connection land. Such a port is free when asked for and often taken by
the time HAProxy binds it. Ray's workers take 10002-19999. Below 20000 are the fixed
ports of Redis, Ray and Serve. Between the two nothing picks ports at random.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time

PORT_RANGE = (20000, 32767)


def _bindable(port: int) -> bool:
    # On all interfaces, as HAProxy and Serve's proxies bind: a port something holds on
    # 127.0.0.1 alone fails this too.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports outside the ephemeral and Ray-worker ranges with nothing
    bound on them at the time of asking."""
    chosen: list[int] = []
    candidates = list(range(PORT_RANGE[0], PORT_RANGE[1] + 1))
    random.SystemRandom().shuffle(candidates)
    for port in candidates:
        if _bindable(port):
            chosen.append(port)
            if len(chosen) == n:
                return chosen
    raise RuntimeError(f"fewer than {n} free ports in {PORT_RANGE}")


def free_port() -> int:
    """One port as :func:`free_ports` chooses them."""
    return free_ports(1)[0]


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


def process_group_gone(pgid: int, timeout_s: float) -> bool:
    """Whether every process of the group has exited within ``timeout_s`` (False also
    where the group is not ours to signal)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        time.sleep(0.2)
    return False
