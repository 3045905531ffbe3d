"""The affinity scenario's pure parts: its product lines and how it reads vLLM's
prefix-cache counters from a scrape of Ray's metrics export."""

from __future__ import annotations

from benchmarks.data.prompts import PRODUCT_LINES, product_line_prompt
from benchmarks.scenarios.affinity import _line_request, prefix_counters

SCRAPE = """\
# HELP serve_app_prefix_cache_hits_tokens_total Prompt tokens found in the prefix cache.
serve_app_prefix_cache_hits_tokens_total{Component="core_worker",WorkerId="a",model="chat"} 900.0
ray_serve_app_prefix_cache_hits_tokens_total{Component="core_worker",WorkerId="b",model="chat"} 1800.0
serve_app_prefix_cache_hits_tokens_total{Component="core_worker",WorkerId="c",model="other"} 5.0
serve_app_prefix_cache_queries_tokens_total{Component="core_worker",WorkerId="a",model="chat"} 1000.0
ray_serve_app_prefix_cache_queries_tokens_total{Component="core_worker",WorkerId="b",model="chat"} 2000.0
"""


def test_the_hit_rate_sums_every_replica_of_the_model():
    assert prefix_counters(SCRAPE) == (2700.0, 3000.0)
    assert prefix_counters(SCRAPE, model="other") == (5.0, 0.0)
    assert prefix_counters("") == (0.0, 0.0)


def test_each_product_line_has_its_own_prompt_from_its_first_words_and_they_interleave():
    prompts = [product_line_prompt(line) for line in range(len(PRODUCT_LINES))]
    assert len({p[:60] for p in prompts}) == len(PRODUCT_LINES)
    assert all(600 < len(p.split()) < 900 for p in prompts)
    questions = [f"q{i}" for i in range(8)]
    systems = [_line_request(i, questions, ["m"] * 4)[1]["messages"][0]["content"] for i in range(8)]
    assert systems[:4] == prompts and systems[4:] == prompts
