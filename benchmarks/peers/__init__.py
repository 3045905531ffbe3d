"""What the scenarios measure ours against: vLLM's own OpenAI server and Ray Serve LLM
(:mod:`benchmarks.peers.engines`), and the embedding deployment Ray Serve's docs have a
user write (:mod:`benchmarks.peers.recipe`). Benchmark-only; nothing here is imported by
``serve_app``.
"""
