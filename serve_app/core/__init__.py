"""Plain Python + torch building blocks. Nothing in this package imports ray.

By role:

- the contract between deployments: ``calls`` (the typed calls and results), ``errors``
  (what a failure means to a client), ``tasks`` (the tasks a model can serve);
- the replica's batching pipeline: ``batching`` (a package: the length-sorted
  sub-batch planner, one static batch through the model, the model's one thread);
- generation: ``continuous`` (the continuous batcher, a package), ``decoding``
  (sampling and streamed text, both engines), ``models`` (loading, runtimes,
  quantization);
- the cache: ``cache`` (keys, stores, semantic index, single-flight);
- scaling: ``schedule`` (the daily load profiles);
- shared helpers: ``coalescing`` (calls made together leave as one: the cache's store
  calls and the router's call gathering), ``recent`` (sliding-window counters),
  ``shared_tasks`` (one awaited task many callers share).
"""
