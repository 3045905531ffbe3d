"""Row surgery on a left-padded transformers ``DynamicCache``, as the continuous
batcher (:mod:`serve_app.core.continuous`) does it between decode steps: append the
rows of another cache (:func:`append_rows`), keep some rows while trimming the
leading columns that only padding uses (:func:`select_rows`), and bound the slots such
a cache can come to hold (:func:`peak_slots`).

Every layer holds keys and values shaped [rows, heads, columns, dim]; all rows end at
the same column, and the attention mask ([rows, columns], 1 = real token) tells the
real columns from the padding. Only caches of plain full-attention ``DynamicLayer``
layers have that layout (:func:`check_cache_layout`).

This module must never import ray.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F


def check_cache_layout(model) -> None:
    """Only plain full-attention DynamicLayers can be merged and sliced as done here."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or []}) or ["no per-layer cache"]
        raise ValueError(f"continuous batching supports models whose cache is plain DynamicLayers; "
                         f"{type(model).__name__} uses {', '.join(kinds)}")


def peak_slots(rows: Iterable[tuple[int, int]]) -> int:
    """The most slots (rows x columns, padding included) a left-padded batch of these rows can come to hold.

    Each row is ``(cached, final)``: the columns it holds now and the most it may grow
    to. Every step adds one column to every row, and a row leaves at the latest when it
    reaches ``final``. The cache is as wide as its widest running row (all rows end at
    the same column), so ``k`` steps from now it holds ``alive(k) x (widest cached of
    the alive rows + k)``. That grows with ``k`` until a row leaves, so its peak is just
    before some row leaves, at ``k = final - cached`` of that row. Rows that end early
    (EOS, a stop string, cancelled) only ever lower it, so this is a bound on what the
    batch will allocate, and it is exact for rows that run to their limit.
    """
    by_remaining = sorted(rows, key=lambda r: r[1] - r[0], reverse=True)
    peak = widest = 0
    for alive, (cached, final) in enumerate(by_remaining, 1):
        # At k = this row's remaining growth, the alive rows are the first `alive` ones.
        widest = max(widest, cached)
        peak = max(peak, alive * (widest + max(0, final - cached)))
    return peak


def append_rows(cache, mask: torch.Tensor, other, other_mask: torch.Tensor):
    """``cache``'s rows, then ``other``'s, left-padding the shorter cache; ``cache`` is extended in place.

    All or nothing: if building any layer fails (out of memory, typically), the layers
    already merged get their old rows back and the error propagates, so ``cache`` is
    as it was and every layer keeps one row count. Layers are merged one at a time, not
    all built before the swap, so memory grows by one layer's old tensors at most, not
    by a second copy of the whole cache; the way back is views into the merged
    tensors, which allocate nothing and so cannot fail themselves.
    """
    rows, old_width = mask.shape
    width = max(old_width, other_mask.shape[1])
    # The mask first: if it fails, nothing has changed yet.
    merged_mask = torch.cat([F.pad(mask, (width - old_width, 0)),
                             F.pad(other_mask, (width - other_mask.shape[1], 0))], dim=0)
    layers = _layers(cache)
    merged = 0
    try:
        for running, joining in zip(layers, _layers(other)):
            keys = _stack_left_padded(running.keys, joining.keys, width)
            values = _stack_left_padded(running.values, joining.values, width)
            running.keys, running.values = keys, values  # both or neither
            merged += 1
    except BaseException:
        for layer in layers[:merged]:
            layer.keys = layer.keys[:rows, :, width - old_width:, :]
            layer.values = layer.values[:rows, :, width - old_width:, :]
        raise
    return cache, merged_mask


def select_rows(cache, mask: torch.Tensor, keep: list[int]):
    """Keep the rows at ``keep``, and drop the leading columns that are padding in all of them.

    Layers are replaced one at a time (memory grows by one layer, not a second cache),
    so if this raises, some layers may already have lost the other rows: the caller
    must then treat the cache as lost (the continuous batcher fails the rows it held).
    """
    index = torch.tensor(keep, dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, index)
    first = int(mask.any(dim=0).long().argmax())  # first column some kept row uses
    for layer in _layers(cache):
        keys = layer.keys.index_select(0, index)[:, :, first:, :]
        values = layer.values.index_select(0, index)[:, :, first:, :]
        layer.keys, layer.values = keys, values
    return cache, mask[:, first:]


def _layers(cache) -> list:
    return list(cache.layers)


def _stack_left_padded(first: torch.Tensor, second: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, columns, dim] tensors stacked on rows, each zero-padded on the left to ``width`` columns.

    One allocation, filled in place: padding each part and then concatenating would
    hold a padded copy of the running cache besides the result.
    """
    rows = first.shape[0] + second.shape[0]
    out = first.new_zeros((rows, first.shape[1], width, first.shape[3]))
    out[: first.shape[0], :, width - first.shape[2]:, :] = first
    out[first.shape[0]:, :, width - second.shape[2]:, :] = second
    return out
