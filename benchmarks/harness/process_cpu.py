"""CPU time per request, by process, for one Serve application on this machine.

Where a request's CPU goes decides what a change can gain on a few cores: a replica's
own work, Ray's per-call work around it, a model engine's child process. Each Serve
replica runs in a process titled ``ray::ServeReplica:<app>:<deployment>``; its children
(vLLM's engine core) are counted under ``<deployment>/child``. Only this machine's
processes are seen, so the figures need a single-node Ray (the benchmarks' own).
"""

from __future__ import annotations

from typing import Optional

import psutil


def _replica_processes(app: str) -> dict[int, tuple[str, psutil.Process]]:
    marker = f"ServeReplica:{app}:"
    found: dict[int, tuple[str, psutil.Process]] = {}
    for process in psutil.process_iter(["cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if marker not in command:
            continue
        role = command.split(marker, 1)[1].split()[0]
        found[process.pid] = (role, process)
        try:
            for child in process.children(recursive=True):
                found[child.pid] = (f"{role}/child", child)
        except psutil.NoSuchProcess:
            pass
    return found


def _seconds(process: psutil.Process) -> Optional[float]:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return None
    return times.user + times.system


class ProcessCPU:
    """``with ProcessCPU(app) as cpu: <run>``, then ``cpu.seconds``: the CPU seconds each
    role of the app's processes spent over the run. A process that starts during the run
    is left out, one that ends counts nothing (a replaced replica's figure is partial)."""

    def __init__(self, app: str):
        self.app = app
        self._before: dict[int, tuple[str, float]] = {}
        self.seconds: dict[str, float] = {}

    def __enter__(self) -> "ProcessCPU":
        self._processes = _replica_processes(self.app)
        for pid, (role, process) in self._processes.items():
            seconds = _seconds(process)
            if seconds is not None:
                self._before[pid] = (role, seconds)
        return self

    def __exit__(self, *exc) -> None:
        totals: dict[str, float] = {}
        for pid, (role, before) in self._before.items():
            after = _seconds(self._processes[pid][1])
            if after is not None:
                totals[role] = totals.get(role, 0.0) + after - before
        self.seconds = totals


def per_request_ms(seconds_by_role: dict[str, float], requests: float) -> dict[str, float]:
    """CPU seconds by role over ``requests`` requests, as ms per request, plus ``all``."""
    if not requests:
        return {}
    per_role = {role: round(seconds / requests * 1000, 2) for role, seconds in sorted(seconds_by_role.items())}
    per_role["all"] = round(sum(seconds_by_role.values()) / requests * 1000, 2)
    return per_role
