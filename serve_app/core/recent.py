"""What happened in the last minute: a bounded time window of events, for /v1/stats.

Prometheus holds the long history; this answers "how is it doing right now" from the
ingress without a Prometheus server. Time is passed in, so tests need no sleeping.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from typing import Any, Iterable, Optional, Sequence


class RecentEvents:
    """Events (tuples whose first item is a monotonic time) of the last ``horizon_s``.

    Bounded by ``max_events`` too, so a burst cannot grow memory without limit; under
    such a burst the window covers less than ``horizon_s`` (``covered_s`` says how much).
    Thread-safe: model batches add from a worker thread while /v1/stats reads.
    """

    def __init__(self, horizon_s: float = 60.0, max_events: int = 50_000):
        self.horizon_s = horizon_s
        self._events: deque[tuple] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def add(self, *values: Any, now: Optional[float] = None) -> None:
        with self._lock:
            self._events.append((time.monotonic() if now is None else now, *values))

    def recent(self, now: Optional[float] = None) -> list[tuple]:
        now = time.monotonic() if now is None else now
        cutoff = now - self.horizon_s
        with self._lock:
            while self._events and self._events[0][0] < cutoff:
                self._events.popleft()
            return list(self._events)

    def covered_s(self, now: Optional[float] = None) -> float:
        events = self.recent(now)
        now = time.monotonic() if now is None else now
        if len(events) < (self._events.maxlen or 0):
            return self.horizon_s
        return now - events[0][0]


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def mean(values: Iterable[float]) -> Optional[float]:
    values = list(values)
    return sum(values) / len(values) if values else None
