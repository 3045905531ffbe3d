"""What every runtime shares: :class:`TaskRuntime`, the tokenizing text runtime, and
the context window a model accepts (:func:`_max_input_tokens`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from serve_app.core.errors import ContextLengthExceededError, InvalidRequestError
from serve_app.core.models.sources import model_revision

# A tokenizer's model_max_length above this is transformers' "no limit" sentinel.
_SANE_MAX_LENGTH = 1_000_000


def _max_input_tokens(config: Any, tokenizer: Any = None, extra: list[int | None] | None = None) -> int:
    candidates: list[int] = []
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = getattr(config, attr, None)
        if isinstance(v, int) and 0 < v < _SANE_MAX_LENGTH:
            candidates.append(v)
            break
    if tokenizer is not None:
        v = getattr(tokenizer, "model_max_length", None)
        if isinstance(v, int) and 0 < v < _SANE_MAX_LENGTH:
            candidates.append(v)
    for v in extra or []:
        if isinstance(v, int) and v > 0:
            candidates.append(v)
    return min(candidates) if candidates else 512



def token_id_input(ids: Any, vocabulary: int | None, field: str) -> list[int]:
    """An input given as token ids (OpenAI's list-of-ints form), checked against the
    model's vocabulary and used as it is: no special tokens are added, as vLLM's own
    server does with token inputs. The context is checked where text's is."""
    ids = list(ids)
    if not ids:
        raise InvalidRequestError(f"{field} is an empty list of token ids; give at least one", param=field)
    if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise InvalidRequestError(f"{field}: token ids must be integers", param=field)
    if vocabulary is not None:
        outside = next((i for i in ids if not 0 <= i < vocabulary), None)
        if outside is not None:
            raise InvalidRequestError(f"{field} has token id {outside}, but the model's vocabulary has "
                                      f"{vocabulary} tokens (ids 0-{vocabulary - 1})", param=field)
    return ids


def vocabulary_size(tokenizer: Any) -> int | None:
    """How many token ids the tokenizer knows (added tokens included), or None."""
    try:
        return len(tokenizer)
    except TypeError:
        return None


class TaskRuntime:
    """Common attributes of every runtime."""

    task: str
    device: torch.device
    dtype: torch.dtype
    revision: str
    max_input_tokens: int
    model_path: Path
    quantization: str = "none"  # set by load_runtime; see serve_app.core.models.quantization

    def __init__(self, *, task: str, model: Any, model_path: Path, device: torch.device, dtype: torch.dtype,
                 max_input_tokens: int):
        self.task = task
        self.model = model
        self.model_path = Path(model_path)
        self.device = device
        self.dtype = dtype
        self.revision = model_revision(self.model_path)
        self.max_input_tokens = max_input_tokens

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(task={self.task!r}, path={str(self.model_path)!r}, device={self.device}, "
            f"dtype={self.dtype}, quantization={self.quantization}, revision={self.revision}, "
            f"max_input_tokens={self.max_input_tokens})"
        )


class _TextRuntime(TaskRuntime):
    tokenizer: Any
    _param = "input"

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id
        return int(pad) if pad is not None else 0

    def tokenize(self, text: str | tuple[int, ...]) -> list[int]:
        """Token ids with special tokens (or the ids given, as they are); rejects empty
        and over-long input."""
        if isinstance(text, (tuple, list)):
            ids = token_id_input(text, vocabulary_size(self.tokenizer), self._param)
            return self._within_window(ids)
        if not isinstance(text, str):
            raise InvalidRequestError(f"{self._param} must be a string, got {type(text).__name__}", param=self._param)
        if not text.strip():
            raise InvalidRequestError(f"{self._param} is empty; give some text", param=self._param)
        ids = self.tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        return self._within_window(list(ids))

    def _within_window(self, ids: list[int]) -> list[int]:
        if len(ids) > self.max_input_tokens:
            raise ContextLengthExceededError(
                f"input has {len(ids)} tokens, model accepts at most {self.max_input_tokens}; shorten the text",
                param=self._param,
            )
        return ids

    def _batch(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-pad rows to the longest row in this sub-batch; ids and attention mask."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self._pad_id(), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            if not r:
                raise ValueError(f"row {i} of the batch has no tokens")
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return ids.to(self.device), mask.to(self.device)
