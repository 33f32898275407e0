"""The DisaggReplicaSet API (``disagg.dev/v1alpha1``): models, constants, CEL rules and child names.

Import the models from here; ``names`` and ``constants`` are imported as modules
(``from drs_operator.api import names``).
"""

from drs_operator.api.resource import DisaggReplicaSet, ObjectMeta
from drs_operator.api.spec import (
    DisaggReplicaSetSpec,
    EngineSpec,
    FrontendSpec,
    ImagesSpec,
    ModelSpec,
    NetworkSpec,
    ParsersSpec,
    RoleSpec,
    RouterSpec,
    Toleration,
    TopologySpec,
    TrtllmSpec,
)
from drs_operator.api.status import (
    Condition,
    DisaggReplicaSetStatus,
    EngineStatus,
    FrontendStatus,
    ReplicaStatus,
    WeightsStatus,
)

__all__ = [
    "Condition",
    "DisaggReplicaSet",
    "DisaggReplicaSetSpec",
    "DisaggReplicaSetStatus",
    "EngineSpec",
    "EngineStatus",
    "FrontendSpec",
    "FrontendStatus",
    "ImagesSpec",
    "ModelSpec",
    "NetworkSpec",
    "ObjectMeta",
    "ParsersSpec",
    "ReplicaStatus",
    "RoleSpec",
    "RouterSpec",
    "Toleration",
    "TopologySpec",
    "TrtllmSpec",
    "WeightsStatus",
]
