"""Prefix-affinity routing of a model's calls to its replicas: calls that share a long
prefix (a product line's system prompt) and the same LoRA adapter go to the replica
whose vLLM prefix cache already holds that prefix, unless its queue is much longer
than another replica's. There, balance wins.

This is the policy of Ray's ``PrefixCacheAffinityRouter`` (what Ray Serve LLM uses), as
a Serve ``RequestRouter`` of our own. Ray's router does not fit here, for three reasons:
- It reads a ``.messages`` list of dicts or a ``.prompt`` string, and raises on any other
  call. The same handle also carries our typed calls, gathered call lists, and the
  ``info()`` and stats calls.
- It asks a detached prefix-tree actor twice per request with a blocking ``ray.get``,
  which stalls the router's event loop.
- Its public import path loads vLLM into the router process.

Here the prefix memory (:class:`~serve_app.core.prefix_index.PrefixIndex`) lives in the
router replica itself. With several router replicas, each learns where prefixes went
from its own traffic.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.request_router import LocalityMixin, MultiplexMixin, RequestRouter

from serve_app.core.calls import GenerateCall
from serve_app.core.prefix_index import PrefixIndex

logger = logging.getLogger("ray.serve")

ROUTER_CLASS = f"{__name__}.PrefixAffinityRouter"


def affinity_text(call: Any) -> Optional[str]:
    """The text whose prefix decides a call's replica, or None (no affinity). The
    adapter leads it: vLLM caches an adapter's prefixes apart from the base model's."""
    if not isinstance(call, GenerateCall):
        return None
    if call.messages is not None:
        # Role markers between contents, as a chat template puts them, so a system
        # prompt followed by different questions shares exactly the system part.
        text = "".join(f"<{turn.role}>{turn.content}" for turn in call.messages)
    elif call.prompts and isinstance(call.prompts[0], str):
        text = call.prompts[0]
    else:  # token-id prompts: no text to match
        return None
    return f"<{call.adapter or ''}>{text}" if text else None


class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """See the module docstring. ``request_router_kwargs``: ``imbalanced_requests``
    (balance wins past this queue-length difference), ``block_chars`` and ``max_blocks``
    (the index's granularity and its memory per replica)."""

    def initialize_state(self, imbalanced_requests: int = 8, block_chars: int = 128, max_blocks: int = 16384,
                         **_: Any) -> None:
        self._imbalanced_requests = imbalanced_requests
        self._index = PrefixIndex(block_chars=block_chars, max_blocks=max_blocks)

    async def choose_replicas(self, candidate_replicas: List[Any], pending_request: Any = None) -> List[List[Any]]:
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        hashes = self._hashes(pending_request)
        if not hashes or not fallback or len(candidate_replicas) < 2:
            return fallback
        queue_lens = await self._queue_lens(candidate_replicas)
        # From here to the record, no await: calls routed at the same moment see each
        # other's choices, so a burst of new prefixes spreads instead of all picking the
        # replica that was emptiest before any of them.
        by_id = {r.replica_id: r for r in candidate_replicas}
        chosen, _ = self._index.best(by_id, hashes)
        if chosen is None:  # a prefix no replica holds: where the fewest prefixes are
            chosen = self._index.least_loaded(by_id)
        if queue_lens and queue_lens.get(chosen, 0) - min(queue_lens.values()) > self._imbalanced_requests:
            return fallback  # balance wins over the cached prefix, which stays where it is
        # Recorded at the choice: Serve tells a router where a request went
        # (on_request_routed) only when strict max_ongoing_requests is on, which it is not
        # by default. A chosen replica that turns the call away (full) still gets the
        # prefix's next calls.
        self._index.record(chosen, hashes)
        return [[by_id[chosen]], *fallback]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        hashes = self._hashes(pending_request)  # where the call really went, when Serve says
        if hashes:
            self._index.record(replica_id, hashes)

    def update_replicas(self, replicas: List[Any]) -> None:
        super().update_replicas(replicas)
        self._index.keep_only(r.replica_id for r in replicas)

    def _hashes(self, pending_request: Any) -> list:
        args = getattr(pending_request, "args", None) or ()
        text = affinity_text(args[0]) if args else None
        return self._index.hashes(text) if text else []

    async def _queue_lens(self, replicas: List[Any]) -> dict:
        """Each replica's requests in flight: the router's cache of them, else a probe."""
        lens, unknown = {}, []
        cache = self._replica_queue_len_cache if self._use_replica_queue_len_cache else None
        for replica in replicas:
            known = cache.get(replica.replica_id) if cache is not None else None
            if known is None:
                unknown.append(replica)
            else:
                lens[replica.replica_id] = known
        if unknown:
            for replica, queue_len in await self._probe_queue_lens(unknown, 0):
                if queue_len is not None:
                    lens[replica.replica_id] = queue_len
        return lens
