"""The `engines` scenario's pure parts, without Ray or any engine: trace-length sampling,
the loads' requests, the peers' engine settings, and the ratio/check logic (a check can
fail, and a system that did not run makes its checks missed, never met)."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")

from benchmarks.harness.registry import ScenarioResult, load_all  # noqa: E402

# Import every scenario module in the registry's order first: importing
# benchmarks.scenarios.engines alone at collection time would register it ahead of the others.
load_all()

from benchmarks.data import prompts, workloads  # noqa: E402
from benchmarks.data.workloads import TRACE  # noqa: E402
from benchmarks.peers.engines import EngineSettings  # noqa: E402
from benchmarks.scenarios import engines  # noqa: E402
from benchmarks.scenarios.engines import OURS, RAY_LLM, VLLM_SERVER, VLLM_SERVER_NO_PREFIX  # noqa: E402


def test_engines_is_registered():
    assert "engines" in load_all()


def test_scale_lengths_divides_and_clips():
    assert workloads.scale_lengths(1600, 20, prompt_scale=8, output_scale=1) == (200, 20)
    assert workloads.scale_lengths(3, 1) == (workloads.PROMPT_TOKENS_BOUNDS[0], workloads.OUTPUT_TOKENS_BOUNDS[0])
    assert workloads.scale_lengths(10**6, 10**6) == (workloads.PROMPT_TOKENS_BOUNDS[1], workloads.OUTPUT_TOKENS_BOUNDS[1])
    # prompt + output always fit the context every system is given
    assert workloads.PROMPT_TOKENS_BOUNDS[1] + workloads.OUTPUT_TOKENS_BOUNDS[1] + 64 <= engines.MAX_MODEL_LEN


def test_sample_lengths_is_seeded_and_keeps_rows_joint():
    rows = [(800, 10), (8000, 300), (80, 5)]
    a = workloads.sample_lengths(rows, 50, seed=1)
    assert a == workloads.sample_lengths(rows, 50, seed=1)
    assert a != workloads.sample_lengths(rows, 50, seed=2)
    allowed = {workloads.scale_lengths(*row) for row in rows}
    assert set(a) <= allowed and len(set(a)) > 1
    with pytest.raises(ValueError):
        workloads.sample_lengths([], 3)


@pytest.mark.skipif(not TRACE.is_file(), reason="the Azure trace is not on this machine")
def test_trace_lengths_scaled_for_a_cpu():
    rows = workloads.read_trace_lengths()
    assert len(rows) > 1000
    sampled = workloads.sample_lengths(rows, 400)
    prompts = sorted(p for p, _ in sampled)
    outputs = sorted(o for _, o in sampled)
    assert 100 <= prompts[len(prompts) // 2] <= 300  # trace median 1,469 / 8
    assert outputs[len(outputs) // 2] <= 30 and max(outputs) <= workloads.OUTPUT_TOKENS_BOUNDS[1]


def test_chat_requests_are_unique_and_sized():
    requests = workloads.chat_requests([(100, 20), (100, 20), (400, 300)], max_tokens_cap=64)
    assert len({r.prompt for r in requests}) == 3
    assert [r.max_tokens for r in requests] == [20, 20, 64]
    words = [len(r.prompt.split()) for r in requests]
    assert words[2] > 3 * words[0]


def test_customer_service_shape():
    prompt = prompts.policy_prompt()
    assert len(prompt.split()) >= 800  # ~1,100 SmolLM2 tokens
    questions = prompts.customer_questions(200)
    assert len(set(questions)) == 200 and max(len(q.split()) for q in questions) < 30
    make = engines.customer_factory("chat", prompt, questions, 32)
    path, body = make(5)
    assert path == "/v1/chat/completions" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["messages"][0] == {"role": "system", "content": prompt} and body["temperature"] == 0


def test_engine_settings_are_the_same_everywhere():
    settings = EngineSettings("bf16", 2048, 16, True, kv_cache_gib=1)
    cli = settings.vllm_cli_args()
    assert cli[:6] == ["--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "16"]
    assert "--enable-prefix-caching" in cli and "--enforce-eager" not in cli
    off = EngineSettings("bf16", 2048, 16, False, enforce_eager=True, pooling=True).vllm_cli_args()
    assert "--no-enable-prefix-caching" in off and "--enforce-eager" in off and off[-2:] == ["--runner", "pooling"]
    kwargs = settings.vllm_engine_kwargs()
    ours = settings.serve_app_vllm_section()
    assert kwargs["max_model_len"] == ours["max_model_len"] == 2048
    assert kwargs["max_num_seqs"] == ours["max_num_seqs"] == 16
    assert kwargs["enable_prefix_caching"] is ours["enable_prefix_caching"] is True
    assert ours["cpu_kv_cache_gib"] == 1
    with pytest.raises(ValueError, match="int8"):
        EngineSettings("int8", 2048, 16, True).dtype


def test_our_vllm_section_is_valid_config():
    pytest.importorskip("pydantic")
    from serve_app.config.vllm import VLLMConfig

    VLLMConfig(**EngineSettings("bf16", 2048, 16, True).serve_app_vllm_section())


def test_ratio_handles_missing_figures():
    assert engines.ratio(2.0, 4.0) == 0.5
    assert engines.ratio(None, 4.0) is None and engines.ratio(2.0, None) is None and engines.ratio(2.0, 0) is None


def _figures(ours_tps: float, server_tps: float, ray_tps: float) -> dict:
    base = {"p95_ms": 1000.0, "p50_ms": 500.0, "p50_ttft_ms": 100.0, "p95_ttft_ms": 200.0}
    figures = {}
    for system, tps in ((OURS, ours_tps), (VLLM_SERVER, server_tps), (RAY_LLM, ray_tps)):
        for load in ("chat", "customer-service"):
            figures[(load, system)] = {**base, "tokens_per_s": tps}
        figures[("embeddings", system)] = {**base, "embeddings_per_s": tps}
    return figures


def _checks(figures: dict) -> dict:
    result = ScenarioResult("engines", "")
    engines.apply_checks(result, figures)
    result.finalize()
    return {c["claim"]: c for c in result.checks}


def test_checks_met_when_ours_keeps_up():
    checks = _checks(_figures(100.0, 100.0, 90.0))
    assert all(c["met"] for c in checks.values()), [c for c in checks.values() if not c["met"]]
    assert len(checks) == len(engines.CHECKS) + 1  # + the error-rate check


def test_checks_can_fail():
    checks = _checks(_figures(80.0, 100.0, 90.0))  # 0.8x the server, 0.89x Ray Serve LLM
    assert not checks["chat generated tokens/s, ours(vLLM) / vLLM server"]["met"]
    assert not checks["embeddings/s, ours(vLLM) / Ray Serve LLM"]["met"]
    assert checks["chat generated tokens/s, ours(vLLM) / vLLM server"]["value"] == 0.8
    slow = _figures(100.0, 100.0, 90.0)
    slow[("customer-service", OURS)]["p95_ttft_ms"] = 300.0  # 1.5x the server's 200
    checks = _checks(slow)
    claim = "customer-service p95 time to first token, ours(vLLM) / vLLM server (prefix cache on)"
    assert checks[claim]["value"] == 1.5 and not checks[claim]["met"]


def test_a_system_that_did_not_run_misses_its_checks():
    figures = _figures(100.0, 100.0, 90.0)
    del figures[("chat", OURS)]
    checks = _checks(figures)
    claim = "chat generated tokens/s, ours(vLLM) / vLLM server"
    assert checks[claim]["value"] is None and not checks[claim]["met"]


def test_derived_ratios_include_both_peers_and_the_prefix_cache():
    figures = _figures(100.0, 50.0, 25.0)
    figures[("customer-service", VLLM_SERVER_NO_PREFIX)] = {"p50_ttft_ms": 800.0, "p95_ttft_ms": 1000.0,
                                                             "tokens_per_s": 20.0}
    derived = engines.derive_ratios(figures)
    assert derived["chat_tokens_per_s_ours_vllm_over_vllm_server"] == 2.0
    assert derived["chat_tokens_per_s_ours_vllm_over_ray_serve_llm"] == 4.0
    assert derived["embeddings_embeddings_per_s_ours_vllm_over_vllm_server"] == 2.0
    assert derived["vllm_server_prefix_cache_off_over_on_p50_ttft"] == 8.0
    assert derived["vllm_server_prefix_cache_off_over_on_p95_ttft"] == 5.0
    assert derived["vllm_server_prefix_cache_on_over_off_tokens_per_s"] == 2.5
