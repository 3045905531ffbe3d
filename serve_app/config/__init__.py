"""Typed models for the ``args:`` section of a Serve config file (deployments/*.yaml).

Every section forbids unknown keys, documents each field and puts units in names, so a
typo fails at build time with the field path, the value given and what would work,
instead of at the first request.

Sections: ``model`` (a served model with its batching, resources and generation
limits), ``vllm`` (vLLM engine options), ``cache`` (the response cache), ``scaling`` (load profiles), ``ingress``
(router and API keys), ``app`` (the whole ``args:`` and its parser), ``reference``
(the config reference of docs/configuration.md).
"""

from serve_app.config.app import AppConfig, ConfigError, model_deployment_name, parse_app_config
from serve_app.config.cache import CacheConfig, ModelCacheConfig, SemanticCacheConfig
from serve_app.config.ingress import AuthConfig, RouterConfig
from serve_app.config.model import BatchingConfig, GenerationConfig, ModelConfig, Precision, ResourcesConfig, Task
from serve_app.config.reference import reference_markdown, write_reference
from serve_app.config.scaling import LoadProfileConfig, SimulatedClockConfig, WindowConfig
from serve_app.config.vllm import VLLMConfig

__all__ = [
    "AppConfig",
    "AuthConfig",
    "BatchingConfig",
    "CacheConfig",
    "ConfigError",
    "GenerationConfig",
    "LoadProfileConfig",
    "ModelCacheConfig",
    "ModelConfig",
    "Precision",
    "ResourcesConfig",
    "RouterConfig",
    "SemanticCacheConfig",
    "SimulatedClockConfig",
    "Task",
    "VLLMConfig",
    "WindowConfig",
    "model_deployment_name",
    "parse_app_config",
    "reference_markdown",
    "write_reference",
]
