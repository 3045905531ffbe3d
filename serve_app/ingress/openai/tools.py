"""Tool calls in ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked into a :class:`ToolsSpec`, the tool turns of a history,
and the ``tool_calls`` of a response or a chunk, with their ids."""

# No `from __future__ import annotations`: FastAPI resolves these bodies' annotations
# at run time, and Serve's ingress re-signs the endpoints that take them.
import json
import uuid
from typing import Literal, Optional, Union

from pydantic import ConfigDict, Field

from serve_app.core.calls import ToolCall, ToolsSpec
from serve_app.core.errors import InvalidRequestError
from serve_app.ingress.openai.common import OpenAIObject


class _FunctionBody(OpenAIObject):
    model_config = ConfigDict(extra="ignore")
    # OpenAI's rule for function names: what templates and parsers can spell back.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict] = None  # a JSON Schema; none: the function takes no arguments
    strict: Optional[bool] = None


class ToolBody(OpenAIObject):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _FunctionBody


class _NamedFunction(OpenAIObject):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(OpenAIObject):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: _NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class _CalledFunction(OpenAIObject):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str  # JSON text, as the response gave it


class ToolCallBody(OpenAIObject):
    """One call of an assistant turn in the history."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: _CalledFunction


def tools_spec(tools: Optional[list[ToolBody]], choice: Optional[ToolChoice],
               parallel: Optional[bool]) -> Optional[ToolsSpec]:
    """What the model is asked to do with the request's tools; None: no tools (none sent,
    or ``tool_choice: none``, which answers as if there were none)."""
    if not tools:
        if choice not in (None, "none", "auto"):  # these two ask nothing without tools
            raise InvalidRequestError("tool_choice needs 'tools': send the functions the model may call",
                                      param="tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    doubled = next((name for name in names if names.count(name) > 1), None)
    if doubled is not None:
        raise InvalidRequestError(f"tools name the function {doubled!r} twice", param="tools")
    if choice == "none":
        return None
    definitions = json.dumps([tool.model_dump(exclude_none=True) for tool in tools], sort_keys=True,
                             separators=(",", ":"))
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice names the function {choice.function.name!r}, which is not "
                                      f"in tools ({', '.join(names)})", param="tool_choice")
        return ToolsSpec(definitions, choice="function", function=choice.function.name, parallel=parallel is not False)
    return ToolsSpec(definitions, choice=choice or "auto", parallel=parallel is not False)


def history_tool_calls(calls: list[ToolCallBody], field: str) -> str:
    """An assistant turn's calls as canonical JSON text (the turn's ``tool_calls``), each
    call's arguments checked to be JSON, as the chat template reads them as an object."""
    for j, call in enumerate(calls):
        try:
            json.loads(call.function.arguments)
        except ValueError:
            raise InvalidRequestError(f"{field}[{j}].function.arguments is not JSON text",
                                      param=f"{field}.{j}.function.arguments") from None
    return json.dumps([call.model_dump() for call in calls], sort_keys=True, separators=(",", ":"))


def response_tool_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
    """OpenAI's ``tool_calls`` of a message, with fresh ids: a cached answer's calls are
    new calls too, which the client will answer with tool turns naming these ids."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]


def delta_tool_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
    """The ``tool_calls`` of a chunk's delta: each call whole, with its position."""
    return [{"index": k, **call} for k, call in enumerate(response_tool_calls(calls))]
