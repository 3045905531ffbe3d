"""Typed models for the ``args:`` section of a Serve config file (deployments/*.yaml).

Every section forbids unknown keys, documents each field and puts units in names, so a
typo fails at build time with the field path, the value given and what would work,
instead of at the first request.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from serve_app.core import schedule
from serve_app.core.quantization import Quantization, check_quantization

# Kept in step with serve_app.core.runtime.TASKS (a unit test checks); not imported from
# there so the router can read its config without importing torch.
Task = Literal["embedding", "text-generation", "text-classification", "image-classification"]

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class BatchingConfig(_Section):
    """Dynamic batching knobs. They travel as the deployment's ``user_config``, so
    changing them in the YAML and redeploying retunes live replicas without a restart."""

    max_batch_size: int = Field(
        32, ge=1, le=4096, description="Most requests (rows) one batch may hold; 1 turns batching off."
    )
    max_batch_tokens: int = Field(
        8192,
        ge=1,
        description="Most real tokens one batch may hold (for generation: prompt + max_tokens per row); "
        "also the padded-token cap of each length-sorted sub-batch. Bounds activation memory.",
    )
    batch_wait_timeout_s: float = Field(
        0.01, ge=0.0, le=10.0, description="How long the first request of a batch waits for others, in seconds."
    )
    sub_batch_overhead_tokens: int = Field(
        32,
        ge=0,
        description="Fixed cost of one model call, in padded tokens, used when splitting a batch into "
        "length-sorted sub-batches: higher makes fewer, more padded calls. Larger on GPUs.",
    )
    length_sorting: bool = Field(
        True,
        description="Sort each batch by length into sub-batches padded to their own longest row. "
        "false pads rows in arrival order (the plain recipe; kept for benchmarks and comparison).",
    )


class ResourcesConfig(_Section):
    """What one replica of a model reserves from Ray."""

    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per replica; fractions allowed.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica; fractions share one GPU. 0 runs on CPU.")
    accelerator_type: Optional[str] = Field(
        None, description="Ray accelerator type to pin replicas to, e.g. 'A10G' or 'A100'; needs num_gpus > 0."
    )
    torch_threads: Optional[int] = Field(
        None, ge=1, description="Torch intra-op threads; default: num_cpus rounded up, so replicas do not oversubscribe cores."
    )

    @model_validator(mode="after")
    def _accelerator_needs_gpu(self) -> "ResourcesConfig":
        if self.accelerator_type and self.num_gpus <= 0:
            raise ValueError(
                f"accelerator_type is {self.accelerator_type!r} but num_gpus is {self.num_gpus}; "
                "set num_gpus > 0 or drop accelerator_type"
            )
        return self


class GenerationConfig(_Section):
    """Limits for text-generation models."""

    default_max_tokens: int = Field(64, ge=1, description="max_tokens when a request gives none.")
    max_tokens_limit: int = Field(512, ge=1, description="Largest max_tokens a request may ask for.")
    max_stop_sequences: int = Field(4, ge=0, description="Most stop strings per request (OpenAI allows 4).")
    engine: Literal["auto", "static", "continuous"] = Field(
        "auto",
        description="static: rows admitted together run as one padded generate() until the last one ends. "
        "continuous: iteration-level batching; requests join the running batch between decode steps and "
        "leave as soon as they end (batching.max_batch_size caps its rows, max_batch_tokens its KV cache, "
        "counted as prompt + max_tokens per row). auto: continuous where the model supports it (a plain "
        "KV cache and position_ids; not sliding-window models), else static; the generation-mixed "
        "benchmark measured continuous ahead at every load.",
    )

    @model_validator(mode="after")
    def _default_within_limit(self) -> "GenerationConfig":
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError(
                f"default_max_tokens ({self.default_max_tokens}) exceeds max_tokens_limit "
                f"({self.max_tokens_limit}); lower the default or raise the limit"
            )
        return self


class SemanticCacheConfig(_Section):
    """Reuse the answer of an earlier, very similar request (opt-in per model)."""

    embedding_model: str = Field(
        description="Name of an embedding model in `models` that embeds the canonical prompt."
    )
    threshold: float = Field(
        0.95,
        ge=0.5,
        le=1.0,
        description="Cosine similarity at or above which a stored answer is reused. "
        "Conservative by default: paraphrases pass, questions that differ in one word rarely do.",
    )


class ModelCacheConfig(_Section):
    """How one model's answers are cached."""

    enabled: bool = Field(True, description="Cache this model's deterministic answers.")
    ttl_s: Optional[float] = Field(None, gt=0, description="Entry lifetime in seconds; default: cache.ttl_s.")
    revision: Optional[str] = Field(
        None,
        description="Revision used in cache keys; default: a hash of the loaded weights and config. "
        "Change it to invalidate every entry of this model at once.",
    )
    semantic: Optional[SemanticCacheConfig] = Field(
        None, description="Semantic (similar-request) cache; text-generation models only."
    )


class CacheConfig(_Section):
    """The CacheServer deployment and its store."""

    enabled: bool = Field(True, description="Deploy the CacheServer and ask it before model calls.")
    store: Literal["memory", "redis"] = Field(
        "memory", description="memory: in the CacheServer process (one replica); redis: shared by every replica."
    )
    ttl_s: float = Field(3600.0, gt=0, description="Default entry lifetime in seconds; every entry has one.")
    max_bytes: int = Field(
        256 * 2**20, ge=1024, description="Memory store budget in bytes (keys + values); least recently used go first."
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0", description="Redis address when the environment variable named by redis_url_env is unset."
    )
    redis_url_env: str = Field("SERVE_APP_REDIS_URL", description="Environment variable holding the Redis URL.")
    redis_password_env: str = Field(
        "SERVE_APP_REDIS_PASSWORD", description="Environment variable holding the Redis password (never put it in YAML)."
    )
    key_prefix: str = Field("serve_app:", description="Prefix of every Redis key, so deployments can share a server.")
    store_timeout_s: float = Field(
        0.05, gt=0, description="A store call slower than this counts as a miss (degrade, never fail)."
    )
    call_timeout_s: float = Field(
        0.25, gt=0, description="The router's limit on one call to the CacheServer; past it, a miss."
    )
    router_hot_ttl_s: float = Field(
        2.0,
        gt=0,
        description="Each router replica keeps answers it just computed or fetched this long, so hot "
        "repeats skip the trip to the CacheServer. After an admin drop, other router replicas may "
        "serve a dropped answer for at most this long. Must cover call_timeout_s.",
    )
    router_hot_bytes: int = Field(
        64 * 2**20, ge=0, description="Byte budget of each router replica's hot tier (encoded answers)."
    )
    revision_refresh_s: float = Field(
        30.0, gt=0, description="How often the router re-reads each model's revision for its keys."
    )
    semantic_max_entries: int = Field(
        10_000, ge=1, description="Most vectors per (model, revision, params) in the semantic index; oldest go first."
    )
    num_replicas: int = Field(1, ge=1, description="CacheServer replicas; more than one needs store: redis to share entries.")
    num_cpus: float = Field(0.1, gt=0, description="CPUs reserved per CacheServer replica.")
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray resources per replica (see router.ray_resources)."
    )

    @model_validator(mode="after")
    def _hot_tier_covers_lookups(self) -> "CacheConfig":
        # An answer must stay in the hot tier while a lookup sent before its write-back
        # can still be on its way, or a duplicate request would call the model again.
        if self.router_hot_ttl_s < self.call_timeout_s:
            raise ValueError(
                f"cache.router_hot_ttl_s ({self.router_hot_ttl_s}) is below cache.call_timeout_s "
                f"({self.call_timeout_s}); raise router_hot_ttl_s to at least call_timeout_s"
            )
        return self

    @model_validator(mode="after")
    def _replicas_share_entries(self) -> "CacheConfig":
        if self.num_replicas > 1 and self.store == "memory":
            raise ValueError(
                f"cache.num_replicas is {self.num_replicas} with store: memory, so replicas would not share "
                "entries; use store: redis or one replica"
            )
        return self


class WindowConfig(_Section):
    """One time-of-day window of a load profile."""

    name: str = Field(description="Label shown in logs, metrics and errors, e.g. 'night' or 'peak'.")
    start: str = Field(description="Local time the window opens, 'HH:MM'.")
    end: str = Field(description="Local time it closes, 'HH:MM' ('24:00' allowed); at or before start runs past midnight.")
    days: Literal["all", "weekdays", "weekends"] = Field(
        "all", description="Days on which the window opens: all, weekdays (Mon-Fri) or weekends (Sat, Sun)."
    )
    min_replicas: int = Field(ge=0, description="Replica floor in this window.")
    max_replicas: int = Field(ge=1, description="Replica ceiling in this window.")
    target_ongoing_requests: float = Field(
        gt=0, description="Ongoing + queued requests one replica should carry; load picks the count between min and max."
    )

    @field_validator("start")
    @classmethod
    def _start_is_time(cls, value: str) -> str:
        schedule.parse_time_of_day(value)
        return value

    @field_validator("end")
    @classmethod
    def _end_is_time(cls, value: str) -> str:
        schedule.parse_time_of_day(value, allow_24=True)
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> "WindowConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"window {self.name!r}: min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self


class SimulatedClockConfig(_Section):
    """A compressed day for tests, demos and the day benchmark. Never set it in production."""

    day_length_s: float = Field(gt=0, description="Real seconds that make one 24 h day, e.g. 240 for a day in 4 minutes.")
    start_time: str = Field("00:00", description="Profile time of day when the clock starts, 'HH:MM'.")
    start_day: Literal["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"] = Field(
        "Mon", description="Weekday the simulated clock starts on."
    )
    anchor_unix_s: Optional[float] = Field(
        None, description="Real Unix time at which the clock reads start_time; default: when the policy starts."
    )

    @field_validator("start_time")
    @classmethod
    def _start_is_time(cls, value: str) -> str:
        schedule.parse_time_of_day(value)
        return value


class LoadProfileConfig(_Section):
    """Replica floors and ceilings by time of day. Models name a profile in `load_profile`;
    Ray Serve then scales them with serve_app's policy (serve_app/scaling.py)."""

    timezone: str = Field("UTC", description="IANA zone the window times are in, e.g. 'Europe/Berlin'.")
    windows: list[WindowConfig] = Field(
        min_length=1, description="Windows that together cover every minute of the week exactly once."
    )
    prewarm_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description="Raise the floor this many seconds before a window with a higher floor opens "
        "(cover replica start time: node launch + model load).",
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="Load must ask for more replicas this long before they are added.")
    downscale_delay_s: float = Field(
        300.0, ge=0, description="Load must ask for fewer replicas this long before they are removed."
    )
    look_back_period_s: float = Field(
        30.0, gt=0, description="Seconds over which Ray Serve averages ongoing requests for the load signal."
    )
    clock: Optional[SimulatedClockConfig] = Field(
        None, description="Simulated (compressed) clock; durations above then count in simulated time."
    )

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"timezone {value!r} is not an IANA zone name, e.g. 'UTC' or 'America/New_York'") from None
        return value

    @model_validator(mode="after")
    def _windows_tile_the_week(self) -> "LoadProfileConfig":
        names = [w.name for w in self.windows]
        if len(set(names)) != len(names):
            raise ValueError(f"window names must be unique, got {names}")
        problems = schedule.coverage_problems(list(self.to_schedule("check").windows))
        if problems:
            raise ValueError(
                "windows must cover every minute of the week exactly once: " + "; ".join(problems)
            )
        return self

    def to_schedule(self, name: str) -> schedule.LoadProfile:
        return schedule.LoadProfile.from_config(name, self.model_dump(mode="json"))


class ModelConfig(_Section):
    """One served model: one ModelServer deployment."""

    name: str = Field(description="Name clients put in the request's `model` field; letters, digits, '.', '_', '-'.")
    source: str = Field(
        description="Where the weights come from: 'hf:Org/name' (hub or local HF cache; honours HF_HUB_OFFLINE), "
        "'package:python_package' (weights shipped inside an installed package) or a local directory."
    )
    task: Task = Field(description="embedding | text-generation | text-classification | image-classification.")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Weight and activation dtype. fp16 needs a GPU; bf16 uses AMX/AVX512-bf16 on recent CPUs."
    )
    quantization: Quantization = Field(
        "none",
        description="Weight quantization applied at load: none | int8 (torchao weight-only, CPU or GPU) | "
        "int4 (torchao weight-only, groups of 32; needs precision: bf16) | bnb-8bit | bnb-4bit "
        "(bitsandbytes, GPU only, precision bf16 or fp16). See docs/optimize/ for measured quality and speed.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto': the GPU Ray assigned if CUDA sees one, else CPU. 'cuda' requires num_gpus > 0."
    )
    hub_revision: Optional[str] = Field(None, description="Branch, tag or commit for hf: sources.")
    trust_remote_code: bool = Field(
        False, description="Run Python code shipped with the model. Only for sources you trust."
    )
    num_replicas: Optional[int] = Field(
        None, ge=1, description="Fixed replica count (default 1); leave it out when load_profile is set."
    )
    load_profile: Optional[str] = Field(
        None, description="Name of an entry in load_profiles that scales this model by time of day and load."
    )
    max_ongoing_requests: int = Field(
        256,
        ge=1,
        description="Requests one replica accepts at once (Ray Serve); must cover max_batch_size so batches can fill.",
    )
    max_queued_requests: int = Field(
        512,
        ge=1,
        description="Requests each router replica may queue for this model once every replica holds "
        "max_ongoing_requests; past it the router answers 503 with Retry-After at once.",
    )
    max_inputs_per_request: int = Field(
        256, ge=1, description="Most inputs (texts, images, prompts) one HTTP request may carry."
    )
    top_k_limit: int = Field(20, ge=1, description="Largest top_k a classification request may ask for.")
    batching: BatchingConfig = Field(default_factory=BatchingConfig, description="Dynamic batching knobs.")
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Per-replica resources.")
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Generation limits (text-generation only)."
    )
    cache: ModelCacheConfig = Field(default_factory=ModelCacheConfig, description="How this model's answers are cached.")

    @field_validator("name")
    @classmethod
    def _name_is_simple(cls, value: str) -> str:
        if not _MODEL_NAME.match(value):
            raise ValueError(
                f"model name {value!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return value

    @field_validator("source")
    @classmethod
    def _source_has_known_form(cls, value: str) -> str:
        if ":" in value.split("/")[0] and not value.startswith(("hf:", "package:")):
            raise ValueError(
                f"source {value!r} has an unknown scheme; use 'hf:Org/name', 'package:NAME' or a local directory path"
            )
        if value in ("hf:", "package:"):
            raise ValueError(f"source {value!r} names nothing after the scheme")
        return value

    @model_validator(mode="after")
    def _device_and_precision_agree(self) -> "ModelConfig":
        gpus = self.resources.num_gpus
        if self.device == "cuda" and gpus <= 0:
            raise ValueError(
                f"model {self.name!r}: device is 'cuda' but resources.num_gpus is {gpus}; "
                "set resources.num_gpus > 0 or device: auto"
            )
        if self.precision == "fp16" and (self.device == "cpu" or gpus <= 0):
            raise ValueError(
                f"model {self.name!r}: precision fp16 needs a GPU but resources.num_gpus is {gpus}; "
                "use precision: bf16 or fp32 on CPU, or give the model a GPU"
            )
        if self.max_ongoing_requests < self.batching.max_batch_size:
            raise ValueError(
                f"model {self.name!r}: max_ongoing_requests ({self.max_ongoing_requests}) is below "
                f"batching.max_batch_size ({self.batching.max_batch_size}), so batches could never fill; "
                "raise max_ongoing_requests"
            )
        return self

    @model_validator(mode="after")
    def _quantization_fits_device(self) -> "ModelConfig":
        if self.quantization == "none":  # precision alone is checked in _device_and_precision_agree
            return self
        # The device a replica will get: 'auto' finds a GPU only when the model asks Ray for one.
        on_gpu = self.device == "cuda" or (self.device == "auto" and self.resources.num_gpus > 0)
        try:
            check_quantization(self.quantization, self.precision, "cuda" if on_gpu else "cpu")
        except ValueError as exc:
            where = "a GPU" if on_gpu else f"CPU (device {self.device}, resources.num_gpus {self.resources.num_gpus})"
            raise ValueError(f"model {self.name!r} on {where}: {exc}") from None
        return self

    def effective_torch_threads(self) -> int:
        if self.resources.torch_threads:
            return self.resources.torch_threads
        return max(1, math.ceil(self.resources.num_cpus))


class RouterConfig(_Section):
    """The HTTP ingress."""

    num_replicas: int = Field(1, ge=1, description="Router replicas (each is stateless).")
    num_cpus: float = Field(0.25, gt=0, description="CPUs reserved per router replica.")
    max_ongoing_requests: int = Field(1024, ge=1, description="Requests one router replica handles at once.")
    ray_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Extra Ray resources per replica; {'node:__internal_head__': 0.001} keeps routers on the head "
        "node so that GPU nodes can drain and be removed.",
    )
    request_timeout_s: float = Field(
        120.0, gt=0, description="A request still unanswered after this many seconds gets HTTP 504."
    )
    max_queued_requests: int = Field(
        2048, ge=1, description="Requests the HTTP proxy may queue for the router; past it, 503 at once."
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After, in seconds, on a 503 for a full queue.")
    replica_retries: int = Field(
        2,
        ge=0,
        description="Times a request is retried on another replica when the model replica serving it dies "
        "(inference is idempotent); with backoff 0.1 s, 0.2 s, ...",
    )
    max_body_bytes: int = Field(
        16 * 2**20, ge=1024, description="Largest request body accepted; larger ones get HTTP 413 unread."
    )
    log_payloads: bool = Field(
        False,
        description="Log each request's inputs and generated text (first 500 characters each) in the router "
        "log. Off by default: prompts and outputs are user data; turn on only to debug.",
    )


class AuthConfig(_Section):
    """API keys (off by default). Keys live in environment variables or files, never in
    the YAML; admin keys may call everything, user keys all but the admin endpoints."""

    enabled: bool = Field(False, description="Require 'Authorization: Bearer <key>' on every endpoint but /healthz.")
    api_keys_env: Optional[str] = Field(
        "SERVE_APP_API_KEYS", description="Environment variable with comma-separated user keys."
    )
    api_keys_file: Optional[str] = Field(None, description="File with one user key per line ('#' comments).")
    admin_keys_env: Optional[str] = Field(
        "SERVE_APP_ADMIN_KEYS",
        description="Environment variable with comma-separated admin keys (for /v1/stats and DELETE /v1/cache).",
    )
    admin_keys_file: Optional[str] = Field(None, description="File with one admin key per line.")


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
            if model.name in seen:
                raise ValueError(f"model name {model.name!r} appears twice in models; names must be unique")
            seen.add(model.name)
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


def reference_markdown() -> str:
    """The config reference for README: one table per section, from the field docs."""
    sections = [
        ("args", AppConfig),
        ("args.router", RouterConfig),
        ("args.models[]", ModelConfig),
        ("args.models[].batching", BatchingConfig),
        ("args.models[].resources", ResourcesConfig),
        ("args.models[].generation", GenerationConfig),
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


_README_START, _README_END = "<!-- config-reference:start -->\n", "\n<!-- config-reference:end -->"


def write_readme_reference(path: str) -> None:
    """Replace the config reference between README's markers with the current one."""
    from pathlib import Path

    readme = Path(path)
    text = readme.read_text()
    start = text.index(_README_START) + len(_README_START)
    end = text.index(_README_END)
    readme.write_text(text[:start] + reference_markdown().rstrip() + text[end:])


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write-readme"]:
        write_readme_reference(sys.argv[2] if len(sys.argv) > 2 else "README.md")
    else:
        print(reference_markdown())
