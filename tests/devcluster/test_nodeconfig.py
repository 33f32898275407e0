"""Real-node configuration (pure): addresses stay in the cluster's own network, every port is on
loopback or a bridge address, DNS forwards nowhere, the kubelet keeps imported images."""

from __future__ import annotations

import ipaddress
import json
import tomllib
from pathlib import Path

import pytest
from drs_devcluster import nodeconfig
from drs_devcluster.layout import Layout
from hypothesis import given
from hypothesis import strategies as st

LAYOUT = Layout(state_dir=Path("/state"), bin_dir=Path("/bins"), port_base=28640)


@given(st.integers(0, 255), st.integers(0, nodeconfig.MAX_REAL_NODES - 1))
def test_addresses_stay_inside_the_clusters_own_network(net: int, index: int) -> None:
    network = nodeconfig.Network(net)
    cidr = ipaddress.ip_network(network.cidr)
    first, last = network.pod_range(index)
    for ip in (network.gateway, network.node_ip(index), first, last):
        assert ipaddress.IPv4Address(ip) in cidr
    assert not cidr.overlaps(ipaddress.ip_network(nodeconfig.service_cidr()))
    pods = {ipaddress.IPv4Address(first), ipaddress.IPv4Address(last)}
    assert ipaddress.IPv4Address(network.gateway) not in pods
    assert ipaddress.IPv4Address(network.node_ip(index)) < ipaddress.IPv4Address(first)
    for name in (network.bridge, network.host_veth, network.peer_veth):
        assert len(name) <= 15  # IFNAMSIZ - 1
    host = ipaddress.IPv4Address(network.host_ip)
    assert host in cidr and host != ipaddress.IPv4Address(network.gateway)
    assert host < ipaddress.IPv4Address(network.node_ip(0))


@given(st.integers(0, 255), st.integers(0, 255))
def test_networks_of_other_slots_share_no_name_or_address(a_net: int, b_net: int) -> None:
    a, b = nodeconfig.Network(a_net), nodeconfig.Network(b_net)
    names = ("bridge", "netns", "host_veth", "peer_veth", "cidr")
    if a.slot == b.slot:  # one network under two numbers: the clash is detected by its names
        assert all(getattr(a, n) == getattr(b, n) for n in names)
    else:
        assert all(getattr(a, n) != getattr(b, n) for n in names)
        assert not ipaddress.ip_network(a.cidr).overlaps(ipaddress.ip_network(b.cidr))
        assert nodeconfig.cgroup_root(a, 0) != nodeconfig.cgroup_root(b, 0)


@given(st.integers(0, 255))
def test_the_test_sessions_network_is_never_the_dev_clusters(dev_net: int) -> None:
    assert nodeconfig.Network(nodeconfig.test_network(dev_net)).slot != nodeconfig.Network(dev_net).slot


def test_each_node_has_its_own_cgroup_root_and_bind_mounts() -> None:
    net = nodeconfig.Network(10)
    roots = {nodeconfig.cgroup_root(net, i) for i in range(nodeconfig.MAX_REAL_NODES)}
    assert len(roots) == nodeconfig.MAX_REAL_NODES
    a, b = nodeconfig.node_dirs(LAYOUT, 0).binds, nodeconfig.node_dirs(LAYOUT, 1).binds
    assert set(a) == set(b) == set(nodeconfig.NODE_BINDS) and nodeconfig.DEVICE_PLUGIN_DIR in a
    assert not set(a.values()) & set(b.values())
    assert all(src.is_relative_to(LAYOUT.state_dir) for src in [*a.values(), *b.values()])


def test_more_real_nodes_than_one_machine_holds_is_refused_naming_the_rule() -> None:
    with pytest.raises(nodeconfig.RealNodeError, match=r"--real-nodes.*between 0 and"):
        nodeconfig.check_count(nodeconfig.MAX_REAL_NODES + 1)
    with pytest.raises(nodeconfig.RealNodeError, match="--real-nodes"):
        nodeconfig.check_count(-1)


def test_ports_are_distinct_and_after_the_control_planes() -> None:
    ports = nodeconfig.ports(LAYOUT, nodeconfig.MAX_REAL_NODES)
    assert len(set(ports.values())) == len(ports)
    assert min(ports.values()) > max(LAYOUT.ports.values())


def test_containerd_listens_only_on_its_socket_and_uses_runc_on_cgroupfs() -> None:
    dirs = nodeconfig.node_dirs(LAYOUT, 0)
    conf = tomllib.loads(nodeconfig.containerd_toml(dirs, "docker.io/library/drs-pause:1"))
    assert conf["grpc"]["address"] == str(dirs.containerd_socket)
    assert conf["ttrpc"]["address"] == conf["debug"]["address"] == conf["metrics"]["address"] == ""
    cri = conf["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["stream_server_address"] == "127.0.0.1"
    assert cri["restrict_oom_score_adj"] is True and cri["netns_mounts_under_state_dir"] is True
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is False


def test_the_cni_network_neither_masquerades_nor_shares_ipam_state() -> None:
    net = nodeconfig.Network(10)
    dirs = nodeconfig.node_dirs(LAYOUT, 0)
    conf = json.loads(nodeconfig.cni_conflist(net, dirs, 0))
    bridge = conf["plugins"][0]
    assert bridge["bridge"] == net.bridge and bridge["ipMasq"] is False
    assert bridge["ipam"]["dataDir"] == str(dirs.ipam_dir)
    assert bridge["ipam"]["ranges"][0][0]["gateway"] == net.gateway


def test_the_kubelet_binds_its_node_address_keeps_images_and_trusts_the_dev_ca() -> None:
    net = nodeconfig.Network(10)
    conf = nodeconfig.kubelet_config(LAYOUT, net, nodeconfig.node_dirs(LAYOUT, 0), 0, Path("/state/resolv.conf"))
    assert conf["address"] == conf["healthzBindAddress"] == net.node_ip(0)
    assert conf["cgroupRoot"] == nodeconfig.cgroup_root(net, 0)
    assert conf["readOnlyPort"] == 0 and conf["authentication"]["anonymous"]["enabled"] is False
    assert conf["imageGCHighThresholdPercent"] == 100  # imported images are never pulled back
    assert conf["clusterDNS"] == [net.gateway] and conf["failCgroupV1"] is False
    # The shared disk is no node's to guard: every disk signal off ("0%"; the kubelet ignores it),
    # so another cluster filling the disk never taints this one's nodes with DiskPressure.
    disk = {k: v for k, v in conf["evictionHard"].items() if k.split(".")[0] in ("nodefs", "imagefs")}
    assert disk == {f"{fs}.{s}": "0%" for fs in ("nodefs", "imagefs") for s in ("available", "inodesFree")}


def test_dns_answers_cluster_names_and_forwards_nowhere() -> None:
    text = nodeconfig.corefile(LAYOUT, nodeconfig.Network(10))
    assert "kubernetes cluster.local" in text and "forward" not in text
    assert "bind 10.110.0.1" in text


def test_kube_proxy_opens_node_ports_on_the_bridge_only_and_leaves_conntrack_alone() -> None:
    net = nodeconfig.Network(10)
    conf = nodeconfig.kube_proxy_config(LAYOUT, net)
    assert conf["mode"] == "nftables" and conf["nodePortAddresses"] == [net.cidr]
    assert conf["conntrack"]["maxPerCore"] == 0
    assert conf["healthzBindAddress"].startswith(f"{net.gateway}:")
