"""The peers the `engines` scenario measures ours against: vLLM's own OpenAI server (a
subprocess) and Ray Serve LLM (``ray.serve.llm``, an application in the benchmark's Ray).

Both are given the same engine settings as ours (:class:`EngineSettings`): precision,
context window, batch cap, prefix caching and KV cache size. Nothing here is imported by
``serve_app``; it is benchmark-only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

from benchmarks.harness.processes import free_port, process_group_gone
from serve_app.replica.vllm.plugin import ENV_SWITCH as PLUGIN_SWITCH

# serve_app's vLLM plugin (serve_app/replica/vllm/plugin.py) is installed in the benchmark's
# environment, and vLLM loads every installed plugin, in the peers too: off for them, so
# each peer runs as a user's vLLM does.
AS_SHIPPED = {PLUGIN_SWITCH: "0"}

# serve_app precision -> vLLM dtype
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class EngineSettings:
    """What every system is configured with, so they are compared like for like."""

    precision: str  # serve_app's name: fp32, bf16, fp16
    max_model_len: int
    max_num_seqs: int
    enable_prefix_caching: bool
    kv_cache_gib: int = 1
    enforce_eager: bool = False
    pooling: bool = False  # an embedding model (vLLM's pooling runner)

    @property
    def dtype(self) -> str:
        try:
            return VLLM_DTYPES[self.precision]
        except KeyError:
            raise ValueError(f"vLLM has no dtype for precision {self.precision!r}; "
                             f"use one of {sorted(VLLM_DTYPES)}") from None

    def vllm_cli_args(self) -> list[str]:
        """The api_server's command-line flags for these settings."""
        args = ["--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs)]
        args.append("--enable-prefix-caching" if self.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.enforce_eager:
            args.append("--enforce-eager")
        if self.pooling:
            args += ["--runner", "pooling"]
        return args

    def vllm_engine_kwargs(self) -> dict:
        """The same settings as vLLM engine arguments (Ray Serve LLM's engine_kwargs)."""
        kwargs = {"dtype": self.dtype, "max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                  "enable_prefix_caching": self.enable_prefix_caching, "enforce_eager": self.enforce_eager}
        if self.pooling:
            kwargs["runner"] = "pooling"
        return kwargs

    def serve_app_vllm_section(self) -> dict:
        """The same settings as our model's ``vllm:`` section (serve_app/config/vllm.py)."""
        return {"max_model_len": self.max_model_len, "max_num_seqs": self.max_num_seqs,
                "enable_prefix_caching": self.enable_prefix_caching, "cpu_kv_cache_gib": self.kv_cache_gib,
                "enforce_eager": self.enforce_eager}


def vllm_cli_flags(engine_args: dict) -> list[str]:
    """vLLM engine arguments (a dict such as ``serve_app.replica.vllm.runtime.engine_args``
    gives) as the api_server's command-line flags: ``model`` left out (the server takes
    it as ``--model``), None left at vLLM's default, dicts and lists as JSON, booleans as
    ``--x`` / ``--no-x``. Some of vLLM's switches have no ``--no-x`` (``--disable-log-stats``):
    False is their default, so it is left out; vLLM's parser says which."""
    parser = _vllm_parser()
    flags: list[str] = []
    for name, value in engine_args.items():
        if name == "model" or value is None:
            continue
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(f"--{flag}")
            elif parser is None or f"--no-{flag}" in parser._option_string_actions:
                flags.append(f"--no-{flag}")
            elif parser.get_default(name) is not False:
                raise ValueError(f"vLLM's server cannot be told {name}=False: it has no --no-{flag}")
        elif isinstance(value, (dict, list)):
            flags += [f"--{flag}", json.dumps(value)]
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def _vllm_parser():
    """vLLM's engine-argument parser, or None where vLLM is not installed."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        return None
    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


@dataclass
class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group.

    ``start()`` returns the base URL once /health answers; ``stop()`` ends exactly that
    process group (the server and the engine-core process it spawns), by its id.
    """

    model_dir: str
    served_name: str
    settings: EngineSettings
    log_path: Path
    startup_timeout_s: float = 900.0
    # The engine's flags, when given, instead of the settings' (see vllm_cli_flags).
    engine_flags: Optional[list[str]] = None
    # Set in the server's environment on top of ours (e.g. its cache directories).
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--disable-uvicorn-access-log",
                *(self.settings.vllm_cli_args() if self.engine_flags is None else self.engine_flags)]

    def start(self) -> str:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.settings.kv_cache_gib), "HF_HUB_OFFLINE": "1",
               **AS_SHIPPED, **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        log.write(" ".join(self.command()) + "\n")
        log.flush()
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {self.process.returncode} while starting: "
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy {self.startup_timeout_s:.0f}s after start: {self.log_tail()}")

    def log_tail(self, lines: int = 6, chars: int = 1500) -> str:
        """The server log's last lines, without the warnings every start prints."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        kept = [line.strip() for line in text.splitlines()
                if line.strip() and "WARNING" not in line and "_pytree" not in line and "torchao" not in line]
        return " | ".join(kept[-lines:])[-chars:] + f" (log: {self.log_path})"

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM this server's process group (its pid is the group id), SIGKILL it if it lingers."""
        process, self.process = self.process, None
        if process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; wait briefly for the rest of its group (the engine core).
            if process_group_gone(process.pid, 15.0):
                break
        process.poll()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def ray_serve_llm_app(model_dir: str, model_id: str, settings: EngineSettings, *, num_cpus: float = 0.5,
                      ingress_num_cpus: float = 0.1):
    """Ray Serve LLM's OpenAI app (LLMConfig + build_openai_app) on the vLLM CPU build:
    a CPU placement group (no accelerator_type), small num_cpus for the replica and its
    ingress, the KV cache sized by VLLM_CPU_KVCACHE_SPACE in the replica's env."""
    from ray.serve.llm import LLMConfig, build_openai_app

    config = LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model_dir},
        engine_kwargs=settings.vllm_engine_kwargs(),
        placement_group_config={"bundles": [{"CPU": num_cpus}]},  # CPU bundles -> the CPU accelerator backend
        deployment_config={"num_replicas": 1, "ray_actor_options": {"num_cpus": num_cpus}},
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib), "HF_HUB_OFFLINE": "1",
                                  **AS_SHIPPED}},
        experimental_configs={"num_ingress_replicas": 1},
    )
    return build_openai_app({"llm_configs": [config],
                             "ingress_deployment_config": {"ray_actor_options": {"num_cpus": ingress_num_cpus}}})
