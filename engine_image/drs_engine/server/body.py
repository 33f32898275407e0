"""Reading request bodies: a size cap, JSON parsing, and validation errors that name the field.

A body over the cap gets 413 — after the body has been drained (up to :data:`DRAIN_FACTOR` times
the cap), so the client reads the 413 instead of a connection reset mid-upload.
"""

from __future__ import annotations

import json
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from drs_engine.errors import BadRequestError, PayloadTooLargeError

#: Past ``cap * DRAIN_FACTOR`` bytes the server stops draining and lets the connection close.
DRAIN_FACTOR: Final = 8

ModelT = TypeVar("ModelT", bound=BaseModel)


async def read_body(request: Request, cap: int) -> bytes:
    """The body, or :class:`PayloadTooLargeError` when it exceeds ``cap`` bytes."""
    declared = request.headers.get("content-length")
    too_large = declared is not None and declared.isdigit() and int(declared) > cap
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            too_large = True
        if too_large:
            if size > cap * DRAIN_FACTOR:
                break
            continue
        chunks.append(chunk)
    if too_large:
        raise PayloadTooLargeError(f"request body exceeds the limit of {cap} bytes")
    return b"".join(chunks)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what is wrong with it."""
    if not body:
        raise BadRequestError("request body is empty; expected a JSON object")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(f"malformed JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequestError(f"request body must be a JSON object, got {type(data).__name__}")
    return data


def validate(model: type[ModelT], data: dict[str, Any]) -> ModelT:
    """``model`` validated from ``data``; the 400 names the first offending field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def validation_error(exc: ValidationError) -> BadRequestError:
    errors = exc.errors(include_url=False)
    if not errors:
        return BadRequestError(str(exc))
    first = errors[0]
    loc = ".".join(str(part) for part in first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        message = f"unknown field {loc!r}: this engine (like TensorRT-LLM) rejects fields it does not know"
    elif loc:
        message = f"{loc}: {first.get('msg', 'invalid value')}"
    else:
        message = str(first.get("msg", "invalid request"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return BadRequestError(message, param=loc or None)
