"""What a result was measured on: machine, versions, git revision."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_revision() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
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
        "cores": os.cpu_count(),
        "torch_threads_per_replica": torch_threads,
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ray": ray.__version__,
        "git_revision": _git_revision(),
    }


def machine_line(info: dict) -> str:
    gpu = info["gpu"] or "no GPU"
    return (
        f"{info['cpu']}, {info['cores']} cores, {gpu}; torch {info['torch']}, transformers "
        f"{info['transformers']}, ray {info['ray']}; git {info['git_revision']}"
    )
