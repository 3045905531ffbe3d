"""The Grafana dashboard the tests read, and its panels (rows' panels included)."""

from __future__ import annotations

from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "dashboards" / "serve_app.json"


def all_panels(panels: list) -> list[dict]:
    """Every panel, including those inside rows (collapsed rows keep theirs in "panels")."""
    out = []
    for panel in panels:
        out.append(panel)
        out.extend(all_panels(panel.get("panels", [])))
    return out
