"""Length-aware batch planning: a pure function from input lengths to a plan.

A dynamic batch arrives in arrival order with rows of very different lengths. Padding
all of them to the longest row wastes compute on pad tokens, so the planner:

1. sorts the rows by length,
2. splits the sorted rows into contiguous sub-batches, choosing the split that
   minimises ``padded tokens + sub_batch_overhead_tokens * number of sub-batches``
   (dynamic programming; the overhead term stops it from running every row alone,
   since each model call has a fixed cost), never letting a sub-batch's padded size
   exceed the token budget or its row count exceed ``max_rows``,
3. pads each sub-batch only to its own longest row,

and :func:`scatter` puts the per-row results back into arrival order.

Generation rows have two extents, not one: ``generate()`` left-pads the prompts to the
longest prompt of the sub-batch and then appends as many columns as the largest
``max_tokens``, so a sub-batch is ``max(prompt) + max(new)`` wide, which can be far more
than ``max(prompt + new)`` ((1000, 10) beside (10, 1000) is 2,000 wide, not 1,010).
The planners take those rows' ``new`` lengths as ``new_tokens`` and charge that width,
so the plan bounds what the model call really allocates.

Nothing here knows about models, tensors or Ray: it is tested with plain lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# A forward call costs about as much as this many extra padded tokens, whatever its
# size (kernel launches, Python and framework overhead). Measured order of magnitude
# for small encoders on CPU; GPUs have a larger fixed cost per call, so GPU configs
# should raise it (``batching.sub_batch_overhead_tokens``).
DEFAULT_SUB_BATCH_OVERHEAD_TOKENS = 32


@dataclass(frozen=True)
class SubBatch:
    """Rows that run together in one model call, padded to ``padded_length``."""

    indices: tuple[int, ...]  # positions in the planned input, shortest row first
    padded_length: int  # columns each row takes: max(lengths) + max(new_tokens) of its rows
    real_tokens: int

    @property
    def rows(self) -> int:
        return len(self.indices)

    @property
    def padded_tokens(self) -> int:
        return self.padded_length * len(self.indices)


@dataclass(frozen=True)
class BatchPlan:
    """How one batch of rows is cut into sub-batches."""

    sub_batches: tuple[SubBatch, ...]
    num_rows: int

    @property
    def real_tokens(self) -> int:
        return sum(sb.real_tokens for sb in self.sub_batches)

    @property
    def padded_tokens(self) -> int:
        return sum(sb.padded_tokens for sb in self.sub_batches)

    @property
    def padding_efficiency(self) -> float:
        """Real tokens / padded tokens: 1.0 means no compute went to padding."""
        padded = self.padded_tokens
        return self.real_tokens / padded if padded else 1.0


def _check_inputs(lengths: Sequence[int], max_batch_tokens: int, max_rows: int | None,
                  new_tokens: Sequence[int] | None = None) -> None:
    if new_tokens is not None:
        if len(new_tokens) != len(lengths):
            raise ValueError(f"new_tokens has {len(new_tokens)} entries for {len(lengths)} lengths")
        for i, new in enumerate(new_tokens):
            if new < 0:
                raise ValueError(f"new_tokens[{i}] is {new}; it must be >= 0")
    if max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 or None, got {max_rows}")
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"lengths[{i}] is {length}; lengths must be >= 0")


def _sub_batch(lengths: Sequence[int], indices: Sequence[int], new_tokens: Sequence[int] | None = None) -> SubBatch:
    new = new_tokens if new_tokens is not None else [0] * len(lengths)
    return SubBatch(
        indices=tuple(indices),
        padded_length=_width(lengths, new, indices),
        real_tokens=sum(lengths[i] + new[i] for i in indices),
    )


def _width(lengths: Sequence[int], new: Sequence[int], indices: Sequence[int]) -> int:
    """Columns of a sub-batch: its rows are padded to the longest input, then all get
    the largest number of new columns (what a left-padded generate() allocates)."""
    if not indices:
        return 0
    return max(lengths[i] for i in indices) + max(new[i] for i in indices)


def plan_batches(
    lengths: Sequence[int],
    *,
    max_batch_tokens: int,
    max_rows: int | None = None,
    sub_batch_overhead_tokens: int = DEFAULT_SUB_BATCH_OVERHEAD_TOKENS,
    new_tokens: Sequence[int] | None = None,
) -> BatchPlan:
    """Plan length-sorted sub-batches for rows of the given token lengths.

    ``new_tokens`` (generation rows): per row, the columns generated after the input;
    a sub-batch is then ``max(lengths) + max(new_tokens)`` wide (see the module
    docstring). Without it every row is just its length.

    Guarantees: every row appears in exactly one sub-batch; a sub-batch's padded
    tokens (rows x its width) stay within ``max_batch_tokens`` unless it is a
    single row that is longer than the budget on its own (such a row still runs,
    alone); no sub-batch holds more than ``max_rows`` rows.
    """
    _check_inputs(lengths, max_batch_tokens, max_rows, new_tokens)
    n = len(lengths)
    if n == 0:
        return BatchPlan(sub_batches=(), num_rows=0)
    new = list(new_tokens) if new_tokens is not None else [0] * n
    order = sorted(range(n), key=lambda i: (lengths[i] + new[i], lengths[i], i))
    row_cap = max_rows if max_rows is not None else n

    # best_cost[j]: cheapest way to cover the j shortest rows; cut_at[j]: where the
    # last sub-batch of that cover starts. A sub-batch order[i:j] is as wide as its
    # longest input plus its most new tokens; both only grow as i goes down.
    inf = float("inf")
    best_cost = [0.0] + [inf] * n
    cut_at = [0] * (n + 1)
    for j in range(1, n + 1):
        longest_input = longest_new = 0
        for i in range(j - 1, -1, -1):
            rows = j - i
            longest_input = max(longest_input, lengths[order[i]])
            longest_new = max(longest_new, new[order[i]])
            width = longest_input + longest_new
            if rows > row_cap or (rows > 1 and rows * width > max_batch_tokens):
                break  # adding more rows only makes the sub-batch bigger
            cost = best_cost[i] + rows * width + sub_batch_overhead_tokens
            if cost < best_cost[j]:
                best_cost[j] = cost
                cut_at[j] = i

    bounds = []
    j = n
    while j > 0:
        bounds.append((cut_at[j], j))
        j = cut_at[j]
    sub_batches = tuple(_sub_batch(lengths, order[i:j], new) for i, j in reversed(bounds))
    return BatchPlan(sub_batches=sub_batches, num_rows=n)


def arrival_order_plan(
    lengths: Sequence[int], *, max_batch_tokens: int, max_rows: int | None = None,
    new_tokens: Sequence[int] | None = None,
) -> BatchPlan:
    """The naive baseline: fill sub-batches in arrival order until the budget is hit.

    Used by benchmarks and tests to show what sorting buys. ``new_tokens`` as for
    :func:`plan_batches`.
    """
    _check_inputs(lengths, max_batch_tokens, max_rows, new_tokens)
    new = list(new_tokens) if new_tokens is not None else [0] * len(lengths)
    sub_batches: list[SubBatch] = []
    current: list[int] = []
    longest_input = longest_new = 0
    for i, length in enumerate(lengths):
        width = max(longest_input, length) + max(longest_new, new[i])
        too_many_rows = max_rows is not None and len(current) + 1 > max_rows
        if current and (too_many_rows or width * (len(current) + 1) > max_batch_tokens):
            sub_batches.append(_sub_batch(lengths, current, new))
            current, longest_input, longest_new = [], 0, 0
        current.append(i)
        longest_input, longest_new = max(longest_input, length), max(longest_new, new[i])
    if current:
        sub_batches.append(_sub_batch(lengths, current, new))
    return BatchPlan(sub_batches=tuple(sub_batches), num_rows=len(lengths))


def scatter(plan: BatchPlan, sub_batch_outputs: Sequence[Sequence[Any]]) -> list[Any]:
    """Put per-sub-batch outputs back into the order the rows were planned in.

    ``sub_batch_outputs[k]`` holds one output per row of ``plan.sub_batches[k]``, in
    that sub-batch's row order. Any mismatch in counts is a bug in the model code, so
    it raises with both numbers rather than handing a caller someone else's answer.
    """
    if len(sub_batch_outputs) != len(plan.sub_batches):
        raise ValueError(
            f"got outputs for {len(sub_batch_outputs)} sub-batches, "
            f"the plan has {len(plan.sub_batches)}"
        )
    results: list[Any] = [None] * plan.num_rows
    for k, (sub_batch, outputs) in enumerate(zip(plan.sub_batches, sub_batch_outputs)):
        if len(outputs) != sub_batch.rows:
            raise ValueError(
                f"sub-batch {k} has {sub_batch.rows} rows but the model returned "
                f"{len(outputs)} outputs"
            )
        for index, output in zip(sub_batch.indices, outputs):
            results[index] = output
    return results
