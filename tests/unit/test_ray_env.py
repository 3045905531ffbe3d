"""The environment serve_app starts Ray with: high-throughput mode by default, a switch
to turn it off, and a user's own exported values left alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from serve_app.ray_env import (
    HIGH_THROUGHPUT_ENV,
    INGRESS_DRAIN_VARIABLE,
    LOCAL_INGRESS_DRAIN_S,
    apply_ray_env,
    high_throughput_active,
    high_throughput_requested,
    shorten_ingress_drain,
)


def test_high_throughput_is_the_default():
    environ: dict[str, str] = {}
    assert apply_ray_env(environ=environ) == HIGH_THROUGHPUT_ENV == {
        "RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    assert environ == HIGH_THROUGHPUT_ENV and high_throughput_active(environ)


def test_the_switch_turns_both_off():
    for off in ("0", "false", "OFF", " no "):
        environ = {"SERVE_APP_HIGH_THROUGHPUT": off}
        assert not high_throughput_requested(environ)
        assert apply_ray_env(environ=environ) == {"RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
        assert not high_throughput_active(environ)
    # The launcher's --classic-proxy wins over anything in the environment.
    environ = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    apply_ray_env(enabled=False, environ=environ)
    assert not high_throughput_active(environ)


def test_a_value_the_user_exported_wins_over_the_default():
    environ = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}
    assert apply_ray_env(environ=environ) == {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "0"}


def test_the_ingress_drain_is_shortened_only_where_unset_and_is_the_variable_ray_reads():
    environ: dict[str, str] = {}
    assert shorten_ingress_drain(environ) == str(LOCAL_INGRESS_DRAIN_S) == environ[INGRESS_DRAIN_VARIABLE]
    kept = {INGRESS_DRAIN_VARIABLE: "30"}
    assert shorten_ingress_drain(kept) == "30"
    # Ray reads it from the environment in its Serve constants (renamed there, this breaks).
    constants = Path(importlib.util.find_spec("ray.serve").submodule_search_locations[0]) / "_private" / "constants.py"
    assert f'os.environ.get("{INGRESS_DRAIN_VARIABLE}"' in constants.read_text()
