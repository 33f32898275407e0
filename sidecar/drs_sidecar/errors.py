"""The sidecar's errors: the shared tree of :mod:`drs_protocol.errors`, with the sidecar's leaves.

A trainer-API route answers every error before any engine is called with the one error body
``{"error": {"message", "type", "param", "code", …}}`` (``exc.to_body()``, ``exc.status``):

::

    ApiError
    ├── BadRequestError           (400 invalid_request_error)  a body that is not JSON, or bad fields
    │   └── Refused               (400) a refit or group no engine would accept (names the field)
    ├── PayloadTooLargeError      (413 request_too_large)      a body over MAX_BODY_BYTES
    ├── ConflictError             (409 conflict_error)
    │   ├── RefitBusy             (409) a refit (or collective step) is already running
    │   ├── NoGroup               (409) a collective step before collective/init formed a group
    │   └── GroupChanged          (409) the fleet is no longer the group's members (names them)
    └── UnavailableError          (503 service_unavailable)
        ├── FleetError            (503) the resource cannot be read (missing, unparsable, API down)
        └── NotAllReady           (503) a collective step needs every engine; names those not ready

What an engine answers is not an error of the sidecar's: it goes into the fan-out's report (502
when the refit is not complete).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from drs_protocol.errors import ApiError, BadRequestError, ConflictError, PayloadTooLargeError, UnavailableError
from drs_protocol.routes import TrainerRoute

__all__ = [
    "ApiError",
    "BadRequestError",
    "FleetError",
    "GroupChanged",
    "NoGroup",
    "NotAllReady",
    "PayloadTooLargeError",
    "RefitBusy",
    "Refused",
]


class Refused(BadRequestError, ValueError):
    """A refit path or version, or a collective group, no engine would accept; the message names
    the field."""


class RefitBusy(ConflictError):
    """A refit is already running."""

    def __init__(self, message: str = "a refit is already running") -> None:
        super().__init__(message)


class NoGroup(ConflictError):
    """A collective step before ``collective_init`` formed the group."""


class GroupChanged(ConflictError):
    """The engines of the status are no longer the collective group's members (one went away, is
    not ready, moved, or one was added): the group is dropped; ``collective/init`` forms a new one."""

    def __init__(self, changes: Sequence[str]) -> None:
        super().__init__(
            "the collective group's members changed: "
            + "; ".join(changes)
            + f" (POST {TrainerRoute.COLLECTIVE_INIT} again)"
        )
        self.changes = list(changes)

    def extra(self) -> dict[str, Any]:
        return {"changes": self.changes}


class FleetError(UnavailableError):
    """The fleet cannot be read (the resource is missing, its status unparsable, the API down)."""


class NotAllReady(UnavailableError):
    """A collective step needs every engine; these are not ready."""

    def __init__(self, engines: Sequence[str]) -> None:
        super().__init__(f"a collective refit needs every engine ready; not ready: {', '.join(engines)}")
        self.engines = list(engines)

    def extra(self) -> dict[str, Any]:
        return {"engines": self.engines}
