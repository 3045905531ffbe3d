"""Benchmarks for serve_app: every figure is a ratio of configurations run side by side.

Run ``python -m benchmarks run --scenario all --quick``; see ``python -m benchmarks -h``.
"""
