"""The daily-profile policy moves a live deployment through the windows of a compressed day."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from ray import serve

from serving_apps import profiled_app

pytestmark = pytest.mark.integration

# Real seconds per simulated hour: a day in 144 s. A tiny replica took 35-38 s to start
# late in the full suite on a busy 2-core machine (avx2 only): the night (48 s) covers the
# deploy, and the peak's third replica has the prewarm plus the peak (9 simulated hours,
# 54 s) to come up before the evening takes it away.
HOUR_S = 6.0


def _window(name, start, end, replicas):
    return {"name": name, "start": start, "end": end, "min_replicas": replicas, "max_replicas": replicas,
            "target_ongoing_requests": 8}


def _running(app: str, deployment: str) -> int:
    status = serve.status().applications.get(app)
    if status is None or deployment not in status.deployments:
        return 0
    return status.deployments[deployment].replica_states.get("RUNNING", 0)


def _controller_logs() -> list[Path]:
    from ray._private.worker import global_worker

    return sorted((Path(global_worker.node.get_session_dir_path()) / "logs" / "serve").glob("controller_*.log"))


def _log_lines() -> dict[Path, list[str]]:
    return {path: path.read_text(errors="replace").splitlines() for path in _controller_logs()}


def _lines_after(marks: dict[Path, int]) -> list[str]:
    """The controller log lines written since ``marks`` (line counts per file) were taken."""
    return [line for path, lines in _log_lines().items() for line in lines[marks.get(path, 0):]]


_DECISION = re.compile(r"serve_app schedule: model=tiny-embed time=\w+ (\d\d):(\d\d) \(simulated clock\) "
                       r"replicas=(\d+) cause=(\w+): (.*)")


def test_policy_follows_three_windows_of_a_compressed_day(redeploy_apps, tiny_bert_embedding_dir, serve_instance):
    marks = {path: len(lines) for path, lines in _log_lines().items()}
    start = time.time()
    profile = {
        "timezone": "Europe/Berlin",
        # Three simulated hours (18 s) of lead before a window with a higher floor.
        "prewarm_s": 3 * 3600,
        "upscale_delay_s": 0,
        "downscale_delay_s": 0,
        "look_back_period_s": 2,
        # The clock reads 00:00 at `start`; the night leaves time for the deploy itself.
        "clock": {"day_length_s": 24 * HOUR_S, "start_time": "00:00", "anchor_unix_s": start},
        "windows": [
            _window("night", "00:00", "08:00", 1),
            _window("morning", "08:00", "12:00", 2),
            _window("peak", "12:00", "18:00", 3),
            _window("evening", "18:00", "24:00", 1),
        ],
    }
    redeploy_apps([profiled_app("daily", tiny_bert_embedding_dir, profile)])

    # Sample the running replicas until they are back to one after the peak, well into the
    # simulated evening (18:00 is +108 s); a slow replica start only makes the wait longer.
    timeline: list[tuple[float, int]] = []
    while time.time() - start < 18 * HOUR_S + 40:
        timeline.append((time.time() - start, _running("daily", "ModelServer-tiny-embed")))
        if timeline[-1][0] > 18 * HOUR_S and timeline[-1][1] == 1 and any(n >= 3 for _, n in timeline):
            break
        time.sleep(0.5)
    counts = [n for _, n in timeline]
    phases = [n for i, n in enumerate(counts) if i == 0 or n != counts[i - 1]]

    def first_at(test, after: float = 0.0) -> float:
        return next(t for t, n in timeline if test(n) and t >= after)

    # The policy's decisions, by simulated time, from the controller log: each change of
    # course is one line with its cause. These are the schedule's own doing and do not
    # depend on how fast this machine starts a replica.
    decisions = []
    for line in _lines_after(marks):
        if found := _DECISION.search(line):
            hour, minute, replicas, cause, reason = found.groups()
            decisions.append((int(hour) * 60 + int(minute), int(replicas), cause, reason))
    summary = [f"{m // 60:02d}:{m % 60:02d} {r} {c}" for m, r, c, _ in decisions]

    def decided(replicas: int, after_min: int = 0):
        return next(d for d in decisions if d[1] == replicas and d[0] >= after_min)

    # Prewarm: two replicas asked for from 05:00, three hours before the morning (08:00)
    # opens, and three from 09:00 for the peak (12:00); the evening (18:00) takes both away.
    two, three = decided(2), decided(3)
    one = decided(1, after_min=three[0])
    assert two[2] == "prewarm" and 5 * 60 <= two[0] < 8 * 60 and "'morning'" in two[3], summary
    assert three[2] == "prewarm" and 9 * 60 <= three[0] < 12 * 60 and "'peak'" in three[3], summary
    assert one[2] == "schedule_max" and one[0] >= 18 * 60 and "'evening'" in one[3], summary

    # The replicas followed, in order: none started before the policy asked for it, and the
    # scale-down waited for the evening. How late a replica is running after the decision
    # is this machine's start-up time (5-17 s seen in the full suite on 2 cores), not the policy's.
    assert max(counts) == 3, f"replica counts seen: {phases}"
    at_two, at_three = first_at(lambda n: n >= 2), first_at(lambda n: n >= 3)
    back_to_one = first_at(lambda n: n == 1, after=at_three)
    assert 5 * HOUR_S <= at_two <= at_three < back_to_one, f"phases {phases} over {timeline}"
    assert at_three >= 9 * HOUR_S, f"three replicas at +{at_three:.1f}s"
    assert back_to_one >= 18 * HOUR_S, f"scaled down before the evening, at +{back_to_one:.1f}s"

    # The deployment still serves.
    reply = httpx.post(f"{serve_instance}/daily/v1/embeddings", json={"model": "tiny-embed", "input": "hi"}, timeout=30)
    assert reply.status_code == 200, reply.text
