"""Per-replica engine NetworkPolicies (``spec.networkPolicy``): rendered, selected, owned, synced, pruned."""

from __future__ import annotations

from typing import Any

import pytest
from drs_operator.api.spec import DisaggReplicaSetSpec
from drs_operator.manifests import desired_children
from drs_operator.manifests.common import SPEC_HASH_ANNOTATION
from drs_operator.manifests.policies import (
    NAMESPACE_NAME_LABEL,
    OperatorPods,
    build_replica_network_policy,
    parse_labels,
)
from drs_operator.plan import plan
from drs_operator.rollout import compute_actions
from drs_operator.validation import validate_spec_data
from hypothesis import given, settings
from hypothesis import strategies as st
from operator_fixtures import OWNER, as_live, build, hgx, spec

SIDECAR = {"podSelector": {"matchLabels": {"app": "trainer-sidecar"}}, "namespaceSelector": {}}


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels and In expressions, all this module renders) against ``labels``."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _pod_labels(children: Any) -> dict[str, dict[str, str]]:
    """Labels of every engine pod and every frontend pod (the Deployments' templates) by name."""
    out = {name: pod["metadata"]["labels"] for name, pod in children.all_of("Pod").items()}
    for name, dep in children.all_of("Deployment").items():
        out[name] = dep["spec"]["template"]["metadata"]["labels"]
    return out


def test_policies_are_off_by_default() -> None:
    _, _, children = build(spec())
    assert children.all_of("NetworkPolicy") == {}
    assert all(rc.network_policy is None for rc in children.replicas)


@settings(max_examples=15, deadline=None)
@given(replicas=st.integers(min_value=1, max_value=4))
def test_each_replicas_policy_selects_its_engines_and_admits_only_its_own_pods(replicas: int) -> None:
    one = {"engines": 1, "tensorParallelSize": 1}  # widths 1+1 tile the 8-GPU nodes: every replica placed
    s = spec(replicas=replicas, prefill=one, decode=one)
    s = s.model_copy(update={"network_policy": spec(networkPolicy={"enabled": True}).network_policy})
    _, placement, children = build(s, hgx(4))
    placed = [r.index for r in placement.replicas if r.placed]
    assert placed == list(range(replicas))
    policies = children.all_of("NetworkPolicy")
    assert sorted(policies) == sorted(f"fleet-r{r}-engines" for r in placed)
    pods = _pod_labels(children)
    for r in placed:
        policy = policies[f"fleet-r{r}-engines"]
        assert policy["metadata"]["ownerReferences"] == [OWNER.reference()]
        assert policy["metadata"]["namespace"] == "ns"
        assert policy["metadata"]["labels"]["disagg.dev/replica"] == str(r)
        assert SPEC_HASH_ANNOTATION in policy["metadata"]["annotations"]
        body = policy["spec"]
        assert body["policyTypes"] == ["Ingress"]
        selected = {n for n, labels in pods.items() if _matches(body["podSelector"], labels)}
        mine = {n for n, labels in pods.items() if labels["disagg.dev/replica"] == str(r)}
        assert selected == {n for n in mine if pods[n]["disagg.dev/role"] in ("prefill", "decode")}
        [rule] = body["ingress"]
        [own, peers] = rule["from"]  # no engineClients: the replica's own pods, the fleet's engines
        assert {n for n, labels in pods.items() if _matches(own["podSelector"], labels)} == mine
        assert "namespaceSelector" not in own  # the policy's own namespace only
        # a path-less catch-up streams the weights from any replica's engine; no other frontend
        engines = {n for n, labels in pods.items() if labels["disagg.dev/role"] in ("prefill", "decode")}
        assert {n for n, labels in pods.items() if _matches(peers["podSelector"], labels)} == engines
        assert "namespaceSelector" not in peers
        admitted = {n for n, labels in pods.items() if any(_matches(p["podSelector"], labels) for p in rule["from"])}
        assert {n for n in pods if pods[n]["disagg.dev/role"] == "frontend"} & admitted == {
            n for n in mine if pods[n]["disagg.dev/role"] == "frontend"
        }


def test_a_path_less_catch_up_reaches_a_peer_of_another_replica() -> None:
    """Every placed engine is a peer in the weights ConfigMap; each replica's policy admits them all."""
    one = {"engines": 1, "tensorParallelSize": 1}
    s = spec(replicas=2, prefill=one, decode=one)
    s = s.model_copy(update={"network_policy": spec(networkPolicy={"enabled": True}).network_policy})
    _, _, children = build(s, hgx(4))
    pods = _pod_labels(children)
    policy = children.all_of("NetworkPolicy")["fleet-r1-engines"]["spec"]
    replacement = {**pods["fleet-r0-decode-0"]}  # replica 0's decode, started again after a kill
    assert _matches(policy["podSelector"], pods["fleet-r1-prefill-0"])
    assert any(_matches(p["podSelector"], replacement) for p in policy["ingress"][0]["from"])
    frontend0 = next(labels for n, labels in pods.items() if n.startswith("fleet-r0-f"))
    assert not any(_matches(p["podSelector"], frontend0) for p in policy["ingress"][0]["from"])


def test_engine_clients_are_appended_as_peers() -> None:
    ip = {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}
    s = spec(networkPolicy={"enabled": True, "engineClients": [SIDECAR, ip]})
    policy = build_replica_network_policy(OWNER, s, 1)
    assert policy["spec"]["ingress"][0]["from"][2:] == [SIDECAR, ip]


@pytest.mark.parametrize(
    ("peer", "words"),
    [
        ({}, "needs podSelector, namespaceSelector or ipBlock"),
        ({"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}, "cannot be combined"),
        ({"pods": {}}, "unknown field"),
    ],
    ids=["empty", "ipblock-and-selector", "unknown-key"],
)
def test_a_bad_engine_client_is_refused_naming_the_field(peer: dict[str, Any], words: str) -> None:
    body = {"model": {"path": "/m"}, "replicas": 1, "networkPolicy": {"enabled": True, "engineClients": [peer]}}
    parsed, problems = validate_spec_data(body)
    assert parsed is None
    assert any(p.path.startswith("spec.networkPolicy.engineClients[0]") and words in p.message for p in problems), (
        problems
    )


def test_the_policy_is_created_with_the_fleet_and_pruned_when_turned_off_or_scaled_down() -> None:
    on = spec(replicas=2, networkPolicy={"enabled": True})
    _, placement, children = build(on)
    first = compute_actions(children, {}, set(), [0, 1])
    assert sorted(a.name for a in first.actions if a.kind == "NetworkPolicy" and a.verb == "create") == [
        "fleet-r0-engines",
        "fleet-r1-engines",
    ]
    live = as_live(children)
    assert compute_actions(children, live, set(), [0, 1]).actions == ()
    _, _, off = build(spec(replicas=2), previous=placement)
    deletes = [a for a in compute_actions(off, live, set(), [0, 1]).actions if a.kind == "NetworkPolicy"]
    assert sorted((a.verb, a.name) for a in deletes) == [("delete", "fleet-r0-engines"), ("delete", "fleet-r1-engines")]
    _, _, one = build(spec(replicas=1, networkPolicy={"enabled": True}), previous=placement)
    down = [a for a in compute_actions(one, live, set(), [0]).actions if a.kind == "NetworkPolicy"]
    assert [(a.verb, a.name) for a in down] == [("delete", "fleet-r1-engines")]


def test_a_new_engine_client_replaces_the_policies_in_place() -> None:
    _, placement, children = build(spec(networkPolicy={"enabled": True}))
    live = as_live(children)
    _, _, wider = build(spec(networkPolicy={"enabled": True, "engineClients": [SIDECAR]}), previous=placement)
    actions = [a for a in compute_actions(wider, live, set(), [0, 1]).actions if a.kind == "NetworkPolicy"]
    assert sorted((a.verb, a.name) for a in actions) == [
        ("replace", "fleet-r0-engines"),
        ("replace", "fleet-r1-engines"),
    ]


def test_the_spec_models_default_is_off() -> None:
    assert DisaggReplicaSetSpec.model_validate({"model": {"path": "/m"}}).network_policy.enabled is False


OPERATOR = OperatorPods("drs-system", {"app.kubernetes.io/name": "drs-operator", "app.kubernetes.io/instance": "drs"})


def _admits(peer: dict[str, Any], namespace: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether a NetworkPolicy peer with selectors admits a pod (its namespace's labels, its own),
    seen from a policy in another namespace than the pod's."""
    in_namespace = "namespaceSelector" in peer and _matches(peer["namespaceSelector"], namespace)
    return in_namespace and _matches(peer.get("podSelector", {}), labels)


def test_the_operators_own_pods_are_admitted_to_every_replicas_engines_and_nothing_else_is() -> None:
    s = spec(replicas=2, networkPolicy={"enabled": True, "engineClients": [SIDECAR]})
    p, placement, _ = build(s)
    children = desired_children(OWNER, s, p, placement, {}, None, OPERATOR)
    system = {NAMESPACE_NAME_LABEL: "drs-system"}
    operator_pod = {**OPERATOR.labels, "pod-template-hash": "5d8c7"}  # the Deployment adds its own
    for name, policy in children.all_of("NetworkPolicy").items():
        peers = policy["spec"]["ingress"][0]["from"]
        assert any(_admits(peer, system, operator_pod) for peer in peers), name
        # the same labels in another namespace, another release's operator, an unlabelled pod
        assert not any(_admits(peer, {NAMESPACE_NAME_LABEL: "team-a"}, operator_pod) for peer in peers), name
        other = {**operator_pod, "app.kubernetes.io/instance": "drs-canary"}
        assert not any(_admits(peer, system, other) for peer in peers), name
        assert not any(_admits(peer, system, {"app": "web"}) for peer in peers), name
        assert peers[-1] == SIDECAR  # engineClients still follow


def test_admitting_the_operator_replaces_the_policies_and_rolls_no_pod() -> None:
    """An operator upgraded into a pod (or out of one) changes the policies only."""
    s = spec(replicas=2, networkPolicy={"enabled": True})
    p, placement, before = build(s)
    after = desired_children(OWNER, s, p, placement, {}, None, OPERATOR)
    actions = compute_actions(after, as_live(before), set(), [0, 1]).actions
    assert sorted((a.verb, a.kind, a.name) for a in actions) == [
        ("replace", "NetworkPolicy", "fleet-r0-engines"),
        ("replace", "NetworkPolicy", "fleet-r1-engines"),
    ]
    assert plan(s, OWNER.name) == p


def test_no_policy_is_rendered_for_the_operator_when_policies_are_off() -> None:
    s = spec(replicas=2)
    p, placement, _ = build(s)
    assert desired_children(OWNER, s, p, placement, {}, None, OPERATOR).all_of("NetworkPolicy") == {}


def test_pod_labels_parse_as_the_chart_writes_them() -> None:
    assert parse_labels("app.kubernetes.io/name=drs-operator,app.kubernetes.io/instance=drs") == OPERATOR.labels
    assert parse_labels(" a=b , c=d ") == {"a": "b", "c": "d"}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("app", "'app': a label is key=value"),
        ("a=b,", "'': a label is key=value"),
        ("=x", "a label key is"),
        ("-a=x", "a label key is"),
        ("Bad_Prefix/a=x", "a label key is"),
        ("a=", "value is 1-63 characters"),
        ("a=b c", "value is 1-63 characters"),
        (f"a={'v' * 64}", "value is 1-63 characters"),
        ("a=b,a=c", "'a': named twice"),
    ],
)
def test_bad_pod_labels_are_refused_naming_the_pair_and_the_rule(text: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_labels(text)
