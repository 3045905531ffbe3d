"""The config reference of docs/configuration.md, generated from the field docs (``python -m serve_app.config``)."""

from __future__ import annotations

from serve_app.config.app import AppConfig
from serve_app.config.cache import CacheConfig, ModelCacheConfig, SemanticCacheConfig
from serve_app.config.ingress import AuthConfig, RouterConfig
from serve_app.config.model import BatchingConfig, GenerationConfig, ModelConfig, ResourcesConfig
from serve_app.config.scaling import LoadProfileConfig, SimulatedClockConfig, WindowConfig
from serve_app.config.vllm import VLLMConfig


def reference_markdown() -> str:
    """The config reference: one table per section, from the field docs."""
    sections = [
        ("args", AppConfig),
        ("args.router", RouterConfig),
        ("args.models[]", ModelConfig),
        ("args.models[].batching", BatchingConfig),
        ("args.models[].resources", ResourcesConfig),
        ("args.models[].generation", GenerationConfig),
        ("args.models[].vllm", VLLMConfig),
        ("args.models[].cache", ModelCacheConfig),
        ("args.models[].cache.semantic", SemanticCacheConfig),
        ("args.cache", CacheConfig),
        ("args.auth", AuthConfig),
        ("args.load_profiles.<name>", LoadProfileConfig),
        ("args.load_profiles.<name>.windows[]", WindowConfig),
        ("args.load_profiles.<name>.clock", SimulatedClockConfig),
    ]
    out = []
    for title, model in sections:
        out.append(f"#### `{title}`\n\n| field | default | meaning |\n|---|---|---|")
        for name, info in model.model_fields.items():
            if info.is_required():
                default = "required"
            elif info.default_factory is not None:
                default = "see below"
            else:
                default = f"`{info.default!r}`" if info.default is not None else "none"
            meaning = (info.description or "").replace("|", "\\|")
            out.append(f"| `{name}` | {default} | {meaning} |")
        out.append("")
    return "\n".join(out)


_START, _END = "<!-- config-reference:start -->\n", "\n<!-- config-reference:end -->"


def write_reference(path: str) -> None:
    """Replace the config reference between the page's markers with the current one."""
    from pathlib import Path

    page = Path(path)
    text = page.read_text()
    start = text.index(_START) + len(_START)
    end = text.index(_END)
    page.write_text(text[:start] + reference_markdown().rstrip() + text[end:])
