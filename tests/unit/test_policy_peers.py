"""``PolicyPeersMatch``: an ``engineClients`` peer that selects nothing is a False condition and
one Warning Event naming the field and the selector; absent while the policies are off; the
selectors turned into the list API's syntax, and malformed ones named by field and rule."""

from __future__ import annotations

import dataclasses
import datetime

import pytest
from drs_operator.api.spec import PolicyPeer
from drs_operator.api.status import Condition, DisaggReplicaSetStatus
from drs_operator.conditions import compute_status
from drs_operator.policy_peers import (
    PeerQuery,
    PeerReport,
    no_namespace_message,
    no_pod_message,
    peer_queries,
    selector_string,
)
from operator_fixtures import OWNER, as_live, observed_fleet

T0 = datetime.datetime(2026, 12, 5, 20, 0, tzinfo=datetime.UTC)
_CHILDREN, _OBSERVED = observed_fleet()
BASE = dataclasses.replace(_OBSERVED, live=as_live(_CHILDREN, ready=True))


def _peer(**selectors: object) -> PolicyPeer:
    return PolicyPeer.model_validate(selectors)


def test_selector_string_matches_the_list_api_syntax() -> None:
    selector = {
        "matchLabels": {"app": "sidecar", "team": "rl"},
        "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["a", "b"]},
            {"key": "zone", "operator": "NotIn", "values": ["x"]},
            {"key": "gpu", "operator": "Exists"},
            {"key": "spot", "operator": "DoesNotExist"},
        ],
    }
    assert selector_string(selector, "f") == "app=sidecar,team=rl,tier in (a,b),zone notin (x),gpu,!spot"
    assert selector_string({}, "f") == ""


@pytest.mark.parametrize(
    ("selector", "says"),
    [
        ({"matchLabel": {"a": "b"}}, "f: unknown key(s) ['matchLabel']"),
        ({"matchExpressions": [{"key": "a", "operator": "Has"}]}, "f.matchExpressions[0].operator: 'Has' is not one"),
        ({"matchExpressions": [{"key": "a", "operator": "In"}]}, "f.matchExpressions[0]: operator In needs values"),
        (
            {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
            "f.matchExpressions[0]: operator Exists takes no values",
        ),
        ({"matchExpressions": [{"operator": "Exists"}]}, "f.matchExpressions[0]: needs a key"),
    ],
)
def test_a_malformed_selector_is_named_by_field_and_rule(selector: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError) as err:
        selector_string(selector, "f")
    assert str(err.value).startswith(says)


def test_queries_skip_ip_blocks_and_report_malformed_selectors_as_selecting_nothing() -> None:
    peers = [
        _peer(podSelector={"matchLabels": {"app": "sidecar"}}),
        _peer(ipBlock={"cidr": "10.0.0.0/8"}),
        _peer(namespaceSelector={"matchLabels": {"kubernetes.io/metadata.name": "trainer"}}, podSelector={}),
        _peer(namespaceSelector={"matchExpressions": [{"key": "a", "operator": "In"}]}),
    ]
    queries, problems = peer_queries(peers)
    assert queries == [
        PeerQuery(0, "app=sidecar", None),
        PeerQuery(2, "", "kubernetes.io/metadata.name=trainer"),
    ]
    assert problems == [
        "spec.networkPolicy.engineClients[3].namespaceSelector.matchExpressions[0]: operator In needs values: "
        "it selects nothing"
    ]


def test_messages_name_the_field_the_selector_and_where_it_looked() -> None:
    assert (
        no_pod_message(PeerQuery(0, "app=sidecar", None), ["rl"])
        == "spec.networkPolicy.engineClients[0]: podSelector 'app=sidecar' selects no pod in namespace rl"
    )
    assert no_namespace_message(PeerQuery(1, None, "kubernetes.io/metadata.name=gone")) == (
        "spec.networkPolicy.engineClients[1]: namespaceSelector 'kubernetes.io/metadata.name=gone' selects no namespace"
    )
    assert no_pod_message(PeerQuery(2, "", "team=rl"), ["a", "b"]) == (
        "spec.networkPolicy.engineClients[2]: podSelector {} (everything) selects no pod in the namespaces "
        "its namespaceSelector 'team=rl' selects (a, b)"
    )


def _status(
    report: PeerReport | None, previous: DisaggReplicaSetStatus | None = None
) -> tuple[DisaggReplicaSetStatus, list[tuple[str, str, str]]]:
    observed = dataclasses.replace(BASE, policy_peers=report)
    status, notes = compute_status(OWNER.name, previous or DisaggReplicaSetStatus(), observed, T0)
    return status, [(str(n.type), n.reason, n.message) for n in notes]


def _match(status: DisaggReplicaSetStatus) -> Condition | None:
    return next((c for c in status.conditions if c.type == "PolicyPeersMatch"), None)


def test_no_check_no_condition() -> None:
    status, notes = _status(None)
    assert _match(status) is None
    assert not [n for n in notes if n[1].startswith("PolicyPeer")]


def test_an_empty_peer_is_a_false_condition_and_one_warning_then_clears_with_a_normal_event() -> None:
    empty = no_pod_message(PeerQuery(0, "app=sidecar", None), ["rl"])
    first, quiet = _status(PeerReport(checked=1))
    assert (c := _match(first)) is not None and (c.status, c.reason) == ("True", "PolicyPeersMatchPods")
    assert not [n for n in quiet if n[1].startswith("PolicyPeer")], "a peer that selects from the start is no news"

    bad, notes = _status(PeerReport(checked=1, empty=(empty,)), first)
    cond = _match(bad)
    assert cond is not None and (cond.status, cond.reason) == ("False", "PolicyPeerSelectsNothing")
    assert cond.message.startswith(empty) and "stay admitted" in cond.message
    [warning] = [n for n in notes if n[1] == "PolicyPeerSelectsNothing"]
    assert warning[0] == "Warning" and "engineClients[0]" in warning[2] and "'app=sidecar'" in warning[2]
    ready = next(c for c in bad.conditions if c.type == "Ready")
    assert ready.status == "True", "the fleet keeps serving"
    assert bad.phase == first.phase

    again, repeat = _status(PeerReport(checked=1, empty=(empty,)), bad)
    assert not [n for n in repeat if n[1].startswith("PolicyPeer")], "no Event while it stays empty"
    assert _match(again) == cond

    cleared, notes = _status(PeerReport(checked=1), again)
    assert (c := _match(cleared)) is not None and c.status == "True"
    assert [(n[0], n[1]) for n in notes if n[1].startswith("PolicyPeer")] == [("Normal", "PolicyPeersMatchPods")]
