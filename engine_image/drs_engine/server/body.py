"""Validation errors that name the field (reading and capping a body: :mod:`drs_protocol.body`)."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from drs_engine.errors import BadRequestError

ModelT = TypeVar("ModelT", bound=BaseModel)


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
