"""Validation errors that name the field (reading and capping a body: :mod:`drs_protocol.body`;
:func:`read_whole_body`, its shortcut for a body that came in one piece).

The field path and message come from :func:`drs_protocol.validation_errors.field_problems`, the
one formatter of pydantic's errors that the operator and the FastAPI servers' 400s use too; the
engine words an unknown field its own way (as TensorRT-LLM refuses one) and counts the rest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, TypeVar

from drs_protocol.body import read_body
from drs_protocol.validation_errors import field_problems
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.types import Message

from drs_engine.errors import BadRequestError

ModelT = TypeVar("ModelT", bound=BaseModel)


def validate(model: type[ModelT], data: dict[str, Any]) -> ModelT:
    """``model`` validated from ``data``; the 400 names the first offending field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc


def check_token_ids(ids: Sequence[int], vocab: int, field: str) -> None:
    """Every id of ``ids`` names a token of a ``vocab``-token vocabulary (a 400 naming ``field`` if not)."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequestError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab})", param=field)


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


async def read_whole_body(request: Request, cap: int) -> bytes:
    """:func:`drs_protocol.body.read_body`'s answer, read without its stream when the body came in
    one ASGI message within ``cap`` (and no ``content-length`` over it): a control call's body
    does, and the stream's async generator cost about a tenth of a call. Anything else (more
    messages, a body over the cap, a disconnect) goes to ``read_body`` with that first message
    put back in front, so its 413 and its draining are unchanged."""
    first = await request.receive()
    if first["type"] == "http.request" and not first.get("more_body", False):
        body: bytes = first.get("body", b"")
        declared = request.headers.get("content-length")
        if len(body) <= cap and not (declared is not None and declared.isdigit() and int(declared) > cap):
            return body
    return await read_body(_Resumed(request, first), cap)


class _Resumed:
    """``request``'s body stream with its first message already received (``first``)."""

    def __init__(self, request: Request, first: Message) -> None:
        self.request = request
        self.first = first

    @property
    def headers(self) -> Mapping[str, str]:
        return self.request.headers

    async def stream(self) -> AsyncIterator[bytes]:
        message = self.first
        while True:
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            if message["type"] == "http.request":
                chunk: bytes = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    return
            message = await self.request.receive()
