"""The daily schedule: a pure function of (profile, now, load), walked with a fake clock."""

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest

from serve_app.config import ConfigError, parse_app_config
from serve_app.core.schedule import (
    LoadProfile,
    active_window,
    decide,
    parse_time_of_day,
    prewarm_lead,
    replicas_for_load,
    scheduled_bounds,
)

UTC = timezone.utc


def _window(name, start, end, lo, hi, days="all", target=8):
    return {"name": name, "start": start, "end": end, "days": days,
            "min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": target}


DAY = {
    "timezone": "UTC",
    "prewarm_s": 600,
    "upscale_delay_s": 30,
    "downscale_delay_s": 300,
    "windows": [
        _window("night", "22:00", "07:00", 1, 2),  # wraps past midnight
        _window("peak", "07:00", "17:00", 4, 10, days="weekdays"),
        _window("weekend-day", "07:00", "17:00", 2, 4, days="weekends"),
        _window("evening", "17:00", "22:00", 2, 6),
    ],
}


def _profile(config=DAY, name="day") -> LoadProfile:
    # Through the config model, as build_app does, so the unit tests cover that path too.
    app = parse_app_config({
        "models": [{"name": "m", "source": "package:x", "task": "embedding", "load_profile": name}],
        "load_profiles": {name: config},
    })
    return app.load_profiles[name].to_schedule(name)


def _at(day: int, hhmm: str, tz=UTC, seconds=0) -> datetime:
    """Weekday ``day`` (Monday 0) of the week of 2024-01-01, which was a Monday."""
    minute = parse_time_of_day(hhmm)
    return datetime(2024, 1, 1 + day, minute // 60, minute % 60, seconds, tzinfo=tz)


MON, SAT, SUN = 0, 5, 6


@pytest.mark.parametrize(
    "when, window",
    [
        (_at(MON, "06:59", seconds=59), "night"),
        (_at(MON, "07:00"), "peak"),
        (_at(MON, "16:59", seconds=59), "peak"),
        (_at(MON, "17:00"), "evening"),
        (_at(MON, "22:00"), "night"),
        (_at(MON, "23:59", seconds=59), "night"),
        (_at(MON, "00:00"), "night"),  # Sunday's night window, wrapped into Monday
        (_at(SAT, "10:00"), "weekend-day"),
        (_at(SUN, "16:59"), "weekend-day"),
        (_at(SUN, "23:30"), "night"),
    ],
)
def test_window_edges_wrap_and_weekends(when, window):
    assert active_window(_profile(), when).name == window


def test_timezone_is_the_profiles_not_the_callers():
    profile = _profile({**DAY, "timezone": "America/New_York"})
    # 11:59 UTC in January is 06:59 in New York (EST, UTC-5): still night there.
    assert active_window(profile, _at(MON, "11:59")).name == "night"
    assert active_window(profile, _at(MON, "12:00")).name == "peak"
    # The same instant given in another zone gives the same answer.
    assert active_window(profile, _at(MON, "12:00").astimezone(ZoneInfo("Asia/Tokyo"))).name == "peak"


def test_prewarm_raises_the_floor_before_the_window_opens():
    profile = _profile()
    early = scheduled_bounds(profile, _at(MON, "06:49"))  # 11 min before the peak
    assert (early.min_replicas, early.prewarm_for) == (1, None)
    warm = scheduled_bounds(profile, _at(MON, "06:50"))  # exactly prewarm_s ahead
    assert warm.min_replicas == 4 and warm.prewarm_for.name == "peak" and warm.prewarm_in_s == 600
    # The floor passes the night's ceiling (2), so the ceiling follows it.
    assert warm.max_replicas == 4 and warm.window.name == "night"
    decision, _ = decide(profile, _at(MON, "06:55"), total_requests=0, current_replicas=1)
    assert decision.replicas == 4 and decision.cause == "prewarm" and "opening in 300 s" in decision.reason
    # Saturday's day window has a lower floor (2): prewarm asks for that, not the weekday peak.
    assert scheduled_bounds(profile, _at(SAT, "06:55")).min_replicas == 2


def test_prewarm_looks_past_midnight_and_ignores_lower_floors():
    config = {**DAY, "windows": [_window("early", "00:05", "12:00", 3, 3), _window("rest", "12:00", "00:05", 1, 1)]}
    profile = _profile(config)
    # Sunday 23:56 is 9 minutes before Monday's 00:05 opening: across midnight and the week's end.
    assert scheduled_bounds(profile, _at(SUN, "23:56")).min_replicas == 3
    assert scheduled_bounds(profile, _at(SUN, "23:54")).min_replicas == 1
    # Ahead of a window with a lower floor, nothing changes early.
    assert scheduled_bounds(profile, _at(MON, "11:55")).min_replicas == 3


@pytest.mark.parametrize(
    "load, current, expected, cause",
    [
        (1000, 6, 10, "load"),  # clamped to the peak's max
        (0, 4, 4, "steady"),  # the peak's floor holds with no load
        (40, 5, 5, "steady"),  # 40 / 8 = 5
        (0, 1, 4, "schedule_min"),  # below the floor: up at once
        (0, 12, 10, "schedule_max"),  # above the ceiling: down at once
    ],
)
def test_bounds_clamp_load(load, current, expected, cause):
    profile = _profile({**DAY, "upscale_delay_s": 0})
    decision, _ = decide(profile, _at(MON, "12:00"), total_requests=load, current_replicas=current)
    assert (decision.replicas, decision.cause) == (expected, cause)


def test_load_changes_wait_for_their_delays():
    profile = _profile()
    noon = _at(MON, "12:00")
    decision, state = decide(profile, noon, total_requests=48, current_replicas=4)  # load wants 6
    assert (decision.replicas, decision.cause) == (4, "load_pending") and "after 30 s" in decision.reason
    decision, state = decide(profile, noon + timedelta(seconds=29), total_requests=48, current_replicas=4, state=state)
    assert decision.replicas == 4
    decision, state = decide(profile, noon + timedelta(seconds=30), total_requests=48, current_replicas=4, state=state)
    assert decision.replicas == 6 and decision.cause == "load" and state == {}
    # Down needs downscale_delay_s (300 s) of lower load; a flip back up restarts the wait.
    t = noon + timedelta(seconds=60)
    decision, state = decide(profile, t, total_requests=8, current_replicas=6, state=state)
    assert decision.replicas == 6
    decision, state = decide(profile, t + timedelta(seconds=200), total_requests=8, current_replicas=6, state=state)
    assert decision.replicas == 6
    decision, state = decide(profile, t + timedelta(seconds=250), total_requests=56, current_replicas=6, state=state)
    assert decision.cause == "load_pending" and state["pending"] == "up"
    decision, state = decide(profile, t + timedelta(seconds=260), total_requests=8, current_replicas=6, state=state)
    decision, state = decide(profile, t + timedelta(seconds=500), total_requests=8, current_replicas=6, state=state)
    assert decision.replicas == 6, "the down wait restarted at +260 s"
    decision, state = decide(profile, t + timedelta(seconds=560), total_requests=8, current_replicas=6, state=state)
    assert decision.replicas == 4 and decision.cause == "load"


def test_window_close_acts_at_once_despite_the_downscale_delay():
    profile = _profile()
    # 9 replicas at the peak; at 17:00 the evening's ceiling (6) applies immediately.
    decision, _ = decide(profile, _at(MON, "17:00"), total_requests=200, current_replicas=9)
    assert (decision.replicas, decision.cause) == (6, "schedule_max")


def test_simulated_clock_compresses_a_day():
    config = {**DAY, "clock": {"day_length_s": 240, "start_time": "06:00", "start_day": "Sat", "anchor_unix_s": 1000.0}}
    profile = _profile(config)
    assert profile.now(1000.0, started_unix_s=0).strftime("%a %H:%M") == "Sat 06:00"
    assert profile.now(1010.0, started_unix_s=0).strftime("%a %H:%M") == "Sat 07:00"  # 10 s = 1 h
    assert profile.now(1000.0 + 240 * 2, started_unix_s=0).strftime("%a %H:%M") == "Mon 06:00"
    # Without an anchor the clock starts when the policy does.
    unanchored = _profile({**config, "clock": {"day_length_s": 240, "start_time": "06:00"}})
    assert unanchored.now(5010.0, started_unix_s=5000.0).strftime("%H:%M") == "07:00"
    # No clock: real time in the profile's zone.
    assert _profile().now(0.0, started_unix_s=0.0) == datetime(1970, 1, 1, tzinfo=UTC)


def test_replicas_for_load():
    assert [replicas_for_load(x, 8) for x in (0, 0.5, 8, 8.0000001, 8.1, 64)] == [0, 1, 1, 1, 2, 8]


def _app(profile, **model):
    return {
        "models": [{"name": "m", "source": "package:x", "task": "embedding", "load_profile": "p", **model}],
        "load_profiles": {"p": profile},
    }


@pytest.mark.parametrize(
    "args, expected",
    [
        (_app({"windows": [_window("a", "00:00", "12:00", 1, 1), _window("b", "13:00", "24:00", 1, 1)]}),
         ["no window covers 12:00-13:00 every day"]),
        (_app({"windows": [_window("a", "22:00", "08:00", 1, 1), _window("b", "07:00", "22:00", 1, 1)]}),
         ["windows 'a', 'b' overlap at 07:00-08:00 every day"]),
        (_app({"windows": [_window("a", "00:00", "24:00", 1, 1, days="weekdays")]}),
         ["no window covers 00:00-00:00 on Sat"]),
        (_app({"windows": [_window("a", "00:00", "24:00", 3, 2)]}), ["min_replicas (3) exceeds max_replicas (2)"]),
        (_app({"windows": [_window("a", "7:5", "24:00", 1, 1)]}), ["'7:5' must look like 'HH:MM'"]),
        (_app({"timezone": "Mars/Olympus", "windows": [_window("a", "00:00", "24:00", 1, 1)]}),
         ["not an IANA zone name"]),
        (_app({"windows": [_window("a", "00:00", "24:00", 1, 1)]}, load_profile="nope"),
         ["load_profile 'nope' is not in load_profiles (defined: p)"]),
        (_app({"windows": [_window("a", "00:00", "24:00", 1, 1)]}, num_replicas=2),
         ["sets both num_replicas (2) and load_profile"]),
        (_app({"windows": [_window("a", "00:00", "24:00", 1, 1)], "prewarm_s": -1}),
         ["args.load_profiles.p.prewarm_s", "expected: Raise the floor"]),
    ],
)
def test_profile_config_errors_name_the_fix(args, expected):
    with pytest.raises(ConfigError) as excinfo:
        parse_app_config(args)
    for text in expected:
        assert text in str(excinfo.value)


def test_policy_adapts_rays_context():
    """The class Ray instantiates, driven through Ray's own serialisation path."""
    from ray.serve.config import AutoscalingConfig

    from serve_app.app import autoscaling_config

    app = parse_app_config(_app(DAY))
    config = AutoscalingConfig(**autoscaling_config("m", "p", app.load_profiles["p"]))
    assert (config.min_replicas, config.max_replicas, config.upscale_delay_s, config.downscale_delay_s) == (1, 10, 0, 0)
    config.policy.serialize_policy()  # what Serve does before shipping it to the controller
    policy_class = config.policy.get_policy()
    policy = policy_class(**config.policy.policy_kwargs)

    def ctx(when, load, target, state=None):
        return SimpleNamespace(current_time=when.timestamp(), total_num_requests=load,
                               target_num_replicas=target, policy_state=state or {})

    replicas, state = policy(ctx(_at(MON, "03:00"), 0, 3))
    assert replicas == 2 and policy.last_decision.cause == "schedule_max"
    replicas, state = policy(ctx(_at(MON, "06:51"), 0, 2, state))
    assert replicas == 4 and policy.last_decision.cause == "prewarm"
    replicas, state = policy(ctx(_at(MON, "12:00"), 80, 4, state))
    assert replicas == 4 and policy.last_decision.cause == "load_pending" and state["serve_app_schedule"]["pending"] == "up"


def test_the_prewarm_lead_is_the_measured_startup_p95_plus_the_margin():
    fixed = _profile()
    assert prewarm_lead(fixed, [120.0]).seconds == 600, "without a margin the lead stays prewarm_s"
    measured = _profile({**DAY, "prewarm_margin_s": 60})
    before = prewarm_lead(measured, [])
    assert before.seconds == 600 and "until a replica start is measured" in before.reason
    starts = [20.0] * 18 + [200.0, 400.0]  # nearest-rank p95 of 20 starts: the 19th
    lead = prewarm_lead(measured, starts)
    assert lead.seconds == 200 + 60 and "p95 200.0 s of 20 start(s)" in lead.reason
    # The lead decides when the floor rises: 260 s before 07:00, not 600 s.
    assert scheduled_bounds(measured, _at(MON, "06:52"), lead.seconds).prewarm_for is None
    assert scheduled_bounds(measured, _at(MON, "06:56"), lead.seconds).prewarm_for.name == "peak"


def test_under_a_simulated_clock_a_real_startup_counts_in_simulated_seconds():
    profile = _profile({**DAY, "prewarm_margin_s": 0, "clock": {"day_length_s": 240}})
    assert prewarm_lead(profile, [10.0]).seconds == 10.0 * 360


def test_the_policy_remembers_each_replicas_reported_startup():
    from serve_app.scaling import STARTUP_METRIC, DailyProfilePolicy

    policy = DailyProfilePolicy("m", "p", {**DAY, "prewarm_margin_s": 60})

    def ctx(when, startups, state):
        return SimpleNamespace(current_time=when.timestamp(), total_num_requests=0, target_num_replicas=1,
                               policy_state=state, aggregated_metrics={STARTUP_METRIC: startups})

    _, state = policy(ctx(_at(MON, "03:00"), {"r1": 100.0}, {}))
    assert policy.last_lead.seconds == 160
    # r1 stopped; r2 started slower: both count, and 06:55 is within the new lead of 07:00.
    replicas, state = policy(ctx(_at(MON, "06:55"), {"r2": 300.0}, state))
    assert state["serve_app_startups"] == {"r1": 100.0, "r2": 300.0}
    assert policy.last_lead.seconds == 360 and replicas == 4 and policy.last_decision.cause == "prewarm"


def test_a_scale_down_waits_at_least_the_measured_startup():
    """Let go and wanted back within its start-up, a replica costs a whole start: down
    waits max(downscale_delay_s, start-up p95), and only down does."""
    profile = _profile()  # downscale_delay_s 300, upscale_delay_s 30
    noon = _at(MON, "12:00")
    lead = prewarm_lead(profile, [900.0])
    assert lead.seconds == 600 and lead.startup_s == 900, "no margin: the lead stays prewarm_s, the p95 is kept"
    decision, state = decide(profile, noon, total_requests=8, current_replicas=6, startup_s=lead.startup_s)
    assert decision.cause == "load_pending" and "after 900 s more" in decision.reason
    later = noon + timedelta(seconds=600)
    decision, state = decide(profile, later, total_requests=8, current_replicas=6, state=state, startup_s=900)
    assert decision.replicas == 6, "past downscale_delay_s, not past the start-up"
    decision, _ = decide(profile, noon + timedelta(seconds=900), total_requests=8, current_replicas=6, state=state,
                         startup_s=900)
    assert decision.replicas == 4 and "held 900 s (the start-up p95; downscale_delay_s 300 s)" in decision.reason
    # A start-up shorter than the delay changes nothing, and up keeps upscale_delay_s.
    decision, state = decide(profile, noon, total_requests=8, current_replicas=6, startup_s=60)
    assert "after 300 s more" in decision.reason
    decision, state = decide(profile, noon, total_requests=48, current_replicas=4, startup_s=900)
    decision, _ = decide(profile, noon + timedelta(seconds=30), total_requests=48, current_replicas=4, state=state,
                         startup_s=900)
    assert decision.replicas == 6


def test_the_policy_holds_a_scale_down_for_the_reported_startup():
    from serve_app.scaling import STARTUP_METRIC, DailyProfilePolicy

    policy = DailyProfilePolicy("m", "p", DAY)  # no margin: the hold needs no prewarm setting

    def ctx(when, load, state):
        return SimpleNamespace(current_time=when.timestamp(), total_num_requests=load, target_num_replicas=6,
                               policy_state=state, aggregated_metrics={STARTUP_METRIC: {"r1": 500.0}})

    _, state = policy(ctx(_at(MON, "12:00"), 8, {}))
    replicas, state = policy(ctx(_at(MON, "12:06"), 8, state))
    assert replicas == 6 and "after 140 s more" in policy.last_decision.reason, "past downscale_delay_s (300 s)"
    replicas, _ = policy(ctx(_at(MON, "12:08", seconds=20), 8, state))
    assert replicas == 4 and "start-up p95 500.0 s" in policy.last_lead.reason


def test_load_adds_no_replica_while_the_ones_asked_for_start():
    """A scale-up waits for the replicas still starting (at most twice the start-up p95),
    then needs its upscale_delay_s afresh; without a measured start-up it does not wait."""
    profile = _profile()  # upscale_delay_s 30
    noon = _at(MON, "12:00")
    decision, state = decide(profile, noon, total_requests=48, current_replicas=5, startup_s=100, starting_replicas=1)
    assert (decision.replicas, decision.cause) == (5, "load_pending")
    assert "once the 1 starting replica(s) run" in decision.reason and state == {"starting_since": noon.timestamp()}
    decision, state = decide(profile, noon + timedelta(seconds=150), total_requests=48, current_replicas=5,
                             state=state, startup_s=100, starting_replicas=1)
    assert decision.replicas == 5
    # Started: the wish is new, and waits its upscale delay.
    later = noon + timedelta(seconds=160)
    decision, state = decide(profile, later, total_requests=48, current_replicas=5, state=state, startup_s=100)
    assert decision.cause == "load_pending" and "after 30 s more" in decision.reason
    decision, _ = decide(profile, later + timedelta(seconds=30), total_requests=48, current_replicas=5, state=state,
                         startup_s=100)
    assert decision.replicas == 6
    # A start that hangs: after twice the start-up p95 (200 s), load scales again.
    _, state = decide(profile, noon, total_requests=48, current_replicas=5, startup_s=100, starting_replicas=1)
    decision, state = decide(profile, noon + timedelta(seconds=200), total_requests=48, current_replicas=5,
                             state=state, startup_s=100, starting_replicas=1)
    assert decision.cause == "load_pending" and "after 30 s more" in decision.reason
    decision, state = decide(profile, noon + timedelta(seconds=230), total_requests=48, current_replicas=5,
                             state=state, startup_s=100, starting_replicas=1)
    assert decision.replicas == 6, "the wait for the hung start is not started over"
    # No start-up measured yet: nothing to wait by, the delay alone applies.
    decision, _ = decide(profile, noon, total_requests=48, current_replicas=5, starting_replicas=1)
    assert "after 30 s more" in decision.reason


def test_the_policy_counts_replicas_serve_is_still_starting():
    from serve_app.scaling import STARTUP_METRIC, DailyProfilePolicy

    policy = DailyProfilePolicy("m", "p", {**DAY, "upscale_delay_s": 0})
    startups = {STARTUP_METRIC: {"r1": 60.0}}

    def ctx(running, target):
        return SimpleNamespace(current_time=_at(MON, "12:00").timestamp(), total_num_requests=48,
                               target_num_replicas=target, current_num_replicas=running, policy_state={},
                               aggregated_metrics=startups)

    assert policy(ctx(running=4, target=5))[0] == 5 and "starting replica(s)" in policy.last_decision.reason
    assert policy(ctx(running=5, target=5))[0] == 6
