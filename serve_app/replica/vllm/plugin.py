"""serve_app's vLLM plugin (entry point ``vllm.general_plugins``, see pyproject.toml):
vLLM loads it in every one of its processes, the engine core included, which a replica
starts as a spawned child where nothing the replica patched in its own process reaches.

What it does: lets vLLM 0.32's AOT compile artifact load on the CPU. On the CPU vLLM
compiles with the stock inductor backend, so the artifact it saves holds a plain
compiled function, and loading it calls ``finalize_loading``, which only vLLM's own
``VllmSerializableFunction`` has (``vllm/compilation/decorators.py``,
``_try_load_aot_compiled_fn``). The ``AttributeError`` is logged as "Compiling model
again due to a load failure" and every start traces and compiles the model again. A
plain function has nothing left to finalize (inductor deserialized its kernels already),
so the shim gives such a function a ``finalize_loading`` that does nothing. Functions
vLLM's backend made keep their own; a torch without AOT loading is left alone.

``SERVE_APP_VLLM_AOT_SHIM=0`` turns it off (vLLM then behaves as shipped).
"""

from __future__ import annotations

import functools
import os
from typing import Any

ENV_SWITCH = "SERVE_APP_VLLM_AOT_SHIM"


def register() -> None:
    """vLLM's plugin hook: called once per vLLM process."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return
    try:
        import torch.compiler
    except ImportError:
        return
    load = getattr(torch.compiler, "load_compiled_function", None)
    if load is None or getattr(load, "_serve_app_shim", False):
        return
    torch.compiler.load_compiled_function = _with_finalize_loading(load)


def _with_finalize_loading(load: Any) -> Any:
    @functools.wraps(load)
    def load_compiled_function(*args: Any, **kwargs: Any) -> Any:
        loaded = load(*args, **kwargs)
        add_missing_finalize_loading(loaded)
        return loaded

    load_compiled_function._serve_app_shim = True  # type: ignore[attr-defined]
    return load_compiled_function


def add_missing_finalize_loading(loaded: Any) -> bool:
    """Gives a loaded artifact's plain compiled function a no-op ``finalize_loading``;
    returns whether it did (False where there is nothing to do)."""
    compiled = getattr(getattr(loaded, "_artifacts", None), "compiled_fn", None)
    if compiled is None or hasattr(compiled, "finalize_loading"):
        return False
    try:
        compiled.finalize_loading = _nothing_to_finalize
    except (AttributeError, TypeError):  # an object that takes no attributes: vLLM logs and recompiles
        return False
    return True


def _nothing_to_finalize(vllm_config: Any = None) -> None:
    """An inductor function loaded from disk is ready to run as it is."""
