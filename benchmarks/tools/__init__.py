"""Measurements run by hand, outside ``python -m benchmarks run``: vLLM's compile modes
(``python -m benchmarks.tools.compile_modes``), what LoRA costs on vLLM's CPU build
(``python -m benchmarks.tools.lora_cost``), the semantic cache's hit rates
(``python -m benchmarks.tools.semantic_pairs``), the dashboard's panels
(``python -m benchmarks.tools.dashboard_plot``) and the CUDA paths on a GPU machine
(``bash benchmarks/tools/gpu_check.sh``); and the engines scenario's chart
(:mod:`benchmarks.tools.engines_plot`).
"""
