"""A streamed generation as server-sent events in OpenAI's chunk format."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, AsyncIterator

from fastapi.responses import StreamingResponse

from serve_app.config import ModelConfig
from serve_app.core.calls import GenerateCall, StreamDelta
from serve_app.ingress import http_errors
from serve_app.ingress.serving import Serving

if TYPE_CHECKING:  # the endpoint modules import this one
    from serve_app.ingress.openai.completions import CompletionChunks

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def event_stream(serving: Serving, model: ModelConfig, call: GenerateCall, chunks: CompletionChunks,
                       include_usage: bool) -> StreamingResponse:
    """The generation's events as they come, in ``chunks``' format.

    The first model event is awaited here, so anything that fails before the model
    produced a token (a bad prompt, a full queue, an unavailable model) is still a
    plain HTTP error; a failure after it can only be reported in the stream.
    """
    events = serving.client.stream(model, call)  # under the request's deadline
    first = await events.__anext__()

    async def sse_events() -> AsyncIterator[bytes]:
        prompt_tokens = completion_tokens = 0
        texts: dict[int, list[str]] = {}
        try:
            for opening in chunks.opening(call.n):
                yield sse(opening)
            event = first
            while event is not None:
                if isinstance(event, StreamDelta):
                    texts.setdefault(event.index, []).append(event.text)
                    yield sse(chunks.text(event.index, event.text, event.logprobs, event.tool_calls))
                else:  # a row finished
                    prompt_tokens += event.prompt_tokens
                    completion_tokens += event.completion_tokens
                    yield sse(chunks.finish(event.index, event.finish_reason))
                event = await anext(events, None)
            if include_usage:
                yield sse(chunks.usage(prompt_tokens, completion_tokens))
            yield SSE_DONE
            serving.log_payload(model, call.cache_input(), ["".join(texts.get(i, ())) for i in sorted(texts)])
        except Exception as exc:  # headers are gone: the error travels as the last event
            yield sse(http_errors.stream_error(exc, model.name).to_body())
        finally:
            await events.aclose()

    # Streams skip the response cache: x-cache says "miss" as for any computed answer.
    return StreamingResponse(sse_events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "x-cache": "miss"})
