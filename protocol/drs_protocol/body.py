"""Reading a JSON request body the same way on every FastAPI server (engine, sidecar).

The body is streamed against a cap: over it, the server answers 413
(:class:`~drs_protocol.errors.PayloadTooLargeError`) after draining up to :data:`DRAIN_FACTOR`
times the cap, so the client reads the 413 instead of a connection reset mid-upload. The frontend's
own HTTP server applies the same cap in its parser.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final, Protocol

from drs_protocol.errors import BadRequestError, PayloadTooLargeError

#: Past ``cap * DRAIN_FACTOR`` bytes the server stops draining and lets the connection close.
DRAIN_FACTOR: Final = 8


class StreamedRequest(Protocol):
    """What :func:`read_body` needs of a request (a Starlette ``Request`` is one)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def stream(self) -> AsyncIterator[bytes]: ...


async def read_body(request: StreamedRequest, cap: int) -> bytes:
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
