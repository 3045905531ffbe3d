"""What every benchmark and test harness shares: ports, processes, HTTP.

The scenario registry (:mod:`~benchmarks.harness.registry`), the load generator
(:mod:`~benchmarks.harness.loadgen`), the report (:mod:`~benchmarks.harness.report`), the
Ray and Serve side (:mod:`~benchmarks.harness.service`), what a result was measured on
(:mod:`~benchmarks.harness.machine`), CPU time by process
(:mod:`~benchmarks.harness.process_cpu`), benchmark-only replicas
(:mod:`~benchmarks.harness.stubs`), ports and processes
(:mod:`~benchmarks.harness.processes`), and the fake multi-node cluster behind
tests/cluster (:mod:`~benchmarks.harness.fake_cluster`).
"""
