"""Node profiles and component command lines: pure, no cluster."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from drs_devcluster import profiles
from drs_devcluster.layout import PORT_OFFSETS, Layout, component_args


@pytest.mark.parametrize(
    ("profile", "count", "gpus"),
    [("hgx", 4, {8}), ("gb200", 36, {4}), ("mixed", 8, {8, 4})],
    ids=["hgx nodes have 8 GPUs", "gb200 nodes have 4 GPUs", "mixed has both"],
)
def test_profiles_give_gpu_capacity_and_unique_loopback_addresses(profile: str, count: int, gpus: set[int]) -> None:
    nodes = profiles.build_nodes(profile, count)
    assert len(nodes) == count
    assert {int(n["status"]["allocatable"][profiles.GPU_RESOURCE]) for n in nodes} == gpus
    ips = [n["status"]["addresses"][0]["address"] for n in nodes]
    assert len(set(ips)) == count
    assert all(ipaddress.ip_address(ip).is_loopback and ip != "127.0.0.1" for ip in ips)
    assert len({n["spec"]["podCIDR"] for n in nodes}) == count
    assert len({n["metadata"]["name"] for n in nodes}) == count


def test_gb200_nodes_are_grouped_18_per_clique_and_hgx_nodes_have_no_clique() -> None:
    gb = profiles.build_nodes("gb200", 40)
    cliques = [n["metadata"]["labels"][profiles.CLIQUE_LABEL] for n in gb]
    assert cliques.count("nvl72-0") == 18 and cliques.count("nvl72-1") == 18 and cliques.count("nvl72-2") == 4
    assert all(profiles.CLIQUE_LABEL not in n["metadata"]["labels"] for n in profiles.build_nodes("hgx", 3))


def test_a_second_batch_of_nodes_gets_addresses_of_its_own() -> None:
    first = profiles.build_nodes("hgx", 8)
    second = profiles.build_nodes("gb200", 8, first_index=8)
    ips = [n["status"]["addresses"][0]["address"] for n in first + second]
    assert len(set(ips)) == 16


@pytest.mark.parametrize(
    ("profile", "count", "message"),
    [
        ("dgx", None, "unknown profile 'dgx'"),
        ("hgx", 0, "--nodes must be between 1"),
        ("gb200", 5000, "--nodes must be"),
    ],
    ids=["unknown profile", "zero nodes", "too many nodes"],
)
def test_bad_profile_input_is_refused_with_the_rule(profile: str, count: int | None, message: str) -> None:
    with pytest.raises(profiles.ProfileError, match=message):
        profiles.build_nodes(profile, count)


def test_each_component_listens_on_its_own_port_of_the_range() -> None:
    layout = Layout(state_dir=Path("/s"), bin_dir=Path("/b"), port_base=20000)
    assert sorted(layout.ports.values()) == list(range(20000, 20000 + len(PORT_OFFSETS)))
    assert f"--secure-port={layout.port('kube-apiserver')}" in component_args(layout, "kube-apiserver")
    assert f"--secure-port={layout.port('kube-scheduler')}" in component_args(layout, "kube-scheduler")
    assert any(str(layout.port("etcd-client")) in a for a in component_args(layout, "etcd"))
    assert component_args(layout, "kwok")[0] == "/b/kwok"


def test_the_node_net_moves_every_node_address_to_its_own_second_octet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(profiles.NODE_NET_ENV, "13")
    ips = [n["status"]["addresses"][0]["address"] for n in profiles.build_nodes("hgx", 3)]
    assert ips == ["127.13.1.1", "127.13.1.2", "127.13.1.3"]


@pytest.mark.parametrize("raw", ["256", "-1", "x"], ids=["too big", "negative", "not a number"])
def test_a_bad_node_net_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(profiles.NODE_NET_ENV, raw)
    with pytest.raises(profiles.ProfileError, match=profiles.NODE_NET_ENV):
        profiles.node_ip(0)
