"""What each replica process loads at start: the router and cache processes serve no
model, so they must not import torch (about 1.4 s of CPU in each process that Serve
starts, paid by every application deployed and every replica added)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["serve_app.ingress.router", "serve_app.cache_server"])
def test_the_router_and_cache_modules_load_without_torch(module):
    probe = (f"import sys, {module}; "
             "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr[-2000:]
