"""The `cheaper-vllm` scenario: cheaper variants of the chat and the embedding model on
vLLM, side by side in one run: fp32, bf16, int8 (w8a8), 4-bit (w4a16) and pruned.

The quantized variants are the checkpoints ``python -m serve_app.optimize quantize
--format`` writes, the pruned one what ``optimize prune`` writes (half the FFN neurons,
then distilled back); they are built once into the user's cache, their reports beside
the results. Each variant then starts its own vLLM engine, in a process of its own as a
replica does, with the engine arguments and environment our replica gives vLLM
(:func:`serve_app.replica.vllm.runtime.engine_args`, ``cpu_engine_env``), one after
another with nothing else running. In it:

- chat: decode tokens/s of one stream (128 new tokens, median of 5) and of 16 streams together, TTFT
  (median of 5 distinct ~200-token prompts, one new token), and the quality figures of
  :mod:`serve_app.optimize.evaluation` read from vLLM itself: greedy answers to the
  evaluation chats, teacher-forced agreement with the fp32 variant's answers (vLLM's
  prompt logprobs give its top token at each answer position), and perplexity on the
  held-out texts;
- embeddings: embeddings/s of 256 mixed-length texts at concurrency 32 (after a first
  256 to warm up), cosine of the held-out texts' vectors to fp32's, and retrieval top-1
  on the evaluation pairs;
- resident memory: the replica's process and vLLM's engine core together, once warm.

Where the deployments file gives the models a GPU (``benchmarks/tools/gpu_check.sh``), an
``fp8`` variant (vLLM quantizes the full-precision weights at load) is added.

Engines start with ``enforce_eager`` (no torch.compile) unless ``--full``: every variant
is measured alike, ten starts fit in the run, and compiled decode is 9-20% faster for
all of them alike (``python -m benchmarks.tools.compile_modes``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import numpy as np

from benchmarks.harness.registry import Context, ScenarioResult, ScenarioSkipped, require_module, scenario
from benchmarks.harness.service import pick_model

DECODE_TOKENS = 128
SINGLE_STREAM_REPEATS = 5  # one stream's rate moves ~10% between runs: the median of five
STREAMS = 16
EMBED_TEXTS = 256
EMBED_CONCURRENCY = 32


def _cache_dir() -> Path:
    return Path(os.environ.get("SERVE_APP_CACHE", Path.home() / ".cache" / "serve_app")) / "benchmark-models"


def _built(kind: str, source: str, task: str, out_dir: Path, *options: str) -> Path:
    """A variant directory written by ``python -m serve_app.optimize`` (once, then cached)."""
    name = source.replace(":", "-").replace("/", "-")
    target = _cache_dir() / f"{name}-{kind}"
    if (target / "config.json").is_file():
        return target
    verb = "prune" if kind.startswith("pruned") else "quantize"
    command = [sys.executable, "-m", "serve_app.optimize", verb, "--source", source, "--task", task, *options,
               "--out", str(target), "--force", "--allow-below-floor", "--repeats", "1"]
    print("   building", kind, ":", " ".join(command), flush=True)
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"building {kind} failed: {run.stderr[-1000:]}")
    report = target / "optimize-report.md"
    if report.is_file():
        (out_dir / f"optimize-{name}-{kind}.md").write_text(report.read_text())
    return target


def _variants(base: dict, ctx: Context) -> dict[str, dict]:
    """name -> {source, precision, quantization} for one model."""
    source, task = base["source"], base["task"]
    out_dir = Path(ctx.out_dir)
    recover = ctx.pick(300, 60, tiny=2)
    variants = {
        "fp32": {"source": source, "precision": "fp32"},
        "bf16": {"source": source, "precision": "bf16"},
        "w8a8": {"source": str(_built("w8a8", source, task, out_dir, "--format", "w8a8")), "precision": "bf16",
                 "quantization": "w8a8"},
        "w4a16": {"source": str(_built("w4a16", source, task, out_dir, "--format", "w4a16")), "precision": "bf16",
                  "quantization": "w4a16"},
        "pruned-ffn50": {"source": str(_built(f"pruned-ffn50-recover{recover}", source, task, out_dir,
                                              "--ffn-keep", "0.5", "--recover-steps", str(recover))),
                         "precision": "bf16"},
    }
    if (base.get("resources") or {}).get("num_gpus", 0) > 0:
        # GPU formats (gpu_check.sh): vLLM quantizes the full-precision weights to fp8 at load.
        variants["fp8"] = {"source": source, "precision": "bf16", "quantization": "fp8"}
    return variants if not ctx.tiny else {k: variants[k] for k in ("fp32", "w8a8")}


# ---- one variant, in a process of its own ---------------------------------------------


def _resident_bytes() -> int:
    import psutil

    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])


async def _generation_figures(engine, tokenizer, job: dict) -> dict[str, Any]:
    from vllm import SamplingParams

    from serve_app.core.models.generation import encode_chat_template
    from serve_app.optimize import heldout_texts
    from serve_app.optimize.evaluation import ANSWER_TOKENS, chat_items

    async def run(ids: list[int], params) -> Any:
        final = None
        async for output in engine.generate({"prompt_token_ids": ids}, params, uuid.uuid4().hex):
            final = output
        figures["requests"] += 1
        return final

    words = heldout_texts()
    figures: dict[str, Any] = {"requests": 0}
    stream_prompts = [tokenizer(" ".join(words[i:i + 3])).input_ids for i in range(STREAMS)]
    decode = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    await run(stream_prompts[0], decode)  # warm-up
    singles = []
    for ids in stream_prompts[:SINGLE_STREAM_REPEATS]:
        started = time.perf_counter()
        await run(ids, decode)
        singles.append(DECODE_TOKENS / (time.perf_counter() - started))
    figures["decode_tokens_per_s_1_stream"] = round(statistics.median(singles), 1)
    started = time.perf_counter()
    await asyncio.gather(*(run(ids, decode) for ids in stream_prompts))
    figures[f"decode_tokens_per_s_{STREAMS}_streams"] = round(STREAMS * DECODE_TOKENS / (time.perf_counter() - started),
                                                               1)
    ttfts = []
    for i in range(5):  # distinct first words: no prefix-cache hits
        ids = tokenizer(f"{i} " + " ".join(words[10 * i:10 * i + 16])).input_ids[:200]
        started = time.perf_counter()
        await run(ids, SamplingParams(max_tokens=1, temperature=0))
        ttfts.append(time.perf_counter() - started)
    figures["ttft_ms_median"] = round(statistics.median(ttfts) * 1000, 1)

    # Quality, from vLLM's own numbers.
    prompts = [encode_chat_template(tokenizer, [{"role": "user", "content": item.prompt}]) for item in chat_items()]
    greedy = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0)
    answers = [list(out.outputs[0].token_ids) for out in await asyncio.gather(*(run(ids, greedy) for ids in prompts))]
    figures["answers"] = answers
    figures["answers_text"] = [tokenizer.decode(a, skip_special_tokens=True) for a in answers]
    reference = job.get("reference_answers")
    if reference:
        scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
        agreed = compared = 0
        outs = await asyncio.gather(*(run(ids + ref, scored) for ids, ref in zip(prompts, reference) if ref))
        for ids, ref, out in zip([p for p, r in zip(prompts, reference) if r], [r for r in reference if r], outs):
            for position, token in enumerate(ref):
                ranked = out.prompt_logprobs[len(ids) + position]
                top = next(t for t, logprob in ranked.items() if logprob.rank == 1)
                agreed += top == token
                compared += 1
        figures["greedy_agreement"] = round(agreed / compared, 4)
    nll = tokens = 0
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for out in await asyncio.gather(*(run(tokenizer(text).input_ids, scored) for text in heldout_texts())):
        for position, ranked in enumerate(out.prompt_logprobs[1:], start=1):
            nll -= ranked[out.prompt_token_ids[position]].logprob
            tokens += 1
    figures["perplexity"] = round(math.exp(nll / tokens), 3)
    return figures


async def _embedding_figures(engine, tokenizer) -> dict[str, Any]:
    from vllm import PoolingParams

    from serve_app.optimize import heldout_texts
    from serve_app.optimize.evaluation import retrieval_pairs

    limit = asyncio.Semaphore(EMBED_CONCURRENCY)
    figures: dict[str, Any] = {"requests": 0}

    async def embed(text: str) -> list[float]:
        async with limit:
            final = None
            async for output in engine.encode({"prompt_token_ids": tokenizer(text).input_ids[:250]},
                                              PoolingParams(task="embed"), uuid.uuid4().hex):
                final = output
            figures["requests"] += 1
            return final.outputs.data.tolist()

    words = " ".join(heldout_texts()).split()
    texts = [" ".join(words[i * 7 % 900: i * 7 % 900 + 4 + (i * 37) % 120]) for i in range(EMBED_TEXTS)]
    await asyncio.gather(*(embed(t) for t in texts))  # warm-up over the same shapes
    started = time.perf_counter()
    await asyncio.gather(*(embed(t) for t in texts))
    figures["embeddings_per_s"] = round(EMBED_TEXTS / (time.perf_counter() - started), 1)
    figures["heldout_vectors"] = await asyncio.gather(*(embed(t) for t in heldout_texts()))
    pairs = retrieval_pairs()
    queries = np.asarray(await asyncio.gather(*(embed(q) for q, _ in pairs)))
    passages = np.asarray(await asyncio.gather(*(embed(p) for _, p in pairs)))
    figures["retrieval_accuracy"] = round(float(np.mean((queries @ passages.T).argmax(axis=1) == np.arange(len(pairs)))),
                                          4)
    return figures


def one_variant(job: dict) -> dict[str, Any]:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from serve_app.config import ModelConfig
    from serve_app.core.models.sources import resolve_source
    from serve_app.replica.vllm.runtime import engine_args

    config = ModelConfig.model_validate(job["config"])
    started = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(config, resolve_source(config.source))))
    figures: dict[str, Any] = {"engine_start_s": round(time.perf_counter() - started, 1)}
    tokenizer = engine.get_tokenizer()
    if config.task == "text-generation":
        figures.update(asyncio.run(_generation_figures(engine, tokenizer, job)))
    else:
        figures.update(asyncio.run(_embedding_figures(engine, tokenizer)))
    figures["resident_mb"] = round(_resident_bytes() / 1e6, 1)
    engine.shutdown()
    return figures


def _run_variant(config: dict, reference_answers: Optional[list] = None) -> dict[str, Any]:
    """One variant's figures, from a process of its own (its memory is its own)."""
    job = json.dumps({"config": config, "reference_answers": reference_answers})
    run = subprocess.run([sys.executable, "-m", "benchmarks.scenarios.cheaper_vllm", "--one", job],
                         capture_output=True, text=True, timeout=1800)
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"variant {config['name']} failed: {run.stderr[-1500:]}")
    return json.loads(line[len("RESULT "):])


# ---- the scenario -----------------------------------------------------------------------


def _config(base: dict, name: str, spec: dict, full: bool) -> dict:
    config = {key: base[key] for key in ("task", "resources", "batching") if key in base}
    vllm = {key: value for key, value in (base.get("vllm") or {}).items() if key != "compile_cache_dir"}
    vllm["enforce_eager"] = not full
    return {**config, "name": name, "engine": "vllm", **spec, "vllm": vllm}


def _cosines(vectors: list, reference: list) -> np.ndarray:
    a, b = np.asarray(vectors), np.asarray(reference)
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@scenario(name="cheaper-vllm")
def cheaper_vllm(ctx: Context) -> ScenarioResult:
    """fp32, bf16, int8 (w8a8), 4-bit (w4a16) and pruned variants of the chat and the embedding
    model on vLLM, side by side: decode tokens/s, TTFT, embeddings/s, resident memory, quality."""
    result = ScenarioResult("cheaper-vllm", cheaper_vllm.__doc__)
    missing = require_module("vllm")
    if missing:
        raise ScenarioSkipped(missing)
    full = not (ctx.quick or ctx.tiny)
    for task in ("text-generation", "embedding"):
        base = pick_model(ctx.models, task)
        rows: dict[str, dict] = {}
        for name, spec in _variants(base, ctx).items():
            reference = rows.get("fp32", {}).get("answers") if task == "text-generation" else None
            print(f"   {base['name']} {name}", flush=True)
            figures = _run_variant(_config(base, f"{base['name']}-{name}", spec, full), reference)
            rows[name] = figures
        fp32 = rows["fp32"]
        for name, figures in rows.items():
            row: dict[str, Any] = {"model": base["name"], "quantization": _variants_label(name),
                                   "engine_start_s": figures["engine_start_s"], "resident_mb": figures["resident_mb"]}
            if task == "text-generation":
                row.update({key: figures[key] for key in ("decode_tokens_per_s_1_stream",
                                                          f"decode_tokens_per_s_{STREAMS}_streams", "ttft_ms_median",
                                                          "perplexity")})
                row["perplexity_vs_fp32"] = round(figures["perplexity"] / fp32["perplexity"], 4)
                row["greedy_agreement"] = figures.get("greedy_agreement", 1.0 if name == "fp32" else None)
                row["answers_identical"] = round(float(np.mean([a == b for a, b in
                                                                zip(figures["answers"], fp32["answers"])])), 4)
                row["paris_answer"] = figures["answers_text"][0]
            else:
                cosine = _cosines(figures["heldout_vectors"], fp32["heldout_vectors"])
                row.update(embeddings_per_s=figures["embeddings_per_s"], cosine_to_fp32_mean=round(float(cosine.mean()), 5),
                           cosine_to_fp32_min=round(float(cosine.min()), 5),
                           retrieval_accuracy=figures["retrieval_accuracy"])
            # Every engine request of the variant (timed and quality ones); one that failed
            # would have ended its process with an error instead of figures.
            result.add_row(f"{base['name']} {name}", requests=figures["requests"], errors=0, **row)
        _checks(result, task, rows)
    return result


def _variants_label(name: str) -> str:
    return {"fp32": "none (fp32)", "bf16": "none (bf16)"}.get(name, name)


def _checks(result: ScenarioResult, task: str, rows: dict[str, dict]) -> None:
    if "w8a8" not in rows or "bf16" not in rows:
        return
    w8a8, bf16, fp32 = rows["w8a8"], rows["bf16"], rows["fp32"]
    if task == "text-generation":
        result.derived["w8a8_decode_vs_bf16_1_stream"] = round(
            w8a8["decode_tokens_per_s_1_stream"] / bf16["decode_tokens_per_s_1_stream"], 3)
        result.derived[f"w8a8_decode_vs_bf16_{STREAMS}_streams"] = round(
            w8a8[f"decode_tokens_per_s_{STREAMS}_streams"] / bf16[f"decode_tokens_per_s_{STREAMS}_streams"], 3)
        result.check("int8 (w8a8) chat decode tokens/s vs bf16, one stream",
                     result.derived["w8a8_decode_vs_bf16_1_stream"], 1.3)
        result.check("int8 (w8a8) chat greedy agreement with fp32", w8a8.get("greedy_agreement"), 0.9)
        result.check("int8 (w8a8) chat perplexity / fp32's", w8a8["perplexity"] / fp32["perplexity"], 1.05,
                     higher_is_better=False)
    else:
        result.derived["w8a8_embeddings_vs_bf16"] = round(w8a8["embeddings_per_s"] / bf16["embeddings_per_s"], 3)
        result.check("int8 (w8a8) embeddings/s vs bf16", result.derived["w8a8_embeddings_vs_bf16"], 1.2)
        cosine = _cosines(w8a8["heldout_vectors"], fp32["heldout_vectors"])
        result.check("int8 (w8a8) embedding cosine to fp32 (mean)", float(cosine.mean()), 0.99)
        result.check("int8 (w8a8) retrieval top-1 minus fp32's", w8a8["retrieval_accuracy"] - fp32["retrieval_accuracy"],
                     0.0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        job = json.loads(sys.argv[2])
        from serve_app.config import ModelConfig
        from serve_app.replica.vllm.runtime import cpu_engine_env

        # Before vLLM is imported: it reads its environment once (threads, KV cache, caches).
        os.environ.update(cpu_engine_env(ModelConfig.model_validate(job["config"])))
        print("RESULT " + json.dumps(one_variant(job)), flush=True)
