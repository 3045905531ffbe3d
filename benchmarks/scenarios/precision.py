"""The `precision` scenario: one embedding model served cheaper, side by side.

The deployments file's embedding model (MiniLM-L6 in local.yaml) is deployed five
times in one Ray instance: fp32 (the reference), bf16, int8 weight-only (fp32
activations), int4 weight-only (bf16 activations, as the CPU kernel needs) and a
pruned copy (50% of the FFN neurons removed by ``python -m serve_app.optimize prune``,
then distilled back for a few hundred steps). Load alternates between them at each
round. Quality is measured through the same HTTP API: every variant embeds the
package's held-out texts, and each vector is compared with the fp32 variant's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

from benchmarks.harness.registry import Context, ScenarioResult, embedding_request, requests_for, run_closed, scenario
from benchmarks.harness.service import pick_model, variant
from serve_app.optimize import heldout_texts

CONCURRENCY = 16


def _pruned_model_dir(source: str, out_dir: Path, recover_steps: int) -> Path:
    """The embedding model with half its FFN neurons, recovered by distillation.

    Built once into the user's cache (it is as large as the model, so not beside the
    results); the prune report goes with the results."""
    cache = Path(os.environ.get("SERVE_APP_CACHE", Path.home() / ".cache" / "serve_app"))
    name = source.replace(":", "-").replace("/", "-")
    target = cache / "benchmark-models" / f"{name}-ffn50-recover{recover_steps}"
    if (target / "config.json").is_file():
        return target
    command = [sys.executable, "-m", "serve_app.optimize", "prune", "--source", source, "--task", "embedding",
               "--ffn-keep", "0.5", "--recover-steps", str(recover_steps), "--out", str(target),
               "--report", str(out_dir / f"prune-ffn50-recover{recover_steps}.json"), "--force",
               "--allow-below-floor"]
    print("   building the pruned variant:", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    return target


def _embed_all(url: str, texts: list[str]) -> np.ndarray:
    vectors = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for start in range(0, len(texts), 16):
            answer = client.post("/v1/embeddings", json={"model": "embed", "input": texts[start:start + 16]})
            answer.raise_for_status()
            vectors += [row["embedding"] for row in answer.json()["data"]]
    return np.asarray(vectors, dtype=np.float64)


@scenario
def precision(ctx: Context) -> ScenarioResult:
    """Embeddings at fp32, bf16, int8, int4 and pruned (FFN 50% + distillation), side by side:
    throughput and p95 at concurrency 16, with cosine to fp32 on held-out texts."""
    result = ScenarioResult("precision", precision.__doc__)
    base = pick_model(ctx.models, "embedding")
    # Tiny: a couple of distillation steps, only to build (once, then cached) and serve a pruned model.
    pruned = _pruned_model_dir(base["source"], Path(ctx.out_dir), recover_steps=ctx.pick(300, 100, tiny=2))
    common = dict(torch_threads=ctx.torch_threads, num_cpus=ctx.model_cpus, max_batch_size=64, batch_wait_timeout_s=0.01)
    configs = {
        "fp32": variant(base, name="embed", precision="fp32", **common),
        "bf16": variant(base, name="embed", precision="bf16", **common),
        "int8": {**variant(base, name="embed", precision="fp32", **common), "quantization": "int8"},
        "int4": {**variant(base, name="embed", precision="bf16", **common), "quantization": "int4"},
        "pruned-ffn50": {**variant(base, name="embed", precision="fp32", **common), "source": str(pruned)},
    }
    deployed = ctx.cluster.deploy_many(
        {f"precision-{name}": ctx.cluster.models_app([config]) for name, config in configs.items()})
    urls = {name: deployed[f"precision-{name}"] for name in configs}

    texts = heldout_texts()[: ctx.pick(None, None, tiny=16)]
    reference = _embed_all(urls["fp32"], texts)
    quality = {}
    for name, url in urls.items():
        vectors = _embed_all(url, texts)
        cosine = np.sum(vectors * reference, axis=1) / (
            np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1))
        quality[name] = {"cosine_mean": round(float(cosine.mean()), 4), "cosine_min": round(float(cosine.min()), 4)}

    rounds = ctx.pick(4, 2, tiny=1)
    concurrency = ctx.pick(CONCURRENCY, CONCURRENCY, tiny=4)
    runs: dict[str, list] = {name: [] for name in urls}
    for _ in range(rounds):  # alternate, so drifting load on the machine hits every variant alike
        for name, url in urls.items():
            runs[name].append(run_closed(url, embedding_request("embed"), concurrency=concurrency,
                                         requests=requests_for(concurrency, ctx), label=name, ctx=ctx, warmup=8))
    rows = {}
    for name in urls:
        best = max(runs[name], key=lambda run: run.throughput_rps)  # the round least disturbed
        rows[name] = result.add(best, name, **quality[name])
        for other in runs[name]:  # a round not reported still counts its failed requests
            if other is not best and other.errors:
                result.add(other, f"{name} (another round)", **quality[name])
    ctx.cluster.delete(*deployed)
    fp32 = rows["fp32"]
    for name, row in rows.items():
        result.derived[f"{name}_throughput_vs_fp32"] = round(row["throughput_rps"] / fp32["throughput_rps"], 2)
    result.derived["texts"] = len(texts)
    result.check("int8 embedding cosine to fp32 (mean)", quality["int8"]["cosine_mean"], 0.99)
    result.check("bf16 embedding cosine to fp32 (mean)", quality["bf16"]["cosine_mean"], 0.99)
    return result
