"""Benchmark scenarios, one per module. Each deploys its variants side by side in one Ray
instance, alternates between them at every load point, and returns rows plus derived ratios.

Scenarios register with ``@scenario`` from :mod:`benchmarks.harness.registry` (which also
holds Context, ScenarioResult and the shared helpers, and lists these modules in
``SCENARIO_MODULES``, in the order they run); a scenario module imports from the harness,
the peers and the data, never from another scenario.
"""
