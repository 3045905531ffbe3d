"""Which revision of each model the router reads cache keys under.

A model's revision comes from one of its replicas (``ModelServer.info``) and is re-read
every ``revision_refresh_s``, so a newly loaded revision makes the old entries
unreachable. It never goes back: during a rolling update the re-read lands on an old or a
new replica at random, and a read from a replica loaded before the one the known
revision came from (``ModelInfo.loaded_at``) is an older revision, so it is kept out. A
rollback starts replicas later still, so it is taken like any update.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Optional

from serve_app.config import ModelConfig
from serve_app.ingress.model_client import ModelClient


@dataclasses.dataclass
class KnownRevision:
    """What the router knows of a model's revision (from ``ModelServer.info``)."""

    revision: str
    loaded_at: Optional[float]  # when the replica that reported it loaded (time.time())
    read_at: float  # time.monotonic() of the last read
    max_input_tokens: Optional[int] = None
    # Revisions seen on replicas loaded before this one's (the old side of a rolling update).
    older: set = dataclasses.field(default_factory=set)


class RevisionTracker:
    def __init__(self, client: ModelClient, refresh_s: float):
        self.client = client
        self.refresh_s = refresh_s
        self.known: dict[str, KnownRevision] = {}

    async def read(self, model: ModelConfig, deadline: Optional[float] = None) -> str:
        """The model's revision for reading cache keys: the configured one, else the
        newest its replicas reported (see the module docstring)."""
        if model.cache.revision:
            return model.cache.revision
        known = self.known.get(model.name)
        now = time.monotonic()
        if known is not None and now - known.read_at < self.refresh_s:
            return known.revision
        try:
            info = await self.client.info(model, deadline=deadline)
        except Exception:
            if known is not None:  # keep serving with the last known revision
                return known.revision
            raise
        if known is not None and info.revision != known.revision and not _loaded_later(info.loaded_at,
                                                                                       known.loaded_at):
            known.older.add(info.revision)  # the old side of an update answered: keep ours
            known.read_at = now
            return known.revision
        older = set() if known is None else (known.older | {known.revision}) - {info.revision}
        loaded_at = info.loaded_at
        if known is not None and info.revision == known.revision and known.loaded_at is not None:
            loaded_at = max(known.loaded_at, loaded_at or known.loaded_at)
        # Bounded: only revisions seen beside each other during updates, the last few kept.
        self.known[model.name] = KnownRevision(info.revision, loaded_at, now, info.max_input_tokens,
                                               set(list(older)[-8:]))
        return info.revision

    def saw(self, model: ModelConfig, revision: Optional[str]) -> None:
        """An answer came from a replica of ``revision``. One the router has not seen
        yet means replicas of another revision now serve: re-read the revision at the
        next request (at most once a second) rather than up to revision_refresh_s later,
        so reads move to the new revision's keys soon after its first replica answers."""
        known = self.known.get(model.name)
        if model.cache.revision or known is None or revision is None:
            return
        if revision != known.revision and revision not in known.older:
            if time.monotonic() - known.read_at >= min(1.0, self.refresh_s):
                known.read_at = -math.inf

    def max_input_tokens(self, model: ModelConfig) -> Optional[int]:
        """The model's context as its replica reported it; None before the first read."""
        known = self.known.get(model.name)
        return known.max_input_tokens if known is not None else None

    def of_result(self, model: ModelConfig, result: Any) -> str:
        """The revision an answer belongs to: the one its replica reported, else the
        configured or last known one."""
        reported = getattr(result, "revision", None)
        if reported:
            return str(reported)
        if model.cache.revision:
            return model.cache.revision
        known = self.known.get(model.name)
        return known.revision if known is not None else "unknown"


def _loaded_later(loaded_at: Optional[float], than: Optional[float]) -> bool:
    """Whether a replica loaded at ``loaded_at`` came after one loaded at ``than``. A
    replica that does not say is older code than one that does (``loaded_at`` came with
    answer revisions), so it is later only if neither says."""
    if loaded_at is None:
        return than is None
    return than is None or loaded_at >= than
