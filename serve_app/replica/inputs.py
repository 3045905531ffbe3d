"""Per-input checks that name the failing input's position."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from serve_app.core.errors import InvalidRequestError


def encode_each(fn: Callable[[Any], Any], values: Sequence[Any], field: str) -> list[Any]:
    """``fn`` over every value; an input error of a list names its position (``input[2]``)."""
    return [_with_param(fn, value, field, index, len(values)) for index, value in enumerate(values)]


def _with_param(fn, value, field: str, index: int, count: int):
    """Run a per-input check, naming the input's position in the error for lists."""
    try:
        return fn(value)
    except InvalidRequestError as exc:
        if count > 1 and (exc.param in (None, field)):
            exc.param = f"{field}[{index}]"
        raise
