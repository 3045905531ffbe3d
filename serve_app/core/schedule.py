"""Daily load profiles: how many replicas a model should run at a given moment.

A profile splits the week into time-of-day windows (optionally only on weekdays or
weekends), each with a replica floor, a ceiling and a per-replica load target. The
schedule is a pure function of (profile, now, load): time is always passed in, so a
test can walk a whole day in microseconds and a simulation can compress one into
minutes. Standard library only: the Ray Serve policy in serve_app/scaling.py runs this
inside the Serve controller.

Rules, in the order :func:`decide` applies them:
1. The schedule's bounds take effect at once: below the floor scales up now, above the
   ceiling scales down now. A lead before a window with a higher floor opens, the
   floor is already raised, because a replica takes minutes to load on a cold GPU node.
   The lead is the model's measured start-up p95 plus ``prewarm_margin_s`` once replicas
   have reported their start-ups (:func:`prewarm_lead`), else ``prewarm_s``.
2. Inside the bounds, load decides: ``ceil(ongoing requests / target_ongoing_requests)``,
   applied once the wish has held for ``upscale_delay_s`` (up) or ``downscale_delay_s``
   (down), so a burst does not start and stop replicas. Down also waits at least the
   measured start-up p95: a replica let go and wanted back within its own start-up
   pays a whole start (and the CPU it takes from the replicas serving) for nothing.
   And while replicas already asked for are starting, load adds no more: what it reads
   then is traffic they will take.
All durations are in the profile's clock: under a simulated (compressed) clock a
downscale delay of 300 s passes in 300 simulated seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Iterator, Optional
from zoneinfo import ZoneInfo

from serve_app.core.recent import percentile

MINUTES_PER_DAY = 24 * 60
MINUTES_PER_WEEK = 7 * MINUTES_PER_DAY
DAY_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
DAY_SETS = {"all": tuple(range(7)), "weekdays": tuple(range(5)), "weekends": (5, 6)}


def parse_time_of_day(text: str, *, allow_24: bool = False) -> int:
    """'HH:MM' -> minutes after midnight. '24:00' only as a window's end."""
    hours, sep, minutes = str(text).partition(":")
    if not sep or not hours.isdigit() or not minutes.isdigit() or len(minutes) != 2:
        raise ValueError(f"time of day {text!r} must look like 'HH:MM', e.g. '07:30'")
    value = int(hours) * 60 + int(minutes)
    if int(minutes) >= 60 or value > MINUTES_PER_DAY or (value == MINUTES_PER_DAY and not allow_24):
        limit = "00:00..24:00" if allow_24 else "00:00..23:59"
        raise ValueError(f"time of day {text!r} is out of range {limit}")
    return value


def format_minute(minute_of_week: float) -> str:
    minute = int(minute_of_week) % MINUTES_PER_WEEK
    day, rest = divmod(minute, MINUTES_PER_DAY)
    return f"{DAY_NAMES[day]} {rest // 60:02d}:{rest % 60:02d}"


@dataclass(frozen=True)
class Window:
    """One time-of-day window. It opens at ``start_minute`` on each day in ``days`` and
    runs to ``end_minute``; an end at or before the start runs past midnight."""

    name: str
    start_minute: int
    end_minute: int
    days: tuple[int, ...]  # weekdays on which the window opens; Monday is 0
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float

    @property
    def duration_minutes(self) -> int:
        return (self.end_minute - self.start_minute) % MINUTES_PER_DAY or MINUTES_PER_DAY

    def spans(self) -> Iterator[tuple[int, int]]:
        """[start, end) in minutes of the week; end may pass the week's end (it wraps)."""
        for day in self.days:
            start = day * MINUTES_PER_DAY + self.start_minute
            yield start, start + self.duration_minutes

    def label(self) -> str:
        start, end = self.start_minute, self.end_minute
        return f"'{self.name}' ({start // 60:02d}:{start % 60:02d}-{end // 60:02d}:{end % 60:02d})"


@dataclass(frozen=True)
class SimulatedClock:
    """A compressed day for tests and demos: ``day_length_s`` real seconds are 24 h of
    profile time, starting at ``start_minute`` (of ``start_day``) at ``anchor_unix_s``."""

    day_length_s: float
    start_minute: int = 0
    start_day: int = 0  # weekday the simulation starts on; Monday is 0
    anchor_unix_s: Optional[float] = None  # None: when the policy first runs

    @property
    def speedup(self) -> float:
        return 86400.0 / self.day_length_s

    def at(self, real_unix_s: float, anchor_unix_s: float, tz: ZoneInfo) -> datetime:
        # 2024-01-01 was a Monday; any fixed Monday works, the date itself is never shown.
        origin = datetime(2024, 1, 1, tzinfo=tz) + timedelta(days=self.start_day, minutes=self.start_minute)
        return origin + timedelta(seconds=(real_unix_s - anchor_unix_s) * self.speedup)


@dataclass(frozen=True)
class LoadProfile:
    name: str
    timezone: str
    windows: tuple[Window, ...]
    prewarm_s: float = 0.0
    # None: the lead is always prewarm_s; a number: measured start-up p95 plus this.
    prewarm_margin_s: Optional[float] = None
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 300.0
    clock: Optional[SimulatedClock] = None

    @property
    def tz(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    @property
    def min_replicas(self) -> int:
        return min(w.min_replicas for w in self.windows)

    @property
    def max_replicas(self) -> int:
        return max(w.max_replicas for w in self.windows)

    @classmethod
    def from_config(cls, name: str, config: dict[str, Any]) -> "LoadProfile":
        """From the (already validated) JSON form of a ``load_profiles`` entry."""
        windows = tuple(
            Window(
                name=w["name"],
                start_minute=parse_time_of_day(w["start"]),
                end_minute=parse_time_of_day(w["end"], allow_24=True) % MINUTES_PER_DAY,
                days=DAY_SETS[w.get("days", "all")],
                min_replicas=int(w["min_replicas"]),
                max_replicas=int(w["max_replicas"]),
                target_ongoing_requests=float(w["target_ongoing_requests"]),
            )
            for w in config["windows"]
        )
        clock = None
        if config.get("clock"):
            c = config["clock"]
            clock = SimulatedClock(
                day_length_s=float(c["day_length_s"]),
                start_minute=parse_time_of_day(c.get("start_time", "00:00")),
                start_day=DAY_NAMES.index(c.get("start_day", "Mon")),
                anchor_unix_s=c.get("anchor_unix_s"),
            )
        return cls(
            name=name,
            timezone=config.get("timezone", "UTC"),
            windows=windows,
            prewarm_s=float(config.get("prewarm_s", 0.0)),
            prewarm_margin_s=None if config.get("prewarm_margin_s") is None else float(config["prewarm_margin_s"]),
            upscale_delay_s=float(config.get("upscale_delay_s", 30.0)),
            downscale_delay_s=float(config.get("downscale_delay_s", 300.0)),
            clock=clock,
        )

    def now(self, real_unix_s: float, started_unix_s: float) -> datetime:
        """Profile time at ``real_unix_s``: wall-clock time in the profile's zone, or the
        simulated clock (anchored at its own anchor, else at ``started_unix_s``)."""
        if self.clock is None:
            return datetime.fromtimestamp(real_unix_s, tz=self.tz)
        anchor = self.clock.anchor_unix_s if self.clock.anchor_unix_s is not None else started_unix_s
        return self.clock.at(real_unix_s, anchor, self.tz)


def coverage_problems(windows: list[Window]) -> list[str]:
    """Every minute of the week must belong to exactly one window. Describe each gap and
    overlap by time of day and the days it happens on, naming the windows; [] when the
    windows tile the week."""
    owners: list[tuple[str, ...]] = [() for _ in range(MINUTES_PER_WEEK)]
    for window in windows:
        for start, end in window.spans():
            for minute in range(start, end):
                owners[minute % MINUTES_PER_WEEK] += (window.name,)
    # Runs of minutes with the same wrong owners, grouped by (owners, time of day) so a
    # gap that repeats every day is reported once with its days.
    days_by_problem: dict[tuple[tuple[str, ...], str], list[str]] = {}
    minute = 0
    while minute < MINUTES_PER_WEEK:
        names = owners[minute]
        end = minute + 1
        while end < MINUTES_PER_WEEK and owners[end] == names:
            end += 1
        if len(names) != 1:
            times = f"{format_minute(minute)[4:]}-{format_minute(end)[4:]}"
            days_by_problem.setdefault((tuple(sorted(set(names))), times), []).append(format_minute(minute)[:3])
        minute = end
    problems = []
    for (names, times), days in days_by_problem.items():
        on = "every day" if len(days) == 7 else "on " + ", ".join(days)
        if names:
            problems.append(f"windows {', '.join(repr(n) for n in names)} overlap at {times} {on}")
        else:
            problems.append(f"no window covers {times} {on}")
    return problems


def minute_of_week(local: datetime) -> float:
    return local.weekday() * MINUTES_PER_DAY + local.hour * 60 + local.minute + local.second / 60


def active_window(profile: LoadProfile, now: datetime) -> Window:
    position = minute_of_week(now.astimezone(profile.tz))
    for window in profile.windows:
        for start, end in window.spans():
            if start <= position < end or start <= position + MINUTES_PER_WEEK < end:
                return window
    raise ValueError(f"load profile {profile.name!r} has no window at {format_minute(position)}")


def openings_within(profile: LoadProfile, now: datetime, horizon_s: float) -> Iterator[tuple[Window, float]]:
    """Windows that open in (now, now + horizon_s], with seconds until each opens.
    Counted in wall-clock minutes of the profile's zone (a DST change shifts it by 1 h)."""
    if horizon_s <= 0:
        return
    position = minute_of_week(now.astimezone(profile.tz))
    for window in profile.windows:
        for start, _ in window.spans():
            ahead_s = ((start - position) % MINUTES_PER_WEEK) * 60
            if 0 < ahead_s <= horizon_s:
                yield window, ahead_s


@dataclass(frozen=True)
class Bounds:
    """What the schedule allows right now."""

    min_replicas: int
    max_replicas: int
    window: Window
    prewarm_for: Optional[Window] = None  # the window whose floor is raised early
    prewarm_in_s: Optional[float] = None


@dataclass(frozen=True)
class PrewarmLead:
    """How long before a window opens its floor is raised, in the profile's clock, and why."""

    seconds: float
    reason: str
    # The measured start-up p95 in the profile's clock (None until a replica reported one):
    # how long a load-driven change waits, at least for down and at most for up (see decide).
    startup_s: Optional[float] = None


# Start-ups a policy keeps for the p95: enough for a stable figure, few enough to follow
# a change (a new image, a filled compile cache).
STARTUP_SAMPLES = 20


def prewarm_lead(profile: LoadProfile, startups_s: list[float]) -> PrewarmLead:
    """The prewarm lead: the measured start-up p95 of the model's replicas (real
    seconds, converted to the profile's clock) plus ``prewarm_margin_s``, once there is
    a measured start-up and a margin is configured; otherwise ``prewarm_s``. The p95
    itself travels along (``startup_s``) whenever a start-up was measured."""
    if not startups_s:
        suffix = " until a replica start is measured" if profile.prewarm_margin_s is not None else ""
        return PrewarmLead(profile.prewarm_s, f"prewarm_s {profile.prewarm_s:g} s{suffix}")
    p95 = percentile(startups_s, 95)
    speedup = profile.clock.speedup if profile.clock else 1.0
    clock = f" x {speedup:g} (simulated clock)" if profile.clock else ""
    startup_s = p95 * speedup
    startup = f"start-up p95 {p95:.1f} s of {len(startups_s)} start(s){clock}"
    if profile.prewarm_margin_s is None:
        return PrewarmLead(profile.prewarm_s, f"prewarm_s {profile.prewarm_s:g} s; {startup}", startup_s)
    lead = startup_s + profile.prewarm_margin_s
    return PrewarmLead(lead, f"{startup} + margin {profile.prewarm_margin_s:g} s = {lead:.0f} s", startup_s)


def scheduled_bounds(profile: LoadProfile, now: datetime, prewarm_s: Optional[float] = None) -> Bounds:
    """The bounds at ``now``; ``prewarm_s`` overrides the profile's lead (see prewarm_lead)."""
    window = active_window(profile, now)
    floor, prewarm_for, prewarm_in_s = window.min_replicas, None, None
    lead_s = profile.prewarm_s if prewarm_s is None else prewarm_s
    for upcoming, ahead_s in openings_within(profile, now, lead_s):
        if upcoming.min_replicas > floor:
            floor, prewarm_for, prewarm_in_s = upcoming.min_replicas, upcoming, ahead_s
    # While prewarming, the floor may pass the current window's ceiling.
    return Bounds(floor, max(window.max_replicas, floor), window, prewarm_for, prewarm_in_s)


def replicas_for_load(total_requests: float, target_ongoing_requests: float) -> int:
    # The small epsilon keeps 16.0000001 requests at target 8 from asking for 3 replicas.
    return max(0, math.ceil(total_requests / target_ongoing_requests - 1e-6))


@dataclass(frozen=True)
class Decision:
    replicas: int
    bounds: Bounds
    load_replicas: int  # what load alone asks for, before the bounds
    cause: str  # schedule_min | prewarm | schedule_max | load | load_pending | steady
    reason: str


def decide(
    profile: LoadProfile,
    now: datetime,
    total_requests: float,
    current_replicas: int,
    state: Optional[dict[str, Any]] = None,
    prewarm_s: Optional[float] = None,
    startup_s: Optional[float] = None,
    starting_replicas: int = 0,
) -> tuple[Decision, dict[str, Any]]:
    """The replica count for ``now``, and the state to pass to the next call.

    ``total_requests`` is the deployment's ongoing plus queued requests (Ray averages
    them over its look-back period); ``current_replicas`` is the current target. The
    state holds only the pending load-driven change (its direction and since when), or
    since when a scale-up has waited for starting replicas, as JSON-friendly values.
    ``prewarm_s``: the lead to use instead of the profile's (:func:`prewarm_lead`).
    ``startup_s``: the model's measured start-up p95, in the profile's clock; a
    load-driven scale-down waits at least that long, and while ``starting_replicas``
    (asked for, not yet running) start, load adds no more for up to twice that long.
    """
    state = dict(state or {})
    bounds = scheduled_bounds(profile, now, prewarm_s)
    window = bounds.window
    for_load = replicas_for_load(total_requests, window.target_ongoing_requests)
    wanted = min(max(for_load, bounds.min_replicas), bounds.max_replicas)
    load_text = f"load {total_requests:.1f} requests / target {window.target_ongoing_requests:g} per replica -> {for_load}"

    starting_since: Optional[float] = None  # set while a scale-up waits for starting replicas

    def done(replicas: int, cause: str, reason: str, pending: Optional[tuple[str, float]] = None):
        new_state = {"pending": pending[0], "pending_since": pending[1]} if pending else {}
        if starting_since is not None:
            new_state["starting_since"] = starting_since
        return Decision(replicas, bounds, for_load, cause, reason), new_state

    if current_replicas < bounds.min_replicas:
        if bounds.prewarm_for is not None:
            return done(
                bounds.min_replicas,
                "prewarm",
                f"prewarm for window {bounds.prewarm_for.label()} opening in {bounds.prewarm_in_s:.0f} s: "
                f"floor {bounds.min_replicas}",
            )
        return done(bounds.min_replicas, "schedule_min", f"window {window.label()} floor {bounds.min_replicas}")
    if current_replicas > bounds.max_replicas:
        return done(bounds.max_replicas, "schedule_max", f"window {window.label()} ceiling {bounds.max_replicas}")
    if wanted == current_replicas:
        return done(current_replicas, "steady", f"window {window.label()}: {load_text}, within [{bounds.min_replicas}, {bounds.max_replicas}]")

    direction = "up" if wanted > current_replicas else "down"
    now_s = now.timestamp()
    if direction == "up" and starting_replicas > 0 and startup_s is not None:
        # The replicas already asked for have not started: the load read now is traffic they
        # will take (and, where replicas share CPUs, what their start takes from the ones
        # serving), so more are added only once they run, or after twice the start-up p95
        # (a start that hangs must not block scaling).
        starting_since = float(state.get("starting_since", now_s))
        if now_s - starting_since < 2 * startup_s:
            return done(current_replicas, "load_pending", f"window {window.label()}: {load_text}; scaling up to "
                                                           f"{wanted} once the {starting_replicas} starting replica(s) run")
    delay_s = profile.upscale_delay_s if direction == "up" else profile.downscale_delay_s
    held_for = f"{delay_s:g} s"
    if direction == "down" and startup_s is not None and startup_s > delay_s:
        # Break-even: wanted back within its start-up, the replica would cost a start.
        delay_s = startup_s
        held_for = f"{delay_s:.0f} s (the start-up p95; downscale_delay_s {profile.downscale_delay_s:g} s)"
    since = state.get("pending_since") if state.get("pending") == direction else None
    since = now_s if since is None else float(since)
    if now_s - since >= delay_s:
        return done(wanted, "load", f"window {window.label()}: {load_text}, held {held_for}: {current_replicas} -> {wanted}")
    return done(
        current_replicas,
        "load_pending",
        f"window {window.label()}: {load_text}; scaling {direction} to {wanted} after {delay_s - (now_s - since):.0f} s more",
        pending=(direction, since),
    )
