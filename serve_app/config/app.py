"""The whole ``args:`` section (:class:`AppConfig`) and :func:`parse_app_config`, which
turns validation errors into one line per problem."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, Field, ValidationError, model_validator

from serve_app.config.base import _Section
from serve_app.config.cache import CacheConfig
from serve_app.config.ingress import AuthConfig, RouterConfig
from serve_app.config.model import ModelConfig
from serve_app.config.scaling import LoadProfileConfig


class AppConfig(_Section):
    """The whole ``args:`` section of a deployments/*.yaml file."""

    models: list[ModelConfig] = Field(min_length=1, description="The models to serve; names must be unique.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="HTTP ingress settings.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="The response cache deployment.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys for the HTTP API.")
    load_profiles: dict[str, LoadProfileConfig] = Field(
        default_factory=dict, description="Named daily load profiles that models refer to in load_profile."
    )

    @model_validator(mode="after")
    def _load_profiles_exist(self) -> "AppConfig":
        for model in self.models:
            if model.load_profile is None:
                continue
            if model.load_profile not in self.load_profiles:
                known = ", ".join(sorted(self.load_profiles)) or "none defined"
                raise ValueError(
                    f"model {model.name!r}: load_profile {model.load_profile!r} is not in load_profiles (defined: {known})"
                )
            if model.num_replicas is not None:
                raise ValueError(
                    f"model {model.name!r} sets both num_replicas ({model.num_replicas}) and load_profile "
                    f"({model.load_profile!r}); the profile decides the count, so remove num_replicas"
                )
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> "AppConfig":
        seen: set[str] = set()
        for model in self.models:
            for name in (model.name, *(adapter.name for adapter in model.adapters)):
                if name in seen:
                    raise ValueError(f"the name {name!r} appears twice among models and their adapters; "
                                     "names must be unique")
                seen.add(name)
        return self

    @model_validator(mode="after")
    def _semantic_cache_models_exist(self) -> "AppConfig":
        tasks = {m.name: m.task for m in self.models}
        for model in self.models:
            semantic = model.cache.semantic
            if semantic is None:
                continue
            if model.task != "text-generation":
                raise ValueError(
                    f"model {model.name!r}: cache.semantic is for text-generation models, not {model.task}; remove it"
                )
            if tasks.get(semantic.embedding_model) != "embedding":
                embedders = ", ".join(n for n, t in tasks.items() if t == "embedding") or "none configured"
                raise ValueError(
                    f"model {model.name!r}: cache.semantic.embedding_model {semantic.embedding_model!r} is not an "
                    f"embedding model in models (embedding models: {embedders})"
                )
        return self

    def model(self, name: str) -> ModelConfig:
        return next(m for m in self.models if m.name == name)


def model_deployment_name(model_name: str) -> str:
    """The Serve deployment that serves one model (dashboards and status reads use it)."""
    return f"ModelServer-{model_name}"


class ConfigError(ValueError):
    """A deployments file's ``args:`` section is invalid; the message lists each problem."""


def _describe_field(loc: tuple[Any, ...]) -> Optional[str]:
    """The documented meaning of the field at ``loc``, used as the 'fix' hint."""
    model: Any = AppConfig
    description = None
    keyed_by_name = False  # inside a dict[str, Section]: the next part is a user-chosen key
    for part in loc:
        if isinstance(part, int) or keyed_by_name:
            keyed_by_name = False
            continue
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return description
        info = fields[part]
        description = info.description
        annotation = info.annotation
        keyed_by_name = getattr(annotation, "__origin__", None) is dict
        # Walk into nested sections (list[ModelConfig], Optional[...]).
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
                break
    return description


def parse_app_config(args: Any) -> AppConfig:
    """Validate a Serve config's ``args:`` into an :class:`AppConfig`.

    Raises :class:`ConfigError` whose message has one line per problem: the field
    path, the value given, what is wrong and what the field expects.
    """
    if not isinstance(args, dict):
        raise ConfigError(f"args must be a mapping with a 'models' list, got {type(args).__name__}")
    try:
        return AppConfig.model_validate(args)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            path = ".".join(["args", *(str(p) for p in error["loc"])])
            shown = repr(error.get("input"))
            if len(shown) > 200:
                shown = shown[:200] + "..."
            line = f"  {path}: {error['msg']} (got {shown})"
            hint = _describe_field(tuple(error["loc"]))
            if hint and error["type"] not in ("value_error", "assertion_error"):
                line += f"; expected: {hint}"
            lines.append(line)
        raise ConfigError("invalid serve_app config:\n" + "\n".join(lines)) from None
