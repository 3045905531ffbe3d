"""Measurements for optimize reports: size, speed at a fixed batch, and quality of a
candidate model against the original on held-out text.

Quality, by task (the candidate is compared with the reference model, not with labels):

- embedding: cosine between the two models' pooled, normalized embeddings of each
  text (mean and min over texts).
- text-generation: top-1 next-token agreement over every position of every text, and
  each model's perplexity on the same text.
- text-classification: share of texts where both models give the same top label.

Models are compared through their runtimes (:mod:`serve_app.core.models`), so pooling,
padding and tokenization are the ones the server uses; :func:`with_model` puts an
in-memory model (a pruned one before it is saved) behind a loaded runtime.
"""

from __future__ import annotations

import copy
import io
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from serve_app.core.models.quantization import parameter_count, weight_bytes
from serve_app.core.models import EmbeddingRuntime, GenerationRuntime, TaskRuntime, TextClassificationRuntime

# Weight files transformers loads (safetensors first); what "bytes on disk" counts.
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


def with_model(runtime: TaskRuntime, model: torch.nn.Module) -> TaskRuntime:
    """A copy of ``runtime`` that runs ``model`` (same tokenizer, pooling, device)."""
    clone = copy.copy(runtime)
    clone.model = model
    return clone


# --------------------------------------------------------------------------- size


def bytes_on_disk(model_dir: Path) -> int:
    """Bytes of the weight files a from_pretrained load of ``model_dir`` reads."""
    model_dir = Path(model_dir)
    for pattern in _WEIGHT_PATTERNS:
        files = sorted(model_dir.glob(pattern))
        if files:
            return sum(f.stat().st_size for f in files)
    raise ValueError(f"no *.safetensors or *.bin weight files in {model_dir}")


def serialized_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``: what quantized weights take when
    written out (safetensors cannot hold torchao's packed tensors)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


def size_figures(model: torch.nn.Module) -> dict[str, int]:
    return {"parameters": parameter_count(model), "weight_bytes_in_memory": weight_bytes(model)}


# --------------------------------------------------------------------------- speed


def fixed_batch(tokenizer: Any, texts: Sequence[str], *, rows: int = 16, tokens: int = 64) -> dict[str, torch.Tensor]:
    """A ``rows x tokens`` batch of real tokens (no padding): the texts' tokens, joined
    and cut into rows, so every model is timed on exactly the same work."""
    stream: list[int] = []
    while len(stream) < rows * tokens:
        before = len(stream)
        for text in texts:
            stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(stream) >= rows * tokens:
                break
        if len(stream) == before:
            raise ValueError("the timing texts tokenize to nothing")
    ids = torch.tensor(stream[: rows * tokens], dtype=torch.long).view(rows, tokens)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _timed_in_turns(calls: Sequence[Any], repeats: int, warmup: int) -> list[list[float]]:
    """Seconds of each call per round, the calls taking turns (A, B, C, A, B, C, ...):
    a change in machine load between rounds then hits every model alike."""
    for call in calls:
        for _ in range(warmup):
            call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for index, call in enumerate(calls):
            started = time.perf_counter()
            call()
            times[index].append(time.perf_counter() - started)
    return times


#: Prompt tokens per row when timing decoding: short, so the new tokens dominate.
DECODE_PROMPT_TOKENS = 8


def compare_speed(runtimes: Sequence[TaskRuntime], batch: dict[str, torch.Tensor], *, repeats: int = 10,
                  warmup: int = 2, decode_tokens: int = 0, decode_repeats: int = 3) -> list[dict[str, Any]]:
    """Per runtime: forward-pass latency of the same fixed batch (median of ``repeats``,
    timed in turns with the other runtimes) and throughput.

    For generation models with ``decode_tokens > 0``, also greedy generation of that
    many new tokens per row after the first :data:`DECODE_PROMPT_TOKENS` tokens of each
    row, as new tokens per second (its short prefill included).
    """
    rows, tokens = batch["input_ids"].shape

    def forward_call(runtime: TaskRuntime):
        ids, mask = batch["input_ids"].to(runtime.device), batch["attention_mask"].to(runtime.device)

        def forward():
            with torch.inference_mode():
                runtime.model(input_ids=ids, attention_mask=mask)
        return forward

    def decode_call(runtime: GenerationRuntime):
        ids = batch["input_ids"][:, :DECODE_PROMPT_TOKENS].to(runtime.device)
        mask = batch["attention_mask"][:, :DECODE_PROMPT_TOKENS].to(runtime.device)

        def decode():
            with torch.inference_mode():
                runtime.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=decode_tokens,
                                       min_new_tokens=decode_tokens, do_sample=False,
                                       pad_token_id=runtime.pad_token_id)
        return decode

    figures = []
    for times in _timed_in_turns([forward_call(r) for r in runtimes], repeats, warmup):
        median = statistics.median(times)
        figures.append({
            "batch_rows": rows, "batch_tokens_per_row": tokens, "repeats": repeats,
            "latency_ms_median": round(median * 1000, 2),
            "latency_ms_min": round(min(times) * 1000, 2),
            "latency_ms_max": round(max(times) * 1000, 2),
            "rows_per_s": round(rows / median, 1),
            "tokens_per_s": round(rows * tokens / median, 1),
        })
    if decode_tokens > 0 and all(isinstance(r, GenerationRuntime) for r in runtimes):
        decode_times = _timed_in_turns([decode_call(r) for r in runtimes], decode_repeats, 1)
        for entry, times in zip(figures, decode_times):
            median = statistics.median(times)
            entry.update({
                "decode_prompt_tokens": DECODE_PROMPT_TOKENS, "decode_new_tokens_per_row": decode_tokens,
                "decode_repeats": decode_repeats, "decode_ms_median": round(median * 1000, 1),
                "decode_new_tokens_per_s": round(rows * decode_tokens / median, 1),
            })
    return figures


# --------------------------------------------------------------------------- quality


def _chunks(items: Sequence[Any], size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


def embedding_agreement(reference: EmbeddingRuntime, candidate: EmbeddingRuntime, texts: Sequence[str],
                        batch_size: int = 16) -> dict[str, float]:
    rows = [reference.tokenize(t) for t in texts]
    cosines = []
    for chunk in _chunks(rows, batch_size):
        ref = torch.tensor(reference.embed(chunk))
        cand = torch.tensor(candidate.embed(chunk))
        cosines.extend((ref * cand).sum(dim=-1).tolist())  # both are L2-normalized
    return {"texts": len(cosines), "embedding_cosine_mean": round(sum(cosines) / len(cosines), 5),
            "embedding_cosine_min": round(min(cosines), 5)}


def label_agreement(reference: TextClassificationRuntime, candidate: TextClassificationRuntime,
                    texts: Sequence[str], batch_size: int = 16) -> dict[str, float]:
    rows = [reference.tokenize(t) for t in texts]
    same = 0
    for chunk in _chunks(rows, batch_size):
        ref = reference.classify(chunk, top_k=1)
        cand = candidate.classify(chunk, top_k=1)
        same += sum(r[0][0] == c[0][0] for r, c in zip(ref, cand))
    return {"texts": len(rows), "label_agreement": round(same / len(rows), 5)}


def _causal_batches(runtime: GenerationRuntime, texts: Sequence[str], batch_size: int):
    for chunk in _chunks(list(texts), batch_size):
        encoded = runtime.tokenizer(chunk, padding=True, padding_side="right", return_tensors="pt")
        yield encoded["input_ids"].to(runtime.device), encoded["attention_mask"].to(runtime.device)


def next_token_agreement(reference: GenerationRuntime, candidate: GenerationRuntime, texts: Sequence[str],
                         batch_size: int = 8) -> dict[str, float]:
    """Top-1 agreement at every position that has a next token, and both perplexities there."""
    agree = positions = 0
    nll = {"reference": 0.0, "candidate": 0.0}
    for ids, mask in _causal_batches(reference, texts, batch_size):
        # Position t predicts token t + 1; count it where that token is real text.
        scored = mask[:, 1:].bool()
        targets = ids[:, 1:]
        predictions = {}
        with torch.inference_mode():
            for name, runtime in (("reference", reference), ("candidate", candidate)):
                logits = runtime.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
                log_probs = torch.log_softmax(logits, dim=-1)
                nll[name] -= log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)[scored].sum().item()
                predictions[name] = logits.argmax(dim=-1)
        agree += int((predictions["reference"] == predictions["candidate"])[scored].sum())
        positions += int(scored.sum())
    if positions == 0:
        raise ValueError("held-out texts are too short: no position has a next token")
    return {
        "texts": len(texts), "positions": positions,
        "next_token_agreement": round(agree / positions, 5),
        "perplexity_reference": round(math.exp(nll["reference"] / positions), 3),
        "perplexity_candidate": round(math.exp(nll["candidate"] / positions), 3),
    }


def quality(reference: TaskRuntime, candidate: TaskRuntime, texts: Sequence[str]) -> dict[str, float]:
    """The task's quality figures of ``candidate`` against ``reference`` (see module doc)."""
    if isinstance(reference, EmbeddingRuntime):
        return embedding_agreement(reference, candidate, texts)
    if isinstance(reference, GenerationRuntime):
        return next_token_agreement(reference, candidate, texts)
    if isinstance(reference, TextClassificationRuntime):
        return label_agreement(reference, candidate, texts)
    raise ValueError(f"no text quality measure for task {reference.task}; use embedding, text-generation "
                     "or text-classification")


# --------------------------------------------------------------------------- reports


def environment() -> dict[str, Any]:
    """What the figures depend on: versions, threads, CPU, and how busy the machine was."""
    import transformers

    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__, "transformers": transformers.__version__, "torchao": torchao_version,
        "python": platform.python_version(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1m_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _mb(value: Any) -> str:
    return f"{value / 1e6:.1f}" if isinstance(value, (int, float)) else "-"


def _number(value: Any, digits: int = 4) -> str:
    if isinstance(value, (int, float)) and abs(value) >= 1000:
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return "-" if value is None else str(value)


_QUALITY_COLUMNS = (
    ("embedding_cosine_mean", "cosine mean"), ("embedding_cosine_min", "cosine min"),
    ("next_token_agreement", "next-token top-1 agreement"), ("perplexity_candidate", "perplexity"),
    ("label_agreement", "label agreement"),
    ("greedy_agreement", "greedy agreement (eval chats)"), ("answers_identical", "answers identical"),
    ("answers_correct_candidate", "answers correct"),
    ("retrieval_accuracy_candidate", "retrieval top-1 (eval pairs)"),
)


def reference_figure(rows: list[dict[str, Any]], key: str) -> Any:
    """A reference figure that the comparisons carry (the same in each)."""
    return next((r["quality"][key] for r in rows if key in (r.get("quality") or {})), None)


def markdown_table(report: dict[str, Any]) -> str:
    """One row per model in the report: size, speed at the fixed batch, quality."""
    rows = report["models"]
    quality_keys = [(k, title) for k, title in _QUALITY_COLUMNS if any(k in (r.get("quality") or {}) for r in rows)]
    # The original has no comparison of its own; its perplexity is every comparison's reference.
    reference_perplexity = reference_figure(rows, "perplexity_reference")
    decode = any("decode_new_tokens_per_s" in (r.get("speed") or {}) for r in rows)
    speed = rows[0].get("speed") or {}
    shape = f"{speed.get('batch_rows', '?')}x{speed.get('batch_tokens_per_row', '?')}"
    header = ["model", "parameters", "on disk MB", "in memory MB", f"latency ms ({shape}, median)", "tokens/s"]
    if decode:
        header.append("decode new tokens/s")
    header += [title for _, title in quality_keys]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        s = r.get("speed") or {}
        q = r.get("quality") or {}
        cells = [r["name"], f"{r['parameters']:,}" if r.get("parameters") else "-", _mb(r.get("bytes_on_disk")),
                 _mb(r.get("weight_bytes_in_memory")), _number(s.get("latency_ms_median")),
                 _number(s.get("tokens_per_s"))]
        if decode:
            cells.append(_number(s.get("decode_new_tokens_per_s")))
        for key, _ in quality_keys:
            value = q.get(key)
            if r["name"] == "original":  # its own figures are every comparison's reference
                value = {"perplexity_candidate": reference_perplexity,
                         "answers_correct_candidate": reference_figure(rows, "answers_correct_reference"),
                         "retrieval_accuracy_candidate": reference_figure(rows, "retrieval_accuracy_reference"),
                         }.get(key, value)
            # Fixed decimals: 0.99996 must not print as "1".
            decimals = 2 if key.startswith("perplexity") else 4
            cells.append("-" if value is None else f"{value:.{decimals}f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
