"""Ray Serve autoscaling policy that follows a daily load profile.

``build_app`` names :class:`DailyProfilePolicy` in a model deployment's
``autoscaling_config.policy`` with the profile as ``policy_kwargs``; the Serve
controller instantiates it once per deployment and calls it every control-loop tick
(about 0.1 s) with an ``AutoscalingContext``. All the deciding happens in
:func:`serve_app.core.schedule.decide`; this class only adapts Ray's context to it and
publishes the decision as metrics and a log line when it changes.

Serve itself still applies the deployment's min/max (the profile's overall floor and
ceiling) and its own up/down delays, which ``build_app`` sets to zero: the profile's
delays are applied here instead, so that a window change is never held back by them.
The controller imports this module (and serve_app.core.schedule), so serve_app must be
installed on the head node; cluster.yaml's setup commands do that.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from serve_app.core.schedule import STARTUP_SAMPLES, Decision, LoadProfile, PrewarmLead, decide, prewarm_lead

# The custom metrics each ModelServer replica reports (its record_autoscaling_stats):
# the calls in progress, and how long the replica took from its process start to ready.
ONGOING_CALLS_METRIC = "ongoing_calls"
STARTUP_METRIC = "startup_s"

logger = logging.getLogger("ray.serve")

POLICY_IMPORT_PATH = "serve_app.scaling:DailyProfilePolicy"
_STATE_KEY = "serve_app_schedule"
_STARTUPS_KEY = "serve_app_startups"


class _ScheduleMetrics:
    """Gauges exported from the Serve controller (ray.util.metrics: the controller is
    not a replica, so ray.serve.metrics' replica labels do not apply)."""

    def __init__(self, model: str, window_names: list[str]) -> None:
        from ray.util import metrics

        self._tags = {"model": model}
        self.min_replicas = metrics.Gauge(
            "serve_app_schedule_min_replicas", description="Replica floor the load profile sets now.", tag_keys=("model",)
        )
        self.max_replicas = metrics.Gauge(
            "serve_app_schedule_max_replicas", description="Replica ceiling the load profile sets now.", tag_keys=("model",)
        )
        self.desired = metrics.Gauge(
            "serve_app_schedule_desired_replicas",
            description="Replicas the daily-profile policy asks Ray Serve for.",
            tag_keys=("model",),
        )
        self.for_load = metrics.Gauge(
            "serve_app_schedule_load_replicas",
            description="Replicas the load alone asks for, before the schedule's bounds.",
            tag_keys=("model",),
        )
        self.window = metrics.Gauge(
            "serve_app_schedule_window_active",
            description="1 for the load-profile window in force, 0 for the others.",
            tag_keys=("model", "window"),
        )
        self.prewarm_lead = metrics.Gauge(
            "serve_app_schedule_prewarm_lead_seconds",
            description="How long before a window opens its floor is raised (profile clock): the measured "
            "start-up p95 plus the margin, or prewarm_s.",
            tag_keys=("model",),
        )
        self._window_names = window_names

    def publish(self, decision: Decision, lead: PrewarmLead) -> None:
        self.prewarm_lead.set(lead.seconds, tags=self._tags)
        self.min_replicas.set(decision.bounds.min_replicas, tags=self._tags)
        self.max_replicas.set(decision.bounds.max_replicas, tags=self._tags)
        self.desired.set(decision.replicas, tags=self._tags)
        self.for_load.set(decision.load_replicas, tags=self._tags)
        for name in self._window_names:
            self.window.set(1 if name == decision.bounds.window.name else 0, tags={**self._tags, "window": name})


def load(ctx: Any) -> float:
    """The deployment's load in calls: ongoing in its replicas plus queued for them.

    Serve counts requests, and the router sends concurrent embedding and classification
    calls to a model as one request (``ModelServer.infer_many``), so Serve's count alone
    would read a replica busy with 30 calls as busy with 2. Each replica reports its
    calls in progress (``record_autoscaling_stats``); Serve's own count still covers
    requests queued in handles and replicas that have not reported yet, so the larger
    of the two is the load.
    """
    requests = float(ctx.total_num_requests or 0.0)
    ongoing = (getattr(ctx, "aggregated_metrics", None) or {}).get(ONGOING_CALLS_METRIC)
    if not ongoing:
        return requests
    return max(requests, sum(ongoing.values()) + float(getattr(ctx, "total_queued_requests", 0.0) or 0.0))


def startups(ctx: Any, known: dict[str, float]) -> dict[str, float]:
    """``known`` (replica id -> start-up seconds) with the start-ups that running replicas
    report now, keeping the latest :data:`STARTUP_SAMPLES` replicas: a replica reports its
    start-up as long as it runs, and it is remembered after it stops."""
    reported = (getattr(ctx, "aggregated_metrics", None) or {}).get(STARTUP_METRIC) or {}
    merged = dict(known)
    for replica, seconds in reported.items():
        key = getattr(replica, "unique_id", None) or str(replica)
        if seconds and seconds > 0 and key not in merged:
            merged[key] = round(float(seconds), 3)
    return dict(list(merged.items())[-STARTUP_SAMPLES:])


class DailyProfilePolicy:
    """Replicas from the time-of-day window, prewarm and load (see core/schedule.py)."""

    def __init__(self, model: str, profile_name: str, profile: dict[str, Any]) -> None:
        self.model = model
        self.profile = LoadProfile.from_config(profile_name, profile)
        self._started_unix_s: Optional[float] = None
        self._last_logged: Optional[tuple] = None
        self._metrics: Optional[_ScheduleMetrics] = None
        self.last_decision: Optional[Decision] = None
        self.last_lead: Optional[PrewarmLead] = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        real_now = ctx.current_time if getattr(ctx, "current_time", None) else time.time()
        if self._started_unix_s is None:
            self._started_unix_s = real_now
        now = self.profile.now(real_now, self._started_unix_s)
        policy_state = ctx.policy_state or {}
        measured = startups(ctx, policy_state.get(_STARTUPS_KEY) or {})
        lead = prewarm_lead(self.profile, list(measured.values()))
        decision, state = decide(
            self.profile,
            now,
            total_requests=load(ctx),
            current_replicas=int(ctx.target_num_replicas),
            state=policy_state.get(_STATE_KEY),
            prewarm_s=lead.seconds,
            startup_s=lead.startup_s,
            # Serve's target counts replicas still starting; current_num_replicas, those running.
            starting_replicas=max(0, int(ctx.target_num_replicas) - int(getattr(ctx, "current_num_replicas",
                                                                                 ctx.target_num_replicas))),
        )
        self.last_decision = decision
        self.last_lead = lead
        self._publish(decision, now, lead)
        return decision.replicas, {_STATE_KEY: state, _STARTUPS_KEY: measured}

    def _publish(self, decision: Decision, now, lead: PrewarmLead) -> None:
        try:
            if self._metrics is None:
                self._metrics = _ScheduleMetrics(self.model, [w.name for w in self.profile.windows])
            self._metrics.publish(decision, lead)
        except Exception:  # metrics must never stop scaling (e.g. Ray metrics not initialised)
            logger.debug("serve_app: could not publish schedule metrics", exc_info=True)
        # One line per change of course, not one per tick.
        key = (decision.replicas, decision.cause, decision.bounds.window.name, decision.bounds.prewarm_for)
        if key != self._last_logged:
            self._last_logged = key
            clock = " (simulated clock)" if self.profile.clock else ""
            logger.info(
                "serve_app schedule: model=%s time=%s%s replicas=%d cause=%s: %s; prewarm lead %.0f s (%s)",
                self.model,
                now.strftime("%a %H:%M"),
                clock,
                decision.replicas,
                decision.cause,
                decision.reason,
                lead.seconds,
                lead.reason,
            )
