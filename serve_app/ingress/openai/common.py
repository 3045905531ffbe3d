"""What every OpenAI endpoint shares: request objects in which null means absent, the
model field, inputs given as texts or token ids, and the usage object."""

# No `from __future__ import annotations`: FastAPI resolves these bodies' annotations
# at run time, and Serve's ingress re-signs the endpoints that take them.
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.core.errors import InvalidRequestError


class OpenAIObject(BaseModel):
    """A request object in which an explicit ``null`` means "not given": OpenAI accepts
    it for every optional field and clients send it (``"temperature": null``), so null
    fields are dropped before validation and take their defaults. A required field
    sent as null is reported as missing."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class ModelBody(OpenAIObject):
    # Unknown OpenAI fields are ignored as OpenAI's own server ignores them, but the
    # ones that would change the answer and that we do not implement are refused below.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str = Field(min_length=1)
    user: Optional[str] = None


# OpenAI's inputs as token ids: one input as a list of ids, or several as a list of lists
# (LangChain's OpenAIEmbeddings sends these by default). Ids are checked against the
# model's vocabulary in the replica, and cached by the ids.
TokenIds = list[int]


def inputs_list(value: Union[str, list[str], TokenIds, list[TokenIds]], field: str,
            limit: int) -> list[Union[str, tuple[int, ...]]]:
    """Texts, or token-id inputs as tuples: ``[1, 2]`` is one input, ``[[1, 2], [3]]`` two."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return as_list([tuple(value)], field, limit)
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        empty = next((i for i, v in enumerate(value) if not v), None)
        if empty is not None:
            raise InvalidRequestError(f"{field}[{empty}] is an empty list of token ids", param=field)
        return as_list([tuple(v) for v in value], field, limit)
    return as_list(value, field, limit)


def as_list(value, field: str, limit: int) -> list:
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise InvalidRequestError(f"'{field}' must not be empty", param=field)
    if len(items) > limit:
        raise InvalidRequestError(
            f"'{field}' has {len(items)} items; this model accepts at most {limit} per request", param=field
        )
    return items


def usage(prompt_tokens: int, completion_tokens: Optional[int] = None) -> dict:
    counts = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + (completion_tokens or 0)}
    if completion_tokens is not None:
        counts["completion_tokens"] = completion_tokens
    return counts
