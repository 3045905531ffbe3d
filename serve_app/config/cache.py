"""The response cache: its deployment and store (``args.cache``), and how each model's
answers are cached (``args.models[].cache``)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from serve_app.config.base import _Section


class SemanticCacheConfig(_Section):
    """Reuse the answer of an earlier, very similar request (opt-in per model)."""

    embedding_model: str = Field(
        description="Name of an embedding model in `models` that embeds the last user turn (everything "
        "before it must match exactly)."
    )
    threshold: float = Field(
        0.95,
        ge=0.5,
        le=1.0,
        description="Cosine similarity of the last user turns at or above which a stored answer is a "
        "candidate; it is reused only if the two turns also have the same numbers, negations and content "
        "words in the same order (see docs/cache.md).",
    )
    embed_timeout_s: float = Field(
        1.0,
        gt=0,
        description="Longest the lookup waits for the last turn's embedding; past it the request goes to "
        "the model without a semantic lookup, so a slow embedder costs hits, never the request's deadline.",
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
        10_000, ge=1, description="Most vectors per semantic namespace (model, revision, params, conversation "
        "context, scope) in the semantic index; oldest go first."
    )
    semantic_max_bytes: int = Field(
        64 * 2**20,
        ge=2**20,
        description="Memory budget of the whole semantic index of one CacheServer replica, all namespaces "
        "together (vectors, keys and questions); least recently used namespaces go first, and one "
        "namespace takes at most half of it.",
    )
    scope: Literal["per_key", "shared"] = Field(
        "per_key",
        description="Who may reuse a semantic entry. per_key: only requests with the same API key (a hash "
        "of it is in the namespace), so one tenant's answer, which may carry its private details, never "
        "answers another's merely similar question; with auth off there are no keys and this is the same "
        "as shared. shared: every caller. Exact entries are shared either way: an identical request gets "
        "the identical answer.",
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
