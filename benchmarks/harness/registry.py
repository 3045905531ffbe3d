"""The scenario registry: what a scenario gets (Context), what it returns (ScenarioResult),
the ``@scenario`` decorator, and the helpers scenarios share.

Scenario modules import from here, never from each other; :func:`load_all` imports
every scenario module once so they register (``SCENARIO_MODULES`` lists them), and
:func:`run_scenario` is the one way a scenario is run (the CLI and the smoke test).

**A failed run is not a figure.** Every load run a scenario records goes through
:meth:`ScenarioResult.add` / :meth:`ScenarioResult.add_row`, which note its error rate.
A run with more than ``ERROR_RATE_LIMIT`` of its requests failed marks the scenario as
failed: all its checks read "not met" whatever their value, the report says so first,
and ``python -m benchmarks run`` exits non-zero. A scenario that raises is failed too.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import httpx

from benchmarks.data.workloads import mixed_texts
from benchmarks.harness.loadgen import RunResult, closed_loop, open_loop
from benchmarks.harness.service import BenchCluster, pick_model, variant

logger = logging.getLogger("benchmarks")

# Largest share of a run's requests that may fail before the run counts as failed (and
# with it every check of its scenario). A benchmark on a healthy stack fails none; the
# slack covers a stray connection reset on a saturated 2-core machine, not a broken path.
ERROR_RATE_LIMIT = 0.02

# Every module that defines scenarios; load_all() imports them in this order, which is
# the order of `python -m benchmarks list` and of `--scenario all`.
SCENARIO_MODULES = (
    "benchmarks.scenarios.batching", "benchmarks.scenarios.bucketing", "benchmarks.scenarios.ceiling",
    "benchmarks.scenarios.recipe", "benchmarks.scenarios.generation", "benchmarks.scenarios.cache",
    "benchmarks.scenarios.trace", "benchmarks.scenarios.day", "benchmarks.scenarios.generation_mixed",
    "benchmarks.scenarios.precision", "benchmarks.scenarios.engines", "benchmarks.scenarios.startup",
    "benchmarks.scenarios.hangups", "benchmarks.scenarios.cheaper_vllm", "benchmarks.scenarios.affinity",
    "benchmarks.scenarios.day_real",
)


@dataclass
class Context:
    cluster: BenchCluster
    models: list[dict]  # from the deployments file
    quick: bool
    precision: Optional[str]
    torch_threads: int
    gen_torch_threads: int
    progress: bool = True
    out_dir: str = "benchmark-results"  # where scenarios that draw their own plots put them
    # Smoke mode: every scenario's code path through the real stack with a handful of
    # requests (the figures mean nothing). Implies quick.
    tiny: bool = False
    # The deployments file's application args (router, cache, models) as shipped; the
    # recipe scenario serves them unchanged. None: only ``models`` is known.
    application: Optional[dict] = None

    def pick(self, full: Any, quick: Any, tiny: Any = None) -> Any:
        """The value for this run's mode: tiny (if given), else quick, else full."""
        if self.tiny and tiny is not None:
            return tiny
        return quick if self.quick or self.tiny else full

    @property
    def model_cpus(self) -> float:
        """Logical CPUs per model replica. They only place replicas (torch threads decide
        real core use); tiny mode asks for less so its variants fit beside other apps
        in a shared Ray instance (the test session's)."""
        return 0.25 if self.tiny else 1.0


class ScenarioSkipped(Exception):
    """Raised by a scenario that cannot run here (a missing peer, data file or package)."""


class RunFailed(RuntimeError):
    """Every request of a load run failed; carries the run so the report can show why."""

    def __init__(self, run: RunResult):
        super().__init__(f"{run.label}: every request failed, e.g. {run.error_samples[:2]}")
        self.run = run


@dataclass
class ScenarioResult:
    name: str
    description: str
    runs: list[dict] = field(default_factory=list)  # RunResult.summary() + "variant", "error_rate", "failed"
    derived: dict[str, Any] = field(default_factory=dict)
    checks: list[dict] = field(default_factory=list)  # {"claim", "value", "target", "met", "target_met"}
    skipped: list[dict] = field(default_factory=list)  # variants not run here: {"variant", "reason"}
    error: Optional[str] = None  # the scenario raised: "Type: message"
    skip_reason: Optional[str] = None  # the whole scenario was skipped
    tiny: bool = False

    # ---- runs -------------------------------------------------------------------------

    def add(self, run: RunResult, variant_name: str, **extra: Any) -> dict:
        """Record one load run (its errors included) as a row."""
        summary = run.summary()
        return self.add_row(variant_name, requests=summary.pop("requests"), errors=summary.pop("errors"),
                            **summary, **extra)

    def add_row(self, variant_name: str, *, requests: int, errors: int, **fields: Any) -> dict:
        """Record a run measured some other way (the day replay, sequential requests)."""
        row = {"variant": variant_name, "requests": requests, "errors": errors, **fields}
        _mark(row)
        self.runs.append(row)
        return row

    def skip_variant(self, variant_name: str, reason: str) -> None:
        """A variant this machine cannot run (e.g. a peer engine that is not installed)."""
        self.skipped.append({"variant": variant_name, "reason": reason})

    @property
    def failed_runs(self) -> list[dict]:
        return [row for row in self.runs if _mark(row)]

    @property
    def failed(self) -> bool:
        """The scenario raised, or a run had more than ERROR_RATE_LIMIT of its requests failed."""
        return self.error is not None or bool(self.failed_runs)

    # ---- checks -----------------------------------------------------------------------

    def check(self, claim: str, value: Optional[float], target: float, *, higher_is_better: bool = True) -> None:
        target_met = value is not None and (value >= target if higher_is_better else value <= target)
        self.checks.append({"claim": claim, "value": None if value is None else round(value, 3), "target": target,
                            "target_met": bool(target_met), "met": bool(target_met) and not self.failed})

    def finalize(self) -> "ScenarioResult":
        """Once every run is in: no check is met in a failed scenario, and every scenario
        that ran carries the error-rate check itself. Idempotent."""
        if self.skip_reason is None:
            claim = f"failed requests, worst run (limit {ERROR_RATE_LIMIT:.0%} per run)"
            self.checks = [c for c in self.checks if c["claim"] != claim]
            worst = max((row["error_rate"] for row in self.runs if _mark(row) is not None), default=0.0)
            self.checks.append({"claim": claim, "value": round(worst, 4), "target": ERROR_RATE_LIMIT,
                                "target_met": self.error is None and not self.failed_runs, "met": not self.failed})
        for check in self.checks:
            check.setdefault("target_met", check["met"])
            check["met"] = bool(check["target_met"]) and not self.failed
        return self


def _mark(row: dict) -> Optional[bool]:
    """Fill in a row's error_rate and failed flag (rows appended directly included);
    None for rows that count no requests (a derived row)."""
    if "errors" not in row or row.get("requests") is None:
        return None
    requests, errors = int(row["requests"]), int(row["errors"] or 0)
    row["error_rate"] = round(errors / requests, 4) if requests else 1.0
    row["failed"] = requests == 0 or errors / requests > ERROR_RATE_LIMIT
    return row["failed"]


# ---- registry ---------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[[Context], ScenarioResult]] = {}


def scenario(fn: Optional[Callable[[Context], ScenarioResult]] = None, *, name: Optional[str] = None):
    """Register a scenario under its function's name, or ``@scenario(name="a-name")``."""

    def register(fn: Callable[[Context], ScenarioResult]) -> Callable[[Context], ScenarioResult]:
        SCENARIOS[name or fn.__name__] = fn
        return fn

    return register(fn) if fn is not None else register


def load_all() -> dict[str, Callable[[Context], ScenarioResult]]:
    """Import every scenario module (each registers on import); returns SCENARIOS in
    SCENARIO_MODULES' order, whichever module something imported first."""
    for module in SCENARIO_MODULES:
        importlib.import_module(module)
    order = {module: i for i, module in enumerate(SCENARIO_MODULES)}
    ranked = sorted(SCENARIOS.items(), key=lambda item: order.get(item[1].__module__, len(order)))
    SCENARIOS.clear()
    SCENARIOS.update(ranked)
    return SCENARIOS


def run_scenario(name: str, ctx: Context) -> ScenarioResult:
    """Run one registered scenario and finalize its result. A scenario that raises comes
    back failed (its error recorded), one that cannot run here comes back skipped;
    either way whatever it left deployed is deleted."""
    fn = load_all()[name]
    description = fn.__doc__ or ""
    try:
        result = fn(ctx)
    except ScenarioSkipped as skip:
        result = ScenarioResult(name, description, skip_reason=str(skip))
    except RunFailed as exc:
        result = ScenarioResult(name, description, error=str(exc))
        result.add(exc.run, exc.run.label)
    except Exception as exc:  # a failed scenario is a result, the next one still runs
        logger.error("scenario %s raised:\n%s", name, traceback.format_exc())
        result = ScenarioResult(name, description, error=f"{type(exc).__name__}: {exc}")
    finally:
        ctx.cluster.delete_all()
    result.tiny = ctx.tiny
    return result.finalize()


def require_module(module: str) -> Optional[str]:
    """None if ``module`` can be imported here, else the reason a variant needing it is skipped."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else f"{module} is not installed on this machine"


# ---- helpers shared by scenarios --------------------------------------------------------

TEXTS = mixed_texts(512, min_words=4, max_words=128, seed=7)


def embedding_request(model_name: str):
    return lambda i: ("/v1/embeddings", {"model": model_name, "input": TEXTS[i % len(TEXTS)]})


def run_closed(url: str, make, *, concurrency: int, requests: int, label: str, ctx: Context, extract=None,
               warmup: int = 0) -> RunResult:
    """A closed-loop run; raises RunFailed if every request failed (record partial
    failures with ScenarioResult.add, which judges them)."""
    if ctx.tiny:
        warmup = min(warmup, 2)
    run = asyncio.run(
        closed_loop(url, make, concurrency=concurrency, requests=requests, label=label, extract=extract,
                    warmup=warmup, progress=ctx.progress)
    )
    if run.requests and run.errors == run.requests:
        raise RunFailed(run)
    return run


def run_open(url: str, make, *, rate_per_s: float, requests: int, label: str, ctx: Context, **options: Any) -> RunResult:
    """An open-loop run (Poisson arrivals, or ``arrivals_s``); raises RunFailed like run_closed."""
    run = asyncio.run(open_loop(url, make, rate_per_s=rate_per_s, requests=requests, label=label,
                                progress=ctx.progress, **options))
    if run.requests and run.errors == run.requests:
        raise RunFailed(run)
    return run


def model_stats(url: str, model: str) -> dict:
    """The model's entry of /v1/stats."""
    return httpx.get(f"{url}/v1/stats", timeout=60).json()["models"][model]


def requests_for(concurrency: int, ctx: Context, per_client: int = 4, floor: int = 64) -> int:
    """Requests for one closed-loop point: enough per client, 3x outside quick mode, a
    handful in tiny mode."""
    if ctx.tiny:
        return max(8, 2 * concurrency)
    n = max(floor, per_client * concurrency)
    return n if ctx.quick else 3 * n


def embedding_variant(ctx: Context, name: str, **batching: Any) -> dict:
    base = pick_model(ctx.models, "embedding")
    return variant(base, name=name, precision=ctx.precision, torch_threads=ctx.torch_threads,
                   num_cpus=ctx.model_cpus, **batching)
