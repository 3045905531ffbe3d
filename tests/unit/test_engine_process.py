"""vLLM's engine core forked from a server that imported its modules ahead of time
(serve_app.replica.vllm.engine_process), tried with a script in place of the engine core:
where the child comes from, the environment it runs in, and that it dies with its parent."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
import time

import pytest

from serve_app.replica.vllm import engine_process
from serve_app.replica.vllm.engine_process import EngineProcessServer, _EngineCoreContext

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the server is Linux-only (/proc, prctl)")

#: Imported by the server and by nothing a fresh interpreter imports, so the child shows
#: whether it was forked from the server (it has it) or spawned (it does not).
PRELOADED = "xml.dom.minidom"

PROBE = """
import json, os, sys, time
try:  # as vLLM names its engine core
    import setproctitle
    setproctitle.setproctitle("VLLM::EngineCore")
except ImportError:
    pass
with open({out!r}, "w") as f:
    json.dump({{"ppid": os.getppid(), "late": os.environ.get("SERVE_APP_TEST_LATE"),
               "preloaded": {module!r} in sys.modules,
               "name": open(f"/proc/{{os.getpid()}}/comm").read().strip()}}, f)
time.sleep({sleep})
"""
#: The probe's process name where setproctitle is installed (vLLM depends on it).
TITLE = "VLLM::EngineCor" if importlib.util.find_spec("setproctitle") else None


def _state(pid: int) -> str:
    """The process's state letter from /proc ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


@pytest.fixture
def server(monkeypatch):
    monkeypatch.delenv(engine_process.ENV_SWITCH, raising=False)
    started = EngineProcessServer(modules=(PRELOADED,))
    yield started
    multiprocessing.forkserver._forkserver._stop()  # reaps it too, killed or not


def _start_probe(server, tmp_path, sleep: float = 0.0):
    out, script = tmp_path / "probe.json", tmp_path / "probe.py"
    script.write_text(PROBE.format(out=str(out), module=PRELOADED, sleep=sleep))
    process = _EngineCoreContext(server, multiprocessing.get_context("spawn")).Process(
        target=runpy.run_path, name="EngineCore", kwargs={"path_name": str(script)})
    process.start()
    deadline = time.monotonic() + 60
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return process, json.loads(out.read_text())


def test_the_engine_core_is_forked_from_the_server_in_the_environment_vllm_started_it_in(server, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setenv("SERVE_APP_TEST_LATE", "set after the server started")  # e.g. vLLM's RAY_ADDRESS
    process, seen = _start_probe(server, tmp_path)
    process.join(30)
    assert process.exitcode == 0
    assert server.engine_process == "preloaded"
    name = seen.pop("name")
    assert seen == {"ppid": server.pid, "late": "set after the server started", "preloaded": True}
    if TITLE:  # named as vLLM names it, which the environment's rewrite once kept it from
        assert name == TITLE


def test_a_load_time_variable_changed_after_the_server_started_spawns_the_engine_core(server, tmp_path,
                                                                                      monkeypatch):
    server.environ()  # its imports are done: what follows changed after them
    monkeypatch.setenv("OMP_SERVE_APP_TEST", "4")  # read when OpenMP loads: a forked child would miss it
    monkeypatch.setenv("SERVE_APP_TEST_LATE", "still passed on")
    process, seen = _start_probe(server, tmp_path)
    process.join(30)
    assert process.exitcode == 0
    assert server.engine_process.startswith("spawned: the environment changed"), server.engine_process
    assert "OMP_SERVE_APP_TEST='4'" in server.engine_process
    name = seen.pop("name")
    assert seen == {"ppid": os.getpid(), "late": "still passed on", "preloaded": False}
    if TITLE:
        assert name == TITLE


REPLICA = """
import json, multiprocessing, runpy, sys, time
from serve_app.replica.vllm.engine_process import EngineProcessServer, _EngineCoreContext
server = EngineProcessServer(modules=({module!r},))
process = _EngineCoreContext(server, multiprocessing.get_context("spawn")).Process(
    target=runpy.run_path, name="EngineCore", kwargs={{"path_name": {script!r}}})
process.start()
print(json.dumps({{"server": server.pid, "engine_core": process.pid, "how": server.engine_process}}), flush=True)
time.sleep(600)
"""


def test_the_engine_core_and_the_server_die_with_the_replica(tmp_path):
    """Ray kills a dying worker's children, not its grandchildren: the engine core, the
    server's child, must go when the replica goes, even killed outright."""
    import subprocess

    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(out=str(tmp_path / "probe.json"), module=PRELOADED, sleep=600))
    replica = subprocess.Popen([sys.executable, "-c", REPLICA.format(module=PRELOADED, script=str(script))],
                               stdout=subprocess.PIPE, text=True, env={**os.environ, engine_process.ENV_SWITCH: "1"})
    try:
        pids = json.loads(replica.stdout.readline())
        assert pids["how"] == "preloaded", pids
        assert _state(pids["engine_core"]) not in ("", "Z")
    finally:
        replica.kill()
        replica.wait()
    deadline = time.monotonic() + 15
    while any(_state(pids[p]) not in ("", "Z") for p in ("server", "engine_core")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(pids["server"]) in ("", "Z"), "the server outlived the replica"
    assert _state(pids["engine_core"]) in ("", "Z"), "the engine core outlived the replica"


def test_what_vllm_adds_to_ld_preload_is_already_there():
    # vLLM adds its libraries only when missing: applied on top of ours, nothing changes,
    # so the server (which got ours) and the engine core (which gets vLLM's) agree.
    ours = engine_process.vllm_cpu_ld_preload("/opt/lib/libextra.so")
    assert ours.split(":").count("/opt/lib/libextra.so") == 1
    assert engine_process.vllm_cpu_ld_preload(ours) == ours
    assert engine_process.load_time_differences({"LD_PRELOAD": ours, "RAY_ADDRESS": "a"},
                                                {"LD_PRELOAD": ours, "RAY_ADDRESS": "b"}) == []
    assert engine_process.load_time_differences({"OMP_NUM_THREADS": "2"}, {}) == ["OMP_NUM_THREADS"]
