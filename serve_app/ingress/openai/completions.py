"""``/v1/completions``: the body, its GenerateCall, the response and its stream chunks."""

# No `from __future__ import annotations`: FastAPI resolves these bodies' annotations
# at run time, and Serve's ingress re-signs the endpoints that take them.
import dataclasses
import time
import uuid
from typing import Optional, Union

from fastapi import Response
from pydantic import Field

from serve_app.config import ModelConfig
from serve_app.core.calls import GenerateCall, GenerateResult, TokenLogprob, ToolCall
from serve_app.core.errors import InvalidRequestError
from serve_app.ingress.openai.common import TokenIds, inputs_list, usage
from serve_app.ingress.openai.sampling import SamplingBody, generate_call, logprobs_count
from serve_app.ingress.openai.streaming import event_stream
from serve_app.ingress.serving import Serving


class CompletionBody(SamplingBody):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1)


def completion_call(body: CompletionBody, model: ModelConfig) -> GenerateCall:
    if body.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
    if body.suffix:  # insertion: text after the completion changes what it says
        raise InvalidRequestError("suffix is not supported; send the request without it", param="suffix")
    if body.best_of is not None and body.best_of != body.n:  # best_of == n: every sample is returned
        raise InvalidRequestError("best_of is not supported; use n for several completions", param="best_of")
    prompts = inputs_list(body.prompt, "prompt", model.max_inputs_per_request)
    if isinstance(body.logprobs, bool):  # the legacy field is a count; true would read as 1
        raise InvalidRequestError("logprobs is a number of alternatives per token (0-5) on /v1/completions",
                                  param="logprobs")
    if body.logprobs is not None and body.logprobs < 0:
        raise InvalidRequestError("logprobs must be >= 0", param="logprobs")
    call = generate_call(body, model, prompts=tuple(prompts))
    return dataclasses.replace(call, logprobs=logprobs_count(body.logprobs, model, "logprobs"))


def completion_logprobs(logprobs: Optional[tuple[TokenLogprob, ...]], text_offset: int = 0) -> Optional[dict]:
    """OpenAI's legacy completions ``logprobs`` object."""
    if logprobs is None:
        return None
    offsets, position = [], text_offset
    for token in logprobs:
        offsets.append(position)
        position += len(token.token)
    return {
        "tokens": [t.token for t in logprobs],
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [dict(t.top) for t in logprobs],
        "text_offset": offsets,
    }


def completion_response(result: GenerateResult, model: str) -> dict:
    choices = [
        {"index": i, "text": c.text, "logprobs": completion_logprobs(c.logprobs), "finish_reason": c.finish_reason}
        for i, c in enumerate(result.completions)
    ]
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result.prompt_tokens, result.completion_tokens),
    }


class CompletionChunks:
    """OpenAI's chunks of one streamed completion (``text_completion``)."""

    object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str):
        self.head = {"id": f"{self.id_prefix}-{uuid.uuid4().hex}", "object": self.object_name,
                     "created": int(time.time()), "model": model}
        # Per choice: how much text its earlier chunks carried, where the next chunk's
        # logprob text_offset starts (OpenAI's offsets run over the whole completion).
        self._sent_chars: dict[int, int] = {}

    def opening(self, choices: int = 1) -> list[dict]:
        return []  # completions chunks carry no role announcement

    def _choice(self, index: int, text: Optional[str], tool_calls: Optional[tuple[ToolCall, ...]] = None) -> dict:
        return {"index": index, "text": text or ""}  # completions have no tools

    def _logprobs(self, logprobs: Optional[tuple[TokenLogprob, ...]], text_offset: int) -> Optional[dict]:
        return completion_logprobs(logprobs, text_offset)

    def text(self, index: int, text: str, logprobs: Optional[tuple[TokenLogprob, ...]] = None,
             tool_calls: Optional[tuple[ToolCall, ...]] = None) -> dict:
        offset = self._sent_chars.get(index, 0)
        self._sent_chars[index] = offset + len(text)
        return {**self.head, "choices": [{**self._choice(index, text, tool_calls),
                                          "logprobs": self._logprobs(logprobs, offset), "finish_reason": None}]}

    def finish(self, index: int, finish_reason: str) -> dict:
        return {**self.head, "choices": [{**self._choice(index, None), "logprobs": None,
                                          "finish_reason": finish_reason}]}

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict:
        return {**self.head, "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


async def create(serving: Serving, body: CompletionBody, response: Response):
    model, adapter = serving.generator(body.model, "/v1/completions")
    call = dataclasses.replace(completion_call(body, model), adapter=adapter)
    if body.stream:
        return await event_stream(serving, model, call, CompletionChunks(body.model), body.include_usage)
    result = await serving.answer(model, call, response)
    serving.log_payload(model, call.cache_input(), [c.text for c in result.completions])
    return completion_response(result, body.model)
