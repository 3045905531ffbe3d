"""Load profiles (``args.load_profiles``): replica floors and ceilings by time of day,
and the simulated clock that compresses a day for tests and benchmarks."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from serve_app.config.base import _Section
from serve_app.core import schedule


class WindowConfig(_Section):
    """One time-of-day window of a load profile."""

    name: str = Field(description="Label shown in logs, metrics and errors, e.g. 'night' or 'peak'.")
    start: str = Field(description="Local time the window opens, 'HH:MM'.")
    end: str = Field(description="Local time it closes, 'HH:MM' ('24:00' allowed); at or before start runs past midnight.")
    days: Literal["all", "weekdays", "weekends"] = Field(
        "all", description="Days on which the window opens: all, weekdays (Mon-Fri) or weekends (Sat, Sun)."
    )
    min_replicas: int = Field(ge=0, description="Replica floor in this window.")
    max_replicas: int = Field(ge=1, description="Replica ceiling in this window.")
    target_ongoing_requests: float = Field(
        gt=0, description="Ongoing + queued requests one replica should carry; load picks the count between min and max."
    )

    @field_validator("start")
    @classmethod
    def _start_is_time(cls, value: str) -> str:
        schedule.parse_time_of_day(value)
        return value

    @field_validator("end")
    @classmethod
    def _end_is_time(cls, value: str) -> str:
        schedule.parse_time_of_day(value, allow_24=True)
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> "WindowConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"window {self.name!r}: min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self


class SimulatedClockConfig(_Section):
    """A compressed day for tests, demos and the day benchmark. Never set it in production."""

    day_length_s: float = Field(gt=0, description="Real seconds that make one 24 h day, e.g. 240 for a day in 4 minutes.")
    start_time: str = Field("00:00", description="Profile time of day when the clock starts, 'HH:MM'.")
    start_day: Literal["Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"] = Field(
        "Mon", description="Weekday the simulated clock starts on."
    )
    anchor_unix_s: Optional[float] = Field(
        None, description="Real Unix time at which the clock reads start_time; default: when the policy starts."
    )

    @field_validator("start_time")
    @classmethod
    def _start_is_time(cls, value: str) -> str:
        schedule.parse_time_of_day(value)
        return value


class LoadProfileConfig(_Section):
    """Replica floors and ceilings by time of day. Models name a profile in `load_profile`;
    Ray Serve then scales them with serve_app's policy (serve_app/scaling.py)."""

    timezone: str = Field("UTC", description="IANA zone the window times are in, e.g. 'Europe/Berlin'.")
    windows: list[WindowConfig] = Field(
        min_length=1, description="Windows that together cover every minute of the week exactly once."
    )
    prewarm_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description="Raise the floor this many seconds before a window with a higher floor opens "
        "(cover replica start time: node launch + model load). With prewarm_margin_s set, only until "
        "the model's replicas have reported a start-up.",
    )
    prewarm_margin_s: Optional[float] = Field(
        None,
        ge=0,
        le=86400,
        description="Set: the prewarm lead is the start-up p95 the model's replicas report (process start to "
        "ready, last 20 starts) plus this margin (cover node launch and image pull); the policy logs the lead. "
        "Unset: the lead is always prewarm_s.",
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="Load must ask for more replicas this long before they are added; while replicas "
        "already added are starting it adds none (for at most twice their start-up p95).",
    )
    downscale_delay_s: float = Field(
        300.0, ge=0, description="Load must ask for fewer replicas this long before they are removed, and at least "
        "the start-up p95 the model's replicas report: one wanted back within its start-up would pay a start for "
        "nothing.",
    )
    look_back_period_s: float = Field(
        30.0, gt=0, description="Seconds over which Ray Serve averages ongoing requests for the load signal."
    )
    clock: Optional[SimulatedClockConfig] = Field(
        None, description="Simulated (compressed) clock; durations above then count in simulated time."
    )

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, value: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"timezone {value!r} is not an IANA zone name, e.g. 'UTC' or 'America/New_York'") from None
        return value

    @model_validator(mode="after")
    def _windows_tile_the_week(self) -> "LoadProfileConfig":
        names = [w.name for w in self.windows]
        if len(set(names)) != len(names):
            raise ValueError(f"window names must be unique, got {names}")
        problems = schedule.coverage_problems(list(self.to_schedule("check").windows))
        if problems:
            raise ValueError(
                "windows must cover every minute of the week exactly once: " + "; ".join(problems)
            )
        return self

    def to_schedule(self, name: str) -> schedule.LoadProfile:
        return schedule.LoadProfile.from_config(name, self.model_dump(mode="json"))
