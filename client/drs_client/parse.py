"""A DisaggReplicaSet object, as the API returns it (a dict), read into a :class:`FleetView` with
the operator's own spec and status models (the one schema source). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drs_operator.api import DisaggReplicaSetStatus, ModelSpec
from drs_operator.api.constants import ConditionStatus, ConditionType
from drs_protocol.validation_errors import field_problems
from pydantic import ValidationError

from drs_client.errors import FleetUnreadable
from drs_client.fleet import EngineView, FleetView


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
    return "; ".join(p.describe() for p in field_problems(exc.errors(), where))
