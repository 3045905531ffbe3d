"""The sampling fields that completions and chat share, and their translation into
the GenerateCall both endpoints send: OpenAI's ranges here, the model's limits
(max_tokens, choices, stop sequences, logprobs) from its config."""

# No `from __future__ import annotations`: FastAPI resolves these bodies' annotations
# at run time, and Serve's ingress re-signs the endpoints that take them.
from typing import Any, Optional, Union

from pydantic import ConfigDict, Field, field_validator

from serve_app.config import ModelConfig
from serve_app.core.calls import GenerateCall, SamplingParams
from serve_app.core.errors import InvalidRequestError
from serve_app.ingress.openai.common import ModelBody, OpenAIObject

# What torch's generators (ours and vLLM's) accept as a seed; a larger one overflowed
# there, a 500 after the request was queued.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class StreamOptions(OpenAIObject):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# Fields of other OpenAI-compatible servers (vLLM's sampling extensions) that change
# the answer and that we do not implement, with the values that change nothing (and
# are accepted). Any other value is a 400 naming the field rather than an answer that
# silently ignores it.
_UNSUPPORTED_EXTENSIONS: dict[str, tuple] = {
    "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,), "length_penalty": (1,),
    "min_tokens": (0,), "ignore_eos": (False,), "stop_token_ids": ([],), "bad_words": ([],),
    "allowed_token_ids": (), "use_beam_search": (False,), "prompt_logprobs": (),
    "include_stop_str_in_output": (False,), "truncate_prompt_tokens": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "logits_processors": (), "vllm_xargs": (),
    "chat_template": (), "chat_template_kwargs": ({},), "add_generation_prompt": (True,),
    "continue_final_message": (False,), "echo": (False,),  # chat's echo (completions declare theirs)
    # OpenAI fields for what these models cannot do at all.
    "audio": (), "modalities": (["text"],), "reasoning_effort": (), "verbosity": (), "web_search_options": (),
}
# Ignored because they cannot change the answer: user, metadata, store, service_tier,
# prediction (a latency hint), safety_identifier,
# prompt_cache_key, and any field not named anywhere here.


def _token_id(key: str) -> int:
    if not (key.isascii() and key.isdigit()):  # isdigit alone also takes "１" and "²"
        raise ValueError(f"logit_bias keys are token ids (non-negative integers as strings), got {key!r}")
    return int(key)


class SamplingBody(ModelBody):
    # Extra fields are kept (not ignored) only so that the ones that would change the
    # answer (_UNSUPPORTED_EXTENSIONS) can be refused by name; the rest are never read.
    model_config = ConfigDict(extra="allow")

    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[Union[bool, int]] = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # Token id (as a string, JSON keys are strings) -> bias added to its logit.
    logit_bias: Optional[dict[str, float]] = None

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_in_range(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key, bias in (value or {}).items():
            _token_id(key)
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias} for token {key}")
        return value

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """The bias as sorted (token id, bias) pairs: hashable, and one order for the cache key."""
        pairs: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            pairs[_token_id(key)] = float(bias)  # "007" and "7" are one token
        return tuple(sorted(pairs.items()))

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _refuse_unsupported(body: SamplingBody) -> None:
    """A 400 naming the first extension field that would change the answer (see
    _UNSUPPORTED_EXTENSIONS); nulls were already dropped as absent."""
    for field, value in (body.model_extra or {}).items():
        harmless = _UNSUPPORTED_EXTENSIONS.get(field)
        # isinstance(.., bool) apart: True == 1, but "repetition_penalty": true is no default.
        if harmless is not None and not any(
                value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in harmless):
            raise InvalidRequestError(f"'{field}' is not supported by this server; send the request without it",
                                      param=field)


def generate_call(body: SamplingBody, model: ModelConfig, **inputs: Any) -> GenerateCall:
    _refuse_unsupported(body)
    limits = model.generation
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")
    if body.n > limits.max_choices:
        raise InvalidRequestError(f"n is {body.n}; this model allows at most {limits.max_choices}", param="n")
    asked = body.requested_max_tokens()
    max_tokens = limits.default_max_tokens if asked is None else asked
    if max_tokens > limits.max_tokens_limit:
        raise InvalidRequestError(
            f"max_tokens is {max_tokens}; this model allows at most {limits.max_tokens_limit}", param="max_tokens"
        )
    stop = body.stop_list()
    if len(stop) > limits.max_stop_sequences:
        raise InvalidRequestError(
            f"{len(stop)} stop sequences given; at most {limits.max_stop_sequences} allowed", param="stop"
        )
    if any(not s for s in stop):
        raise InvalidRequestError("stop sequences must not be empty strings", param="stop")
    sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed,
                              frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                              logit_bias=body.logit_bias_pairs())
    return GenerateCall(max_tokens=max_tokens, sampling=sampling, stop=tuple(stop), n=body.n,
                        max_tokens_defaulted=asked is None, **inputs)


def logprobs_count(top: Optional[int], model: ModelConfig, param: str) -> Optional[int]:
    """The call's logprobs: None (not asked) or how many alternatives per token."""
    if top is None:
        return None
    limit = model.generation.max_top_logprobs
    if top > limit:
        raise InvalidRequestError(f"{param} is {top}; this model allows at most {limit}", param=param)
    return top
