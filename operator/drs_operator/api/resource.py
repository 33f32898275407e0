"""The whole ``DisaggReplicaSet`` object as the apiserver stores it."""

from __future__ import annotations

from typing import Any, Literal

from drs_protocol.config import CamelModel
from pydantic import ConfigDict, Field

from drs_operator.api.spec import DisaggReplicaSetSpec
from drs_operator.api.status import DisaggReplicaSetStatus


class ObjectMeta(CamelModel):
    """The parts of ``metadata`` the operator reads; everything else is kept as is."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = None
    generation: int | None = None
    uid: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class DisaggReplicaSet(CamelModel):
    """A DisaggReplicaSet resource. The literals equal ``constants.API_VERSION`` and ``constants.KIND`` (a test checks)."""

    model_config = ConfigDict(frozen=True)

    api_version: Literal["disagg.dev/v1alpha1"] = "disagg.dev/v1alpha1"
    kind: Literal["DisaggReplicaSet"] = "DisaggReplicaSet"
    metadata: ObjectMeta
    spec: DisaggReplicaSetSpec
    status: DisaggReplicaSetStatus | None = None

    def to_manifest(self) -> dict[str, Any]:
        """The object as JSON-ready camelCase data, without unset optional fields."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
