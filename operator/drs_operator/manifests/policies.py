"""``build_replica_network_policy``: the NetworkPolicy of one replica's engines (pure).

Rendered only when ``spec.networkPolicy.enabled``, one per placed replica, as a child of the
DisaggReplicaSet (owner reference, spec hash, pruned with the replica like its pods). It selects
the replica's prefill and decode pods by the labels every engine pod carries (the fleet, the
replica index, the role) and admits, on every port:

* pods of the same fleet and replica: its frontends (requests) and its engines (the
  prefill-to-decode KV handoff, and the ranks of an engine wider than a node);
* the fleet's engines of every replica: an engine that starts under desired weights without a
  checkpoint path (after a broadcast or CUDA IPC refit) streams them from a serving peer engine
  of the fleet (``drs_engine.weights.peer``, the weights ConfigMap's ``peers``: every placed
  engine), and a replica whose engines were all replaced, or a replica added by scale-up, has no
  holder of its own; the stream is authenticated by the fleet's control token like every engine
  route, and another replica's frontends stay refused;
* ``spec.networkPolicy.engineClients``: whoever else talks to engines, such as the trainer's
  refit sidecar, and the operator, which asks every engine what weights it holds
  (``kube/engines.py``; not admitted by itself here: the policy does not know the operator's
  namespace and labels; an engine it cannot reach shows unknown weights).

A chart cannot write "same replica as me" (it does not know the fleets' names); the chart's own
``networkPolicy`` values keep the namespace-wide frontend policy. NetworkPolicies do not apply to
``hostNetwork`` pods (so the spec refuses both together: ``rules.MSG_POLICY_HOST_NETWORK``), and
enforcing them is the CNI's job (on the dev cluster's real nodes, kube-router's firewall's).
"""

from __future__ import annotations

from drs_operator.api import names
from drs_operator.api.constants import LABEL_REPLICA, LABEL_REPLICASET, LABEL_ROLE, ROLE_FRONTEND, ROLES
from drs_operator.api.objects import Manifest
from drs_operator.api.spec import DisaggReplicaSetSpec
from drs_operator.manifests.common import Owner, with_hash


def replica_selector(drs: str, replica: int, roles: tuple[str, ...]) -> Manifest:
    """A label selector of the pods of ``drs``'s replica ``replica`` with one of ``roles``."""
    return {
        "matchLabels": {LABEL_REPLICASET: drs, LABEL_REPLICA: str(replica)},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(roles)}],
    }


def fleet_engines_selector(drs: str) -> Manifest:
    """A label selector of the prefill and decode pods of every replica of ``drs`` (the peers a
    path-less catch-up streams the desired weights from)."""
    return {
        "matchLabels": {LABEL_REPLICASET: drs},
        "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": [str(r) for r in ROLES]}],
    }


def build_replica_network_policy(owner: Owner, spec: DisaggReplicaSetSpec, replica: int) -> Manifest:
    """The NetworkPolicy admitting only replica ``replica``'s own pods, the fleet's engines and
    ``engineClients`` to its engines."""
    engines = tuple(str(r) for r in ROLES)
    clients = [
        peer.model_dump(by_alias=True, exclude_none=True, mode="json") for peer in spec.network_policy.engine_clients
    ]
    return with_hash(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": owner.metadata(
                names.network_policy_name(owner.name, replica), names.labels(owner.name, replica=replica)
            ),
            "spec": {
                "podSelector": replica_selector(owner.name, replica, engines),
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [
                            {"podSelector": replica_selector(owner.name, replica, (ROLE_FRONTEND, *engines))},
                            {"podSelector": fleet_engines_selector(owner.name)},
                            *clients,
                        ]
                    }
                ],
            },
        }
    )
