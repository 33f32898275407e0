"""Validation errors that name the field (reading and capping a body: :mod:`drs_protocol.body`).

The field path and message come from :func:`drs_protocol.validation_errors.field_problems`, the
one formatter of pydantic's errors that the operator and the FastAPI servers' 400s use too; the
engine words an unknown field its own way (as TensorRT-LLM refuses one) and counts the rest.
"""

from __future__ import annotations

from typing import Any, TypeVar

from drs_protocol.validation_errors import field_problems
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
    problems = field_problems(exc.errors(include_url=False))
    if not problems:
        return BadRequestError(str(exc))
    first = problems[0]
    if first.kind == "extra_forbidden":
        message = f"unknown field {first.path!r}: this engine (like TensorRT-LLM) rejects fields it does not know"
    else:
        message = first.describe()
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
    return BadRequestError(message, param=first.path or None)
