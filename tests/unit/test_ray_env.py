"""The environment serve_app starts Ray with: high-throughput mode by default, a switch
to turn it off, and a user's own exported values left alone."""

from __future__ import annotations

from serve_app.ray_env import HIGH_THROUGHPUT_ENV, apply_ray_env, high_throughput_active, high_throughput_requested


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
