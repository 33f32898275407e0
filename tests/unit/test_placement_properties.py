"""place() properties over random valid specs and node pools (hypothesis)."""

from __future__ import annotations

from typing import Any

from drs_operator.api import DisaggReplicaSetSpec
from drs_operator.layout import frontend_urls
from drs_operator.placement import NodeInfo, Placement, place
from drs_operator.plan import Plan, plan
from hypothesis import given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=200, deadline=None)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    data: dict[str, Any] = {
        "replicas": draw(st.integers(0, 6)),
        "model": {"path": "/m"},
        "prefill": {"engines": draw(st.integers(1, 3)), "tensorParallelSize": draw(st.sampled_from([1, 2, 4, 8, 16]))},
        "decode": {"engines": draw(st.integers(1, 3)), "tensorParallelSize": draw(st.sampled_from([1, 2, 4, 8]))},
        "frontend": {"workers": draw(st.integers(1, 3))},
        "network": {"hostNetwork": draw(st.booleans())},
    }
    return plan(DisaggReplicaSetSpec.model_validate(data), "drs")


@st.composite
def pools(draw: st.DrawFn) -> list[NodeInfo]:
    count = draw(st.integers(0, 10))
    nodes = []
    for i in range(count):
        size = draw(st.sampled_from([4, 8]))
        segment = draw(st.sampled_from([None, "a", "b"]))
        ok = draw(st.booleans()) or draw(st.booleans())  # mostly schedulable
        nodes.append(
            NodeInfo(
                name=f"n{i:02d}",
                allocatable=size,
                free=draw(st.integers(0, size)),
                segment=segment or f"n{i:02d}",
                schedulable=ok,
                unschedulable_reason=None if ok else "cordoned",
                address=f"127.0.1.{i + 1}",
            )
        )
    return nodes


def demand(p: Placement, nodes: list[NodeInfo]) -> dict[str, int]:
    size = {n.name: n.allocatable for n in nodes}
    used: dict[str, int] = {}
    for r in p.replicas:
        for e in r.engines:
            for n in e.nodes:
                used[n] = used.get(n, 0) + (e.width if len(e.nodes) == 1 else size[n])
    return used


@SETTINGS
@given(plans(), pools())
def test_no_engine_straddles_a_node_and_no_node_is_over_committed(layout: Plan, nodes: list[NodeInfo]) -> None:
    p = place(layout, nodes)
    by_name = {n.name: n for n in nodes}
    for r in p.replicas:
        assert r.placed == all(e.nodes for e in r.engines) == any(e.nodes for e in r.engines), "gang: all or nothing"
        for e in r.engines:
            if len(e.nodes) == 1:
                assert e.width <= by_name[e.nodes[0]].allocatable
            elif e.nodes:
                sizes = {by_name[n].allocatable for n in e.nodes}
                assert len(sizes) == 1 and e.width == len(e.nodes) * sizes.pop(), "a wide engine takes whole nodes"
                assert len({by_name[n].segment for n in e.nodes}) == 1, "a wide engine stays in one segment"
            assert all(by_name[n].schedulable for n in e.nodes)
        if r.placed:
            nodes_of_replica = r.nodes
            assert [f.node for f in r.frontends] == [
                nodes_of_replica[f.index % len(nodes_of_replica)] for f in r.frontends
            ]
            assert r.split == (len({by_name[n].segment for n in nodes_of_replica}) > 1)
    for name, gpus in demand(p, nodes).items():
        assert gpus <= by_name[name].free


@SETTINGS
@given(plans(), pools())
def test_ports_node_ids_and_urls(layout: Plan, nodes: list[NodeInfo]) -> None:
    p = place(layout, nodes)
    frontends = [f for r in p.replicas for f in r.frontends]
    assert len({f.port for f in frontends}) == len(frontends)
    assert [f.node_id for f in frontends] == list(range(len(frontends)))
    urls = frontend_urls(layout, p, "ns", {n.name: n.address for n in nodes if n.address})
    assert len(urls) == len(layout.replicas) * layout.frontends_per_replica
    ports = [int(u.rsplit(":", 1)[1]) for u in urls if u is not None]
    assert ports == sorted(ports), "replica-major order"
    placed = {f.node_id for f in frontends if f.node is not None}
    assert all((u is not None) == (i in placed) for i, u in enumerate(urls)), "a URL only where a frontend runs"


@SETTINGS
@given(plans(), pools())
def test_placing_again_with_the_result_as_previous_changes_nothing(layout: Plan, nodes: list[NodeInfo]) -> None:
    first = place(layout, nodes)
    assert place(layout, nodes, previous=first) == first


@SETTINGS
@given(plans(), pools())
def test_the_output_does_not_depend_on_the_order_of_the_nodes(layout: Plan, nodes: list[NodeInfo]) -> None:
    assert place(layout, list(reversed(nodes))) == place(layout, nodes)


@SETTINGS
@given(plans(), pools(), st.data())
def test_losing_a_node_moves_only_the_replicas_on_it(layout: Plan, nodes: list[NodeInfo], data: st.DataObject) -> None:
    first = place(layout, nodes)
    if not nodes:
        return
    lost = data.draw(st.sampled_from([n.name for n in nodes]))
    second = place(layout, [n for n in nodes if n.name != lost], previous=first)
    for before, after in zip(first.replicas, second.replicas, strict=True):
        if before.placed and lost not in before.nodes:
            assert after.engines == before.engines, f"replica {before.index} did not use {lost} but moved"
        assert lost not in after.nodes
