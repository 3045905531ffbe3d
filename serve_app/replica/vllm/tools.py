"""Tool calls on vLLM, made as vLLM's own server makes them.

- ``tool_choice: required`` and a named function constrain the output with structured
  output: a JSON array of ``{name, parameters}`` (vLLM's schema for the tools), or the
  named function's parameters. The arguments therefore always parse against the
  function's schema, even on a tiny model that was never taught to call tools.
- ``tool_choice: auto`` leaves the model free and reads its calls back with the model's
  parser from ``vllm.tool_parsers`` (``hermes`` for Qwen2.5, ``llama3_json``, ...), the
  one named in the model's ``vllm.tool_parser``.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from serve_app.core.calls import ToolCall, ToolsSpec
from serve_app.core.errors import InvalidRequestError


def tool_parser_class(name: Optional[str]) -> Any:
    """vLLM's parser class for ``vllm.tool_parser`` (None: none configured). An unknown
    name fails the replica's start, naming the ones vLLM has."""
    if name is None:
        return None
    from vllm.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})
        raise ValueError(f"vllm.tool_parser {name!r} is not one of vLLM's tool parsers: {', '.join(known)}") from None


class ToolCalling:
    """One chat's tools on vLLM: the output constraint its sampling takes, whether the
    model's special tokens stay in the text (a parser may read them), and the calls
    read back from each choice's text."""

    def __init__(self, spec: ToolsSpec, *, parser_class: Any, tokenizer: Any, model_name: str):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        self.spec = spec
        self._parser_class, self._tokenizer = parser_class, tokenizer
        if spec.choice == "auto" and parser_class is None:
            raise InvalidRequestError(
                f"tool_choice auto needs a tool parser for the model's own call format, and model {model_name!r} "
                "has none (vllm.tool_parser in its config); send tool_choice required or name a function",
                param="tool_choice")
        # vLLM's own request object, as its parsers and schema builder read one.
        choice: Any = spec.choice
        if spec.choice == "function":
            choice = {"type": "function", "function": {"name": spec.function}}
        self.request = ChatCompletionRequest(model=model_name, messages=[], tools=spec.tool_list(),
                                             tool_choice=choice, parallel_tool_calls=spec.parallel)
        if spec.choice == "auto":
            self.request = self._parser().adjust_request(self.request)

    def _parser(self) -> Any:
        # A parser keeps state for streaming, so each read gets its own, as in vLLM's server.
        return self._parser_class(self._tokenizer, self.request.tools)

    def constraint(self) -> Optional[dict]:
        """The JSON Schema the output must match (required, a named function), or None."""
        if self.spec.choice == "auto":
            return None
        from vllm.tool_parsers.utils import get_json_schema_from_tools

        schema = get_json_schema_from_tools(tool_choice=self.request.tool_choice, tools=self.request.tools,
                                            parallel_tool_calls=self.spec.parallel)
        return json.loads(schema) if isinstance(schema, str) else schema

    @property
    def skip_special_tokens(self) -> bool:
        """False where the parser reads the model's call markers (hermes' <tool_call>)."""
        return bool(getattr(self.request, "skip_special_tokens", True))

    def read(self, text: str, finish_reason: str) -> tuple[str, Optional[tuple[ToolCall, ...]], str]:
        """A choice's (text besides the calls, calls, finish_reason). OpenAI's finish
        reason is "tool_calls" for the calls of auto and required, "stop" for a named
        function's. An output cut short (length) that does not parse stays text, so the
        client sees what came and why it stopped."""
        if self.spec.choice == "function":
            if finish_reason != "stop" or not _is_json(text):
                return text, None, finish_reason
            return "", (ToolCall(name=self.spec.function, arguments=text.strip()),), finish_reason
        if self.spec.choice == "required":
            try:
                calls = json.loads(text)
                found = tuple(ToolCall(name=str(c["name"]), arguments=json.dumps(c.get("parameters", {}),
                                                                                 ensure_ascii=False))
                              for c in calls)
            except (ValueError, TypeError, KeyError, AttributeError):  # not the constrained shape: cut short
                return text, None, finish_reason
            return "", found, "tool_calls"
        found = self._parser().extract_tool_calls(text, self.request)
        if not found.tools_called or not found.tool_calls:
            return text, None, finish_reason
        calls = tuple(ToolCall(name=c.function.name, arguments=c.function.arguments) for c in found.tool_calls)
        content = found.content or ""
        return content if content.strip() else "", calls, "tool_calls"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
