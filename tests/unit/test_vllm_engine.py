"""The vLLM engine in the replica without vLLM's engine process: a fake AsyncLLM that
speaks its output protocol (DELTA outputs per choice, abort on cancel) stands in, so
choice order, logprobs, deadlines, cancellation and stats are checked in milliseconds.
The real engine runs in tests/integration/test_vllm_serving.py."""

from __future__ import annotations

import os

import asyncio
import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from serve_app.config import ModelConfig
from serve_app.core.calls import ChatTurn, EmbedCall, GenerateCall, StreamDelta, StreamEnd
from serve_app.core.errors import (
    ContextLengthExceededError,
    DeadlineExceededError,
    InvalidRequestError,
    ModelUnavailableError,
)
from serve_app.replica.vllm.runtime import VLLMRuntime, compile_cache_dir, cpu_engine_env, engine_args, gpu_engine_env
from serve_app.replica.vllm.stats import EngineStatsLogger

from replica_fakes import FakeMetrics, run, server

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
WAIT = "wait"  # a prompt whose request produces one token, then nothing until aborted
EOS = "e o s"  # a prompt whose rows end on the EOS token after one word


class FakeTokenizer:
    """A token per word, id = word length; a chat is one token per message."""

    def __call__(self, text: str):
        return SimpleNamespace(input_ids=[len(word) for word in text.split()])

    def apply_chat_template(self, chat, **kwargs):
        return [len(m["content"]) for m in chat]


class FakeAsyncLLM:
    """vLLM's AsyncLLM as the engine sees it: generate() yields DELTA RequestOutputs
    (one new token per step for each of the n choices), and cancelling it aborts."""

    def __init__(self, dead: bool = False, refuse: BaseException | None = None, finish_with: str = "length"):
        self.requests: list[tuple[list[int], object]] = []
        self.aborted: list[str] = []
        self.dead = dead
        self.refuse = refuse  # raised as vLLM's input checks raise, before any output
        self.finish_with = finish_with  # the last step's finish_reason
        self.encode_threads: list[str] = []

    async def generate(self, prompt, sampling, request_id, lora_request=None):
        ids = prompt["prompt_token_ids"]
        self.requests.append((ids, sampling))
        if self.dead:
            from vllm.v1.engine.exceptions import EngineDeadError

            raise EngineDeadError()
        if self.refuse is not None:
            raise self.refuse
        try:
            if ids == [1, 1, 1]:  # EOS: a word, then EOS with no text, as vLLM reports it
                for step, (text, token, finish) in enumerate((("yes", 5, None), ("", 2, "stop"))):
                    yield SimpleNamespace(outputs=[
                        SimpleNamespace(index=j, text=text, token_ids=[token], stop_reason=None,
                                        logprobs=_logprobs(token, sampling.logprobs), finish_reason=finish)
                        for j in range(sampling.n)
                    ])
                return
            steps = 1 if ids == [len(WAIT)] else sampling.max_tokens
            for step in range(steps):
                last = step == steps - 1 and ids != [len(WAIT)]
                yield SimpleNamespace(outputs=[
                    SimpleNamespace(index=j, text=f"<{ids[0]}.{j}.{step}>", token_ids=[step],
                                    logprobs=_logprobs(step, sampling.logprobs),
                                    finish_reason=self.finish_with if last else None)
                    for j in range(sampling.n)
                ])
                await asyncio.sleep(0)
            if ids == [len(WAIT)]:
                await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise

    async def encode(self, prompt, params, request_id):
        import torch

        if self.refuse is not None:
            raise self.refuse
        yield SimpleNamespace(outputs=SimpleNamespace(data=torch.tensor([float(len(prompt["prompt_token_ids"]))])))

    async def abort(self, request_ids):
        self.aborted.extend(request_ids)

    def shutdown(self):
        pass

    async def check_health(self):
        if self.dead:
            raise RuntimeError("engine core died")


def _logprobs(token_id: int, top):
    if top is None:
        return None
    candidates = {token_id: SimpleNamespace(logprob=-0.5, rank=1, decoded_token=f"tok{token_id}"),
                  100 + token_id: SimpleNamespace(logprob=-2.0, rank=2, decoded_token="alt")}
    return [candidates]


def _server(engine: FakeAsyncLLM, task: str = "text-generation"):
    runtime = VLLMRuntime(task=task, engine=engine, tokenizer=FakeTokenizer(), revision="r-vllm",
                          max_input_tokens=20, device="cpu", dtype="float32",
                          stats_logger=EngineStatsLogger(FakeMetrics()))
    return server(runtime, engine="vllm")


@needs_vllm
def test_choices_are_prompt_major_and_a_prompt_counts_once():
    ms = _server(FakeAsyncLLM())
    result = run(ms.infer(GenerateCall(max_tokens=2, prompts=("a bb", "ccc"), n=2)))
    assert [c.text for c in result.completions] == [
        "<1.0.0><1.0.1>", "<1.1.0><1.1.1>", "<3.0.0><3.0.1>", "<3.1.0><3.1.1>"]
    assert [c.prompt_tokens for c in result.completions] == [2, 0, 1, 0]
    assert result.prompt_tokens == 3 and result.completion_tokens == 8
    assert all(c.finish_reason == "length" and c.logprobs is None for c in result.completions)
    (_, sampling), _ = ms.runtime.engine.requests
    assert sampling.n == 2 and sampling.max_tokens == 2
    assert run(ms.info()).engine == "vllm"
    assert run(ms.get_stats())["engine"]["kind"] == "vllm"


@needs_vllm
def test_stream_sends_each_choice_its_deltas_then_ends_in_index_order():
    ms = _server(FakeAsyncLLM())

    async def collect():
        return [event async for event in ms.infer_stream(GenerateCall(max_tokens=2, prompts=("a", "bb"), n=2))]

    events = run(collect())
    deltas = [e for e in events if isinstance(e, StreamDelta)]
    assert {e.index for e in deltas} == {0, 1, 2, 3}
    assert "".join(e.text for e in deltas if e.index == 3) == "<2.1.0><2.1.1>"
    ends = [e for e in events if isinstance(e, StreamEnd)]
    assert [e.index for e in ends] == [0, 1, 2, 3] and events[-len(ends):] == ends
    assert [e.prompt_tokens for e in ends] == [1, 0, 1, 0]


@needs_vllm
def test_a_stream_sends_what_it_made_within_the_interval_as_one_delta():
    ms = _server(FakeAsyncLLM())
    ms.engine.stream_interval_s = 60.0  # everything after the first delta is held to the end

    async def collect():
        return [e async for e in ms.infer_stream(GenerateCall(max_tokens=4, prompts=("a",), n=2, logprobs=0))]

    events = run(collect())
    deltas = [e for e in events if isinstance(e, StreamDelta)]
    # The stream's first token goes at once; the rest, per choice, when the interval ends.
    assert [(d.index, d.text) for d in deltas] == [
        (0, "<1.0.0>"), (0, "<1.0.1><1.0.2><1.0.3>"), (1, "<1.1.0><1.1.1><1.1.2><1.1.3>")]
    assert [len(d.logprobs) for d in deltas] == [1, 3, 4]
    plain = run(_server(FakeAsyncLLM()).infer(GenerateCall(max_tokens=4, prompts=("a",), n=2)))
    assert ["".join(d.text for d in deltas if d.index == i) for i in (0, 1)] == [c.text for c in plain.completions]


@needs_vllm
def test_logprobs_carry_the_chosen_token_and_the_asked_alternatives():
    ms = _server(FakeAsyncLLM())
    result = run(ms.infer(GenerateCall(max_tokens=2, messages=(ChatTurn("user", "hi"),), logprobs=1)))
    (completion,) = result.completions
    assert [(t.token, t.logprob) for t in completion.logprobs] == [("tok0", -0.5), ("tok1", -0.5)]
    assert all(t.top == ((t.token, -0.5),) for t in completion.logprobs)


@needs_vllm
def test_logprobs_leave_out_the_eos_token_the_text_leaves_out():
    ms = _server(FakeAsyncLLM())
    result = run(ms.infer(GenerateCall(max_tokens=4, prompts=(EOS,), n=2, logprobs=0)))
    for completion in result.completions:
        assert completion.text == "yes" and completion.finish_reason == "stop"
        assert [t.token for t in completion.logprobs] == ["tok5"]
        assert completion.completion_tokens == 2  # EOS was generated, and is billed as vLLM's server does

    async def collect():
        return [e async for e in ms.infer_stream(GenerateCall(max_tokens=4, prompts=(EOS,), logprobs=0))]

    deltas = [e for e in run(collect()) if isinstance(e, StreamDelta)]
    assert [(d.text, [t.token for t in d.logprobs]) for d in deltas] == [("yes", ["tok5"])]


@needs_vllm
def test_a_deadline_aborts_the_request_and_answers_504():
    ms = _server(FakeAsyncLLM())
    call = GenerateCall(max_tokens=5, prompts=(WAIT,), deadline=time.time() + 0.1)
    with pytest.raises(DeadlineExceededError):
        run(ms.infer(call))
    assert len(ms.runtime.engine.aborted) >= 1


@needs_vllm
def test_a_consumer_that_leaves_a_stream_aborts_its_request():
    ms = _server(FakeAsyncLLM())

    async def leave_after_first_delta():
        stream = ms.infer_stream(GenerateCall(max_tokens=5, prompts=(WAIT,)))
        first = await stream.__anext__()
        await stream.aclose()
        return first

    assert isinstance(run(leave_after_first_delta()), StreamDelta)
    assert ms.runtime.engine.aborted
    assert run(ms.get_stats())["cancelled_rows"] == 1


@needs_vllm
def test_a_dead_engine_is_a_503_and_fails_the_health_check():
    ms = _server(FakeAsyncLLM(dead=True))
    with pytest.raises(ModelUnavailableError) as caught:
        run(ms.infer(GenerateCall(max_tokens=2, prompts=("a",))))
    assert caught.value.code == "engine_dead"
    with pytest.raises(RuntimeError):
        run(ms.check_health())


def test_the_context_window_is_checked_before_the_engine_sees_the_call():
    ms = _server(FakeAsyncLLM())
    with pytest.raises(ContextLengthExceededError) as caught:
        run(ms.infer(GenerateCall(max_tokens=18, prompts=("a b c",))))
    assert caught.value.param == "max_tokens" and not ms.runtime.engine.requests


def test_engine_args_follow_the_config():
    chat = ModelConfig(
        name="c", source="/m", task="text-generation", engine="vllm", precision="bf16",
        batching={"max_batch_size": 12}, vllm={"max_model_len": 2048, "engine_args": {"kv_cache_dtype": "fp8"}})
    args = engine_args(chat, Path("/models/c"))
    assert args["dtype"] == "bfloat16" and args["max_num_seqs"] == 12 and args["max_model_len"] == 2048
    assert args["enable_prefix_caching"] and args["runner"] == "generate" and args["kv_cache_dtype"] == "fp8"
    assert "distributed_executor_backend" not in args
    embed = ModelConfig(name="e", source="/m", task="embedding", engine="vllm", precision="fp32")
    args = engine_args(embed, Path("/models/e"))
    assert args["runner"] == "pooling" and "enable_prefix_caching" not in args
    sharded = ModelConfig(name="big", source="/m", task="text-generation", engine="vllm", precision="bf16",
                          resources={"num_gpus": 4}, vllm={"tensor_parallel_size": 4})
    assert engine_args(sharded, Path("/m"))["distributed_executor_backend"] == "ray"
    # "auto" is the replica's to resolve on its node; vLLM never gets a guess.
    with pytest.raises(ValueError, match="precision 'auto' is not resolved"):
        engine_args(ModelConfig(name="a", source="/m", task="embedding", engine="vllm"), Path("/m"))


def test_cpu_engine_core_gets_the_models_torch_threads():
    default = ModelConfig(name="e", source="/m", task="embedding", engine="vllm", resources={"num_cpus": 0.8})
    assert cpu_engine_env(default)["OMP_NUM_THREADS"] == "1"  # num_cpus rounded up
    assert cpu_engine_env(default)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the model in the engine core
    two = ModelConfig(name="e", source="/m", task="embedding", engine="vllm",
                      resources={"num_cpus": 0.8, "torch_threads": 2}, vllm={"cpu_kv_cache_gib": 2})
    assert cpu_engine_env(two) == {"VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": "2",
                                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_AOT_COMPILE": "1",
                                   "VLLM_CACHE_ROOT": os.path.expanduser("~/.cache/vllm"),
                                   "TORCHINDUCTOR_CACHE_DIR": os.path.expanduser("~/.cache/vllm/inductor")}


def test_compiled_kernels_are_kept_where_the_config_says(monkeypatch):
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    kept = ModelConfig(name="e", source="/m", task="embedding", engine="vllm", vllm={"compile_cache_dir": "/cache"})
    env = cpu_engine_env(kept)
    # AOT artifacts load through serve_app's vLLM plugin (installed with the package).
    assert env["VLLM_USE_AOT_COMPILE"] == "1"
    assert (env["VLLM_CACHE_ROOT"], env["TORCHINDUCTOR_CACHE_DIR"]) == ("/cache", "/cache/inductor")
    gpu = ModelConfig(name="g", source="/m", task="embedding", engine="vllm", resources={"num_gpus": 1})
    assert compile_cache_dir(gpu) is None and compile_cache_dir(kept) == "/cache/inductor"
    # A GPU engine keeps its compiled graphs where the config says too, else where vLLM does.
    assert gpu_engine_env(gpu) == {}
    kept_on_gpu = gpu.model_copy(update={"vllm": kept.vllm})
    assert gpu_engine_env(kept_on_gpu) == {"VLLM_CACHE_ROOT": "/cache"}


def test_aot_compile_by_default_but_for_generation_on_a_cpu_with_amx(monkeypatch):
    # Measured (benchmarks.tools.compile_modes): the AOT graph embeds as fast everywhere, and
    # decodes 25% slower with AMX tiles but as fast without them, where it starts sooner.
    from serve_app.replica.vllm import runtime

    chat = ModelConfig(name="c", source="/m", task="text-generation", engine="vllm")
    embed = ModelConfig(name="e", source="/m", task="embedding", engine="vllm")
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    assert cpu_engine_env(chat)["VLLM_USE_AOT_COMPILE"] == "0"
    assert cpu_engine_env(embed)["VLLM_USE_AOT_COMPILE"] == "1"
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512_bf16", "avx512_vnni"}))
    assert cpu_engine_env(chat)["VLLM_USE_AOT_COMPILE"] == "1"
    chat = chat.model_copy(update={"vllm": chat.vllm.model_copy(update={"aot_compile": False})})
    assert cpu_engine_env(chat)["VLLM_USE_AOT_COMPILE"] == "0"
    chat = chat.model_copy(update={"vllm": chat.vllm.model_copy(update={"aot_compile": None})})
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    forced = chat.model_copy(update={"vllm": chat.vllm.model_copy(update={"aot_compile": True})})
    assert cpu_engine_env(forced)["VLLM_USE_AOT_COMPILE"] == "1"
    off = embed.model_copy(update={"vllm": embed.vllm.model_copy(update={"aot_compile": False})})
    assert cpu_engine_env(off)["VLLM_USE_AOT_COMPILE"] == "0"


def test_embeddings_run_eager_on_a_cpu_unless_the_config_says_otherwise():
    # Measured (benchmarks.tools.compile_modes): compiling made embeddings no faster on the CPU
    # but their engine's start 5-23 s slower; generation decoded faster compiled.
    embed = ModelConfig(name="e", source="/m", task="embedding", engine="vllm", precision="fp32")
    chat = ModelConfig(name="c", source="/m", task="text-generation", engine="vllm", precision="fp32")
    assert engine_args(embed, Path("/m"))["enforce_eager"] is True
    assert engine_args(chat, Path("/m"))["enforce_eager"] is False
    on_gpu = embed.model_copy(update={"resources": embed.resources.model_copy(update={"num_gpus": 1})})
    assert engine_args(on_gpu, Path("/m"))["enforce_eager"] is False  # vLLM's own default there
    compiled = embed.model_copy(update={"vllm": embed.vllm.model_copy(update={"enforce_eager": False})})
    eager_chat = chat.model_copy(update={"vllm": chat.vllm.model_copy(update={"enforce_eager": True})})
    assert engine_args(compiled, Path("/m"))["enforce_eager"] is False
    assert engine_args(eager_chat, Path("/m"))["enforce_eager"] is True


def test_without_the_plugin_the_cpu_engine_reuses_inductors_caches_instead(monkeypatch):
    config = ModelConfig(name="e", source="/m", task="embedding", engine="vllm")
    monkeypatch.setenv("SERVE_APP_VLLM_AOT_SHIM", "0")
    env = cpu_engine_env(config)
    assert env["VLLM_USE_AOT_COMPILE"] == "0" and env["TORCHINDUCTOR_CACHE_DIR"].endswith("inductor")


def test_the_plugin_gives_only_a_plain_loaded_function_a_finalize_loading(monkeypatch):
    import torch.compiler

    from serve_app.replica.vllm import plugin

    def plain():
        return "ran"

    class VllmFunction:  # what vLLM's own backend saves: its finalize_loading stays
        def finalize_loading(self, vllm_config):
            return "vllm's"

    own = VllmFunction()
    artifacts = {"plain": SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=plain)),
                 "own": SimpleNamespace(_artifacts=SimpleNamespace(compiled_fn=own))}
    monkeypatch.setattr(torch.compiler, "load_compiled_function", lambda name, **kwargs: artifacts[name])
    plugin.register()
    plugin.register()  # vLLM calls it in every process, and more than once in one
    loaded = torch.compiler.load_compiled_function("plain", f_globals={})
    assert loaded._artifacts.compiled_fn.finalize_loading(None) is None and plain() == "ran"
    assert torch.compiler.load_compiled_function("own")._artifacts.compiled_fn.finalize_loading(None) == "vllm's"
    assert not plugin.add_missing_finalize_loading(SimpleNamespace())  # nothing loaded: nothing to do


def test_the_plugin_is_installed_where_vllm_finds_it():
    from importlib.metadata import entry_points

    assert "serve_app.replica.vllm.plugin:register" in {ep.value for ep in entry_points(group="vllm.general_plugins")}


def test_engine_stats_keep_the_latest_step_and_the_prefix_hit_rate():
    metrics = FakeMetrics()
    logger = EngineStatsLogger(metrics)
    for hits in (0, 96):
        logger.record(SimpleNamespace(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25,
                                      prefix_cache_stats=SimpleNamespace(queries=128, hits=hits)),
                      SimpleNamespace(num_preempted_reqs=0, finished_requests=[]))
    snapshot = logger.snapshot()
    assert snapshot["running_requests"] == 3 and snapshot["waiting_requests"] == 1
    assert snapshot["prefix_cache_hit_rate"] == 96 / 256
    assert metrics.prefix_cache_queries.values == [128, 128] and metrics.prefix_cache_hits.values == [96]
    assert metrics.kv_cache_usage.values == [0.25, 0.25]
    assert snapshot["steps_finishing_requests"] == 0 and snapshot["requests_finished_per_step"] is None


def test_engine_stats_count_requests_finished_per_step():
    # An embedding request finishes in the step that ran it, so this is vLLM's batch size
    # for embeddings (the figure the transformers engines report as rows per batch).
    logger = EngineStatsLogger(FakeMetrics())
    scheduler = SimpleNamespace(num_running_reqs=0, num_waiting_reqs=0, kv_cache_usage=0.0, prefix_cache_stats=None)
    for finished in (10, 0, 6):  # a step that finished nothing (a decode step) is not counted
        logger.record(scheduler, SimpleNamespace(num_preempted_reqs=0, finished_requests=[object()] * finished))
    logger.record(scheduler, None)
    snapshot = logger.snapshot()
    assert snapshot["steps_finishing_requests"] == 2 and snapshot["requests_finished_per_step"] == 8


# ---- what vLLM refuses, and generations it ends unfinished ------------------------------


def _vllm_refusal(message: str) -> BaseException:
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message)


@needs_vllm
def test_a_schema_vllm_cannot_compile_is_a_400_naming_response_format():
    ms = _server(FakeAsyncLLM(refuse=_vllm_refusal("Failed to transform json schema into a grammar: bad type")))
    with pytest.raises(InvalidRequestError) as caught:
        run(ms.infer(GenerateCall(max_tokens=2, messages=(ChatTurn(role="user", content="hi"),))))
    assert caught.value.param == "response_format" and caught.value.status_code == 400


@needs_vllm
def test_a_request_vllm_refuses_is_a_400_naming_the_input():
    ms = _server(FakeAsyncLLM(refuse=_vllm_refusal("The decoder prompt is too long")))
    with pytest.raises(InvalidRequestError) as caught:
        run(ms.infer(GenerateCall(max_tokens=2, prompts=("a b",))))
    assert caught.value.param == "prompt" and "too long" in caught.value.message
    embedder = _server(FakeAsyncLLM(refuse=_vllm_refusal("This model does not support pooling")), task="embedding")
    with pytest.raises(InvalidRequestError) as caught:
        run(embedder.infer(EmbedCall(texts=("a b",))))
    assert caught.value.param == "input"


@needs_vllm
def test_our_own_value_errors_stay_internal_and_their_text_stays_in_the_log():
    """A ValueError from our code (here: the fake engine, outside vLLM's package) is not a
    client error; through infer_many, the client sees a message without its text."""
    ms = _server(FakeAsyncLLM(refuse=ValueError("secret internal detail")))
    with pytest.raises(ValueError):
        run(ms.infer(GenerateCall(max_tokens=2, prompts=("a",))))
    (outcome,) = run(ms.infer_many([GenerateCall(max_tokens=2, prompts=("a",))])).outcomes
    assert outcome.status_code == 500 and "secret" not in outcome.message and "ValueError" not in outcome.message


@needs_vllm
@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_generation_vllm_ends_unfinished_is_an_error_not_a_stop(reason):
    ms = _server(FakeAsyncLLM(finish_with=reason))
    with pytest.raises(ModelUnavailableError) as caught:
        run(ms.infer(GenerateCall(max_tokens=3, prompts=("a b",))))
    assert caught.value.code == "generation_unfinished" and caught.value.status_code == 503


def test_empty_text_is_refused_before_vllm_sees_it():
    runtime = _server(FakeAsyncLLM()).runtime
    for text in ("", "   "):
        with pytest.raises(InvalidRequestError) as caught:
            runtime.tokenize(text)
        assert caught.value.param == "input"
        with pytest.raises(InvalidRequestError) as caught:
            runtime.encode_prompt(text)
        assert caught.value.param == "prompt"


@needs_vllm
def test_embedding_inputs_are_tokenized_off_the_event_loop():
    import threading

    ms = _server(FakeAsyncLLM(), task="embedding")
    threads = []
    tokenize = ms.runtime.tokenize
    ms.runtime.tokenize = lambda text: threads.append(threading.current_thread().name) or tokenize(text)
    result = run(ms.infer(EmbedCall(texts=("one two", "three"))))
    assert result.embeddings == [[2.0], [1.0]]
    assert threads and all(name.startswith("tokenize") for name in threads)
    with pytest.raises(InvalidRequestError) as caught:
        run(ms.infer(EmbedCall(texts=("fine", ""))))
    assert caught.value.param == "input[1]"


@needs_vllm
def test_an_omitted_max_tokens_gets_the_room_the_prompt_leaves():
    """vLLM's server caps an omitted max_tokens at what the context leaves; a 400 would name
    a field the client never sent. An explicit max_tokens is still checked as given."""
    ms = _server(FakeAsyncLLM())  # a context of 20 tokens
    long_prompt = " ".join(["w"] * 18)
    fitted = run(ms.infer(GenerateCall(max_tokens=5, prompts=(long_prompt,), max_tokens_defaulted=True)))
    assert fitted.completions[0].completion_tokens == 2
    assert ms.runtime.engine.requests[-1][1].max_tokens == 2
    with pytest.raises(ContextLengthExceededError) as caught:
        run(ms.infer(GenerateCall(max_tokens=5, prompts=(long_prompt,))))
    assert caught.value.param == "max_tokens"
    with pytest.raises(ContextLengthExceededError) as caught:
        run(ms.infer(GenerateCall(max_tokens=5, prompts=(" ".join(["w"] * 20),), max_tokens_defaulted=True)))
    assert caught.value.param == "prompt"
