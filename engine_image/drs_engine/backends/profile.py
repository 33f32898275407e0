"""``/control/profile/start`` and ``/stop`` for backends that profile by the wall clock alone."""

from __future__ import annotations

import time
from typing import Any

from drs_engine.errors import BadRequestError


class WallClockProfile:
    """One profile at a time; ``stop`` says how long it ran. ``started`` is what ``start`` answers."""

    def __init__(self, started: dict[str, Any]) -> None:
        self._started_answer = {"profiling": True, **started}
        self._since: float | None = None

    def start(self) -> dict[str, Any]:
        if self._since is not None:
            raise BadRequestError("a profile is already running")
        self._since = time.monotonic()
        return dict(self._started_answer)

    def stop(self) -> dict[str, Any]:
        if self._since is None:
            raise BadRequestError("no profile is running")
        elapsed = time.monotonic() - self._since
        self._since = None
        return {"profiling": False, "duration_s": round(elapsed, 6)}
