"""results.json, a markdown table and PNG plots for a benchmark run."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from benchmarks.harness.machine import machine_line
from benchmarks.harness.registry import ERROR_RATE_LIMIT

_COLUMNS = ["variant", "concurrency", "requests", "errors", "throughput_rps", "p50_ms", "p95_ms", "p99_ms"]
_EXTRA = ["padding_efficiency", "model_calls_per_batch", "tokens_per_s", "mean_batch_rows", "p50_ttft_ms", "p95_ttft_ms",
          "cosine_mean", "cosine_min",
          # cheaper-vllm: one row per variant, measured inside its own engine process
          "engine_start_s", "resident_mb", "decode_tokens_per_s_1_stream", "decode_tokens_per_s_16_streams",
          "ttft_ms_median", "perplexity_vs_fp32", "greedy_agreement", "answers_identical", "embeddings_per_s",
          "cosine_to_fp32_mean", "cosine_to_fp32_min", "retrieval_accuracy",
          # affinity: vLLM's prefix-cache hits over lookups, both replicas together
          "prefix_cache_hit_rate"]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def failed(res: dict) -> bool:
    """The scenario raised, or one of its runs failed more than ERROR_RATE_LIMIT of its requests."""
    return res.get("error") is not None or any(row.get("failed") for row in res["runs"])


def failure_lines(res: dict) -> list[str]:
    """Why a scenario failed, one line each (empty if it did not)."""
    lines = []
    if res.get("error"):
        lines.append(f"raised {res['error']}")
    for row in res["runs"]:
        if row.get("failed"):
            samples = "; ".join(str(s) for s in row.get("error_samples") or [])[:300]
            lines.append(f"run {row['variant']!r}: {row['errors']} of {row['requests']} requests failed "
                         f"({row.get('error_rate', 1.0):.1%}, limit {ERROR_RATE_LIMIT:.0%})"
                         + (f", e.g. {samples}" if samples else ""))
    return lines


def markdown(results: list[dict], machine: dict, command: str) -> str:
    lines = [f"Measured on {machine_line(machine)}.", "", f"Command: `{command}`", ""]
    bad = [res["name"] for res in results if failed(res)]
    if bad:
        lines += [f"**FAILED: {len(bad)} of {len(results)} scenarios ({', '.join(bad)})**: a run with more than "
                  f"{ERROR_RATE_LIMIT:.0%} of its requests failed, or the scenario raised. Their figures are not "
                  "measurements and none of their checks is met.", ""]
    if any(res.get("tiny") for res in results):
        lines += ["Tiny mode (`--tiny`): a smoke run with a handful of requests; the figures mean nothing.", ""]
    for res in results:
        lines += [f"### {res['name']}", "", res["description"].strip(), ""]
        if res.get("skip_reason"):
            lines += [f"Skipped: {res['skip_reason']}.", ""]
            continue
        if failed(res):
            lines += ["**FAILED**: " + line for line in failure_lines(res)] + [""]
        extra = [c for c in _EXTRA if any(c in row for row in res["runs"])]
        columns = _COLUMNS + extra
        lines.append("| " + " | ".join(columns) + " |")
        lines.append("|" + "---|" * len(columns))
        for row in res["runs"]:
            cells = [_cell(row.get(c)) for c in columns]
            if row.get("failed"):
                cells[0] += " **(failed run)**"
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        for skipped in res.get("skipped") or ():
            lines.append(f"- {skipped['variant']}: skipped, {skipped['reason']}")
        if res.get("skipped"):
            lines.append("")
        if res["derived"]:
            lines.append("Derived: " + ", ".join(f"{k} = {_cell(v)}" for k, v in res["derived"].items()))
            lines.append("")
        for check in res["checks"]:
            if check["met"]:
                mark = "met"
            elif check.get("target_met", False):
                mark = "**not met: the scenario failed**"
            else:
                mark = "**missed**"
            lines.append(f"- {check['claim']}: {_cell(check['value'])} (target {check['target']}): {mark}")
        lines.append("")
    return "\n".join(lines)


def plots(results: list[dict], out_dir: Path) -> list[Path]:
    """Throughput and latency percentiles against concurrency, per scenario with a sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for res in results:
        series: dict[str, list[dict]] = defaultdict(list)
        for row in res["runs"]:
            if row.get("concurrency") is not None and row.get("p50_ms") is not None:
                series[row["variant"]].append(row)
        if not any(len(rows) > 1 for rows in series.values()):
            continue
        fig, (ax_tput, ax_lat) = plt.subplots(1, 2, figsize=(11, 4))
        for name, rows in series.items():
            rows = sorted(rows, key=lambda r: r["concurrency"])
            xs = [r["concurrency"] for r in rows]
            ax_tput.plot(xs, [r["throughput_rps"] for r in rows], marker="o", label=name)
            for q, style in (("p50_ms", "-"), ("p95_ms", "--"), ("p99_ms", ":")):
                ax_lat.plot(xs, [r[q] for r in rows], style, marker="o", label=f"{name} {q[:-3]}")
        ax_tput.set(title=f"{res['name']}: throughput", xlabel="concurrency", ylabel="requests/s")
        ax_lat.set(title=f"{res['name']}: latency", xlabel="concurrency", ylabel="ms", yscale="log")
        for ax in (ax_tput, ax_lat):
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{res['name']}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write(results: list[dict], machine: dict, command: str, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps({"machine": machine, "command": command, "scenarios": results}, indent=2))
    (out_dir / "results.md").write_text(markdown(results, machine, command))
    files = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    for path in plots(results, out_dir):
        files[path.stem] = path
    return files
