"""Log lines of a replica reach its log file within a second, whatever Ray buffers.

Under ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` (serve_app's default, see :mod:`serve_app.ray_env`)
Ray Serve buffers the replica's ``ray.serve`` log records in memory, 1000 at a time
(``RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE``), and writes them out only when the buffer is
full or an ERROR arrives. That saves a file write per access-log line, but on a quiet
replica a warning, a payload log (``router.log_payloads``) or a retune could wait hours
to be seen. A daemon thread per process flushes the buffer every second instead: writes
stay batched, and nothing waits longer than that.
"""

from __future__ import annotations

import logging
import logging.handlers
import threading
import time

SERVE_LOGGER = "ray.serve"
FLUSH_INTERVAL_S = 1.0

_started = threading.Lock()
_flusher: threading.Thread | None = None


def flush_buffered_logs(logger_name: str = SERVE_LOGGER) -> int:
    """Write out what the logger's buffering handlers hold; returns how many it flushed."""
    flushed = 0
    for handler in logging.getLogger(logger_name).handlers:
        if isinstance(handler, logging.handlers.BufferingHandler) and handler.buffer:
            handler.flush()
            flushed += 1
    return flushed


def _flush_forever(interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        try:
            flush_buffered_logs()
        except Exception:  # a failing flush must never take the replica down; the next one retries
            pass


def start_log_flusher(interval_s: float = FLUSH_INTERVAL_S) -> None:
    """Start this process's flushing thread (once; later calls do nothing)."""
    global _flusher
    with _started:
        if _flusher is None:
            _flusher = threading.Thread(target=_flush_forever, args=(interval_s,), name="serve-log-flusher", daemon=True)
            _flusher.start()
