"""What the relay answers: a whole body or chunks, and the headers naming the engines of the turn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

from drs_protocol import fields

#: Header value when no engine of a role served the turn (an early return has no decode leg).
NO_ENGINE: Final = "none"


@dataclass(slots=True)
class Reply:
    """What the HTTP layer sends: a whole body, or chunks (``stream``) it must drain or close."""

    status: int
    content_type: str
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    prefill: str | None = None
    decode: str | None = None
    routed: bool = False  #: engines were chosen for this turn: name them (or "none") in headers
    weights_version: str | None = None  #: the weights version the engine says produced the answer
    turn_started: str | None = None  #: the turn's stamp (``x-drs-turn-started``), as sent on its legs

    def engine_headers(self) -> list[tuple[bytes, bytes]]:
        if not self.routed:
            return []
        out = [
            (fields.HEADER_PREFILL_ENGINE.encode(), (self.prefill or NO_ENGINE).encode()),
            (fields.HEADER_DECODE_ENGINE.encode(), (self.decode or NO_ENGINE).encode()),
        ]
        if self.weights_version:
            out.append((fields.HEADER_WEIGHTS_VERSION.encode(), self.weights_version.encode()))
        if self.turn_started:
            out.append((fields.HEADER_TURN_STARTED.encode(), self.turn_started.encode()))
        return out
