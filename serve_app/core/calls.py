"""The typed calls that cross a deployment handle, and what comes back.

The router turns one HTTP request into exactly one of :class:`EmbedCall`,
:class:`ClassifyCall` or :class:`GenerateCall` and sends it to the model's replica
(``ModelServer.infer``, or ``ModelServer.infer_stream`` for a streamed generation;
concurrent embedding and classification calls may travel together through
``ModelServer.infer_many``, answered by one :class:`CallOutcomes`).
The replica answers with the call's ``result_type`` (:class:`EmbedResult`,
:class:`ClassifyResult`, :class:`GenerateResult`) or, streamed, with
:class:`StreamDelta` events and one :class:`StreamEnd` per row. One object per call,
so a field added here reaches every layer, and a typo fails at construction instead of
deep inside a replica.

Every type here is a plain frozen dataclass of builtins: no torch, no Ray, no pydantic,
so it pickles cheaply across the handle and tests can build it without either. The
router owns request-shape checks (field ranges, configured limits); the replica owns
what needs the model (token counts against the context window).

This module must never import ray or torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar, Optional, Protocol, Sequence, Union

from serve_app.core.errors import ServeAppError


_GREEDY_BELOW, _MIN_TEMPERATURE = 1e-5, 1e-2


@dataclass(frozen=True)
class SamplingParams:
    """Everything that must be equal for rows to share one generate() call."""

    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    seed: Optional[int] = None
    # OpenAI's penalties and logit_bias. Only vLLM applies them; the transformers
    # engines refuse a call where any differs from these defaults (which change nothing).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, sorted by id

    def __post_init__(self):
        # A temperature that small divides the logits to inf and the draw fails on NaN
        # (a 500 after the request was queued). vLLM's own rule, so every engine and the
        # cache key agree: below 1e-5 is greedy, below 1e-2 is raised to 1e-2.
        t = self.temperature
        if t is not None and 0 < t < _MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0 if t < _GREEDY_BELOW else _MIN_TEMPERATURE)

    @property
    def penalised(self) -> bool:
        """Whether any penalty or logit bias is set (a non-default value)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature is None or self.temperature <= 0


@dataclass(frozen=True)
class ChatTurn:
    """One chat message as the model sees it: the router maps "developer" to "system"."""

    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    # An assistant turn's calls: OpenAI's tool_calls list as canonical JSON text (hashable,
    # and part of the cache key through chat()).
    tool_calls: Optional[str] = None
    tool_call_id: Optional[str] = None  # a tool turn: the call it answers

    def template_message(self) -> dict:
        """The turn as a chat template reads it. Templates index a call's arguments as an
        object (Qwen2.5, Llama 3: ``tool_call.arguments | tojson``), so the JSON text
        OpenAI sends is parsed, as vLLM's server does."""
        message: dict = {"role": self.role, "content": self.content}
        if self.tool_calls is not None:
            calls = json.loads(self.tool_calls)
            for call in calls:
                function = call.get("function", {})
                if isinstance(function.get("arguments"), str):
                    function["arguments"] = json.loads(function["arguments"])
            message["tool_calls"] = calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True)
class ToolsSpec:
    """OpenAI's ``tools`` and ``tool_choice`` for one chat (vLLM engine)."""

    definitions: str  # the tools list as canonical JSON text
    choice: str = "auto"  # "auto" | "required" | "function": call the one named in `function`
    function: Optional[str] = None
    parallel: bool = True  # parallel_tool_calls: False allows at most one call

    def tool_list(self) -> list[dict]:
        return json.loads(self.definitions)


# ---- results --------------------------------------------------------------------------


class _Wire:
    """Results travel through the response cache as msgpack maps (never pickle).

    Every result carries ``revision``: the revision of the replica that computed it
    (``ModelServer.infer`` sets it). During a rolling update the router's idea of the
    model's revision can be another replica's, so the router writes an answer back under
    the revision in the answer, never under the one it guessed. A change of fields here
    needs a bump of ``serve_app.core.cache.values.VALUE_SCHEMA``.
    """

    def to_wire(self) -> dict:
        """The result as a map of its fields, nested results (completions, logprobs) as
        maps too. Lists of plain values are the result's own, not copies: the map is for
        encoding at once (dataclasses.asdict copied every float of every embedding: 7% of
        the router's CPU per embedding request, measured)."""
        return _wire_value(self)


def _wire_value(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _wire_value(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)) and value and dataclasses.is_dataclass(value[0]):
        return [_wire_value(item) for item in value]
    return value


def _pair(value: Any) -> Any:
    """A stored (label, score) pair as it is, refusing anything else: unpacking would
    take the string "12" for the pair ("1", 2.0)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"not a (label, score) pair: {value!r:.40}")
    return value


def _revision(data: dict) -> Optional[str]:
    revision = data.get("revision")
    return None if revision is None else str(revision)


@dataclass(frozen=True)
class EmbedResult(_Wire):
    embeddings: list[list[float]]
    prompt_tokens: int
    revision: Optional[str] = None

    @classmethod
    def from_wire(cls, data: dict) -> "EmbedResult":
        return cls(embeddings=list(data["embeddings"]), prompt_tokens=int(data["prompt_tokens"]),
                   revision=_revision(data))


@dataclass(frozen=True)
class ClassifyResult(_Wire):
    # Per input: (label, score) pairs, best first, at most the call's top_k.
    rankings: list[list[tuple[str, float]]]
    prompt_tokens: int
    revision: Optional[str] = None

    @classmethod
    def from_wire(cls, data: dict) -> "ClassifyResult":
        rankings = [[(str(label), float(score)) for label, score in map(_pair, row)] for row in data["rankings"]]
        return cls(rankings=rankings, prompt_tokens=int(data["prompt_tokens"]), revision=_revision(data))


@dataclass(frozen=True)
class TokenLogprob(_Wire):
    """One generated token's log-probability and, when asked for, the most likely
    alternatives at its position (best first)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_wire(cls, data: Any) -> "TokenLogprob":
        return cls(token=str(data["token"]), logprob=float(data["logprob"]),
                   top=tuple((str(t), float(lp)) for t, lp in data["top"]))


@dataclass(frozen=True)
class ToolCall(_Wire):
    """One function call a model made. Its OpenAI id is the router's to give, per
    response, so that an answer from the cache gets fresh ids too."""

    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @classmethod
    def from_wire(cls, data: Any) -> "ToolCall":
        return cls(name=str(data["name"]), arguments=str(data["arguments"]))


@dataclass(frozen=True)
class Completion(_Wire):
    """One generated row (one choice)."""

    text: str  # with tool_calls: the text besides the calls ("" if none)
    finish_reason: str  # "stop" | "length" | "tool_calls"
    # A prompt's tokens are counted once: on its first choice, 0 on the others (n > 1).
    prompt_tokens: int
    completion_tokens: int
    logprobs: Optional[tuple[TokenLogprob, ...]] = None  # only when the call asked for them
    tool_calls: Optional[tuple[ToolCall, ...]] = None  # the calls the model made (a chat with tools)

    @classmethod
    def from_wire(cls, data: dict) -> "Completion":
        logprobs, tool_calls = data.get("logprobs"), data.get("tool_calls")
        return cls(text=str(data["text"]), finish_reason=str(data["finish_reason"]),
                   prompt_tokens=int(data["prompt_tokens"]), completion_tokens=int(data["completion_tokens"]),
                   logprobs=None if logprobs is None else tuple(TokenLogprob.from_wire(t) for t in logprobs),
                   tool_calls=None if tool_calls is None else tuple(ToolCall.from_wire(t) for t in tool_calls))


@dataclass(frozen=True)
class GenerateResult(_Wire):
    # One per choice, prompt-major: prompt 0's n choices, then prompt 1's (completions),
    # or the chat's n choices; OpenAI's choice index is the position here.
    completions: list[Completion]
    revision: Optional[str] = None

    @property
    def prompt_tokens(self) -> int:
        return sum(c.prompt_tokens for c in self.completions)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.completions)

    @classmethod
    def from_wire(cls, data: dict) -> "GenerateResult":
        return cls(completions=[Completion.from_wire(c) for c in data["completions"]], revision=_revision(data))


@dataclass(frozen=True)
class StreamDelta:
    """New text of one row (choice) of a streamed generation."""

    index: int
    text: str
    logprobs: Optional[tuple[TokenLogprob, ...]] = None  # the new tokens', when the call asked
    tool_calls: Optional[tuple[ToolCall, ...]] = None  # calls the row made (its last delta)


@dataclass(frozen=True)
class StreamEnd:
    """One row of a streamed generation ended; its text came as deltas before."""

    index: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


StreamEvent = Union[StreamDelta, StreamEnd]


# ---- calls ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EmbedCall:
    # Each input: a text, or token ids as given (a tuple of ints, OpenAI's token input).
    texts: tuple[Union[str, tuple[int, ...]], ...]
    # time.time() past which the caller no longer waits: rows still queued are dropped
    # with a 504 instead of being computed for nobody. Set by the router's model client.
    deadline: Optional[float] = None

    result_type: ClassVar[type] = EmbedResult

    @property
    def rows(self) -> int:
        """Inputs the call puts into the model's batch."""
        return len(self.texts)

    def cache_input(self) -> Any:
        return list(self.texts)

    def cache_params(self) -> dict:
        return {}


@dataclass(frozen=True)
class ClassifyCall:
    """Exactly one of ``texts`` (text-classification) or ``images`` (encoded image bytes)."""

    texts: Optional[tuple[str, ...]] = None
    images: Optional[tuple[bytes, ...]] = None
    top_k: int = 1
    deadline: Optional[float] = None

    result_type: ClassVar[type] = ClassifyResult

    def __post_init__(self) -> None:
        if (self.texts is None) == (self.images is None):
            raise ValueError("a ClassifyCall carries exactly one of texts or images")

    @property
    def rows(self) -> int:
        """Inputs the call puts into the model's batch."""
        return len(self.texts if self.texts is not None else self.images)

    def cache_input(self) -> Any:
        return list(self.texts if self.texts is not None else self.images)

    def cache_params(self) -> dict:
        return {"top_k": self.top_k}


@dataclass(frozen=True)
class ResponseFormat:
    """Constrained output (OpenAI's ``response_format``): any JSON object, or JSON that
    matches ``schema`` (a JSON Schema, as canonical JSON text so the call stays hashable)."""

    type: str  # "json_object" | "json_schema"
    schema: Optional[str] = None


@dataclass(frozen=True)
class GenerateCall:
    """Completions (``prompts``: one row each) or a chat (``messages``: one row).

    ``n``, ``logprobs``, ``response_format``, ``tools`` and the sampling penalties and
    logit bias are what only some engines do (vLLM's); an engine that cannot refuses
    the call with a 400 naming the field.
    """

    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    prompts: Optional[tuple[Union[str, tuple[int, ...]], ...]] = None  # texts, or token ids as given
    messages: Optional[tuple[ChatTurn, ...]] = None
    stop: tuple[str, ...] = ()
    deadline: Optional[float] = None
    n: int = 1  # choices per prompt
    # None: no logprobs; k >= 0: each generated token's, with the k most likely alternatives.
    logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[ToolsSpec] = None  # chat only
    adapter: Optional[str] = None  # the model's LoRA adapter that answers (vLLM), None: the base model
    # The client did not send max_tokens: max_tokens is the model's default, and a prompt
    # that leaves less room gets what is left (as vLLM's server does), not a 400 naming a
    # field the client never sent. Not part of the cache key: what it changes follows
    # from the prompt and max_tokens, which are.
    max_tokens_defaulted: bool = False

    result_type: ClassVar[type] = GenerateResult

    def __post_init__(self) -> None:
        if (self.prompts is None) == (self.messages is None):
            raise ValueError("a GenerateCall carries exactly one of prompts or messages")

    @property
    def rows(self) -> int:
        """Prompts the call runs (each gives ``n`` choices)."""
        return len(self.prompts) if self.prompts is not None else 1

    def chat(self) -> Optional[list[dict]]:
        """The messages as chat-template dicts, or None for a completion."""
        if self.messages is None:
            return None
        return [turn.template_message() for turn in self.messages]

    def cache_input(self) -> Any:
        return list(self.prompts) if self.prompts is not None else self.chat()

    def cache_params(self) -> dict:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "stop": list(self.stop),
            "seed": self.sampling.seed,
            "frequency_penalty": self.sampling.frequency_penalty,
            "presence_penalty": self.sampling.presence_penalty,
            "logit_bias": [list(pair) for pair in self.sampling.logit_bias],
            # Each of these changes the answer, so each is part of the key.
            "n": self.n,
            "logprobs": self.logprobs,
            "response_format": None if self.response_format is None else dataclasses.asdict(self.response_format),
            "tools": None if self.tools is None else dataclasses.asdict(self.tools),
            "adapter": self.adapter,  # an adapter's answers never serve the base model, nor the reverse
        }


ModelCall = Union[EmbedCall, ClassifyCall, GenerateCall]
ModelResult = Union[EmbedResult, ClassifyResult, GenerateResult]


@dataclass(frozen=True)
class ModelInfo:
    """What a replica says about the model it serves (``ModelServer.info``)."""

    name: str
    task: str
    revision: str  # leads the model's cache keys; changes when the weights do
    max_input_tokens: int
    device: str
    dtype: str
    quantization: str
    labels: tuple[str, ...] = ()
    engine: Optional[str] = None  # "vllm" | "static" | "continuous" (generation), "vllm" | None (others)
    # time.time() when this replica loaded the model. During a rolling update replicas of
    # two revisions answer side by side; the router keeps the revision of the replica
    # loaded last, so its idea of the current revision never goes back to the old one.
    loaded_at: Optional[float] = None


@dataclass(frozen=True)
class CallOutcomes:
    """``ModelServer.infer_many``'s answer: one outcome per call, in the calls' order.

    An outcome is the call's result or the :class:`~serve_app.core.errors.ServeAppError`
    it failed with, so one call's 400 or 504 never fails the others that travelled with
    it. ``replica`` names the replica that answered (None outside Serve): the router
    counts the replicas it reaches by it, to keep a few groups in flight per replica.
    """

    outcomes: tuple[Any, ...]  # ModelResult | ServeAppError, per call
    replica: Optional[str] = None


class ModelServerAPI(Protocol):
    """What the router calls on a model deployment's replica: the one declared API that
    the real replica (``serve_app.replica.model_server.ModelServer``) and the benchmark
    stubs (``benchmarks.harness.stubs``) implement, so neither can lack a method the router
    relies on (tests/unit/test_model_server_api.py checks both against this class)."""

    async def infer(self, call: ModelCall) -> ModelResult:
        """The call's ``result_type``, or raises a ServeAppError."""

    async def infer_many(self, calls: Sequence[ModelCall]) -> CallOutcomes:
        """Each call's outcome, as :meth:`infer` would answer it alone."""

    def infer_stream(self, call: GenerateCall) -> AsyncIterator[StreamEvent]:
        """A streamed generation: StreamDelta events, then one StreamEnd per row."""

    async def info(self) -> ModelInfo:
        """What the replica serves (revision, context window, engine)."""

    async def get_stats(self) -> dict:
        """The replica's counters for /v1/stats."""

    async def check_health(self) -> None:
        """Serve's health check: raises while the replica cannot serve."""


MODEL_SERVER_METHODS: tuple[str, ...] = tuple(
    name for name in vars(ModelServerAPI) if not name.startswith("_") and callable(getattr(ModelServerAPI, name)))


def missing_model_server_methods(cls: type) -> list[str]:
    """The :class:`ModelServerAPI` methods ``cls`` lacks or declares differently (sync
    where the API is async, other parameter names), each as a readable line."""
    problems = []
    for name in MODEL_SERVER_METHODS:
        declared, implemented = getattr(ModelServerAPI, name), getattr(cls, name, None)
        if implemented is None:
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        if inspect.iscoroutinefunction(declared) != inspect.iscoroutinefunction(implemented):
            problems.append(f"{cls.__name__}.{name} must {'' if inspect.iscoroutinefunction(declared) else 'not '}"
                            "be async")
        wanted = list(inspect.signature(declared).parameters)
        given = list(inspect.signature(implemented).parameters)[:len(wanted)]
        if given != wanted:
            problems.append(f"{cls.__name__}.{name} takes {given}, the API {wanted}")
    return problems


async def answer_each(infer: Callable[[ModelCall], Awaitable[Any]], calls: Sequence[ModelCall], *,
                      replica: Optional[str], unexpected: Callable[[BaseException], Any]) -> CallOutcomes:
    """``infer_many`` for any replica: the calls run concurrently (their rows batch as
    if they had come one by one), and each gets its own outcome. A ServeAppError is
    the call's outcome as it is; any other exception goes through ``unexpected``, which
    turns it into the error that call alone gets."""
    results = await asyncio.gather(*(infer(call) for call in calls), return_exceptions=True)
    return CallOutcomes(
        outcomes=tuple(r if isinstance(r, ServeAppError) or not isinstance(r, BaseException) else unexpected(r)
                       for r in results),
        replica=replica)
