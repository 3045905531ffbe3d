"""Ray Serve's throughput mode buffers a replica's log records until 1000 wait; the
flusher writes them out within a second instead."""

from __future__ import annotations

import logging
import logging.handlers
import threading
import time

from serve_app import serve_logs


def _buffered_logger(name: str):
    target = logging.handlers.BufferingHandler(capacity=10_000)  # stands in for the log file
    memory = logging.handlers.MemoryHandler(capacity=1000, target=target, flushLevel=logging.ERROR)
    logger = logging.getLogger(name)
    logger.handlers[:] = [memory]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, target


def test_buffered_records_are_written_out_by_a_flush():
    logger, file = _buffered_logger("serve-logs-test-flush")
    logger.warning("a warning on a quiet replica")
    assert file.buffer == []  # as Ray leaves it: in memory until 1000 records or an ERROR
    assert serve_logs.flush_buffered_logs("serve-logs-test-flush") == 1
    assert [r.getMessage() for r in file.buffer] == ["a warning on a quiet replica"]
    assert serve_logs.flush_buffered_logs("serve-logs-test-flush") == 0  # nothing left


def test_the_flusher_thread_writes_ray_serve_records_within_its_interval(monkeypatch):
    logger, file = _buffered_logger(serve_logs.SERVE_LOGGER)
    monkeypatch.setattr(serve_logs, "_flusher", None)
    serve_logs.start_log_flusher(interval_s=0.05)
    serve_logs.start_log_flusher(interval_s=0.05)  # once per process
    logger.info("payload model=m input=x")
    deadline = time.monotonic() + 5
    while not file.buffer and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [r.getMessage() for r in file.buffer] == ["payload model=m input=x"]
    assert any(t.name == "serve-log-flusher" and t.daemon for t in threading.enumerate())
    logger.handlers.clear()
