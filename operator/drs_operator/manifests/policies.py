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
* the operator's own pods (:class:`OperatorPods`: their namespace and the labels that select
  them, which the chart passes in ``DRS_OPERATOR_POD_LABELS`` and ``POD_NAMESPACE``): the operator
  asks every engine what weights it holds (``kube/engines.py``), and an engine it cannot reach
  shows unknown weights. An operator run outside a pod (the tests' in-process one) knows no pods
  of its own and admits none;
* ``spec.networkPolicy.engineClients``: whoever else talks to engines, such as the trainer's
  refit sidecar.

A chart cannot write "same replica as me" (it does not know the fleets' names); the chart's own
``networkPolicy`` values keep the namespace-wide frontend policy. NetworkPolicies do not apply to
``hostNetwork`` pods (so the spec refuses both together: ``rules.MSG_POLICY_HOST_NETWORK``), and
enforcing them is the CNI's job (on the dev cluster's real nodes, kube-router's firewall's).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Final

from drs_operator.api import names
from drs_operator.api.constants import LABEL_REPLICA, LABEL_REPLICASET, LABEL_ROLE, ROLE_FRONTEND, ROLES
from drs_operator.api.objects import Manifest
from drs_operator.api.spec import DisaggReplicaSetSpec
from drs_operator.manifests.common import Owner, with_hash

#: The label the API server sets on every namespace: its name (Kubernetes ≥ 1.21).
NAMESPACE_NAME_LABEL: Final = "kubernetes.io/metadata.name"
#: A label's name, and a non-empty value (Kubernetes' rule: 63 characters at most, alphanumerics at
#: both ends, ``-``, ``_`` and ``.`` between).
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
#: A label key's optional prefix: a DNS subdomain (253 characters at most).
_LABEL_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclasses.dataclass(frozen=True)
class OperatorPods:
    """The operator's own pods: their namespace and the labels that select them."""

    namespace: str
    labels: Mapping[str, str]

    def peer(self) -> Manifest:
        """A NetworkPolicy peer admitting exactly these pods (from any namespace's policy)."""
        return {
            "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: self.namespace}},
            "podSelector": {"matchLabels": dict(self.labels)},
        }


def parse_labels(text: str) -> dict[str, str]:
    """``key=value,key=value`` as a mapping; a ValueError names the pair and the rule it breaks."""
    labels: dict[str, str] = {}
    for pair in (p.strip() for p in text.split(",")):
        key, sep, value = pair.partition("=")
        prefix, slash, name = key.rpartition("/")
        if not sep:
            raise ValueError(f"{pair!r}: a label is key=value")
        if not _LABEL_NAME.fullmatch(name) or (slash and (len(prefix) > 253 or not _LABEL_PREFIX.fullmatch(prefix))):
            raise ValueError(
                f"{key!r}: a label key is an optional DNS-subdomain prefix and '/', then a name of at most "
                "63 characters, alphanumeric at both ends, '-', '_' or '.' between"
            )
        if not _LABEL_NAME.fullmatch(value):
            raise ValueError(
                f"{pair!r}: a selector label's value is 1-63 characters, alphanumeric at both ends, '-', '_' or '.' between"
            )
        if key in labels:
            raise ValueError(f"{key!r}: named twice")
        labels[key] = value
    return labels


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


def build_replica_network_policy(
    owner: Owner, spec: DisaggReplicaSetSpec, replica: int, operator: OperatorPods | None = None
) -> Manifest:
    """The NetworkPolicy admitting only replica ``replica``'s own pods, the fleet's engines, the
    ``operator``'s pods (when it runs in a pod) and ``engineClients`` to its engines."""
    engines = tuple(str(r) for r in ROLES)
    clients = [
        peer.model_dump(by_alias=True, exclude_none=True, mode="json") for peer in spec.network_policy.engine_clients
    ]
    if operator is not None:
        clients.insert(0, operator.peer())
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
