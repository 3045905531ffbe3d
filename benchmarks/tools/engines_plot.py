"""The `engines` scenario's bar chart (engines.png): generated tokens/s, time to first token
and embeddings/s per system, from the scenario's run rows. The scenario draws it at the
end of its run (:mod:`benchmarks.scenarios.engines`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from benchmarks.data.workloads import TRACE_ATTRIBUTION
from benchmarks.harness.registry import ScenarioResult


def plot(result: ScenarioResult, out_dir: Path, systems: Sequence[str]) -> Optional[Path]:
    """engines.png in ``out_dir``: one bar per system on each panel (its colour by its place
    in ``systems``); None when no run succeeded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("chat", "tokens_per_s", "chat: generated tokens/s"), ("chat", "p95_ttft_ms", "chat: p95 TTFT (ms)"),
              ("embeddings", "embeddings_per_s", "embeddings/s"),
              ("customer-service", "p95_ttft_ms", "customer-service: p95 TTFT (ms)")]
    rows = [row for row in result.runs if not row.get("failed")]
    if not rows:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    colours = {name: f"C{i}" for i, name in enumerate(systems)}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4))
    for ax, (load, metric, title) in zip(axes, panels):
        chosen = [row for row in rows if row.get("load") == load and row.get(metric) is not None]
        ax.bar([row["system"].replace(" (prefix cache off)", "\n(no prefix cache)") for row in chosen],
               [row[metric] for row in chosen], color=[colours[row["system"]] for row in chosen])
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("engines: same loads, one system at a time")
    fig.text(0.01, 0.01, "chat lengths: " + TRACE_ATTRIBUTION, fontsize=6)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = out_dir / "engines.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
