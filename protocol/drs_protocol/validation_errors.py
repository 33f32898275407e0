"""Pydantic's validation errors as field problems: the one formatter of their locations.

Every process that validates input with pydantic reports a problem as *where* (a dotted path,
list indices in brackets: ``spec.prefill.engines``, ``engineClients[0].ipBlock``) and *what*
(pydantic's message, with its error type and the offending input for callers that word it their
own way). The operator's ``Valid`` condition and ``drs plan``, and the FastAPI servers' 400s
(:mod:`drs_protocol.fastapi_errors`), build their messages from :func:`field_problems`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldProblem:
    """One pydantic error: its field path, message, error type and input."""

    path: str
    message: str
    kind: str  #: pydantic's error type (``missing``, ``extra_forbidden``, ``greater_than_equal`` …)
    value: Any = None

    def describe(self) -> str:
        """``path: message`` (the message alone at the top level): how a 400 words it."""
        return f"{self.path}: {self.message}" if self.path else self.message


def field_path(loc: Sequence[int | str], prefix: str = "", *, skip: Collection[str] = ()) -> str:
    """``loc`` as a dotted path under ``prefix`` (indices in brackets); parts in ``skip`` left out."""
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in skip:
            path = f"{path}.{part}" if path else str(part)
    return path


def field_problems(
    errors: Iterable[Mapping[str, Any]], prefix: str = "", *, skip: Collection[str] = ()
) -> list[FieldProblem]:
    """Every error of ``ValidationError.errors()`` (or FastAPI's ``RequestValidationError.errors()``)."""
    return [
        FieldProblem(
            field_path(err.get("loc", ()), prefix, skip=skip),
            str(err.get("msg", "invalid value")),
            str(err.get("type", "")),
            err.get("input"),
        )
        for err in errors
    ]
