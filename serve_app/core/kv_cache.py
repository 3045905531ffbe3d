"""Row surgery on a left-padded transformers ``DynamicCache``, as the continuous
batcher (:mod:`serve_app.core.continuous`) does it between decode steps: append the
rows of another cache (:func:`append_rows`), and keep some rows while trimming the
leading columns that only padding uses (:func:`select_rows`).

Every layer holds keys and values shaped [rows, heads, columns, dim]; all rows end at
the same column, and the attention mask ([rows, columns], 1 = real token) tells the
real columns from the padding. Only caches of plain full-attention ``DynamicLayer``
layers have that layout (:func:`check_cache_layout`).

This module must never import ray.
"""

from __future__ import annotations

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


def append_rows(cache, mask: torch.Tensor, other, other_mask: torch.Tensor):
    """``cache``'s rows, then ``other``'s, left-padding the shorter cache; ``cache`` is extended in place."""
    width = max(mask.shape[1], other_mask.shape[1])
    for running, joining in zip(_layers(cache), _layers(other)):
        running.keys = torch.cat([_pad_left(running.keys, width), _pad_left(joining.keys, width)], dim=0)
        running.values = torch.cat([_pad_left(running.values, width), _pad_left(joining.values, width)], dim=0)
    merged_mask = torch.cat([F.pad(mask, (width - mask.shape[1], 0)),
                             F.pad(other_mask, (width - other_mask.shape[1], 0))], dim=0)
    return cache, merged_mask


def select_rows(cache, mask: torch.Tensor, keep: list[int]):
    """Keep the rows at ``keep``, and drop the leading columns that are padding in all of them."""
    index = torch.tensor(keep, dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, index)
    first = int(mask.any(dim=0).long().argmax())  # first column some kept row uses
    for layer in _layers(cache):
        layer.keys = layer.keys.index_select(0, index)[:, :, first:, :]
        layer.values = layer.values.index_select(0, index)[:, :, first:, :]
    return cache, mask[:, first:]


def _layers(cache) -> list:
    return list(cache.layers)


def _pad_left(states: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad [rows, heads, columns, dim] on the left of the columns up to ``width``."""
    missing = width - states.shape[-2]
    return F.pad(states, (0, 0, missing, 0)) if missing > 0 else states

