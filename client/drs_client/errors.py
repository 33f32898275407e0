"""The trainer library's errors: one tree, each naming what failed (the fleet, the engine, the field).

::

    DrsClientError
    ├── FleetError                 the DisaggReplicaSet cannot be read
    │   ├── FleetNotFound          no such resource (or it was deleted while watched)
    │   └── FleetUnreadable        the API answered an error, or the status does not parse
    ├── FleetInvalid               the operator marked the spec Invalid (its message says why)
    ├── WaitTimeout                the fleet did not serve in time (the last view it showed)
    └── SidecarError               the trainer's sidecar (``drs sidecar``)
        ├── NoSidecar              no sidecar URL given (``sidecar_url=`` or ``$DRS_SIDECAR_URL``)
        ├── SidecarUnreachable     no HTTP answer (connection refused, timeout)
        ├── SidecarRejected        an error body: 400 bad field, 409 busy, 503 fleet not ready …
        └── EnginesFailed          a fan-out that did not reach every engine: names each one
            └── RefitIncomplete    the same, for a refit (the weights are kept as desired)

These are client-side errors: the servers' errors (``drs_protocol.errors``) arrive here as the
status and error body of a :class:`SidecarRejected`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from drs_protocol.trainer_api import EngineOutcome, FanOutReport, PendingEngine

    from drs_client.fleet import FleetView


class DrsClientError(Exception):
    """Base of every error of :mod:`drs_client`."""


class FleetError(DrsClientError):
    def __init__(self, namespace: str, name: str, why: str) -> None:
        super().__init__(f"DisaggReplicaSet {namespace}/{name}: {why}")
        self.namespace = namespace
        self.name = name
        self.why = why


class FleetNotFound(FleetError):
    pass


class FleetUnreadable(FleetError):
    pass


class FleetInvalid(DrsClientError):
    def __init__(self, view: FleetView, message: str) -> None:
        super().__init__(f"DisaggReplicaSet {view.namespace}/{view.name} is Invalid: {message}")
        self.view = view


class WaitTimeout(DrsClientError, TimeoutError):
    def __init__(self, view: FleetView, waited_s: float, wanted: str) -> None:
        super().__init__(
            f"DisaggReplicaSet {view.namespace}/{view.name} did not serve in {waited_s:.0f}s (wanted {wanted}): "
            f"phase {view.phase}, ready {view.ready_replicas}/{view.replicas}, {len(view.urls)} URL(s)"
        )
        self.view = view


class SidecarError(DrsClientError):
    pass


class NoSidecar(SidecarError):
    pass


class SidecarUnreachable(SidecarError):
    def __init__(self, url: str, why: str) -> None:
        super().__init__(f"sidecar {url}: no answer ({why})")
        self.url = url


class SidecarRejected(SidecarError):
    """The sidecar answered its error body (``status``, ``type``, ``message``; ``body``: all of it)."""

    def __init__(self, route: str, status: int, body: dict[str, Any]) -> None:
        error = body.get("error")
        fields: dict[str, Any] = error if isinstance(error, dict) else {}
        self.route = route
        self.status = status
        self.type = str(fields.get("type", ""))
        self.message = str(fields.get("message", body))
        self.body = body
        super().__init__(f"{route}: {status} {self.type}: {self.message}")


class EnginesFailed(SidecarError):
    """A fan-out that did not reach every engine; :attr:`failed` and :attr:`pending` name them."""

    def __init__(self, route: str, report: FanOutReport) -> None:
        self.route = route
        self.report = report
        self.failed: list[EngineOutcome] = list(report.failed)
        self.pending: list[PendingEngine] = list(report.pending)
        parts = [f"{o.engine} ({o.detail})" for o in self.failed]
        parts += [f"{p.engine} (not ready)" for p in self.pending]
        message = f"{route}: {report.ok}/{report.engines} engines ok; not done on: {', '.join(parts)}"
        if report.group_abort is not None:  # a collective step: the group is gone, init forms a new one
            message += f"; the group was aborted, culprit: {', '.join(report.group_abort.culprits)}"
        super().__init__(message)

    @property
    def engines(self) -> list[str]:
        """The names of the engines it did not reach."""
        return [o.engine for o in self.failed] + [p.engine for p in self.pending]


class RefitIncomplete(EnginesFailed):
    """A refit that did not load on every engine; the sidecar keeps the weights as desired and loads
    them on each engine as it comes up."""
