"""python -m benchmarks run --scenario NAME [--quick | --tiny] [--config deployments/local.yaml]

Exits 1 when a scenario failed: it raised, or one of its runs had more than
ERROR_RATE_LIMIT (benchmarks/harness/registry.py) of its requests failed. Missed targets are
figures, not failures: they are reported, and the exit status stays 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

from serve_app.core.tasks import PRECISION_CHOICES
from serve_app.ray_env import apply_ray_env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run scenarios and write results.json, results.md and plots")
    run.add_argument("--scenario", default="all", help="a scenario name, a comma-separated list, or 'all'")
    run.add_argument("--quick", action="store_true", help="fewer requests per point (all scenarios in ~13 min on 2 cores)")
    run.add_argument("--tiny", action="store_true",
                     help="smoke mode: every scenario's code path with a handful of requests (all in ~3 min on "
                          "2 cores); checks that the stack serves, measures nothing")
    run.add_argument("--config", default="deployments/local.yaml", help="deployments file whose models are benchmarked")
    run.add_argument("--precision", choices=list(PRECISION_CHOICES), help="override the models' precision")
    run.add_argument("--torch-threads", type=int, default=1, help="torch threads per model replica (and for the in-process ceiling)")
    run.add_argument("--gen-torch-threads", type=int, default=1,
                     help="torch threads for the generation scenario's replicas (1 measured fastest on 2 cores)")
    run.add_argument("--address", help="join a running Ray cluster (e.g. 'auto') instead of starting one")
    run.add_argument("--out", default="benchmark-results", help="output folder")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--classic-proxy", action="store_true",
                     help="Ray Serve's classic Python proxy instead of its high-throughput HAProxy ingress "
                          "(the default, as make serve runs it; SERVE_APP_HIGH_THROUGHPUT=0 does the same)")
    sub.add_parser("list", help="list the scenarios")
    args = parser.parse_args(argv)
    if args.command == "run":
        # Before anything imports ray.serve, and before the Ray it starts (see serve_app.ray_env).
        apply_ray_env(enabled=False if args.classic_proxy else None)

    from benchmarks.harness.registry import Context, load_all, run_scenario

    scenarios = load_all()
    if args.command == "list":
        for name, fn in scenarios.items():
            print(f"{name:16s} {(fn.__doc__ or '').strip().splitlines()[0]}")
        return 0

    names = list(scenarios) if args.scenario == "all" else [s.strip() for s in args.scenario.split(",")]
    unknown = [n for n in names if n not in scenarios]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {', '.join(scenarios)}")

    from benchmarks.harness import report
    from benchmarks.harness.machine import machine_info
    from benchmarks.harness.service import BenchCluster, load_application

    command = "python -m benchmarks " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    cluster = BenchCluster(args.address)
    results = []
    files: dict[str, Path] = {}
    started = time.perf_counter()
    try:
        application = load_application(args.config)
        ctx = Context(cluster=cluster, models=application["models"], application=application, quick=args.quick or args.tiny,
                      precision=args.precision, torch_threads=args.torch_threads, gen_torch_threads=args.gen_torch_threads,
                      progress=not args.no_progress, out_dir=args.out, tiny=args.tiny)
        for name in names:
            t0 = time.perf_counter()
            print(f"== {name}", flush=True)
            res = run_scenario(name, ctx)
            results.append(dataclasses.asdict(res))
            if res.skip_reason:
                print(f"   skipped: {res.skip_reason}")
            for line in report.failure_lines(results[-1]):
                print(f"   FAILED: {line}")
            for check in res.checks:
                mark = "met" if check["met"] else ("NOT MET (scenario failed)" if check["target_met"] else "MISSED")
                print(f"   {check['claim']}: {check['value']} (target {check['target']}) {mark}")
            print(f"   {name} took {time.perf_counter() - t0:.0f}s", flush=True)
            # Write after every scenario so a long run keeps what it measured.
            files = report.write(results, machine_info(args.torch_threads), command, Path(args.out))
    finally:
        cluster.close()
    print(f"wrote {', '.join(str(p) for p in files.values())} in {time.perf_counter() - started:.0f}s")
    bad = [res["name"] for res in results if report.failed(res)]
    if bad:
        print(f"FAILED: {', '.join(bad)} (failed requests above the limit, or an exception; see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
