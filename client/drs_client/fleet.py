"""What the trainer reads of a fleet: :class:`FleetView`, parsed from the DisaggReplicaSet with the
operator's own status models (the one schema source), and what "serving" means.

Pure: no I/O. :func:`view_of` takes the resource as the API returns it (a dict).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from drs_operator.api import DisaggReplicaSetStatus, ModelSpec
from drs_operator.api.constants import ConditionStatus, ConditionType, Phase
from pydantic import ValidationError

from drs_client.errors import FleetUnreadable


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine: ``weights_version`` as the operator shows it (None: the weights it started with)."""

    name: str
    role: str
    replica: int
    url: str | None
    ready: bool
    weights_version: str | None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class FleetView:
    """One DisaggReplicaSet as its status shows it. Equal views are the same as far as a trainer cares
    (the watch yields a new one only when something here changed)."""

    namespace: str
    name: str
    generation: int | None
    observed_generation: int | None
    phase: str | None
    replicas: int
    ready_replicas: int
    updated_replicas: int
    urls: tuple[str, ...]
    engines: tuple[EngineView, ...]
    weights_version: str | None
    message: str
    #: the model name clients send (``spec.model.servedName``, else its path)
    model: str | None = None
    #: ``spec.model.parsers.reasoning``: the engines split reasoning from the answer
    reasoning_parser: str | None = None

    @property
    def current(self) -> bool:
        """The status was written for the spec as it is now (not an older generation)."""
        return self.generation is None or self.observed_generation == self.generation

    @property
    def invalid(self) -> bool:
        return self.current and self.phase == Phase.INVALID.value

    def serves(self, min_ready_replicas: int | None = None) -> bool:
        """Serving: the status is current, there are URLs, and either the phase is Ready (every replica
        ready and updated; ``min_ready_replicas`` None) or at least that many replicas are ready."""
        if not self.current or not self.urls:
            return False
        if min_ready_replicas is None:
            return self.phase == Phase.READY.value
        return self.ready_replicas >= min_ready_replicas

    def engine_weights(self) -> dict[str, str | None]:
        """Engine name -> the weights version the status shows for it."""
        return {e.name: e.weights_version for e in self.engines}


@dataclass(frozen=True, slots=True)
class Progress:
    """What a wait reports to its callback on every change."""

    phase: str | None
    ready_replicas: int
    replicas: int
    urls: int
    message: str
    elapsed_s: float
    view: FleetView


def view_of(resource: Mapping[str, Any]) -> FleetView:
    """The :class:`FleetView` of a DisaggReplicaSet object (``FleetUnreadable`` if its status does not parse)."""
    meta = resource.get("metadata") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    try:
        status = DisaggReplicaSetStatus.model_validate(resource.get("status") or {})
    except ValidationError as exc:
        raise FleetUnreadable(namespace, name, f"status does not parse: {_problems('status', exc)}") from exc
    ready = next((c for c in status.conditions if c.type == ConditionType.READY), None)
    valid = next((c for c in status.conditions if c.type == ConditionType.VALID), None)
    message = (valid.message if valid is not None and valid.status == ConditionStatus.FALSE else None) or (
        ready.message if ready is not None else ""
    )
    try:
        model = ModelSpec.model_validate((resource.get("spec") or {}).get("model") or {"path": "?"})
    except ValidationError as exc:
        raise FleetUnreadable(namespace, name, f"spec does not parse: {_problems('spec.model', exc)}") from exc
    return FleetView(
        namespace=namespace,
        name=name,
        generation=meta.get("generation"),
        observed_generation=status.observed_generation,
        phase=None if status.phase is None else status.phase.value,
        replicas=status.replicas,
        ready_replicas=status.ready_replicas,
        updated_replicas=status.updated_replicas,
        urls=tuple(status.urls),
        engines=tuple(
            EngineView(
                name=e.name,
                role=e.role.value,
                replica=rs.index,
                url=e.url,
                ready=e.ready and e.url is not None,
                weights_version=e.weights_version,
                problem=e.problem,
            )
            for rs in status.replica_statuses
            for e in rs.engines
        ),
        weights_version=None if status.weights is None else status.weights.version,
        message=message,
        model=model.served_name or model.path,
        reasoning_parser=None if model.parsers is None else model.parsers.reasoning,
    )


def _problems(where: str, exc: ValidationError) -> str:
    """Every problem on one line, each with its field path (``status.readyReplicas: …``)."""
    return "; ".join(f"{'.'.join([where, *(str(p) for p in e['loc'])])}: {e['msg']}" for e in exc.errors())
