"""The HTTP ingress (``args.router``) and its API keys (``args.auth``)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from serve_app.config.base import _Section


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
    gather_calls: bool = Field(
        True,
        description="Send concurrent embedding and text-classification calls to a model as one Serve request "
        "(each keeps its own result and errors): 40-55% less CPU per call in the router and the model "
        "replica, measured on 2 cores. Generation and image calls always travel alone (a group answers when "
        "its slowest call ends).",
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
