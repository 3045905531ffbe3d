"""``/v1/classify``: texts or base64 images, bounded before any image is decoded, their
ClassifyCall and the ranked labels."""

# No `from __future__ import annotations`: FastAPI resolves these bodies' annotations
# at run time, and Serve's ingress re-signs the endpoints that take them.
import base64
import binascii
import io
from typing import Optional, Union

from fastapi import Response
from pydantic import Field, field_validator

from serve_app.config import ModelConfig
from serve_app.core.calls import ClassifyCall, ClassifyResult
from serve_app.core.errors import InvalidRequestError
from serve_app.ingress.openai.common import ModelBody, as_list, usage
from serve_app.ingress.serving import Serving

# Declared pixels (width x height, read from the headers before anything is decoded)
# of all the images of one classify request together. Each image is also capped on
# its own at the replica (core.models.encoders.MAX_IMAGE_PIXELS).
MAX_REQUEST_IMAGE_PIXELS = 64_000_000
# What PIL may open: anything else is refused before a decoder for it ever runs.
# (Its JPEG opener also opens MPO, the JPEG variant many phone cameras write.)
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


class ClassifyBody(ModelBody):
    input: Optional[Union[str, list[str]]] = None
    image: Optional[Union[str, list[str]]] = Field(
        None, description="Base64-encoded image bytes (optionally a data: URL); never fetched from a URL."
    )
    top_k: int = Field(1, ge=1)

    @field_validator("image")
    @classmethod
    def _no_urls(cls, value):
        images = [value] if isinstance(value, str) else (value or [])
        if any(item.startswith(("http://", "https://")) for item in images):
            raise ValueError("images must be sent as base64, not fetched from a URL")
        return value

    @property
    def task(self) -> str:
        """The task this body asks for; exactly one of input or image must be given."""
        if (self.input is None) == (self.image is None):
            raise InvalidRequestError("send exactly one of 'input' (text) or 'image' (base64)", param="input")
        return "text-classification" if self.input is not None else "image-classification"


def _decode_image(data: str, param: str) -> bytes:
    if data.startswith("data:"):
        _, _, data = data.partition(",")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image is not valid base64", param=param) from None
    if not raw:
        raise InvalidRequestError("image is empty", param=param)
    return raw


def _declared_pixels(raw: bytes, param: str) -> int:
    """Width x height from the image's header; nothing is decoded (PIL opens lazily).
    0 for bytes that are no PNG, JPEG or WebP header: the replica, which opens images
    with the same formats only, refuses those with the reason."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS) as img:
            width, height = img.size
    except Image.DecompressionBombError:  # PIL's own limit, far above ours
        raise InvalidRequestError("image is too large; send a smaller image", param=param) from None
    except Exception:  # PIL raises many types for bytes that are not an image it may open
        return 0
    return width * height


def _check_image_pixels(images: list[bytes]) -> None:
    """Every image of a request decodes on the replica; their declared sizes together
    bound that work before any of it is done (a 160 KB PNG can declare 7000x7000)."""
    params = ["image"] if len(images) == 1 else [f"image[{i}]" for i in range(len(images))]
    total = 0
    for raw, param in zip(images, params):
        total += _declared_pixels(raw, param)
        if total > MAX_REQUEST_IMAGE_PIXELS:
            raise InvalidRequestError(
                f"the images of this request have more than {MAX_REQUEST_IMAGE_PIXELS} pixels together "
                f"(width x height, summed; exceeded at {param}); send fewer or smaller images",
                param=param,
            )


def classify_call(body: ClassifyBody, model: ModelConfig) -> ClassifyCall:
    if body.input is not None:
        inputs = {"texts": tuple(as_list(body.input, "input", model.max_inputs_per_request))}
    else:
        encoded = as_list(body.image, "image", model.max_inputs_per_request)
        images = [_decode_image(e, "image" if len(encoded) == 1 else f"image[{i}]") for i, e in enumerate(encoded)]
        _check_image_pixels(images)
        inputs = {"images": tuple(images)}
    if body.top_k > model.top_k_limit:
        raise InvalidRequestError(f"top_k is {body.top_k}; at most {model.top_k_limit} allowed", param="top_k")
    return ClassifyCall(top_k=body.top_k, **inputs)


def classify_response(result: ClassifyResult, model: str) -> dict:
    data = [
        {"index": i, "labels": [{"label": label, "score": score} for label, score in ranked]}
        for i, ranked in enumerate(result.rankings)
    ]
    return {"object": "list", "model": model, "data": data, "usage": usage(result.prompt_tokens)}


async def create(serving: Serving, body: ClassifyBody, response: Response) -> dict:
    task = body.task
    endpoint = "/v1/classify with 'input'" if task == "text-classification" else "/v1/classify with 'image'"
    model = serving.model(body.model, task, endpoint)
    call = classify_call(body, model)
    result = await serving.answer(model, call, response)
    logged = list(call.texts) if call.texts is not None else f"{len(call.images)} image(s)"
    serving.log_payload(model, logged, result.rankings)
    return classify_response(result, model.name)
