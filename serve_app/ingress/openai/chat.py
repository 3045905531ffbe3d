"""``/v1/chat/completions``: messages and response formats, the GenerateCall they make,
the response and its ``chat.completion.chunk`` events."""

# No `from __future__ import annotations`: FastAPI resolves these bodies' annotations
# at run time, and Serve's ingress re-signs the endpoints that take them.
import dataclasses
import json
import time
import uuid
from typing import Literal, Optional, Union

from fastapi import Response
from pydantic import ConfigDict, Field

from serve_app.config import ModelConfig
from serve_app.core.calls import ChatTurn, GenerateCall, GenerateResult, ResponseFormat, TokenLogprob, ToolCall
from serve_app.core.errors import InvalidRequestError
from serve_app.ingress.openai.common import OpenAIObject, usage
from serve_app.ingress.openai.completions import CompletionChunks
from serve_app.ingress.openai.sampling import SamplingBody, generate_call, logprobs_count
from serve_app.ingress.openai.streaming import event_stream
from serve_app.ingress.openai.tools import (
    ToolBody,
    ToolCallBody,
    ToolChoice,
    delta_tool_calls,
    history_tool_calls,
    response_tool_calls,
    tools_spec,
)
from serve_app.ingress.serving import Serving


class _TextPart(OpenAIObject):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIObject):
    model_config = ConfigDict(extra="ignore")
    # "function" (the deprecated tool result) parses so that chat_call can refuse it by name.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # None: an assistant turn without text (OpenAI's tool-call turns send content: null).
    content: Optional[Union[str, list[_TextPart]]] = None
    tool_calls: Optional[list[ToolCallBody]] = None
    tool_call_id: Optional[str] = None
    function_call: Optional[dict] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JSONSchemaFormat(OpenAIObject):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict = Field(alias="schema")
    strict: Optional[bool] = None


class ResponseFormatBody(OpenAIObject):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class ChatCompletionBody(SamplingBody):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormatBody] = None
    tools: Optional[list[ToolBody]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    # OpenAI's deprecated form of tools, refused by name.
    functions: Optional[list[dict]] = None
    function_call: Optional[Union[str, dict]] = None

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


def _turn(message: ChatMessage, index: int) -> ChatTurn:
    """The message as the model sees it. What this API cannot carry is refused by name,
    never dropped from the prompt, which would change the answer."""
    field = f"messages.{index}"
    if message.role == "function" or message.function_call:
        raise InvalidRequestError("function_call and 'function' messages are OpenAI's deprecated form of tools; "
                                  "send tool_calls and 'tool' messages", param=f"{field}.role")
    if message.content is None and message.role != "assistant":
        raise InvalidRequestError(f"a {message.role} message needs content", param=f"{field}.content")
    if message.tool_calls and message.role != "assistant":
        raise InvalidRequestError("only assistant messages carry tool_calls", param=f"{field}.tool_calls")
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidRequestError("a tool message needs the tool_call_id of the call it answers",
                                  param=f"{field}.tool_call_id")
    return ChatTurn(
        "system" if message.role == "developer" else message.role, message.text(),
        tool_calls=history_tool_calls(message.tool_calls, f"{field}.tool_calls") if message.tool_calls else None,
        tool_call_id=message.tool_call_id if message.role == "tool" else None)


def chat_call(body: ChatCompletionBody, model: ModelConfig) -> GenerateCall:
    if not body.messages:
        raise InvalidRequestError("'messages' must not be empty", param="messages")
    turns = tuple(_turn(message, index) for index, message in enumerate(body.messages))
    for field in ("functions", "function_call"):
        if getattr(body, field) not in (None, [], "none", "auto"):
            raise InvalidRequestError(f"{field} is OpenAI's deprecated form of tools; send 'tools' and "
                                      "'tool_choice'", param=field)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = logprobs_count(body.top_logprobs or 0, model, "top_logprobs") if body.logprobs else None
    response_format = None
    if body.response_format is not None and body.response_format.type != "text":
        if body.response_format.type == "json_schema":
            if body.response_format.json_schema is None:
                raise InvalidRequestError("response_format json_schema needs a 'json_schema' object with a 'schema'",
                                          param="response_format")
            schema = json.dumps(body.response_format.json_schema.json_schema, sort_keys=True, separators=(",", ":"))
            response_format = ResponseFormat(type="json_schema", schema=schema)
        else:
            response_format = ResponseFormat(type="json_object")
    tools = tools_spec(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools is not None and tools.choice != "auto" and response_format is not None:
        raise InvalidRequestError(f"tool_choice {tools.choice} constrains the answer to a tool call, and "
                                  "response_format to its own format; send one of them", param="response_format")
    call = generate_call(body, model, messages=turns)
    return dataclasses.replace(call, logprobs=logprobs, response_format=response_format, tools=tools)


def chat_logprobs(logprobs: Optional[tuple[TokenLogprob, ...]]) -> Optional[dict]:
    """OpenAI's chat ``logprobs`` object (``content``: one entry per token)."""
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(tok, lp) for tok, lp in t.top]}
                        for t in logprobs]}


def _message(text: str, tool_calls: Optional[tuple[ToolCall, ...]]) -> dict:
    if not tool_calls:
        return {"role": "assistant", "content": text}
    # OpenAI's tool-call message has content null unless the model also wrote text.
    return {"role": "assistant", "content": text or None, "tool_calls": response_tool_calls(tool_calls)}


def chat_response(result: GenerateResult, model: str) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": i,
                "message": _message(c.text, c.tool_calls),
                "logprobs": chat_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(result.completions)
        ],
        "usage": usage(result.prompt_tokens, result.completion_tokens),
    }


class ChatChunks(CompletionChunks):
    """OpenAI's ``chat.completion.chunk`` events."""

    object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def opening(self, choices: int = 1) -> list[dict]:  # OpenAI's first chunk of each choice announces the role
        return [{**self.head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]} for i in range(choices)]

    def _choice(self, index: int, text: Optional[str], tool_calls: Optional[tuple[ToolCall, ...]] = None) -> dict:
        delta = {} if text is None or (tool_calls and not text) else {"content": text}
        if tool_calls:
            delta["tool_calls"] = delta_tool_calls(tool_calls)
        return {"index": index, "delta": delta}

    def _logprobs(self, logprobs: Optional[tuple[TokenLogprob, ...]], text_offset: int) -> Optional[dict]:
        return chat_logprobs(logprobs)  # chat logprobs carry no offsets


async def create(serving: Serving, body: ChatCompletionBody, response: Response):
    model, adapter = serving.generator(body.model, "/v1/chat/completions")
    call = dataclasses.replace(chat_call(body, model), adapter=adapter)
    if body.stream:
        return await event_stream(serving, model, call, ChatChunks(body.model), body.include_usage)
    result = await serving.answer(model, call, response)
    serving.log_payload(model, call.cache_input(), [c.text for c in result.completions])
    return chat_response(result, body.model)
