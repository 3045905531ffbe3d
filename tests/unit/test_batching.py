"""The batching planner, tested with plain lists (no model, no Ray)."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.core.batching.planner import arrival_order_plan, plan_batches, scatter

lengths_strategy = st.lists(st.integers(min_value=1, max_value=512), min_size=0, max_size=80)
budget_strategy = st.integers(min_value=1, max_value=8192)
rows_strategy = st.one_of(st.none(), st.integers(min_value=1, max_value=64))


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_strategy, budget=budget_strategy, max_rows=rows_strategy)
def test_every_row_planned_once_within_budget(lengths, budget, max_rows):
    plan = plan_batches(lengths, max_batch_tokens=budget, max_rows=max_rows)
    planned = sorted(i for sb in plan.sub_batches for i in sb.indices)
    assert planned == list(range(len(lengths)))
    for sb in plan.sub_batches:
        assert sb.padded_length == max(lengths[i] for i in sb.indices)
        # Only a single row longer than the whole budget may exceed it, alone.
        assert sb.padded_tokens <= budget or sb.rows == 1
        assert max_rows is None or sb.rows <= max_rows


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_strategy, budget=budget_strategy, max_rows=rows_strategy)
def test_scatter_restores_arrival_order(lengths, budget, max_rows):
    plan = plan_batches(lengths, max_batch_tokens=budget, max_rows=max_rows)
    # Each "model output" names the row it was computed for.
    outputs = [[("row", i) for i in sb.indices] for sb in plan.sub_batches]
    assert scatter(plan, outputs) == [("row", i) for i in range(len(lengths))]


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_strategy, budget=budget_strategy, max_rows=rows_strategy)
def test_never_costlier_than_arrival_order(lengths, budget, max_rows):
    """Sorted planning's objective (padded tokens + per-call overhead) beats arrival order's."""
    overhead = 32
    ours = plan_batches(lengths, max_batch_tokens=budget, max_rows=max_rows, sub_batch_overhead_tokens=overhead)
    naive = arrival_order_plan(lengths, max_batch_tokens=budget, max_rows=max_rows)
    cost = lambda p: p.padded_tokens + overhead * len(p.sub_batches)  # noqa: E731
    assert cost(ours) <= cost(naive)


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_strategy, max_rows=rows_strategy)
def test_padding_efficiency_at_least_arrival_order_with_same_calls(lengths, max_rows):
    """With an unlimited budget and free calls cut at the same count, sorting pads no more."""
    budget = 10**9
    naive = arrival_order_plan(lengths, max_batch_tokens=budget, max_rows=max_rows)
    ours = plan_batches(lengths, max_batch_tokens=budget, max_rows=max_rows, sub_batch_overhead_tokens=0)
    assert ours.padding_efficiency >= naive.padding_efficiency - 1e-12


def test_mixed_lengths_padding_efficiency():
    rng = random.Random(0)
    lengths = [rng.randint(4, 128) for _ in range(256)]
    budget = 4096
    ours = plan_batches(lengths, max_batch_tokens=budget, max_rows=64)
    naive = arrival_order_plan(lengths, max_batch_tokens=budget, max_rows=64)
    assert ours.padding_efficiency >= 0.85, ours.padding_efficiency
    assert ours.padding_efficiency > naive.padding_efficiency
    # Even when each call costs as much as a whole sub-batch of padding, sorting keeps
    # padding low while making no more calls than the budget forces.
    frugal = plan_batches(lengths, max_batch_tokens=budget, max_rows=64, sub_batch_overhead_tokens=budget)
    assert frugal.padding_efficiency >= 0.85, frugal.padding_efficiency
    assert len(frugal.sub_batches) <= len(naive.sub_batches)


def test_overhead_trades_calls_for_padding():
    rng = random.Random(1)
    lengths = [rng.randint(4, 128) for _ in range(64)]
    calls = [
        len(plan_batches(lengths, max_batch_tokens=8192, sub_batch_overhead_tokens=o).sub_batches)
        for o in (0, 8, 64, 512, 8192)
    ]
    assert calls == sorted(calls, reverse=True) and calls[0] == 64 and calls[-1] <= 2


def test_equal_lengths_make_one_call():
    plan = plan_batches([10] * 16, max_batch_tokens=1000)
    assert len(plan.sub_batches) == 1
    assert plan.padding_efficiency == 1.0


def test_row_longer_than_budget_runs_alone():
    plan = plan_batches([5, 900, 6], max_batch_tokens=100)
    assert any(sb.indices == (1,) for sb in plan.sub_batches)


def test_empty_plan():
    plan = plan_batches([], max_batch_tokens=10)
    assert plan.sub_batches == () and plan.padding_efficiency == 1.0
    assert scatter(plan, []) == []


def test_scatter_rejects_count_mismatch_naming_both_numbers():
    plan = plan_batches([3, 3], max_batch_tokens=100)
    with pytest.raises(ValueError, match="2 rows but the model returned 1"):
        scatter(plan, [["only-one"]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_batch_tokens": 0}, "max_batch_tokens must be >= 1"),
        ({"max_batch_tokens": 10, "max_rows": 0}, "max_rows must be >= 1"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_batches([1, 2], **kwargs)
