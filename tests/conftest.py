"""Fixtures shared by every test.

* ``devcluster`` (session): the real control plane (etcd, kube-apiserver, kube-scheduler,
  kube-controller-manager, kwok) started once, torn down at the end even when tests fail.
* ``namespace``: a fresh namespace per test, deleted afterwards.
* ``pod_runner`` (module): the pod runner, so pods whose command is ``drs`` run as local processes
  on their node's address and turn Ready from their real probes (started unless one runs already;
  stopped after the module only when started here).
Tests that use them carry ``@pytest.mark.cluster`` (``make unit`` deselects them).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from drs_devcluster import profiles, testing
from drs_devcluster.testing import RunningCluster, namespace_for, session_cluster
from hypothesis import HealthCheck, settings

# Property tests check results, not speed: on a shared 2-core machine one input's generation
# can pause for over a second (a run of tests/unit on 2026-12-07 failed hypothesis' "input
# generation is slow" check: 1.7 s for one input of a 12-leaf strategy), and a timed deadline
# would fail the same way.
settings.register_profile("drs", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("drs")


@pytest.fixture(scope="session")
def devcluster() -> Iterator[RunningCluster]:
    yield from session_cluster()


@pytest.fixture
def namespace(devcluster: RunningCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = namespace_for(request.node.name)
    devcluster.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        devcluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def pod_runner(devcluster: RunningCluster) -> Iterator[None]:
    with testing.pod_runner(devcluster.cluster):
        yield


@pytest.fixture(autouse=True)
def default_node_net(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests without a cluster see the default node addresses (127.0.x.y) whatever the shell exports.

    ``DRS_DEV_NODE_NET`` keeps parallel dev clusters apart; pure tests that expect 127.0.1.1 must
    not depend on it. Cluster tests keep it: their cluster was created with it.
    """
    if request.node.get_closest_marker("cluster") is None:
        monkeypatch.delenv(profiles.NODE_NET_ENV, raising=False)
