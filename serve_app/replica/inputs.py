"""Per-input checks that name the failing input's position."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, Sequence

from serve_app.core.errors import InvalidRequestError

# One thread per replica process tokenises: a Rust tokenizer must not be used from two
# threads at once ("Already borrowed"), and a text as large as the router's body limit
# takes seconds to tokenise, which on the event loop would stall every other request
# and stream of the replica (the context check can only refuse it afterwards).
_TOKENIZER_THREAD = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")


# Image decoding and resizing, off the event loop too, two requests at a time: each may
# hold up to 64 megapixels (about 200 MB as RGB) while it decodes, so an unbounded pool
# could take gigabytes under a burst of large images.
_IMAGE_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="decode-image")


async def in_tokenizer_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in the replica's tokenizer thread, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, fn, *args)


async def in_image_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in one of the replica's image-decoding threads, off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_IMAGE_THREADS, fn, *args)


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
