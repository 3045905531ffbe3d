"""The `startup` scenario: how long a vLLM replica takes to start, cold and warm, against
vLLM's own OpenAI server for the same model on the same machine.

For each of the deployments file's chat and embedding models, as shipped (engine vLLM),
four starts, one after another, nothing else running:

- ours, cold: a new application whose ``vllm.compile_cache_dir`` is an empty directory
  (the model's one-time preparation on a machine type, a GGUF conversion and the
  precision gate, done and timed before, see :func:`_prepare`);
- ours, warm: the same application again, deleted and redeployed on the filled directory;
- vLLM's server (``python -m vllm.entrypoints.openai.api_server``), cold and warm the
  same way (``VLLM_CACHE_ROOT`` and inductor's cache in a directory of its own), with the
  engine arguments our replica gives vLLM, as command-line flags, and vLLM's own
  defaults otherwise (its AOT compile included), as a user runs it.

Each start is timed from the deploy (or the process start) to ready (Serve routes to
the replica, or vLLM's /health answers) and to the first answer. Ours also reports the
replica's own split (process, load, engine, warm-up) from /v1/stats. For the embedding
model, the first 256 requests after ready (concurrency 32) are compared with the next
256: the rate a replica added at the morning ramp serves at, against its warm rate.
"""

from __future__ import annotations

import copy
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import httpx

from benchmarks.harness.registry import (TEXTS, Context, ScenarioResult, ScenarioSkipped, model_stats,
                                         require_module, run_closed, scenario)
from benchmarks.harness.service import pick_model
from benchmarks.peers.engines import EngineSettings, VLLMServer, vllm_cli_flags

OURS, PEER = "serve_app", "vllm-server"
FIRST_LOAD = 256  # embedding requests right after ready, then as many again once warm
LOAD_CONCURRENCY = 32
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
        "temperature": 0}


def _first_request(task: str, model: str) -> tuple[str, dict]:
    if task == "text-generation":
        return "/v1/chat/completions", {"model": model, **CHAT}
    return "/v1/embeddings", {"model": model, "input": TEXTS[0]}


def _our_config(base: dict, cache_dir: str) -> dict:
    """The model exactly as shipped, on vLLM, its compile cache in ``cache_dir``."""
    config = copy.deepcopy(base)
    config.pop("cache", None)  # per-model cache settings may name models left out
    config["engine"] = "vllm"
    config["vllm"] = {**(config.get("vllm") or {}), "compile_cache_dir": cache_dir}
    return config


def _resolved(config_dict: dict) -> tuple[Any, Path]:
    """The model's config with the precision our replica runs it in (``precision: auto``
    through the precision gate) and the directory of its files (a GGUF file converted to
    safetensors). Both are kept in ``$SERVE_APP_CACHE`` per model and machine type: only
    a machine type's first call pays them."""
    import torch

    from serve_app.config import ModelConfig
    from serve_app.core.models.sources import resolve_source
    from serve_app.optimize.precision_gate import replica_precision

    config = ModelConfig.model_validate(config_dict)
    model_dir = resolve_source(config.source, hub_revision=config.hub_revision,
                               trust_remote_code=config.trust_remote_code)
    precision, _ = replica_precision(config, torch.device("cpu"))
    return config.model_copy(update={"precision": precision}), model_dir


def _peer_server(config_dict: dict, cache_dir: str, log_path: Path) -> VLLMServer:
    """vLLM's server with the engine arguments our replica gives vLLM for this model, in
    the dtype our replica runs (the gate's verdict included)."""
    from serve_app.replica.vllm.runtime import cpu_engine_env, engine_args

    config, model_dir = _resolved(config_dict)
    ours_env = cpu_engine_env(config)
    env = {"VLLM_CACHE_ROOT": cache_dir, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
           # The same threads and KV cache as ours; vLLM's compile and process settings are its own.
           "OMP_NUM_THREADS": ours_env["OMP_NUM_THREADS"], "VLLM_CPU_KVCACHE_SPACE": ours_env["VLLM_CPU_KVCACHE_SPACE"]}
    flags = vllm_cli_flags(engine_args(config, model_dir))
    settings = EngineSettings(precision=config.precision, max_model_len=config.vllm.max_model_len or 0,
                              max_num_seqs=config.vllm.max_num_seqs or config.batching.max_batch_size,
                              enable_prefix_caching=config.vllm.enable_prefix_caching,
                              kv_cache_gib=config.vllm.cpu_kv_cache_gib, pooling=config.task == "embedding")
    return VLLMServer(str(model_dir), config.name, settings, log_path=log_path, engine_flags=flags, env=env)


def _prepare(config_dict: dict) -> float:
    """Seconds this machine's one-time preparation of the model took (:func:`_resolved`;
    about 0 when an earlier run did it): every start timed after it finds it done, as
    vLLM's server gets the converted files."""
    started = time.perf_counter()
    _resolved(config_dict)
    return time.perf_counter() - started


def _first_answer_s(url: str, task: str, model: str) -> float:
    path, body = _first_request(task, model)
    started = time.perf_counter()
    answer = httpx.post(url + path, json=body, timeout=600)
    answer.raise_for_status()
    return time.perf_counter() - started


def _embedding_load(result: ScenarioResult, ctx: Context, url: str, model: str, label: str) -> dict[str, float]:
    """The first FIRST_LOAD requests after ready, then the next as many: requests/s of each."""
    rates = {}
    for phase, offset in (("first", 0), ("warm", FIRST_LOAD)):
        requests = ctx.pick(FIRST_LOAD, FIRST_LOAD, tiny=16)
        run = run_closed(url, lambda i, offset=offset: ("/v1/embeddings", {"model": model, "input": TEXTS[offset + i]}),
                         concurrency=LOAD_CONCURRENCY, requests=requests, label=f"{label} {phase} {requests}", ctx=ctx)
        result.add(run, f"{label} {phase} {requests}")
        rates[phase] = run.throughput_rps
    return rates


def _start_ours(result: ScenarioResult, ctx: Context, config: dict, start: str) -> dict[str, Any]:
    name, task = config["name"], config["task"]
    app = f"startup-{name}"
    began = time.perf_counter()
    url = ctx.cluster.deploy(ctx.cluster.models_app([config]), app)
    ready_s = time.perf_counter() - began
    try:
        first_s = _first_answer_s(url, task, name)
        snapshot = model_stats(url, name).get("startup") or {}
        row = result.add_row(f"{OURS} {name} {start}", requests=1, errors=0, ready_s=round(ready_s, 1),
                             first_answer_s=round(ready_s + first_s, 1),
                             **{f"replica_{k}": v for k, v in snapshot.items() if k != "ready"})
        if task == "embedding":
            row.update({f"{phase}_{FIRST_LOAD}_rps": rate for phase, rate in
                        _embedding_load(result, ctx, url, name, f"{OURS} {name} {start}").items()})
        return row
    finally:
        ctx.cluster.delete(app)


def _start_peer(result: ScenarioResult, ctx: Context, config: dict, cache_dir: str,
                start: str) -> Optional[dict[str, Any]]:
    """vLLM's server, timed as ours; None (the variant skipped, with its log's tail) if it did not start."""
    name, task = config["name"], config["task"]
    label = f"{PEER} {name} {start}"
    server = _peer_server(config, cache_dir, Path(ctx.out_dir) / "startup-logs" / f"{name}-{start}.log")
    began = time.perf_counter()
    try:
        url = server.start()
    except (RuntimeError, TimeoutError) as exc:
        result.skip_variant(label, f"vLLM's server did not start: {exc}")
        return None
    ready_s = time.perf_counter() - began
    try:
        first_s = _first_answer_s(url, task, name)
        row = result.add_row(label, requests=1, errors=0, ready_s=round(ready_s, 1),
                             first_answer_s=round(ready_s + first_s, 1))
        if task == "embedding":
            row.update({f"{phase}_{FIRST_LOAD}_rps": rate for phase, rate in
                        _embedding_load(result, ctx, url, name, label).items()})
        return row
    finally:
        server.stop()


@scenario
def startup(ctx: Context) -> ScenarioResult:
    """vLLM replica start, cold (empty compile cache) and warm (filled), ours against vLLM's
    own server for the same model: time to ready and to first answer, and the embedding
    rate of the first 256 requests after ready against the warm rate."""
    missing = require_module("vllm")
    if missing:
        raise ScenarioSkipped(missing)
    result = ScenarioResult("startup", startup.__doc__)
    figures: dict[tuple[str, str, str], dict] = {}
    for task in ("text-generation", "embedding"):
        base = pick_model(ctx.models, task)
        name = base["name"]
        result.derived[f"{name}: one-time preparation on this machine type (s)"] = round(_prepare(base), 1)
        with tempfile.TemporaryDirectory(prefix="startup-ours-") as ours_cache, \
                tempfile.TemporaryDirectory(prefix="startup-vllm-") as peer_cache:
            for start in ("cold", "warm"):
                figures[OURS, name, start] = _start_ours(result, ctx, _our_config(base, ours_cache), start)
            for start in ("cold", "warm"):
                figures[PEER, name, start] = _start_peer(result, ctx, _our_config(base, peer_cache), peer_cache, start)

        ours_warm = figures[OURS, name, "warm"]
        result.check(f"{name}: ours, warm start, deploy to ready (s)", ours_warm["ready_s"], 20.0,
                     higher_is_better=False)
        peer_cold = figures.get((PEER, name, "cold"))
        if peer_cold:
            result.check(f"{name}: cold start to first answer, ours / vLLM's server",
                         figures[OURS, name, "cold"]["first_answer_s"] / peer_cold["first_answer_s"], 1.0,
                         higher_is_better=False)
        if task == "embedding":
            for system in (OURS, PEER):
                for start in ("cold", "warm"):
                    row = figures.get((system, name, start))
                    if row and row.get(f"warm_{FIRST_LOAD}_rps"):
                        ratio = row[f"first_{FIRST_LOAD}_rps"] / row[f"warm_{FIRST_LOAD}_rps"]
                        result.derived[f"{system} {name} {start}: first {FIRST_LOAD} / warm rate"] = round(ratio, 3)
                        if system == OURS:
                            result.check(f"{name}: ours, {start} start, first {FIRST_LOAD} requests after ready / "
                                         f"warm rate", ratio, 0.9)
    return result
