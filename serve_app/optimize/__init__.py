"""Offline model optimization: ``python -m serve_app.optimize quantize|prune ...``.

``quantize`` measures a quantization mode (as ``load_runtime`` applies it when a
model's config sets ``quantization:``) against the unquantized model. ``prune``
removes FFN neurons and attention heads (:mod:`serve_app.optimize.pruning`), optionally
recovers quality by distillation, and saves a model directory that a config's
``source:`` can point to. Both print and save a report (JSON and a markdown table)
with size, speed at a fixed batch and quality against the original on held-out text.

The package ships two small corpora written for it, ``data/calibration.txt`` (what
pruning scores and distills on) and ``data/heldout.txt`` (what quality is measured
on); no line is in both, so quality is never measured on text the model was fitted to.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

BUILTIN = "builtin"


def _read_lines(text: str) -> list[str]:
    """Non-empty lines that are not '#' comments, stripped, duplicates dropped in order."""
    seen: set[str] = set()
    lines = []
    for raw in text.splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and line not in seen:
            seen.add(line)
            lines.append(line)
    return lines


def _builtin(name: str) -> list[str]:
    return _read_lines(resources.files(__name__).joinpath("data", name).read_text(encoding="utf-8"))


def load_texts(source: str, *, builtin_name: str) -> list[str]:
    """Lines of ``source``: a text file (one text per line) or ``builtin`` for the shipped one."""
    if source == BUILTIN:
        return _builtin(builtin_name)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"text file {str(path)!r} does not exist; give a file with one text per line, or '{BUILTIN}'")
    lines = _read_lines(path.read_text(encoding="utf-8"))
    if not lines:
        raise ValueError(f"text file {str(path)!r} has no text lines (blank lines and '#' comments are skipped)")
    return lines


def calibration_texts(source: str = BUILTIN) -> list[str]:
    """Texts that pruning scores importance and distills on."""
    return load_texts(source, builtin_name="calibration.txt")


def heldout_texts(source: str = BUILTIN, *, exclude: list[str] | None = None) -> list[str]:
    """Texts that quality is measured on, without any line of ``exclude`` (the calibration text)."""
    texts = load_texts(source, builtin_name="heldout.txt")
    if exclude:
        banned = set(exclude)
        texts = [t for t in texts if t not in banned]
        if not texts:
            raise ValueError("every held-out line is also a calibration line; give disjoint texts")
    return texts
