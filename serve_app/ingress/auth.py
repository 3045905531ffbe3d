"""API keys: who may call the service, and who may call its admin endpoints.

Keys come from environment variables (comma-separated) and/or files (one key per
line, '#' comments), never from the YAML itself. A presented key is compared with
every known key in constant time, so timing reveals neither a key's prefix nor which
key matched.
"""

from __future__ import annotations

import hashlib

import hmac
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Iterable, Mapping, Optional

from serve_app.core.errors import AuthenticationError, PermissionDeniedError


class Role(Enum):
    USER = "user"
    ADMIN = "admin"


def read_keys(env_var: Optional[str], file: Optional[str], environ: Mapping[str, str] = os.environ) -> list[str]:
    keys: list[str] = []
    if env_var and environ.get(env_var):
        keys += [k.strip() for k in environ[env_var].split(",")]
    if file:
        for line in Path(file).expanduser().read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    return [k for k in keys if k]


def _matches_any(presented: bytes, keys: Iterable[bytes]) -> bool:
    found = False
    for key in keys:  # no early exit: every key is compared every time
        found |= hmac.compare_digest(presented, key)
    return found


@dataclass(frozen=True)
class ApiKeys:
    user_keys: tuple[bytes, ...]
    admin_keys: tuple[bytes, ...]

    @classmethod
    def load(cls, *, user_env: Optional[str], user_file: Optional[str], admin_env: Optional[str],
             admin_file: Optional[str], environ: Mapping[str, str] = os.environ) -> "ApiKeys":
        users = read_keys(user_env, user_file, environ)
        admins = read_keys(admin_env, admin_file, environ)
        if not users and not admins:
            sources = ", ".join(s for s in (f"${user_env}" if user_env else "", user_file or "",
                                            f"${admin_env}" if admin_env else "", admin_file or "") if s)
            raise ValueError(f"auth is enabled but no API keys were found in {sources or 'any source'}; "
                             "set the variables or files, or turn auth off")
        short = [k for k in users + admins if len(k) < 16]
        if short:
            raise ValueError(f"{len(short)} API key(s) are shorter than 16 characters; use long random keys")
        return cls(tuple(k.encode() for k in users), tuple(k.encode() for k in admins))

    def role_of(self, authorization: Optional[str]) -> Optional[Role]:
        """The role of an ``Authorization: Bearer <key>`` header; None if no known key."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = token.strip().encode()
        is_admin = _matches_any(presented, self.admin_keys)
        is_user = _matches_any(presented, self.user_keys)
        return Role.ADMIN if is_admin else Role.USER if is_user else None

    def authorize(self, authorization: Optional[str], *, admin: bool) -> Role:
        """The caller's role, or the error to answer with: 401 without a known key,
        403 for a user key on an admin endpoint (admin keys may call everything)."""
        role = self.role_of(authorization)
        if role is None:
            if not authorization:
                raise AuthenticationError("missing API key; send 'Authorization: Bearer <key>'")
            raise AuthenticationError("invalid API key")
        if admin and role is not Role.ADMIN:
            raise PermissionDeniedError("this endpoint needs an admin API key")
        return role


def key_identity(authorization: Optional[str]) -> Optional[str]:
    """A stable hash of the bearer key in an ``Authorization`` header; None without one.
    The request context carries it as the caller, for the semantic cache's scope
    (``cache.scope: per_key``): only the hash travels, the raw key never reaches a
    namespace, a log line or the CacheServer."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    # Domain-separated so that this hash is good for nothing but telling callers apart.
    return hashlib.sha256(b"serve_app caller\0" + token.encode()).hexdigest()[:32]
