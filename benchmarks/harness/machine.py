"""What a result was measured on: machine, versions, git revision."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from serve_app.ray_env import high_throughput_active


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# The CPU features that decide which precisions are fast here (bf16 needs AVX512-bf16 or
# AMX to beat fp32 on a CPU), in the order the machine line names them.
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS /proc/cpuinfo lists (empty where it cannot be read)."""
    # The reader precision auto decides by (imported here: it imports torch).
    from serve_app.core.models.devices import cpu_flags as present_flags

    present = present_flags()
    return [flag for flag in CPU_FLAGS if flag in present]


def _git_revision() -> str:
    try:
        root = Path(__file__).resolve().parents[2]
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info(torch_threads: int | None = None) -> dict:
    import ray
    import torch
    import transformers

    gpu = None
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return {
        "cpu": _cpu_model(),
        "cpu_flags": cpu_flags(),
        "cores": os.cpu_count(),
        "torch_threads_per_replica": torch_threads,
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": ray.__version__,
        # Which ingress Ray Serve ran: its HAProxy one (high-throughput mode) or the classic proxy.
        "ray_serve_ingress": "haproxy" if high_throughput_active() else "classic proxy",
        "git_revision": _git_revision(),
    }


def machine_line(info: dict) -> str:
    gpu = info["gpu"] or "no GPU"
    cpu = info["cpu"]
    flags = info.get("cpu_flags")  # absent in results written before it was recorded
    if flags is not None:
        cpu += f" ({', '.join(flags)})" if flags else f" (none of {', '.join(CPU_FLAGS)})"
    return (
        f"{cpu}, {info['cores']} cores, {gpu}; torch {info['torch']}, transformers "
        f"{info['transformers']}, ray {info['ray']}"
        + (f" (ingress: {info['ray_serve_ingress']})" if info.get("ray_serve_ingress") else "")
        + f"; git {info['git_revision']}"
    )
