"""Which replica has seen a prompt's prefix: the memory behind prefix-affinity routing.

A prompt's text is cut into blocks of ``block_chars``, and each block gets a hash chained
over every block before it (as vLLM's prefix cache chains its KV block hashes), so that
block i's hash stands for the whole prefix up to it. Each replica keeps the hashes of
the prompts sent to it, least recently used dropped first, so what the index remembers
follows what the replica's KV cache is likely still to hold.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Hashable, Iterable, Optional


def block_hashes(text: str, block_chars: int) -> list[bytes]:
    """The chained hash of each whole block of ``text`` (a tail shorter than a block
    is left out: a prefix cache reuses whole blocks only)."""
    hashes, previous = [], b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + text[start:start + block_chars].encode(), digest_size=8).digest()
        hashes.append(previous)
    return hashes


class PrefixIndex:
    """Per replica, the prefix blocks it was sent (at most ``max_blocks`` each)."""

    def __init__(self, *, block_chars: int = 128, max_blocks: int = 16384):
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self._blocks: dict[Hashable, OrderedDict] = {}

    def hashes(self, text: str) -> list[bytes]:
        return block_hashes(text, self.block_chars)

    def matched(self, replica: Hashable, hashes: list[bytes]) -> int:
        """How many leading blocks of the prompt the replica was sent."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        count = 0
        for h in hashes:  # chained: a block matches only if every block before it did
            if h not in blocks:
                break
            count += 1
        return count

    def best(self, replicas: Iterable[Hashable], hashes: list[bytes]) -> tuple[Optional[Hashable], int]:
        """The replica holding the longest prefix of the prompt and its block count;
        (None, 0) where none holds its first block."""
        best, best_count = None, 0
        for replica in replicas:
            count = self.matched(replica, hashes)
            if count > best_count:
                best, best_count = replica, count
        return best, best_count

    def least_loaded(self, replicas: Iterable[Hashable]) -> Optional[Hashable]:
        """The replica remembered to hold the fewest blocks: where a new prefix goes, so
        that distinct prefixes spread over the replicas."""
        return min(replicas, key=lambda r: len(self._blocks.get(r, ())), default=None)

    def record(self, replica: Hashable, hashes: list[bytes]) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        """Forget replicas that are gone (scaled down, replaced)."""
        alive = set(replicas)
        for replica in [r for r in self._blocks if r not in alive]:
            del self._blocks[replica]
