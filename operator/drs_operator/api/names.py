"""Every child name and address of a DisaggReplicaSet, in one place.

Names are functions of the DisaggReplicaSet's name and the plan's indices only, so they are
stable across reconciles and operator restarts:

=========================  ==========================================  ======================
child                      name                                        example (``drs``)
=========================  ==========================================  ======================
engine (rank-0 pod)        ``<drs>-r<replica>-<role>-<ordinal>``       ``drs-r0-prefill-0``
engine pod of rank k > 0   ``<engine>-w<k>``                           ``drs-r0-prefill-0-w1``
engines headless Service   ``<drs>-engines``                           ``drs-engines``
frontend Deployment+Svc    ``<drs>-r<replica>-f<index>``               ``drs-r1-f0``
frontend standby Deploym.  ``<drs>-r<replica>-f<index>-standby``       ``drs-r1-f0-standby``
role engine ConfigMap      ``<drs>-<role>-config``                     ``drs-decode-config``
replica frontend ConfigMap ``<drs>-r<replica>-frontend-config``        ``drs-r0-frontend-config``
control-token Secret       ``<drs>-control``                           ``drs-control``
serving-token Secret       ``<drs>-serving``                           ``drs-serving``
replica engines NetPolicy  ``<drs>-r<replica>-engines``                ``drs-r0-engines``
=========================  ==========================================  ======================

Invariant: with a DisaggReplicaSet name of at most ``MAX_NAME_LENGTH`` (40) characters and the
API's bounds (replica < 256, ordinal < 64, rank < 256, frontend < 256) every name here is a valid
DNS label of at most 63 characters (a test checks the worst case), so engine pods can use their
name as hostname under the headless Service.
"""

from __future__ import annotations

from typing import Final

from drs_operator.api.constants import (
    APP_NAME,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_PART_OF,
    LABEL_REPLICA,
    LABEL_REPLICASET,
    LABEL_ROLE,
    MANAGER_NAME,
)

#: The longest a DNS label (Service name, pod hostname) may be.
DNS_LABEL_MAX: Final = 63


def engine_name(drs: str, replica: int, role: str, ordinal: int) -> str:
    """The engine's stable name, also the name (and hostname) of its rank-0 pod."""
    return f"{drs}-r{replica}-{role}-{ordinal}"


def engine_pod_name(drs: str, replica: int, role: str, ordinal: int, rank: int = 0) -> str:
    """Pod ``rank`` of an engine; rank 0 (which serves HTTP) carries the engine's own name."""
    base = engine_name(drs, replica, role, ordinal)
    return base if rank == 0 else f"{base}-w{rank}"


def engines_service_name(drs: str) -> str:
    """The headless Service giving every engine pod a DNS name."""
    return f"{drs}-engines"


def engine_host(drs: str, namespace: str, pod: str) -> str:
    """DNS name of an engine pod under the headless Service (pod networking)."""
    return f"{pod}.{engines_service_name(drs)}.{namespace}.svc"


def frontend_name(drs: str, replica: int, index: int) -> str:
    """Name of the Deployment and of the Service of frontend ``index`` of ``replica``."""
    return f"{drs}-r{replica}-f{index}"


#: Suffix of the second Deployment of a frontend URL (``spec.frontend.standby``).
STANDBY_SUFFIX: Final = "-standby"


def frontend_deployment_name(drs: str, replica: int, index: int, process: int = 0) -> str:
    """The Deployment running process ``process`` of a frontend URL: 0 is named after the frontend
    (and its Service), 1 is its standby."""
    base = frontend_name(drs, replica, index)
    return base if process == 0 else f"{base}{STANDBY_SUFFIX}"


def frontend_host(drs: str, namespace: str, replica: int, index: int) -> str:
    """DNS name of a frontend's Service (pod networking)."""
    return f"{frontend_name(drs, replica, index)}.{namespace}.svc"


def engine_config_name(drs: str, role: str) -> str:
    """ConfigMap holding the TensorRT-LLM arguments of every engine of ``role``."""
    return f"{drs}-{role}-config"


def frontend_config_name(drs: str, replica: int) -> str:
    """ConfigMap holding a replica's frontend config (engine pools, routers)."""
    return f"{drs}-r{replica}-frontend-config"


def network_policy_name(drs: str, replica: int) -> str:
    """The NetworkPolicy of one replica's engines (``spec.networkPolicy.enabled``)."""
    return f"{drs}-r{replica}-engines"


def weights_config_name(drs: str) -> str:
    """ConfigMap holding the fleet's desired weights (read by every engine pod at its start)."""
    return f"{drs}-weights"


def control_secret_name(drs: str) -> str:
    """Secret holding the bearer token of the engines' control API."""
    return f"{drs}-control"


def serving_secret_name(drs: str) -> str:
    """Secret holding the fleet's serving token (turn legs, KV fetch, gang polling; ``drs_protocol.auth``)."""
    return f"{drs}-serving"


def url(host: str, port: int) -> str:
    """``http://host:port`` (IPv6 literals in brackets)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def selector(drs: str) -> str:
    """``status.selector``: the label selector of every child of ``drs``."""
    return f"{LABEL_REPLICASET}={drs}"


def labels(drs: str, role: str | None = None, replica: int | None = None) -> dict[str, str]:
    """Labels every child of ``drs`` carries; ``role`` is prefill, decode or frontend."""
    out = {
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: drs,
        LABEL_PART_OF: APP_NAME,
        LABEL_MANAGED_BY: MANAGER_NAME,
        LABEL_REPLICASET: drs,
    }
    if role is not None:
        out[LABEL_COMPONENT] = role
        out[LABEL_ROLE] = role
    if replica is not None:
        out[LABEL_REPLICA] = str(replica)
    return out
