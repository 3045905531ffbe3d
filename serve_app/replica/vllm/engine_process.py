"""vLLM's engine core process, forked from a server that imported vLLM ahead of time.

``AsyncLLM`` runs its engine core in a child process. In a Ray actor vLLM must spawn it
(forking a process with Ray's threads is unsafe), and the new interpreter imports vLLM
again before it loads anything: 11 s of a 48 s warm SmolLM2 start on 2 cores, right after
the 7.6 s the replica itself spent importing vLLM (docs/engines.md). So a replica that
will run a model on vLLM's CPU build first starts a multiprocessing forkserver, which
imports vLLM's engine-core modules (see :mod:`serve_app.replica.vllm.preload`) while the
replica resolves the model and imports vLLM in parallel; when vLLM starts its engine
core, the child is forked from that server, single-threaded and free of Ray, with its
modules already imported.

The child must start as the spawned one would have:

- what is read when an interpreter or a library loads (``LD_PRELOAD``, OpenMP's and
  malloc's settings, ``PYTHON*``, torch's) must already be the engine's when the server
  starts: the replica applies its engine environment
  (:func:`~serve_app.replica.vllm.runtime.apply_engine_env`) and what vLLM's CPU platform
  would add (:func:`vllm_cpu_load_environment`) before it. If any of them differs, as the
  server's imports left it, from the environment vLLM starts the process in, the engine
  core is spawned as vLLM does, and the replica logs which variables differed;
- everything else of the environment vLLM set by then (``RAY_ADDRESS``, say) is applied
  in the child before vLLM's code runs;
- it dies with the replica: its parent is the server, which exits when the replica does,
  and the child asks the kernel for SIGKILL when its parent dies (Ray kills a dying
  worker's children, not its grandchildren).

The server stays up while the engine core it forked runs (multiprocessing reads the
child's exit status through it). ``SERVE_APP_VLLM_PRELOAD=0`` turns all this off.

This module imports neither vLLM nor Ray: the child unpickles its process class from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import json
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Iterator, Optional

logger = logging.getLogger("ray.serve")

#: "0" turns the server off.
ENV_SWITCH = "SERVE_APP_VLLM_PRELOAD"
#: How the replica tells the server what to import and where to report (read by preload).
REQUEST_ENV = "SERVE_APP_VLLM_PRELOAD_REQUEST"
#: What vLLM's engine core process imports first: the engine core (its scheduler, torch,
#: transformers), the in-process executor and the CPU model runner.
ENGINE_CORE_MODULES = ("vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker")
#: How long vLLM's start waits for the server's imports before it spawns instead.
IMPORTS_TIMEOUT_S = 120.0

#: Environment variables read when the interpreter or a native library loads (or when
#: torch is imported), which the server had to have already: a difference falls back to spawn.
_LOAD_TIME_PREFIXES = ("LD_", "OMP_", "KMP_", "GOMP_", "MALLOC_", "TCMALLOC_", "PYTHON", "TORCH")

_PR_SET_PDEATHSIG = 1


def load_time_differences(server: dict[str, str], launch: dict[str, str]) -> list[str]:
    """The load-time variables (names) that differ between two environments."""
    names = {k for k in (*server, *launch) if k.startswith(_LOAD_TIME_PREFIXES)}
    return sorted(k for k in names if server.get(k) != launch.get(k))


def vllm_cpu_load_environment(environ: Any) -> dict[str, str]:
    """The load-time variables vLLM's CPU platform sets for its engine processes when it
    builds the engine's config (``CpuPlatform.check_and_update_config``), found without
    importing vLLM: inductor's per-kernel thread count read from the environment (read
    when torch's inductor config is imported), and ``LD_PRELOAD``."""
    out = {"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1"}
    preload = vllm_cpu_ld_preload(environ.get("LD_PRELOAD", ""))
    if preload:
        out["LD_PRELOAD"] = preload
    return out


def vllm_cpu_ld_preload(current: str) -> str:
    """``LD_PRELOAD`` as vLLM's CPU platform sets it (``vllm/platforms/cpu.py``, Linux
    x86): torch's libgomp appended unless an OpenMP runtime is there, vLLM's bundled
    tcmalloc put first unless one is there."""
    value = current
    if not any(lib in value for lib in ("libomp", "libgomp", "libiomp")):
        torch_spec = importlib.util.find_spec("torch")
        if torch_spec and torch_spec.origin:
            torch_pkg = os.path.dirname(torch_spec.origin)
            found: list[str] = []
            for libs in (os.path.join(os.path.dirname(torch_pkg), "torch.libs"), os.path.join(torch_pkg, "lib")):
                found.extend(glob.glob(os.path.join(libs, "libgomp*.so*")))
            if found:
                value = f"{value}:{found[0]}" if value else found[0]
    if "libtcmalloc" not in value:
        vllm_spec = importlib.util.find_spec("vllm")
        if vllm_spec and vllm_spec.origin:
            libs = os.path.join(os.path.dirname(vllm_spec.origin), "libs")
            for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*"):
                found = glob.glob(os.path.join(libs, pattern))
                if found:
                    value = f"{found[0]}:{value}" if value else found[0]
                    break
    return value


class EngineProcessServer:
    """The forkserver of one replica (multiprocessing keeps one per process)."""

    def __init__(self, modules: tuple[str, ...] = ENGINE_CORE_MODULES):
        # The server writes its environment here once its imports are done (see preload).
        self._report = os.path.join(tempfile.mkdtemp(prefix="serve-app-engine-process-"), "environ.json")
        forkserver = multiprocessing.forkserver._forkserver
        forkserver.set_forkserver_preload(["serve_app.replica.vllm.preload"])
        os.environ[REQUEST_ENV] = json.dumps({"modules": list(modules), "report": self._report})
        try:
            forkserver.ensure_running()  # launches it and returns: the imports run in the server
        finally:
            del os.environ[REQUEST_ENV]
        self.pid: Optional[int] = forkserver._forkserver_pid
        self._environ: Optional[dict[str, str]] = None
        #: How the engine core started: "preloaded" (forked from here), "spawned: <why>", or
        #: None before it did.
        self.engine_process: Optional[str] = None

    @classmethod
    def start(cls) -> Optional["EngineProcessServer"]:
        """Adds what vLLM's CPU platform would add to this process's environment (the
        engine's already, see :func:`~serve_app.replica.vllm.runtime.apply_engine_env`)
        and starts the server; None where it is switched off or fails."""
        if os.environ.get(ENV_SWITCH, "1") == "0" or sys.platform != "linux":
            return None
        os.environ.update(vllm_cpu_load_environment(os.environ))
        try:
            return cls()
        except Exception as exc:  # the start goes on as vLLM ships it
            logger.warning("vLLM's engine process server did not start (%s: %s); vLLM will spawn its engine core",
                           type(exc).__name__, exc)
            return None

    def alive(self) -> bool:
        """Whether the server runs (read from /proc: waiting on it here would reap it
        behind multiprocessing's back)."""
        if self.pid is None or multiprocessing.forkserver._forkserver._forkserver_pid != self.pid:
            return False
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state != "Z"

    def environ(self, timeout_s: float = IMPORTS_TIMEOUT_S) -> Optional[dict[str, str]]:
        """The server's environment after its imports (waits for them), None if it
        reported none in time."""
        deadline = time.monotonic() + timeout_s
        while self._environ is None and time.monotonic() < deadline and self.alive():
            try:
                with open(self._report) as f:
                    self._environ = json.load(f)
            except (OSError, ValueError):
                time.sleep(0.05)
            else:
                shutil.rmtree(os.path.dirname(self._report), ignore_errors=True)
        return self._environ

    def how_to_start(self, launch_environ: dict[str, str]) -> str:
        """"preloaded" if the engine core can be forked from here, else "spawned: <why>"."""
        environ = self.environ()
        if environ is None or not self.alive():
            return "spawned: the server exited or did not finish its imports"
        differs = load_time_differences(environ, launch_environ)
        if differs:
            shown = "; ".join(f"{k}={launch_environ.get(k)!r}, the server's {environ.get(k)!r}" for k in differs)
            return f"spawned: the environment changed after the server started ({shown})"
        return "preloaded"

    @contextlib.contextmanager
    def serving_vllm(self) -> Iterator[None]:
        """While vLLM starts its engine: its engine-core processes start through here."""
        import vllm.v1.engine.utils as engine_utils

        original = engine_utils.get_mp_context
        engine_utils.get_mp_context = lambda: _EngineCoreContext(self, original())
        started = False
        try:
            yield
            started = True
        finally:
            engine_utils.get_mp_context = original
            if self.engine_process is None:
                self.engine_process = "spawned: vLLM started no engine core process"
            if not (started and self.engine_process == "preloaded"):
                self.stop()
            logger.info("vLLM's engine core: %s", self.engine_process)

    def stop(self) -> None:
        """Stops the server, and any engine core it forked with it: for when vLLM does not
        start or started its engine core otherwise. Killed, not asked: a server still
        importing reads its requests only when done."""
        with contextlib.suppress(Exception):
            if self.alive():
                os.kill(self.pid, signal.SIGKILL)
                multiprocessing.forkserver._forkserver._stop()  # reaps it, forgets its address
        shutil.rmtree(os.path.dirname(self._report), ignore_errors=True)


class _EngineCoreContext:
    """vLLM's multiprocessing context, whose Process is :class:`_EngineCoreProcess`."""

    def __init__(self, server: EngineProcessServer, original: Any):
        self._server = server
        self._original = original

    def Process(self, *args: Any, **kwargs: Any) -> "_EngineCoreProcess":
        process = _EngineCoreProcess(*args, **kwargs)
        process._server = self._server
        return process

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


class _EngineCoreProcess(multiprocessing.context.ForkServerProcess):
    """Forked from the server where the environment allows it, else spawned; either way
    its target runs in the environment of the moment vLLM started it."""

    _server: Optional[EngineProcessServer] = None
    _how = "spawned"

    def start(self) -> None:
        launch_environ = dict(os.environ)
        server, self._server = self._server, None  # not pickled into the child
        self._how = server.how_to_start(launch_environ) if server else "spawned: no server"
        if server is not None:
            server.engine_process = self._how
        parent = server.pid if self._how == "preloaded" else os.getpid()  # "preloaded" only with a server
        self._kwargs = {"environ": launch_environ, "parent": parent, "target": self._target, "kwargs": self._kwargs}
        self._target = run_in_environment
        super().start()

    @staticmethod
    def _Popen(process_obj: "_EngineCoreProcess") -> Any:
        if process_obj._how == "preloaded":
            from multiprocessing.popen_forkserver import Popen
        else:
            from multiprocessing.popen_spawn_posix import Popen
        return Popen(process_obj)


def run_in_environment(environ: dict[str, str], parent: int, target: Any, kwargs: dict[str, Any]) -> Any:
    """The engine core's entry: dies with its parent (pid ``parent``), takes the launch
    environment, runs ``target``."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)
    # A forked child inherits a write end of the pipe whose closing tells the server the
    # replica is gone; holding it would keep the server, and so this child, alive.
    alive_fd = multiprocessing.forkserver._forkserver._forkserver_alive_fd
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        multiprocessing.forkserver._forkserver._forkserver_alive_fd = None
    with contextlib.suppress(Exception):
        # setproctitle (vLLM names its processes VLLM::EngineCore with it) finds the memory
        # it rewrites from where the environment's strings lie when it first runs; after
        # the environment below is rewritten it cannot, and names nothing.
        import setproctitle

        setproctitle.getproctitle()
    os.environ.clear()
    os.environ.update(environ)
    return target(**kwargs)
