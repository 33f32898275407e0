"""``drs_client``: the trainer's library for a DisaggReplicaSet fleet (imports neither kopf nor the
operator's Kubernetes layer).

* :class:`AsyncFleet` (asyncio) and :class:`Fleet` (blocking, same methods): find a fleet
  (namespace/name; in-cluster credentials or a kubeconfig), :meth:`~AsyncFleet.wait_ready` with a
  progress callback, its URLs and engines, :meth:`~AsyncFleet.watch` its changes, and through the
  trainer's sidecar (``drs sidecar``) refit / sleep / wake / reset the prefix cache and read the
  weights every engine serves.
* :class:`Sidecar` (blocking; ``drs_client.sidecar.AsyncSidecar`` for asyncio): the sidecar alone,
  for a trainer that knows only its URL, with NeMo RL's collective and colocated refit steps too.
* :class:`FleetView`, :class:`EngineView`, :class:`Progress`: what it reads (pure data).
* :mod:`drs_client.errors`: one exception tree; every error names the fleet, the engine or the field.
* :mod:`drs_client.gym`: NeMo-Gym's model-server config for a fleet (``drs gym-config``).

Every body sent or read is a :mod:`drs_protocol` model (:mod:`drs_protocol.trainer_api`).
"""

from drs_client.aio import AsyncFleet
from drs_client.errors import (
    DrsClientError,
    EnginesFailed,
    FleetError,
    FleetInvalid,
    FleetNotFound,
    FleetUnreadable,
    NoSidecar,
    RefitIncomplete,
    SidecarError,
    SidecarRejected,
    SidecarUnreachable,
    WaitTimeout,
)
from drs_client.fleet import EngineView, FleetView, Progress
from drs_client.sync import Fleet, Sidecar

__all__ = [
    "AsyncFleet",
    "DrsClientError",
    "EngineView",
    "EnginesFailed",
    "Fleet",
    "FleetError",
    "FleetInvalid",
    "FleetNotFound",
    "FleetUnreadable",
    "FleetView",
    "NoSidecar",
    "Progress",
    "RefitIncomplete",
    "Sidecar",
    "SidecarError",
    "SidecarRejected",
    "SidecarUnreachable",
    "WaitTimeout",
]
