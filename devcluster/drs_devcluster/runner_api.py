"""The pod runner's raw API calls: reading JSON answers, the watch's lines, one-line failures.

The runner talks to the apiserver through ``kubernetes_asyncio`` with ``_preload_content=False``
(it reads raw JSON, not the client's models); these helpers turn those responses into dicts,
lines and errors.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any, Final

#: Seconds for one list of pods.
LIST_TIMEOUT_S: Final = 30.0
#: Seconds for one read, patch or create.
API_CALL_TIMEOUT_S: Final = 10.0


class Gone(Exception):
    """The watch's resourceVersion is too old (410): re-list."""


class ApiError(Exception):
    """The apiserver answered a raw request with an error status."""

    def __init__(self, status: int, body: str) -> None:
        self.status = status
        super().__init__(f"HTTP {status}: {body[:300]}")


async def watch_lines(resp: Any) -> AsyncIterator[bytes]:
    """The newline-delimited JSON of a watch, without a limit on line length."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


async def read_json(resp: Any) -> dict[str, Any]:
    try:
        body = await resp.read()
    finally:
        resp.release()
    if not 200 <= resp.status < 300:
        raise ApiError(resp.status, body.decode(errors="replace"))
    data: dict[str, Any] = json.loads(body)
    return data


def describe(exc: BaseException) -> str:
    """One line about an API or I/O failure (ApiException's str carries every response header)."""
    if isinstance(exc, ApiError):
        return str(exc)
    status = getattr(exc, "status", None)
    if status is None:
        return f"{type(exc).__name__}: {exc}"
    body = getattr(exc, "body", None)
    message = str(getattr(exc, "reason", ""))
    with contextlib.suppress(TypeError, ValueError, KeyError):
        message = json.loads(body or "")["message"]
    return f"HTTP {status}: {message}"
