"""Whether a stored value can be the answer to the request that found it.

A key names the model, revision, task, input and parameters, so a value under it should
fit; one that does not (another revision's answer, the wrong number of rows, a
non-finite vector, a cancelled generation) is corruption or a bug, and it must cost a
miss, never a wrong answer.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from serve_app.core.calls import ClassifyResult, EmbedResult, GenerateResult, ModelCall, ModelResult


def misfit(call: ModelCall, result: ModelResult, revision: Optional[str]) -> Optional[str]:
    """Why ``result`` cannot be the answer to ``call`` of ``revision``, or None if it can."""
    if revision is not None and result.revision is not None and result.revision != revision:
        return f"revision {result.revision!r}, not {revision!r}"
    if result.prompt_tokens < 0:
        return "negative prompt_tokens"
    if isinstance(result, EmbedResult):
        if len(result.embeddings) != len(call.texts):
            return f"{len(result.embeddings)} embeddings for {len(call.texts)} inputs"
        if not all(isinstance(row, (list, tuple)) and row for row in result.embeddings):
            return "an embedding that is not a list of numbers"
        vectors = np.asarray(result.embeddings)  # ragged rows raise: caught as corrupt
        if vectors.ndim != 2 or vectors.dtype.kind != "f" or not np.isfinite(vectors).all():
            return "embeddings that are not finite floats of one dimension"
    elif isinstance(result, ClassifyResult):
        inputs = call.texts if call.texts is not None else call.images
        if len(result.rankings) != len(inputs):
            return f"{len(result.rankings)} rankings for {len(inputs)} inputs"
        if not all(1 <= len(row) <= call.top_k and all(math.isfinite(score) for _, score in row)
                   for row in result.rankings):
            return f"a ranking that is not 1 to {call.top_k} finite scores"
    elif isinstance(result, GenerateResult):
        if len(result.completions) != call.rows * call.n:
            return f"{len(result.completions)} completions for {call.rows * call.n} choices"
        for completion in result.completions:
            if completion.finish_reason not in ("stop", "length"):  # "cancelled" is never an answer
                return f"finish_reason {completion.finish_reason!r}"
            if (completion.logprobs is None) != (call.logprobs is None) or completion.completion_tokens < 0:
                return "logprobs or token counts that do not fit the request"
    return None
