"""Incremental detokenization for streamed generation.

:class:`TextStream` turns one row's token ids, pushed one at a time, into text deltas
that are safe to send to a client straight away. Both generation engines use it (the
static one in :meth:`serve_app.core.models.GenerationRuntime.generate`, the
continuous one in :mod:`serve_app.core.continuous`), so a row streams the same text
whichever engine runs it.

The contract: the deltas that :meth:`TextStream.push` and :meth:`TextStream.finish`
return concatenate exactly to :attr:`TextStream.text`, which is the decoded completion
cut at the first stop string. To keep that promise while tokens still arrive, a delta
never includes

- text that a stop string would later cut off: a suffix that could be the start of a
  stop string stays held back until the next tokens show whether it is one;
- an incomplete character: byte-level tokenizers decode a partial UTF-8 sequence as
  U+FFFD, which the next token may turn into a real character;
- trailing whitespace: tokenizers that clean up spaces (``" ."`` -> ``"."``) may still
  drop it once the next token arrives.

:meth:`TextStream.finish` flushes whatever is held back. Every push decodes the whole
completion again, which is what makes the text exact whatever the tokenizer's decoder
does across token boundaries; it costs microseconds per token for completions of a few
hundred tokens, far below one model step.

This module must never import ray.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"


def first_stop(text: str, stops: Iterable[str]) -> int | None:
    """Character offset of the earliest occurrence of any non-empty stop string, else None."""
    best = None
    for s in stops:
        if s:
            p = text.find(s)
            if p >= 0 and (best is None or p < best):
                best = p
    return best


def _stop_prefix_overlap(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class TextStream:
    """One row's completion text, built token by token.

    ``decode`` maps the completion's token ids to text (the runtime's decode, which
    skips special tokens); ``stops`` are the row's stop strings. Not thread-safe: one
    engine thread owns each stream.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Iterable[str] = ()):
        self._decode = decode
        self.stops: tuple[str, ...] = tuple(s for s in stops if s)
        self.token_ids: list[int] = []
        self._emitted = ""  # text handed out so far; always a prefix of the final text
        self._full = ""  # decode of all token ids so far (before any stop cut)
        self._stop_at: int | None = None  # char offset of the matched stop string in _full
        self._finished = False
        self._warned_divergence = False

    @property
    def stopped(self) -> bool:
        """True once the decoded text contains one of the stop strings."""
        return self._stop_at is not None

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def text(self) -> str:
        """The text handed out so far; after :meth:`finish`, the row's final text."""
        return self._emitted

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became safe to emit ("" if none).

        After a stop string matched, or after :meth:`finish`, further tokens are ignored:
        the row has ended.
        """
        if self._finished or self._stop_at is not None:
            return ""
        self.token_ids.append(int(token_id))
        self._full = self._decode(self.token_ids)
        if not self._full.startswith(self._emitted) and not self._warned_divergence:
            # Decoding more tokens rewrote text that was already emitted (a decoder quirk
            # beyond what the hold-back rules cover). Emitted text cannot be taken back,
            # so from here on the stream's text is what was emitted plus what follows it.
            self._warned_divergence = True
            logger.warning("detokenized text changed behind the stream position; streamed text may differ "
                           "from a one-shot decode")
        if self.stops:
            pos = first_stop(self._full, self.stops)
            if pos is not None:
                self._stop_at = max(pos, len(self._emitted))
                return self._take(self._stop_at)
        safe = len(self._full)
        while safe > len(self._emitted) and self._full[safe - 1] == _REPLACEMENT_CHAR:
            safe -= 1
        while safe > len(self._emitted) and self._full[safe - 1].isspace():
            safe -= 1
        if self.stops:
            safe -= _stop_prefix_overlap(self._full[:safe], self.stops)
        return self._take(safe)

    def finish(self) -> str:
        """End the row; return everything still held back (cut at a matched stop string)."""
        if self._finished:
            return ""
        self._finished = True
        end = self._stop_at if self._stop_at is not None else len(self._full)
        return self._take(end)

    def _take(self, end: int) -> str:
        start = len(self._emitted)
        if end <= start:
            return ""
        delta = self._full[start:end]
        self._emitted += delta
        return delta
