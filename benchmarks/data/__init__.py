"""The requests the scenarios send: deterministic text and chat mixes, the Azure trace's
arrivals and lengths (:mod:`benchmarks.data.workloads`), and the customer-service prompt
text (:mod:`benchmarks.data.prompts`)."""
