"""Whether each ``spec.networkPolicy.engineClients`` peer selects anything (pure).

A NetworkPolicy peer whose selector matches no pod (a mistyped label, a trainer not started yet,
a namespace that does not exist) admits nobody, silently: the trainer's sidecar is then refused
by the policy and its refits fail far from the cause. The operator therefore asks the API, for
each peer with a selector, whether it selects a pod (``kube/policy_peers.py``: a ``limit=1``
list per namespace, at most every :data:`RECHECK_S` seconds per fleet) and reports what it
found in the ``PolicyPeersMatch`` condition: False with reason ``PolicyPeerSelectsNothing`` and
a message naming the field (``spec.networkPolicy.engineClients[i]``) and the selector, with a
Warning Event when it flips. The policies are applied as written all the same: the replicas' own
pods and every other peer stay admitted (the fleet keeps serving whoever is allowed).

The peer's meaning follows ``networking.k8s.io/v1 NetworkPolicyPeer``: a ``podSelector`` alone
selects pods of the fleet's namespace; a ``namespaceSelector`` alone every pod of the namespaces
it selects; both, the pods of those namespaces that match; an ``ipBlock`` selects addresses,
which are not checked. An empty selector (``{}``) selects everything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Final

from drs_operator.api.spec import PolicyPeer

#: The spec field the peers are in (named in every message).
PEERS_FIELD: Final = "spec.networkPolicy.engineClients"
#: How often a fleet's peers are asked about again (also the next look while one selects nothing).
RECHECK_S: Final = 15.0
#: Namespaces looked into per peer (a ``namespaceSelector`` that selects more is taken as selecting pods).
MAX_NAMESPACES: Final = 16
#: ``matchExpressions`` operators and whether they take values.
_OPERATORS: Final = {"In": True, "NotIn": True, "Exists": False, "DoesNotExist": False}


@dataclasses.dataclass(frozen=True)
class PeerQuery:
    """What to ask the API about one peer: label selectors in the list API's syntax ("" selects
    everything); ``namespaces`` None means the fleet's own namespace."""

    index: int
    pods: str | None
    namespaces: str | None

    @property
    def field(self) -> str:
        return f"{PEERS_FIELD}[{self.index}]"


@dataclasses.dataclass(frozen=True)
class PeerReport:
    """What one check found: how many peers were checked, and a message per peer that selects nothing."""

    checked: int
    empty: tuple[str, ...] = ()


def selector_string(selector: Mapping[str, Any], field: str) -> str:
    """``selector`` (a metav1.LabelSelector) in the list API's ``labelSelector`` syntax; a
    ValueError naming ``field`` and the rule when it is not a label selector."""
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise ValueError(
            f"{field}: unknown key(s) {sorted(unknown)}; a label selector has matchLabels, matchExpressions"
        )
    labels = selector.get("matchLabels") or {}
    if not isinstance(labels, Mapping):
        raise ValueError(f"{field}.matchLabels: must be a map of label to value")
    parts = [f"{k}={v}" for k, v in sorted(labels.items())]
    expressions = selector.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise ValueError(f"{field}.matchExpressions: must be a list")
    for i, expr in enumerate(expressions):
        where = f"{field}.matchExpressions[{i}]"
        if not isinstance(expr, Mapping) or not expr.get("key"):
            raise ValueError(f"{where}: needs a key")
        op, values = expr.get("operator"), expr.get("values") or []
        if op not in _OPERATORS:
            raise ValueError(f"{where}.operator: {op!r} is not one of {', '.join(_OPERATORS)}")
        if _OPERATORS[op] != bool(values):
            need = "needs values" if _OPERATORS[op] else "takes no values"
            raise ValueError(f"{where}: operator {op} {need}")
        key = expr["key"]
        if op in ("In", "NotIn"):
            parts.append(f"{key} {op.lower()} ({','.join(str(v) for v in values)})")
        else:
            parts.append(key if op == "Exists" else f"!{key}")
    return ",".join(parts)


def peer_queries(peers: Sequence[PolicyPeer]) -> tuple[list[PeerQuery], list[str]]:
    """The queries of the peers with a selector, and a message for each selector that is not one."""
    queries: list[PeerQuery] = []
    problems: list[str] = []
    for i, peer in enumerate(peers):
        if peer.pod_selector is None and peer.namespace_selector is None:
            continue  # an ipBlock
        field = f"{PEERS_FIELD}[{i}]"
        try:
            pods = None if peer.pod_selector is None else selector_string(peer.pod_selector, f"{field}.podSelector")
            spaces = (
                None
                if peer.namespace_selector is None
                else selector_string(peer.namespace_selector, f"{field}.namespaceSelector")
            )
        except ValueError as exc:
            problems.append(f"{exc}: it selects nothing")
            continue
        queries.append(PeerQuery(i, pods, spaces))
    return queries, problems


def _shown(selector: str | None) -> str:
    return "{} (everything)" if not selector else repr(selector)


def no_namespace_message(query: PeerQuery) -> str:
    return f"{query.field}: namespaceSelector {_shown(query.namespaces)} selects no namespace"


def no_pod_message(query: PeerQuery, namespaces: Sequence[str]) -> str:
    where = (
        f"namespace {namespaces[0]}"
        if query.namespaces is None
        else f"the namespaces its namespaceSelector {_shown(query.namespaces)} selects ({', '.join(namespaces)})"
    )
    return f"{query.field}: podSelector {_shown(query.pods)} selects no pod in {where}"


def condition_message(report: PeerReport) -> str:
    """The ``PolicyPeersMatch`` condition's message."""
    if not report.empty:
        return f"every peer of {PEERS_FIELD} with a selector selects a pod ({report.checked} checked)"
    return (
        "; ".join(report.empty)
        + ". The NetworkPolicies are applied as written: the replicas' own pods and the other peers stay admitted"
    )
