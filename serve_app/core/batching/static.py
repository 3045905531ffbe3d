"""One static model batch: group, plan, run each sub-batch, scatter back.

The replica's executor hands :func:`run_static_batch` the rows it admitted together.
Rows are grouped by ``group`` (rows in different groups never share a model call:
generation rows with different sampling parameters), each group is cut by
:mod:`serve_app.core.batching.planner` into sub-batches padded only to their own longest row,
and each sub-batch goes to the caller's ``call_model``. The results come back in
arrival order. A sub-batch that fails gets its exception in the slots of its own rows
alone, so one bad item never fails the others.

What happened is returned as a :class:`BatchReport` for the replica's stats observer;
nothing here records anything itself.

This module must never import ray.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from serve_app.core.batching.planner import BatchPlan, SubBatch, arrival_order_plan, plan_batches, scatter
from serve_app.core.errors import DeadlineExceededError

logger = logging.getLogger(__name__)


class BatchingKnobs(Protocol):
    """The batching settings read here (``serve_app.config.BatchingConfig`` has them)."""

    max_batch_size: int
    max_batch_tokens: int
    sub_batch_overhead_tokens: int
    length_sorting: bool


@dataclass
class Row:
    """One input waiting in the batch queue."""

    payload: Any  # token ids, a pixel tensor or a GenerationRequest
    tokens: int  # what this row costs the batch's token budget
    group: Any  # rows in different groups never share a model call (sampling params)
    enqueued_at: float  # time.monotonic()
    # The budgets in force when the row was queued, read by batch_cost (which Ray
    # calls with the rows alone, not the replica).
    token_budget: int
    row_budget: int
    output: Any = None  # generation rows: their link back to the request (streaming, cancellation)
    deadline: Optional[float] = None  # time.time() after which its caller no longer waits
    # Generation rows: how many of ``tokens`` are generated after the input (max_tokens).
    # generate() left-pads inputs to the longest one and then appends the largest
    # max_tokens, so the planner charges a sub-batch max(input) + max(new) per row.
    new_tokens: int = 0


def new_row(payload: Any, tokens: int, batching: BatchingKnobs, *, group: Any = None,
            deadline: Optional[float] = None, output: Any = None, new_tokens: int = 0) -> Row:
    """A row queued now, under the budgets of ``batching``. ``tokens`` counts all of
    the row (input and ``new_tokens``)."""
    if not 0 <= new_tokens <= tokens:
        raise ValueError(f"new_tokens={new_tokens} must be between 0 and the row's tokens ({tokens})")
    return Row(payload=payload, tokens=tokens, group=group, enqueued_at=time.monotonic(),
               token_budget=batching.max_batch_tokens, row_budget=batching.max_batch_size,
               output=output, deadline=deadline, new_tokens=new_tokens)


def expired(row: Row) -> Optional[BaseException]:
    """The error for a row whose caller's deadline passed while it waited, else None."""
    if row.deadline is not None and time.time() > row.deadline:
        return DeadlineExceededError("the request's deadline passed while it waited for the model", code="timeout")
    return None


def batch_cost(rows: Sequence[Row]) -> int:
    """Batch size in row units that also charges tokens.

    Ray's queue closes a batch when this reaches ``max_batch_size`` (R). Rows count 1
    each, and tokens count R/T each, so the value stays <= R exactly when the batch
    has <= R rows and <= T tokens (T = max_batch_tokens). A single row longer than T
    is charged T, so it still runs, alone.
    """
    token_budget, row_budget = rows[0].token_budget, rows[0].row_budget
    tokens = sum(min(row.tokens, token_budget) for row in rows)
    return max(len(rows), math.ceil(tokens * row_budget / token_budget))


@dataclass(frozen=True)
class BatchReport:
    """What one model batch did, for the stats observer."""

    rows: int
    waits: tuple[float, ...]  # per row: seconds from enqueue to the start of this batch
    plans: tuple[BatchPlan, ...]  # one per group; each sub-batch was one model call
    started_at: float  # time.monotonic()

    @property
    def sub_batches(self) -> tuple[SubBatch, ...]:
        return tuple(sub_batch for group_plan in self.plans for sub_batch in group_plan.sub_batches)

    @property
    def real_tokens(self) -> int:
        return sum(group_plan.real_tokens for group_plan in self.plans)

    @property
    def padded_tokens(self) -> int:
        return sum(group_plan.padded_tokens for group_plan in self.plans)


def plan(lengths: list[int], batching: BatchingKnobs, new_tokens: Optional[list[int]] = None) -> BatchPlan:
    """The sub-batches for rows of these (input) lengths under ``batching``;
    ``new_tokens``: what generation rows generate after their input (see
    :func:`~serve_app.core.batching.plan_batches`)."""
    if not batching.length_sorting:
        return arrival_order_plan(lengths, max_batch_tokens=batching.max_batch_tokens, max_rows=batching.max_batch_size,
                                  new_tokens=new_tokens)
    return plan_batches(
        lengths,
        max_batch_tokens=batching.max_batch_tokens,
        max_rows=batching.max_batch_size,
        sub_batch_overhead_tokens=batching.sub_batch_overhead_tokens,
        new_tokens=new_tokens,
    )


def plan_rows(rows: Sequence[Row], batching: BatchingKnobs) -> BatchPlan:
    """The sub-batches for these rows (one group), charged as the model call pads them."""
    if not any(row.new_tokens for row in rows):
        return plan([row.tokens for row in rows], batching)
    return plan([row.tokens - row.new_tokens for row in rows], batching, [row.new_tokens for row in rows])


def run_static_batch(
    rows: Sequence[Row],
    call_model: Callable[[list[Row]], list[Any]],
    batching: BatchingKnobs,
    *,
    name: str = "model",
) -> tuple[list[Any], BatchReport]:
    """Run ``rows`` as one model batch: one result (or Exception) per row, in order, and the report.

    ``call_model(sub_batch_rows)`` runs one sub-batch (rows of a single group) and
    must return one output per row, in order; if it raises or returns the wrong
    count, only that sub-batch's rows get the error. ``name`` is for the log.
    """
    started = time.monotonic()
    results: list[Any] = [None] * len(rows)
    plans: list[BatchPlan] = []
    groups: dict[Any, list[int]] = {}
    for index, row in enumerate(rows):
        groups.setdefault(row.group, []).append(index)
    for indices in groups.values():
        group_rows = [rows[i] for i in indices]
        group_plan = plan_rows(group_rows, batching)
        plans.append(group_plan)
        outputs = []
        for sub_batch in group_plan.sub_batches:
            sub_rows = [group_rows[i] for i in sub_batch.indices]
            try:
                out = call_model(sub_rows)
                if len(out) != len(sub_rows):
                    raise RuntimeError(f"model {name} returned {len(out)} outputs for {len(sub_rows)} inputs")
            except Exception as exc:  # fail only the rows of this sub-batch
                logger.exception("model %s failed on a sub-batch of %d rows", name, len(sub_rows))
                out = [exc] * len(sub_rows)
            outputs.append(out)
        for i, output in zip(indices, scatter(group_plan, outputs)):
            results[i] = output
    report = BatchReport(rows=len(rows), waits=tuple(started - row.enqueued_at for row in rows),
                         plans=tuple(plans), started_at=started)
    return results, report
