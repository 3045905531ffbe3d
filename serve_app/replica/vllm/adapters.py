"""LoRA adapters on vLLM: a model's ``adapters`` read from their directories, the
engine arguments that let vLLM serve them beside the base model, and the LoRARequest
each adapter's calls run with."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from serve_app.config import ModelConfig
from serve_app.core.errors import ModelUnavailableError
from serve_app.core.models.sources import model_revision

# The ranks vLLM's LoRA kernels are built for (vllm.config.lora.MaxLoRARanks).
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclasses.dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int
    revision: str  # of its files: a retrained adapter gets new cache keys
    lora_id: int  # vLLM's id for it, unique within the engine (1, 2, ...)


def load_adapters(config: ModelConfig) -> dict[str, Adapter]:
    """The model's adapters, checked to be peft directories (a missing one fails the
    replica's start naming it, not its first request)."""
    adapters = {}
    for lora_id, adapter in enumerate(config.adapters, start=1):
        path = Path(adapter.source).expanduser()
        try:
            settings = json.loads((path / "adapter_config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"model {config.name!r}: adapter {adapter.name!r} at {path} has no readable "
                             f"adapter_config.json (peft's layout): {exc}") from None
        if settings.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"model {config.name!r}: adapter {adapter.name!r} is a {settings['peft_type']} adapter; "
                             "vLLM serves LoRA adapters")
        adapters[adapter.name] = Adapter(adapter.name, path, int(settings.get("r", 8)), model_revision(path), lora_id)
    return adapters


def lora_engine_args(adapters: dict[str, Adapter]) -> dict[str, Any]:
    """vLLM's LoRA arguments for these adapters ({} for none: LoRA off, torch.compile kept)."""
    if not adapters:
        return {}
    rank = max(a.rank for a in adapters.values())
    fitting = next((r for r in _VLLM_RANKS if r >= rank), None)
    if fitting is None:
        raise ValueError(f"a LoRA adapter has rank {rank}; vLLM serves ranks up to {_VLLM_RANKS[-1]}")
    # Every adapter may be in one batch: calls to different adapters decode together.
    return {"enable_lora": True, "max_loras": len(adapters), "max_lora_rank": fitting,
            "max_cpu_loras": len(adapters)}


def adapters_revision(adapters: dict[str, Adapter]) -> str:
    """What the model's revision adds for its adapters ("" for none): changing, adding
    or removing an adapter gives the model's cached answers new keys."""
    if not adapters:
        return ""
    digest = hashlib.sha256(json.dumps(sorted((a.name, a.revision) for a in adapters.values())).encode())
    return f"-lora{digest.hexdigest()[:12]}"


def lora_request(adapters: dict[str, Adapter], name: Optional[str]) -> Any:
    """vLLM's LoRARequest for the adapter a call names (None: the base model)."""
    if name is None:
        return None
    adapter = adapters.get(name)
    if adapter is None:  # the router knows it, this replica not: a config change rolling out
        raise ModelUnavailableError(f"adapter {name!r} is not on this replica yet (its config is changing); retry",
                                    param="model", code="adapter_not_loaded")
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.lora_id, lora_path=str(adapter.path))
