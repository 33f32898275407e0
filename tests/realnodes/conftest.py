"""The real-node cluster: a control plane with one real node (kubelet, containerd, CNI bridge,
kube-proxy, CoreDNS, the fake GPU device plugin) and the project's image imported, started once
per session beside the kwok cluster and torn down at the end (``drs dev down`` semantics: every
process by pid, mounts, the bridge and the iptables chain, the sysctls)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from drs_devcluster import inpod
from drs_devcluster.testing import RunningCluster, namespace_for, real_node_cluster

from .pods import OPERATOR_NS, explain


@pytest.fixture(scope="session")
def realcluster() -> Iterator[RunningCluster]:
    yield from real_node_cluster()


@pytest.fixture
def realns(realcluster: RunningCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = namespace_for(request.node.name)
    realcluster.kubectl("create", "namespace", name)
    # The ServiceAccount admission plugin is on here (in-cluster clients get tokens): pods can be
    # created once the controller-manager has made the namespace's `default` ServiceAccount.
    realcluster.kubectl("wait", "--for=create", "serviceaccount/default", "-n", name, "--timeout=60s")
    try:
        yield name
    finally:
        realcluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(realcluster: RunningCluster) -> Iterator[str]:
    """The chart installed (or upgraded) with the local image and the operator Ready; yields its
    namespace. A failed install fails with the cluster's state: the nodes, the operator's pods,
    their logs (and the log before a restart), the namespace's events."""
    try:
        inpod.helm_install(realcluster.cluster, release="drs", namespace=OPERATOR_NS)
    except inpod.InPodError as exc:
        raise AssertionError(f"{exc}\n{explain(realcluster, OPERATOR_NS)}") from exc
    yield OPERATOR_NS
